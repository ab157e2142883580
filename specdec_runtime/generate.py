"""One generate loop for autoregressive and speculative decoding.

    out = generate(target, prompt_ids, drafter=None)                       # autoregressive
    out = generate(target, prompt_ids, drafter, Sampler(0.7, seed=0), gamma=5, stop_ids={2})
    out.tokens, out.stats.tau, out.stop_reason
    rows = generate_batch(target, [ids_a, ids_b, ...], Sampler(), max_new_tokens=64, stop_ids={2})

Each round: the drafter proposes g <= gamma tokens after the sequence (a chain, or a token tree at
most gamma deep; LookupFirst's lookups may propose a longer chain, cut to the tokens left), the
target runs once on the newest token plus the draft, verification (verify.py) accepts a branch and
adds one token of the target's own, and the target's KV cache is rolled back by position (rejected
slots are overwritten next round; a tree's accepted nodes move to the slots after the prefix). With
no drafter, or an empty draft, a round is a plain decode step, through the same code. There is one
host sync per round: the accepted length and the new tokens come back together (drafters that sync
themselves say so: n-gram lookup, a draft exit's confidence test). On a CPU, where the host is the
device, a round decides over host lists instead (decide_on_host).

generate_batch decodes many prompts at once, autoregressively, for throughput (self-distillation
data): the prompts are left-padded to one length (Decoder.left_pad), and every step runs all rows
through each weight once.
"""

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from specdec_runtime.cpu.host_rules import greedy_on_host, sample_on_host
from specdec_runtime.drafters.protocol import Draft, Drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.model import Decoder, DecoderOutput
from specdec_runtime.sampling import Sampler
from specdec_runtime.spectr import verify_spectr
from specdec_runtime.stats import GenerationStats
from specdec_runtime.tree import DeviceTree
from specdec_runtime.verify import verify, verify_forced

# Verification over host lists where the target runs on a CPU (decide_on_host): there the device
# rules' dozen tensor ops a round cost more than the rules themselves. False: the device rules
# everywhere, as on a GPU (the tests run both).
HOST_RULES = True


class Generation(NamedTuple):
    tokens: list[int]  # the new tokens (a stop token, when hit, is the last one)
    stats: GenerationStats
    stop_reason: str  # "stop_token" or "length"


def check_fits(prompt_len: int, max_new_tokens: int, context: int, name: str = "the prompt") -> None:
    """Raise a SpecdecError when prompt + new tokens do not fit the target's context."""
    if prompt_len == 0:
        raise SpecdecError(f"{name} is empty after tokenization")
    if prompt_len + max_new_tokens > context:
        raise SpecdecError(
            f"{name} has {prompt_len} tokens; with max_new_tokens={max_new_tokens} it needs "
            f"{prompt_len + max_new_tokens} positions but the target's context is {context}: "
            "shorten the prompt or lower max_new_tokens"
        )


def verify_forward(
    target: Decoder, ids: Tensor, L: int, draft: Draft | None, taps: tuple[int, ...], argmax_only: bool = False
) -> DecoderOutput:
    """The target's output (batch row 0) for the newest token ids[L-1] and the draft after it:
    logits [g + 1, V] (hidden [g + 1, n * H] after the `taps` layers), for a chain or a tree.
    argmax_only: greedy verification reads only their argmax (the forward's option: the logits may
    then be None, with greedy set)."""
    root, opts = ids[L - 1 : L], dict(taps=taps, argmax_only=argmax_only)
    if draft is None or not draft.tokens.numel():
        out = target(root[None], L - 1, **opts)
    elif draft.tree is not None:
        t = draft.tree.tensors_on(ids.device)
        out = target(torch.cat([root, draft.tokens])[None], L - 1, tree=(t["depth"], t["ancestor"]), **opts)
    elif draft.residual is not None:  # resume where an early-exit drafter stopped
        out = target(draft.residual, L - 1, first_layer=draft.resume_layer, **opts)
    else:
        out = target(torch.cat([root, draft.tokens])[None], L - 1, **opts)
    logits, greedy = (None if x is None else x[0] for x in (out.logits, out.greedy))
    return DecoderOutput(logits, out.hidden[0] if taps else None, greedy)


