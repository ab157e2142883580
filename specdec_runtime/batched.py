"""Speculative decoding of a batch of prompts: every row drafts, is verified and accepts its own
number of tokens each round, in one target forward for the whole batch.

    outs = generate_many(target, prompts, RowLookup(), Sampler(), max_new_tokens=128, gamma=4, stop_ids={2})
    outs = generate_many(target, prompts, RowModel(draft_decoder), Sampler(0.7, seed=0), gamma=4)  # drafters/batched.py
    outs[b].tokens, outs[b].stats.tau     # each row as generate() returns it
    outs = generate_many(target, prompts, None, Sampler(), rows=8)   # 8 rows, the other prompts queued

Each row of the target's cache is one sequence at slots of its own (specdec_runtime.rows): prompts
are left-padded to one length, and a round writes row b's newest token and draft at the slots
after its own last accepted token, so rows drift apart as they accept different numbers of tokens
(ragged acceptance), each at its exact RoPE positions. Drafts shorter than the round's longest
are padded, and a row accepts no further than its own draft. A drafter of token trees drafts a
tree a row (RowDrafter.tree): each row's nodes at the slots after its newest, its accepted branch
moved after it, the tokens past its budget dropped. A round verifies every row (greedy: the
longest prefix, or branch, the target's argmax follows; sampled: speculative sampling, the rules
generate() uses) and reads the accepted lengths and tokens back in one host sync.

With rows < the prompts, the others wait in a queue: the first row whose prompt stops takes the
next one, prefilled into that row alone at slot 0 (rows.one_row), its drafter row started over
(RowDrafter.refill). Once the queue is empty, an eager target's batch drops its done rows where
its drafter can too (the cache's and the drafter's: rows.keep_rows, RowDrafter.keep; not a compiled
draft model's or EAGLE-3's captured steps), so that the last prompts do not pay
for rows that decode nothing: a forward of B rows costs B rows' compute, and a speculative row's
g + 1 tokens. On a compiled target a round's forward is a captured step of a fixed batch size
(rows.captured_rows), so a done row runs its newest token again (its output dropped) until the
last row stops; the prefills run eagerly. A round reads the device once,
for its accepted lengths and tokens; what goes to the device is copied from host lists without
waiting for it. Drafters (drafters/batched.py): prompt lookup (RowLookup, on the host), a
stand-alone model (RowModel, batched like the target), the target cut short or with sublayers
skipped (RowSelf), EAGLE-3 chains and trees (RowEagle3, reading the target's features of each
row's accepted tokens), Medusa chains and trees and MTP heads (RowMedusa, RowMTP, reading its last
states), and lookup first before any of them (RowLookupFirst); draft exits run one prompt at a
time (batch_drafter says which). A batch of one is generate() itself.
"""

import time

import torch
from torch import Tensor

from specdec_runtime.drafters.protocol import RowDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import Generation, check_fits, generate, left_padded
from specdec_runtime.model import Decoder
from specdec_runtime.rows import keep_rows, one_row
from specdec_runtime.rows import prefill as prefill_rows
from specdec_runtime.sampling import Sampler, argmax
from specdec_runtime.stats import GenerationStats
from specdec_runtime.verify import verify_rows_sample, verify_rows_tree_sample, walk_rows


