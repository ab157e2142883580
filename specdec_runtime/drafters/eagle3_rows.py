"""EAGLE-3 for batched decoding (specdec_runtime.batched): the drafter's chains or trees for every
row, each row at slots of its own in the drafter's cache (drafters/batched.py builds it).

    rows = RowEagle3(eagle3_drafter)  # its trees (tree_budget > 0) or chains
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from specdec_runtime.cache import cache_spans
from specdec_runtime.drafters.eagle3 import CATCH_UP_ROWS, MAX_DEPTH, Eagle3Drafter, best_nodes, layer_rows
from specdec_runtime.drafters.protocol import Drafter, RowDrafter
from specdec_runtime.graphs import CapturedStep
from specdec_runtime.layers import linear, rms_norm, rope_table
from specdec_runtime.rows import captured_rows, move_rows
from specdec_runtime.sampling import Sampler, argmax


class RowEagle3(RowDrafter):
    """An EAGLE-3 drafter for every row (its fused weights, eagle3.Eagle3Drafter._rows batched): its
    own cache a row a sequence, row b's position p at slot p. A round first runs each row's accepted
    positions with the target's features (the catch-up, padded to the longest row's), then drafts
    for all rows: chains of max(gammas) tokens, each reading the previous one's prenorm, or (a
    drafter of trees) every row's EAGLE-2 tree of the drafter's budget as one
    sequence's is drafted on the device (Eagle3Drafter._tree_on_device, a row each: a fixed top-k
    frontier per level, max(gammas) levels deep).

    Where the drafter drafts on the device (Eagle3Drafter.on_device: a GPU's default), a greedy
    round (any round, drafting trees) is two captured steps that read nothing back, as one
    sequence's is: the catch-up, its rows padded to one of CATCH_UP_ROWS, and the whole chain or
    tree; the batch padded to a captured batch size (rows.captured_rows). Each is captured once per
    span of the cache (the target's rule, model.py), every span and catch-up size at once. A prompt
    just taken from the queue runs its rows eagerly first."""

    def __init__(self, drafter: Eagle3Drafter):
        self.d, self.hidden_layers = drafter, drafter.hidden_layers
        self.tree_nodes = drafter.tree_budget
        self.name = drafter.name if self.tree_nodes else f"{drafter.name} (chains)"
        self.tree: dict[str, Tensor] | None = None
        self.steps: dict[tuple, CapturedStep] = {}  # on_device: by (kind, size, span); they point at self.kv
        self.kv: Tensor | None = None  # [rows, 2 h_kv, S, D] the drafter's cache, kept across calls

    def start(self, prompts: list[list[int]], row_start: list[int], capacity: int) -> None:
        cfg, target, B = self.d.model.config.layer, self.d.target, len(prompts)
        rows, size = B, capacity + 1 + (MAX_DEPTH - 1) * self.d.top_k * bool(self.tree_nodes)  # (+ a tree's rows)
        if self.d.on_device:  # (+ a catch-up's padding; in steps of 256 slots, as the target's cache)
            rows, size = captured_rows(B), -(-(size + CATCH_UP_ROWS[-1]) // 256) * 256
        if self.kv is None or self.kv.shape[0] != rows or self.kv.shape[2] < size:  # (stale slots are masked)
            self.steps.clear()
            self.kv = None  # free the old one first
            shape = (rows, 2 * cfg.num_kv_heads, size, cfg.head_dim)
            self.kv = torch.zeros(shape, device=target.device, dtype=target.dtype)
            self.rope = rope_table(cfg, size, target.device, target.dtype)
            self.slots = torch.arange(size, device=target.device)
        self.seqs = [list(p) for p in prompts]
        self.pending: list[list[Tensor]] = [[] for _ in prompts]

    def refill(self, b: int, prompt: list[int]) -> None:
        self.seqs[b], self.pending[b] = list(prompt), []

    def observe_tokens(self, b: int, tokens: list[int]) -> None:
        self.seqs[b] += tokens

    def observe(self, b: int, hidden: Tensor) -> None:
        self.pending[b].append(hidden)

    def keep(self, rows: list[int]) -> bool:
        if self.d.on_device:  # (its steps are captured for the batch's size)
            return False
        move_rows(self.kv, rows)  # (to the first rows)
        self.seqs, self.pending = [self.seqs[b] for b in rows], [self.pending[b] for b in rows]
        return True

    def _layer(self, tokens: Tensor, feature: Tensor, start: Tensor, bound: int, kv: Tensor) -> Tensor:
        """Rows tokens [B, T] with features [B, T, H] at slots (= rope positions) start[b] onward,
        each seeing its own row's slots up to its own among the first `bound`: their prenorm [B, T, H]."""
        slots = start[:, None] + self.slots[: tokens.shape[1]]
        return self._layer_at(tokens, feature, slots, slots, self.slots[:bound] <= slots[..., None], bound, kv)

    def _layer_at(self, tokens: Tensor, feature: Tensor, positions: Tensor, slots: Tensor, mask: Tensor, bound: int,
                  kv: Tensor) -> Tensor:  # fmt: skip
        """Rows tokens [B, T] with features [B, T, H] at rope positions [B, T], written at slots [B, T],
        each seeing the slots mask [B, T, bound] lets it: their prenorm [B, T, H]."""
        cfg, (B, T) = self.d.model.config, tokens.shape
        group = cfg.layer.num_heads // cfg.layer.num_kv_heads
        embeds = self.d.target.embed_tokens(tokens).view(B * T, -1)
        cs = self.rope[positions]  # [B, T, 2, D]
        out = layer_rows(self.d.w, cfg, embeds, feature.reshape(B * T, -1), B, cs[:, :, None, 0], cs[:, :, None, 1],
                         kv, slots, mask.repeat(1, group, 1)[:, None], bound)  # fmt: skip
        return out.view(B, T, -1)

    def _rows(self, tokens: Tensor, feature: Tensor, starts: list[int], row: int | None = None) -> Tensor:
        """_layer eagerly at host starts, on the cache's first B rows or its row `row` alone (B = 1)."""
        kv = self.kv[: tokens.shape[0]] if row is None else self.kv[row : row + 1]
        start = torch.tensor(starts).to(self.slots.device, non_blocking=True)
        return self._layer(tokens, feature, start, max(starts) + tokens.shape[1], kv)

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], Tensor | None]:
        d, B, g = self.d, len(self.seqs), max(gammas)
        w, eps, device = d.w, d.model.config.layer.rms_norm_eps, d.target.device
        feats = [torch.cat(p) if p else None for p in self.pending]  # rows L-1-k .. L-2 of each sequence
        self.pending = [[] for _ in range(B)]
        for b, f in enumerate(feats):  # a prompt just taken from the queue: its rows alone, all but the last
            if f is not None and f.shape[0] > g + 1:
                seq, k = self.seqs[b], f.shape[0]
                tokens = torch.tensor([seq[len(seq) - k : len(seq) - 1]]).to(device, non_blocking=True)
                self._rows(tokens, linear(f[:-1].to(w.dtype), w.fc)[None], [len(seq) - 1 - k], row=b)
                feats[b] = f[-1:]
        counts = [1 if f is None else f.shape[0] for f in feats]  # (a stopped row: one row of zeros)
        starts = [len(seq) - 1 - k for seq, k in zip(self.seqs, counts, strict=True)]  # the catch-ups' first slots
        self.tree, trees = None, bool(self.tree_nodes)
        if d.on_device and (sampler.greedy or trees) and max(counts) <= CATCH_UP_ROWS[-1]:
            drafted = self._draft_captured(feats, counts, starts, g)
            return drafted, [g if k else 0 for k in gammas] if trees else list(gammas), None
        m = max(counts)
        tokens, features = self._catch_up_inputs(feats, counts, B, m)
        fc = linear(features.view(B * m, -1), w.fc).view(B, m, -1)
        prenorm = self._rows(tokens, fc, starts)
        last = torch.tensor(counts).to(device, non_blocking=True) - 1
        prenorm = prenorm[torch.arange(B, device=device), last][:, None]  # [B, 1, H] each row's newest
        starts = [s + k for s, k in zip(starts, counts, strict=True)]  # the first draft's slot
        if trees:
            start = torch.tensor(starts).to(device, non_blocking=True)
            levels, budget = self._tree_shape(g)
            bound = max(starts) + max(levels - 1, 1) * d.top_k
            tokens, self.tree = self._tree(prenorm[:, 0], d._head(prenorm[:, 0]), start, levels=levels, budget=budget,
                                           span=bound, kv=self.kv[:B])  # fmt: skip
            return tokens, [g if k else 0 for k in gammas], None
        drafted, probs = [], []
        for i in range(g):
            logits = linear(rms_norm(prenorm[:, 0], w.norm, eps), w.head)  # [B, N]
            if sampler.greedy:  # draft ids ascend with target ids: the same first maximum
                token = d.draft_ids[argmax(logits)]
            else:
                full = logits.new_full((B, d.target.config.vocab_size), float("-inf"))
                probs.append(sampler.probs(full.index_copy_(1, d.draft_ids, logits)))
                token = sampler.sample(probs[-1])
            drafted.append(token)
            if i + 1 < g:
                prenorm = self._rows(token[:, None], prenorm, [s + i for s in starts])
        return torch.stack(drafted, 1), list(gammas), torch.stack(probs, 1) if probs else None

    def _catch_up_inputs(self, feats: list[Tensor | None], counts: list[int], rows: int, m: int):
        """(tokens [rows, m], features [rows, m, 3 H_t]) of each row's catch-up: its k features and the
        tokens after those positions, padded with copies of its last token and zero features (a
        stopped row: one zero row; rows past the batch: all padding)."""
        H3 = self.d.model.config.target_hidden_size * len(self.hidden_layers)
        zero = torch.zeros(1, H3, device=self.d.target.device, dtype=self.d.w.dtype)
        padded = [zero if f is None else f.to(zero.dtype) for f in feats] + [zero] * (rows - len(feats))
        features = pad_sequence(padded + [zero.expand(m, -1)], batch_first=True)[:-1]  # [rows, m, H3]
        tokens = [seq[len(seq) - k :] for seq, k in zip(self.seqs, counts, strict=True)]
        tokens = [t + t[-1:] * (m - k) for t, k in zip(tokens, counts, strict=True)] + [[0] * m] * (rows - len(feats))
        return torch.tensor(tokens).to(zero.device, non_blocking=True), features

    def _draft_captured(self, feats: list[Tensor | None], counts: list[int], starts: list[int], g: int) -> Tensor:
        """The greedy chains [B, g] of the catch-up and chain steps (the class docstring)."""
        B, rows = len(feats), self.kv.shape[0]
        m = next(r for r in CATCH_UP_ROWS if r >= max(counts))
        tokens, features = self._catch_up_inputs(feats, counts, rows, m)
        pad = [0] * (rows - B)
        newest = [s + k for s, k in zip(starts, counts, strict=True)]  # each row's first draft's slot
        inputs = dict(tokens=tokens, features=features, start=starts + pad, last=[k - 1 for k in counts] + pad)
        prenorm, logits = self._replay("catch-up", m, self._catch_up, inputs, max(newest))
        inputs = dict(prenorm=prenorm, logits=logits, start=newest + pad)
        if not self.tree_nodes:
            return self._replay("chain", g, partial(self._chain, gamma=g), inputs, max(newest) + g - 1)[:B]
        levels, budget = self._tree_shape(g)
        end = max(newest) + max(levels - 1, 1) * self.d.top_k - 1
        tokens, tree = self._replay("tree", levels, partial(self._tree, levels=levels, budget=budget), inputs, end)
        self.tree = {k: v if k == "levels" else v[:B] for k, v in tree.items()}
        return tokens[:B]

    def _replay(self, kind: str, size: int, fn, inputs: dict, end: int):
        """Step (kind, size) over the span of the cache that holds slots up to `end` (its queries'),
        run on inputs (host lists copied in); first seen, captured for every span at once, a
        catch-up for every size at once (_resized)."""
        spans = cache_spans(self.kv.shape[2], True)
        span = next(s for s in spans if s >= end)
        if (kind, size, span) not in self.steps:
            as_tensor = lambda v: torch.tensor(v, device=self.kv.device) if isinstance(v, list) else v  # noqa: E731
            tensors = {k: as_tensor(v) for k, v in inputs.items()}
            for other in CATCH_UP_ROWS if kind == "catch-up" else (size,):
                shaped = _resized(tensors, other) if kind == "catch-up" else tensors
                for s in spans:
                    if (kind, other, s) not in self.steps:
                        self.steps[(kind, other, s)] = CapturedStep(
                            partial(fn, span=s), shaped, host_reads=False, compile=self.d.step_backend,
                            dynamic={"tokens": 1, "features": 1} if kind == "catch-up" else None,  # (compiled once)
                        )
        return self.steps[(kind, size, span)](**inputs)

    def _tree_shape(self, g: int) -> tuple[int, int]:
        """(levels, nodes) of a tree at most g deep, as one sequence's on the device (_draft_on_device)."""
        levels, K = min(g, MAX_DEPTH), self.d.top_k
        return levels, min(self.d.tree_budget, K + (levels - 1) * K * K)

    def _tree(self, prenorm: Tensor, logits: Tensor, start: Tensor, *, levels: int, budget: int, span: int,
              kv: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
        """Every row's EAGLE-2 tree (Eagle3Drafter._tree_on_device with a row dimension): the root
        rows' prenorm [B, H] and logits [B, N], the first tree rows' slots start [B] -> (the chosen
        nodes' target ids [B, budget], the trees' tensors as Tree.tensors a row each, levels shared).
        Candidates are numbered level by level (frontier row r's child of rank c is r * top_k + c);
        row b's level-d frontier at slots start[b] + (d - 1) * top_k + r and position start[b] + d - 1,
        each seeing its row's prefix (slots < start[b]) and its ancestors' rows, within `span` slots."""
        K, B, H = self.d.top_k, prenorm.shape[0], prenorm.shape[-1]
        kv = self.kv if kv is None else kv
        ar = self.slots[:K]
        top = logits.float().log_softmax(-1).topk(K)  # [B, K]
        scores, toks = [top.values], [top.indices]
        parents, ranks, depths = [(ar - 1 - ar).expand(B, K)], [ar.expand(B, K)], [(ar * 0 + 1).expand(B, K)]
        frontier, front_scores, front_toks = ar.expand(B, K), top.values, top.indices
        features = prenorm[:, None].expand(B, K, H)
        W = max(levels - 1, 1) * K  # the tree's rows
        rel = self.slots[:span] - start[:, None]  # [B, span] each slot relative to the row's first tree row
        prefix, row_of, in_tree = rel < 0, rel.clamp(0, W - 1), (rel >= 0) & (rel < W)
        seen = torch.zeros(B, K, W, dtype=torch.bool, device=prenorm.device)  # the frontier's ancestors' rows
        base = K
        for depth in range(1, levels):
            own = (depth - 1) * K + ar  # the frontier's rows
            seen = seen | (self.slots[:W] == own[:, None])
            mask = prefix[:, None] | (in_tree[:, None] & seen.gather(2, row_of[:, None].expand(B, K, span)))
            position = (start - 1 + depth)[:, None].expand(B, K)
            out = self._layer_at(self.d.draft_ids[front_toks], features, position, start[:, None] + own, mask, span, kv)
            child = self.d._head(out.reshape(B * K, H)).float().log_softmax(-1).topk(K)  # [B K, K]
            cand = (front_scores[:, :, None] + child.values.view(B, K, K)).view(B, K * K)
            keep = cand.topk(K, dim=1).indices  # [B, K]
            scores.append(cand)
            toks.append(child.indices.view(B, K * K))
            parents.append(frontier.repeat_interleave(K, dim=1))
            ranks.append(ar.repeat(K).expand(B, K * K))
            depths.append((ar.repeat(K) * 0 + depth + 1).expand(B, K * K))
            r = keep // K
            frontier, front_scores, front_toks = base + keep, cand.gather(1, keep), toks[-1].gather(1, keep)
            features, seen = out.gather(1, r[..., None].expand(B, K, H)), seen.gather(1, r[..., None].expand(B, K, W))
            base += K * K
        candidates = (torch.cat(x, dim=1) for x in (scores, toks, parents, ranks, depths))
        tok, tensors = best_nodes(*candidates, K, budget, self.slots[: levels + 1])
        return self.d.draft_ids[tok], tensors

    def _catch_up(self, tokens: Tensor, features: Tensor, start: Tensor, last: Tensor, *, span: int):
        """A captured catch-up: rows tokens [B, R] with the target's features [B, R, 3 H_t] at slots
        start[b] onward -> the prenorm [B, H] and draft logits [B, N] of each row's row `last`."""
        B, R = tokens.shape
        fc = linear(features.view(B * R, -1), self.d.w.fc).view(B, R, -1)
        prenorm = self._layer(tokens, fc, start, span, self.kv)
        prenorm = prenorm[torch.arange(B, device=prenorm.device), last]  # [B, H] each row's newest
        return prenorm, self.d._head(prenorm)

    def _chain(self, prenorm: Tensor, logits: Tensor, start: Tensor, *, gamma: int, span: int) -> Tensor:
        """A captured greedy chain [B, gamma] (target ids): token i from the previous row's logits, its
        row (the token, the previous prenorm) at slot start[b] + i."""
        tokens = []
        for i in range(gamma):
            tokens.append(self.d.draft_ids[logits.argmax(-1)])  # [B]
            if i + 1 < gamma:
                prenorm = self._layer(tokens[-1][:, None], prenorm[:, None], start + i, span, self.kv)[:, 0]
                logits = self.d._head(prenorm)
        return torch.stack(tokens, 1)

    def alone(self) -> Drafter:
        return self.d


def _resized(inputs: dict[str, Tensor], R: int) -> dict[str, Tensor]:
    """A catch-up's inputs at R rows a sequence: cut, or padded with rows that write slots past the
    sequence's only (stale, rewritten before they are read: a capture runs the step)."""
    tokens, features = inputs["tokens"][:, :R], inputs["features"][:, :R]
    m = tokens.shape[1]
    padded = dict(tokens=F.pad(tokens, (0, R - m)), features=F.pad(features, (0, 0, 0, R - m)))
    return inputs | padded | dict(last=inputs["last"].clamp(max=m - 1))