def decide_on_host(
    draft: Draft | None, verified: DecoderOutput, sampler: Sampler, typical: tuple[float, float] | None
) -> tuple[list[int], list[int]] | None:
    """A round's verification over host lists, for a target on a CPU (HOST_RULES): (path, new), new
    the n accepted tokens and the target's own after them, path[:n + 1] the accepted nodes, root
    first (cpu/host_rules.py: greedy_on_host, sample_on_host); or None where the device rule applies (sampled
    drafts that carry their distributions, typical acceptance, a greedy round without the kernel's
    argmax)."""
    g = 0 if draft is None else draft.tokens.shape[0]
    tree = draft.tree if g else None
    if sampler.greedy and verified.greedy is not None:  # the argmax the forward computed, with the draft: one read
        host = torch.cat([verified.greedy, draft.tokens]).tolist() if g else verified.greedy.tolist()
        return greedy_on_host(tree, host[g + 1 :], host[: g + 1])
    if not sampler.greedy and typical is None and (draft is None or draft.probs is None):
        return sample_on_host(tree, draft.tokens.tolist() if g else [], verified.logits, sampler)
    return None


def cut(draft: Draft, g: int) -> Draft:
    """A draft up to g tokens deep: a chain's first g tokens (with their distributions and, resuming
    drafts, residual rows), a tree's nodes up to depth g (which come first: nodes are in order of
    depth)."""
    if draft.tree is not None:
        tree = draft.tree.truncated(g)
        probs = draft.probs[: len(tree)] if draft.probs is not None else None
        return draft._replace(tokens=draft.tokens[: len(tree)], probs=probs, tree=tree)
    residual = draft.residual[:, : g + 1] if draft.residual is not None else None
    probs = draft.probs[:g] if draft.probs is not None else None
    return draft._replace(tokens=draft.tokens[:g], probs=probs, residual=residual)