@torch.inference_mode()
def generate_many(
    target: Decoder,
    prompts: list[list[int]],
    drafter: RowDrafter | None = None,
    sampler: Sampler | None = None,
    *,
    max_new_tokens: int = 256,
    gamma: int = 4,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    pad_id: int = 0,
    rows: int | None = None,
    capacity: int = 0,
    accept_rate: float | None = None,
) -> list[Generation]:
    """Each prompt's generation, decoded together (module docstring); greedy rows equal generate()'s
    for the same prompt, sampled rows follow the target's distribution. rows: the batch size (default:
    every prompt at once); the prompts past the first `rows` wait in a queue, each taking the first
    row another prompt leaves. The stats of each prompt count the forwards while it was running; its
    times are its share of each round's (split among the prompts running then), so that totals over
    the prompts are the batch's (GenerationStats.total: tokens/s of the batch). capacity: KV slots to
    make room for, as generate's: the largest over several calls keeps their caches (and graphs).
    accept_rate: generate's, for measuring the mechanics only (each drafted token accepted with this
    probability whatever its value, the target's argmax after them): the output is NOT the target's."""
    if not prompts or max_new_tokens < 1 or gamma < 0 or (rows is not None and rows < 1):
        got = f"{len(prompts)}, {max_new_tokens}, {gamma}, {rows}"
        raise SpecdecError(f"need prompts, max_new_tokens >= 1, gamma >= 0 and rows >= 1 (got {got})")
    if min(map(len, prompts)) == 0:
        raise SpecdecError("a prompt is empty after tokenization")
    if accept_rate is not None and not 0 <= accept_rate <= 1:
        raise SpecdecError(f"accept_rate is a probability in [0, 1] (got {accept_rate})")
    sampler = sampler or Sampler()
    B = min(rows or len(prompts), len(prompts))
    if B == 1 and len(prompts) == 1:
        alone = None if drafter is None else drafter.alone()
        return [generate(target, prompts[0], alone, sampler, max_new_tokens=max_new_tokens, gamma=gamma,
                         stop_ids=stop_ids, capacity=capacity, accept_rate=accept_rate)]  # fmt: skip
    device, start = target.device, time.perf_counter()
    forced = None if accept_rate is None else (accept_rate, sampler.generator(device))  # the draws: the sampler's seed
    finished = lambda tokens: tokens[-1] in stop_ids or len(tokens) >= max_new_tokens  # noqa: E731
    ids, _ = left_padded(prompts[:B], pad_id)
    P, longest = ids.shape[1], max(map(len, prompts))
    row_start = [P - len(p) for p in prompts[:B]]  # each row's first prompt slot
    check_fits(longest, max_new_tokens, target.config.max_position_embeddings, "the longest prompt")
    nodes = max(gamma, drafter.tree_nodes if drafter is not None else 0)
    capacity = max(capacity, longest + max_new_tokens + nodes)  # a prompt from the queue starts its row at slot 0
    target.setup_cache(B, capacity)
    target.left_pad(torch.tensor(row_start).to(device, non_blocking=True), per_row=True)
    try:
        taps = drafter.hidden_layers if drafter is not None else ()  # the target's residual streams it reads
        prefill = prefill_rows(target, ids.to(device, non_blocking=True), logits_to_keep=1, taps=taps)
        first = sampler.next_token(prefill.logits[:, -1])
        out = [[t] for t in first.tolist()] + [[] for _ in prompts[B:]]  # each prompt's tokens
        stats = [GenerationStats(calls=1, target_forwards=1) for _ in prompts]
        row_of = list(range(B))  # the prompt each row decodes
        queue = list(range(B, len(prompts)))
        if drafter is not None:
            drafter.start(prompts[:B], row_start, capacity)
            for b in range(B):
                drafter.observe_tokens(b, out[b])
                if taps:
                    drafter.observe(b, prefill.hidden[b, P - len(prompts[b]) :])
        slot = [P] * B  # each row's newest token's slot (every prompt ends at P - 1)
        done = [finished(out[b]) for b in range(B)]
        for j in range(B):
            stats[j].prefill_s = (time.perf_counter() - start) / B
        while True:
            for b in range(B):  # a row whose prompt is done takes the next one waiting
                while done[b] and queue:
                    t0, j = time.perf_counter(), queue.pop(0)
                    row_of[b] = j
                    with one_row(target, b):
                        prompt = torch.tensor([prompts[j]]).to(device, non_blocking=True)
                        pre = prefill_rows(target, prompt, logits_to_keep=1, taps=taps)
                    out[j] = sampler.next_token(pre.logits[:, -1]).tolist()  # a host sync a prompt
                    slot[b], done[b] = len(prompts[j]), finished(out[j])
                    if drafter is not None:
                        drafter.refill(b, prompts[j])
                        drafter.observe_tokens(b, out[j])
                        if taps:
                            drafter.observe(b, pre.hidden[0])
                    stats[j].prefill_s = time.perf_counter() - t0  # (its own: a round can refill every row)
            running = [row_of[b] for b in range(B) if not done[b]]
            if not running:
                break
            t1 = time.perf_counter()
            if len(running) < B and not queue and not target.compiled:  # the live rows alone (below)
                live = [b for b in range(B) if not done[b]]
                if drafter is None or drafter.keep(live):
                    keep_rows(target, live)
                    B, row_of, slot, done = len(live), running, [slot[b] for b in live], [False] * len(live)
            gammas = [0 if done[b] else min(gamma, max_new_tokens - len(out[row_of[b]]) - 1) for b in range(B)]
            if drafter is not None and max(gammas) > 0:
                drafts, lengths, q = drafter.draft(gammas, sampler)
                looked, tree = drafter.lookup_rows, drafter.tree  # (RowLookupFirst's looked-up rows; trees)
                if tree is not None and 0 in lengths:  # (a row with no room to draft: none of its nodes accepted)
                    tree = _idle(tree, lengths)
            else:
                drafts, lengths, q = torch.zeros(B, 0, dtype=torch.long, device=device), [0] * B, None
                looked, tree = frozenset(), None
            t2 = time.perf_counter()
            g = max(lengths) if tree is None else drafts.shape[1]  # (a tree: every node)
            newest = torch.tensor([out[j][-1] for j in row_of]).to(device, non_blocking=True)
            x = torch.cat([newest[:, None], drafts[:, :g].to(device, non_blocking=True)], dim=1)  # [B, g + 1]
            shape = {} if tree is None else {"tree": (tree["depth"], tree["ancestor"])}
            verified = target(x, slot, taps=taps, **shape)
            logits = verified.logits  # [B, g + 1, V]
            # (a captured step's buffer: the drafter keeps its rows past the step's next run)
            hidden = verified.hidden.clone() if taps else None
            t3 = time.perf_counter()
            if tree is None:
                n, token = _verify(x[:, 1:], lengths, q, logits, sampler, forced)
                branch, reached = x[:, 1:], n[:0]
            else:  # each row's accepted branch: its K/V moved after its root, its states in order
                n, token, path = _verify_trees(x, tree, logits, sampler, forced)
                _move_rows(target, slot, path)
                branch, reached = x.gather(1, path)[:, 1:], tree["depth"].amax(dim=1)  # [B, D]; the depths reached
                hidden = hidden.gather(1, path[..., None].expand(-1, -1, hidden.shape[-1])) if taps else None
            D = branch.shape[1]
            host = torch.cat([n, token, branch.flatten(), reached]).tolist()  # the one host sync of the round
            if tree is not None:  # (a tree's drafted depth: how deep its nodes reach, as one sequence counts it)
                lengths = [min(k, d) for k, d in zip(lengths, host[-B:], strict=True)]
            for b in range(B):
                if done[b]:
                    continue
                k, j = host[b], row_of[b]
                new = host[2 * B + b * D : 2 * B + b * D + k] + [host[B + b]]
                new = new[: max_new_tokens - len(out[j])]  # (a tree may reach past the row's budget)
                for i, t in enumerate(new):
                    if t in stop_ids:
                        new = new[: i + 1]
                        break
                stats[j].record_round(lengths[b], min(k, len(new)), b in looked)
                out[j] += new
                slot[b] += len(new)  # (k + 1 but where a stop or the budget cut it: the row is done then)
                done[b] = finished(out[j])
                if drafter is not None:
                    drafter.observe_tokens(b, new)
                    if taps:
                        drafter.observe(b, hidden[b, : k + 1])
            share = 1 / len(running)  # the round's times, split among the prompts it decoded
            t4 = time.perf_counter()
            for s in (stats[j] for j in running):
                s.draft_s += (t2 - t1) * share
                s.target_s += (t3 - t2) * share
                s.verify_s += (t4 - t2) * share
                s.total_s += (t4 - t1) * share
    finally:
        target.left_pad(None)
    generations = []
    for j, s in enumerate(stats):
        s.new_tokens = len(out[j])
        s.total_s += s.prefill_s
        generations.append(Generation(out[j], s, "stop_token" if out[j][-1] in stop_ids else "length"))
    return generations


