"""One generate loop for autoregressive and speculative decoding.

    out = generate(target, prompt_ids, drafter=None)                       # autoregressive
    out = generate(target, prompt_ids, drafter, Sampler(0.7, seed=0), gamma=5, stop_ids={2})
    out.tokens, out.stats.tau, out.stop_reason

Each round: the drafter proposes g <= gamma tokens after the sequence, the target runs once on
the newest token plus the draft (g + 1 positions), verification accepts a prefix and adds one
token of the target's own, and the target's KV cache is rolled back by position (rejected slots
are overwritten next round). A tree draft (Medusa) is verified the same way with tree attention;
its accepted branch's KV entries are moved to the slots after the prefix. With no drafter, or
an empty draft, a round is a plain decode step.
There is one host sync per round: the accepted count and the new tokens come back together. On
the fixed-shape path (a compiled target, see model.py) positions stay on the device as well.
"""

import time
from typing import NamedTuple

import torch
from torch import Tensor

from specdec_runtime.drafters import Draft, Drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.model import Decoder, DecoderOutput
from specdec_runtime.sampling import Sampler
from specdec_runtime.stats import GenerationStats
from specdec_runtime.tree import Tree, verify_tree_greedy, verify_tree_sample, verify_tree_typical
from specdec_runtime.verify import verify_greedy, verify_sample


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
    target: Decoder, ids: Tensor, L: int, draft: Draft | None, hidden: bool, hidden_layer: int | None = None
) -> DecoderOutput:
    """The target's output (batch row 0) for the newest token ids[L-1] and the draft after it:
    logits [g + 1, V] (hidden [g + 1, H] when asked: final-norm, or after layer hidden_layer - 1),
    for a chain or a token tree."""
    kw = dict(return_hidden=hidden, hidden_layer=hidden_layer)
    start = target.slot(L - 1)  # an int, or a device tensor on the fixed-shape (compiled) path
    if draft is None or not draft.tokens.numel():
        out = target(ids[None, L - 1 : L], start, **kw)
    elif draft.tree is not None:
        t = draft.tree.on(ids.device)
        nodes = torch.cat([ids[L - 1 : L], draft.tokens])[None]
        out = target(nodes, start, positions=t["depth"] + start, tree_mask=t["ancestor"], **kw)
    elif draft.residual is not None:  # resume where an early-exit drafter stopped
        out = target.head(target.run_layers(draft.residual, start, draft.resume_layer), return_hidden=hidden)
    else:
        out = target(torch.cat([ids[L - 1 : L], draft.tokens])[None], start, **kw)
    return DecoderOutput(out.logits[0], out.hidden[0] if hidden else None)