class Clock:
    """Wall time at stage boundaries; with sync, after the device's queued work (exact stage costs
    on a GPU, at the price of a host sync per stage: off unless asked for)."""

    def __init__(self, device: torch.device, sync: bool):
        self.sync = sync and device.type == "cuda"

    def __call__(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()


@torch.inference_mode()
def generate(
    target: Decoder,
    prompt: list[int] | Tensor,
    drafter: Drafter | None = None,
    sampler: Sampler | None = None,
    *,
    max_new_tokens: int = 256,
    gamma: int = 4,
    adaptive_gamma: bool = False,
    max_gamma: int = 16,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    typical: tuple[float, float] | None = None,
    capacity: int = 0,
    timed: bool = False,
    accept_rate: float | None = None,
    teacher: Callable[[int, Tensor], None] | None = None,
) -> Generation:
    """Generate up to max_new_tokens after `prompt`, stopping at any of stop_ids.

    gamma: draft length; adaptive_gamma: transformers' heuristic (+2 after a fully accepted draft,
    -1 otherwise, within 1..max_gamma), on the rounds whose draft is at most gamma long (a longer
    lookup draft says nothing about the drafter's own length). Greedy output equals the target's
    greedy output exactly; sampled output follows the target's (warped) distribution exactly,
    except with typical=(posterior_threshold, alpha): Medusa's typical acceptance for sampling,
    which is LOSSY.
    capacity: KV slots to make room for (at least prompt + max_new_tokens): pass the largest over
    a set of prompts, and every call reuses the same caches (and, compiled, the same CUDA graphs).
    timed: make the stage times in the stats exact on a GPU (a host sync per stage).
    accept_rate: for measuring the runtime's mechanics only (scripts/bench_gpu.py --accept-rate):
    each drafted token is accepted with this probability whatever its value (a tree's first child
    at each depth), as SGLang's simulated acceptance; the output is then NOT the target's.
    teacher(position, probs [V]): called at each round whose draft was rejected, with the target's
    distribution where it rejected it (the sampler's; greedy: the plain softmax), which the token
    at ids[position] was chosen from: online adaptation's signal (specdec_runtime.drafters.online). The
    target's logits are then kept in greedy rounds too; the output is unchanged.
    """
    if accept_rate is not None and not 0 <= accept_rate <= 1:
        raise SpecdecError(f"accept_rate is a probability in [0, 1] (got {accept_rate})")
    if max_new_tokens < 1 or gamma < 0 or max_gamma < 1:
        raise SpecdecError(
            f"need max_new_tokens >= 1, gamma >= 0, max_gamma >= 1 (got {max_new_tokens}, {gamma}, {max_gamma})"
        )
    sampler = sampler or Sampler()
    device = target.device
    # non_blocking: a list's copy to a GPU need not wait for the device (a sync the fast path avoids)
    prompt_in, on_cpu = prompt, torch.as_tensor(prompt, dtype=torch.long).flatten()
    prompt = on_cpu.to(device, non_blocking=True)
    P = prompt.shape[0]
    check_fits(P, max_new_tokens, target.config.max_position_embeddings)
    capacity = max(capacity, P + max_new_tokens)
    taps = drafter.hidden_layers if drafter is not None else ()
    stats = GenerationStats(calls=1)
    clock = Clock(device, timed)
    argmax_only = sampler.greedy and (teacher is None or drafter is None)  # greedy verification: the argmax only
    on_host = HOST_RULES and device.type == "cpu"  # on a CPU the device is the host: rounds decide there
    forced = None if accept_rate is None else sampler.generator(device)  # the draws: the sampler's seed
    t_start = clock()

    # A token tree writes all its nodes' K/V past the sequence before the branch is kept.
    target.setup_cache(1, capacity + (drafter.tree_nodes if drafter is not None else 0))
    ids = torch.empty(P + max_new_tokens, dtype=torch.long, device=device)  # prompt + new tokens
    ids[:P] = prompt
    prefill = target.prefill(prompt[None], logits_to_keep=1, taps=taps)
    first = sampler.next_token(prefill.logits[0, -1])
    ids[P] = first
    out = [int(first)]  # host sync: the first token
    stats.target_forwards = 1
    if drafter is not None:
        drafter.start(prompt, capacity)
        drafter.observe_tokens((list(map(int, prompt_in)) if isinstance(prompt_in, list) else on_cpu.tolist()) + out)
        if taps:
            drafter.observe(prefill.hidden[0])
    stats.prefill_s = clock() - t_start

    L = P + 1  # tokens in ids; the target's cache holds all but the newest
    stop = out[0] in stop_ids
    while not stop and len(out) < max_new_tokens:
        t0 = clock()
        room = max_new_tokens - len(out) - 1  # never verify past the budget
        g_max = min(gamma, room)
        draft = drafter.draft(ids[:L], g_max, sampler) if drafter is not None and g_max > 0 else None
        if draft is not None and draft.depth > room:
            draft = cut(draft, room)  # a longer lookup (a chain, or merged with the model's nodes)
        t1 = clock()
        verified = verify_forward(target, ids, L, draft, taps, argmax_only)
        t2 = clock()
        depth = 0 if draft is None else draft.depth
        device_tree = draft is not None and isinstance(draft.tree, DeviceTree)  # decided by the device rules
        host_rules = on_host and forced is None and not device_tree
        decided = decide_on_host(draft, verified, sampler, typical) if host_rules else None
        if decided is not None:
            path, new = decided
            n = len(new) - 1
            ids[L : L + n + 1] = torch.tensor(new)
        else:
            if forced is not None and draft is not None and draft.tokens.numel():
                v = verify_forced(draft, verified.logits, verified.greedy, accept_rate, forced)
            elif draft is not None and draft.chains is not None and not sampler.greedy and typical is None:
                v = verify_spectr(draft, verified.logits, sampler)  # SpecTr's k sequences
            else:
                v = verify(draft, ids[L - 1], verified.logits, sampler, typical, verified.greedy)
            nodes = ids[L - 1 : L] if draft is None else torch.cat([ids[L - 1 : L], draft.tokens])
            branch = nodes[v.path]  # [D + 1] the drafted branch, root first
            reached = draft.tree.reached.view(1) if device_tree else v.accept_len.view(1)  # a device tree's depth
            host = torch.cat([v.accept_len.view(1), reached, branch[1:], v.token.view(1)]).tolist()  # the one host sync
            n, path = host[0], v.path
            new = host[2 : 2 + n] + host[-1:]
            depth = host[1] if device_tree else depth
            ids[L : L + n] = branch[1 : n + 1]
            ids[L + n] = v.token
        if teacher is not None and n < depth:  # rejected after n accepted: the target's choice at L + n
            row = verified.logits[path[n]]
            teacher(L + n, row.float().softmax(-1) if sampler.greedy else sampler.probs(row))
        if draft is not None and draft.tree is not None and n:  # the accepted nodes' K/V move into place
            target.cache.move(torch.as_tensor(path[1 : n + 1], device=device) + (L - 1), L)
        if taps:
            drafter.observe(verified.hidden[path[: n + 1]])
        for i, t in enumerate(new):
            if t in stop_ids:
                new, stop = new[: i + 1], True
                break
        lookup = draft is not None and draft.lookup
        if drafter is not None:
            drafter.observe_tokens(new)
        stats.record_round(depth, min(n, len(new)), lookup)  # accepted drafts after a stop token are not output
        out += new
        L += len(new)
        if adaptive_gamma and drafter is not None and g_max == gamma and depth <= gamma:
            gamma = min(gamma + 2, max_gamma) if n == gamma else max(1, gamma - 1)
        t3 = clock()
        stats.draft_s += t1 - t0
        stats.target_s += t2 - t1
        stats.verify_s += t3 - t1

    stats.new_tokens = len(out)
    stats.total_s = clock() - t_start
    return Generation(out, stats, "stop_token" if stop else "length")


def cut_at_stop(tokens: list[int], stop_ids: set[int] | frozenset[int]) -> list[int]:
    """Tokens up to and including the first stop token (what a finished row made after it is dropped)."""
    for j, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: j + 1]
    return tokens


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Prompts left-padded to the longest: (ids [B, T] with every row's last prompt token at T - 1,
    each row's first prompt position [B])."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = torch.as_tensor(p, dtype=torch.long)
    return ids, torch.tensor([T - len(p) for p in prompts])


@torch.inference_mode()
def generate_batch(
    target: Decoder,
    prompts: list[list[int]],
    sampler: Sampler,
    *,
    max_new_tokens: int,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    pad_id: int = 0,
) -> list[list[int]]:
    """Each prompt's new tokens (up to max_new_tokens, cut after its first stop token), decoded
    autoregressively in one batch: left-padded to the longest prompt, one prefill, then one step of
    all rows per token until every row has stopped. Rows that stopped keep stepping (their tokens
    are dropped), so a batch of similar lengths wastes least. Greedy rows equal generate()'s output
    for the same prompt but for rounding (a step's products see several rows; tested)."""
    if max_new_tokens < 1 or not prompts:
        raise SpecdecError(f"need prompts and max_new_tokens >= 1 (got {len(prompts)}, {max_new_tokens})")
    if min(len(p) for p in prompts) == 0:
        raise SpecdecError("a prompt is empty after tokenization")
    ids, starts = left_padded(prompts, pad_id)
    (B, T), device = ids.shape, target.device
    check_fits(T, max_new_tokens, target.config.max_position_embeddings, "the longest prompt")
    target.setup_cache(B, T + max_new_tokens)
    target.left_pad(starts.to(device))
    stops = torch.tensor(sorted(stop_ids) or [-1], device=device)
    token = sampler.next_token(target.prefill(ids.to(device), logits_to_keep=1).logits[:, -1])  # [B]
    out, done = [token], torch.isin(token, stops)
    for slot in range(T, T + max_new_tokens - 1):
        if bool(done.all()):  # a host sync per step: nothing against a step of many rows
            break
        token = sampler.next_token(target(token[:, None], slot).logits[:, -1])
        out.append(token)
        done |= torch.isin(token, stops)
    target.left_pad(None)
    return [cut_at_stop(row, stop_ids) for row in torch.stack(out, 1).tolist()]