def _verify_trees(x: Tensor, tree: dict[str, Tensor], logits: Tensor, sampler: Sampler,
                  forced: tuple[float, torch.Generator] | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(accepted lengths [B], the target's own token after them [B], the accepted branches [B, D + 1]:
    node indices per depth, root first, entries past a row's length at the root) of every row's
    token tree: x [B, N + 1] the roots and nodes, tree its tensors a row each (levels [D + 1] shared).
    Greedy: the branch the target's argmax follows (verify_tree_greedy's rule for every row at
    once); sampled: verify_rows_tree_sample; forced: each depth's first child a draw."""
    if sampler.greedy or forced is not None:
        choice = argmax(logits)  # [B, N + 1]
        if forced is None:
            chosen = x == choice.gather(1, tree["parent"])  # siblings are distinct: at most one matches
        else:
            u = torch.rand(x.shape[0], tree["levels"].shape[0], device=x.device, generator=forced[1]) < forced[0]
            chosen = ~tree["earlier"].any(dim=-1) & u.gather(1, tree["depth"])
        if "alive" in tree:  # (a row drafting a chain in its tree: drafters.batched.chain_rows)
            chosen = chosen & tree["alive"]
        path, n = walk_rows(tree, chosen)
        return n, choice.gather(1, path.gather(1, n[:, None])).squeeze(1), path
    return verify_rows_tree_sample(x, tree, sampler.probs(logits), sampler)


def _idle(tree: dict[str, Tensor], lengths: list[int]) -> dict[str, Tensor]:
    """The tree's tensors with every node of the rows that drafted nothing (lengths[b] == 0: at their
    budget, or done) dead (tree["alive"]), so that verification takes the target's token after the
    root: their trees were drafted only because the round's other rows draft."""
    depth = tree["depth"]
    idle = torch.tensor([n == 0 for n in lengths]).to(depth.device, non_blocking=True)[:, None]
    alive = ~(idle & (torch.arange(depth.shape[1], device=depth.device) > 0))
    return tree | {"alive": alive & tree["alive"] if "alive" in tree else alive}


def _move_rows(target: Decoder, slot: list[int], path: Tensor) -> None:
    """Every row's accepted branch path [B, D + 1] (node indices, root at slot[b]) moved to the slots
    right after its root, in every layer (entries past a row's length copy the root into slots
    that are stale, as a rejected draft's are)."""
    B, D = path.shape[0], path.shape[1] - 1
    if D == 0:
        return
    root = torch.tensor(slot).to(path.device, non_blocking=True)[:, None]
    rows = torch.arange(B, device=path.device)[:, None].expand(B, D)
    kv = target.cache.kv  # [layers, rows, 2 Hkv, S, Dh]
    kv[:, rows, :, root + torch.arange(1, D + 1, device=path.device)] = kv[:, rows, :, root + path[:, 1:]]


def _verify(drafts: Tensor, lengths: list[int], q: Tensor | None, logits: Tensor, sampler: Sampler,
            forced: tuple[float, torch.Generator] | None = None):  # fmt: skip
    """(accepted lengths [B], the target's own token after them [B]) of every row's chain. forced:
    (rate, generator) of accept_rate (generate_many), each drafted token a draw."""
    B, g = drafts.shape
    lengths = torch.tensor(lengths).to(drafts.device, non_blocking=True)
    if sampler.greedy or forced is not None:
        choice = argmax(logits)  # [B, g + 1]
        real = torch.arange(g, device=drafts.device) < lengths[:, None]
        if forced is None:
            accepted = choice[:, :g] == drafts
        else:
            accepted = torch.rand(B, g, device=drafts.device, generator=forced[1]) < forced[0]
        n = (accepted & real).long().cumprod(dim=1).sum(dim=1)
        return n, choice.gather(1, n[:, None]).squeeze(1)
    return verify_rows_sample(drafts, lengths, None if q is None else q[:, :g], sampler.probs(logits), sampler)