def verify_tree(
    draft: Draft, root: Tensor, logits: Tensor, sampler: Sampler, typical: tuple[float, float] | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(path [D + 1], accept_len, next token) for a tree draft (a chain under typical acceptance)."""
    tree = draft.tree or Tree.chain(draft.tokens.shape[0])
    nodes = torch.cat([root.view(1), draft.tokens])
    if sampler.greedy:
        return verify_tree_greedy(tree, nodes, logits)
    if typical is not None:
        return verify_tree_typical(tree, nodes, sampler.probs(logits), sampler, threshold=typical[0], alpha=typical[1])
    return verify_tree_sample(tree, nodes, sampler.probs(logits), sampler)


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
) -> Generation:
    """Generate up to max_new_tokens after `prompt`, stopping at any of stop_ids.

    gamma: draft length; adaptive_gamma: transformers' heuristic (+2 after a fully accepted draft,
    -1 otherwise, within 1..max_gamma). Greedy output equals the target's greedy output exactly;
    sampled output follows the target's (warped) distribution exactly, except with
    typical=(posterior_threshold, alpha): Medusa's typical acceptance for sampling, which is LOSSY.
    """
    if max_new_tokens < 1 or gamma < 0 or max_gamma < 1:
        raise SpecdecError(
            f"need max_new_tokens >= 1, gamma >= 0, max_gamma >= 1 (got {max_new_tokens}, {gamma}, {max_gamma})"
        )
    sampler = sampler or Sampler()
    device = target.device
    prompt = torch.as_tensor(prompt, dtype=torch.long, device=device).flatten()
    P = prompt.shape[0]
    check_fits(P, max_new_tokens, target.config.max_position_embeddings)
    capacity = P + max_new_tokens
    stats = GenerationStats(calls=1)
    t_start = time.perf_counter()

    # A token tree writes all its nodes' K/V past the sequence before the branch is kept.
    target.setup_cache(1, capacity + getattr(drafter, "tree_nodes", 0))
    ids = torch.empty(capacity, dtype=torch.long, device=device)  # prompt + new tokens
    ids[:P] = prompt
    observe = getattr(drafter, "observe", None)  # drafters that read the target's hidden states
    tap = getattr(drafter, "hidden_layer", None)  # ... after this layer instead of the final norm
    prefill = target(prompt[None], 0, logits_to_keep=1, return_hidden=observe is not None, hidden_layer=tap)
    first = sampler.next_token(prefill.logits[0, -1])
    ids[P] = first
    out = [int(first)]  # host sync: the first token
    stats.target_forwards = 1
    if drafter is not None:
        drafter.start(prompt, capacity)
    if observe is not None:
        observe(prefill.hidden[0])  # the prompt's rows (only the last one for final-norm states)
    stats.prefill_s = time.perf_counter() - t_start

    L = P + 1  # tokens in ids; the target's cache holds all but the newest
    stop = out[0] in stop_ids
    while not stop and len(out) < max_new_tokens:
        t0 = time.perf_counter()
        g_max = min(gamma, max_new_tokens - len(out) - 1)  # never draft past the budget
        draft = drafter.draft(ids[:L], g_max, sampler) if drafter is not None and g_max > 0 else None
        g = 0 if draft is None else draft.tokens.shape[0]
        t1 = time.perf_counter()

        verified = verify_forward(target, ids, L, draft, observe is not None, tap)
        logits, rows = verified.logits, slice(0, 1)  # rows: the accepted positions, in order
        if g == 0:  # a plain decode step
            token = sampler.next_token(logits[0])
            n, new = 0, [int(token)]  # host sync
        elif draft.tree is not None or (typical is not None and not sampler.greedy):
            path, n_t, token = verify_tree(draft, ids[L - 1], logits, sampler, typical)
            branch = torch.cat([ids[L - 1 : L], draft.tokens])[path]  # [D + 1] accepted branch, root first
            host = torch.cat([n_t.view(1), branch, token.view(1)]).tolist()  # the round's one host sync
            n, new = host[0], host[2 : 2 + host[0]] + host[-1:]
            ids[L : L + n] = branch[1 : n + 1]
            if draft.tree is not None and n:  # the accepted nodes' K/V move to slots L..L+n-1
                target.cache.move(path[1 : n + 1] + (L - 1), L)
            rows = path[: n + 1] if draft.tree is not None else slice(0, n + 1)
            g = draft.tree.depth if draft.tree is not None else g
        else:
            if sampler.greedy:
                n_t, token = verify_greedy(draft.tokens, logits)
            else:
                n_t, token = verify_sample(draft.tokens, draft.probs, sampler.probs(logits), sampler)
            host = torch.cat([n_t.view(1), draft.tokens, token.view(1)]).tolist()  # the round's one host sync
            n, new = host[0], host[1 : 1 + host[0]] + host[-1:]
            ids[L : L + g] = draft.tokens
            rows = slice(0, n + 1)
        ids[L + n] = token
        if observe is not None:
            observe(verified.hidden[rows])
        stats.record_round(g, n)
        for i, t in enumerate(new):
            if t in stop_ids:
                new, stop = new[: i + 1], True
                break
        out += new
        L += len(new)
        if adaptive_gamma and drafter is not None and g_max == gamma:
            gamma = min(gamma + 2, max_gamma) if n == gamma else max(1, gamma - 1)
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1

    stats.new_tokens = len(out)
    stats.total_s = time.perf_counter() - t_start
    return Generation(out, stats, "stop_token" if stop else "length")
