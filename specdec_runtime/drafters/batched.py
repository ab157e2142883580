"""Drafters for batched decoding (specdec_runtime.batched): prompt lookup for every row, on the
host, a stand-alone model batched like the target, and EAGLE-3 chains, each row at slots of its own.

    rows = batch_drafter(drafter)     # RowLookup, RowModel, RowEagle3, or None: a kind that decodes a prompt at a time
"""

import torch
from torch import Tensor

from specdec_runtime.drafters.eagle3 import Eagle3Drafter, layer_rows
from specdec_runtime.drafters.lookup import NgramDrafter
from specdec_runtime.drafters.protocol import Drafter, RowDrafter
from specdec_runtime.drafters.standalone import ModelDrafter, in_target_vocab
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import left_padded
from specdec_runtime.layers import linear, rms_norm, rope_table
from specdec_runtime.model import Decoder
from specdec_runtime.rows import one_row
from specdec_runtime.sampling import Sampler, argmax


class RowLookup(RowDrafter):
    """Prompt lookup (NgramDrafter) for every row, on the host."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, device: torch.device | str = "cpu"):
        self.max_ngram, self.min_ngram, self.device = max_ngram, min_ngram, torch.device(device)
        self.name = f"ngram:{max_ngram}"
        self.rows: list[NgramDrafter] = []

    def start(self, prompts: list[list[int]], row_start: Tensor, capacity: int) -> None:
        self.rows = [NgramDrafter(self.max_ngram, self.min_ngram) for _ in prompts]
        for row, prompt in zip(self.rows, prompts, strict=True):
            row.observe_tokens(prompt)

    def refill(self, b: int, prompt: list[int]) -> None:
        self.rows[b] = NgramDrafter(self.max_ngram, self.min_ngram)
        self.rows[b].observe_tokens(prompt)

    def observe_tokens(self, b: int, tokens: list[int]) -> None:
        self.rows[b].observe_tokens(tokens)

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], None]:
        drafts = []
        for row, g in zip(self.rows, gammas, strict=True):
            found = row.draft(torch.tensor(row.seq), g, sampler).tokens.tolist() if g else []
            drafts.append(found[:g])
        lengths = [len(d) for d in drafts]
        tokens = torch.zeros(len(drafts), max(lengths), dtype=torch.long)
        for b, d in enumerate(drafts):
            tokens[b, : len(d)] = torch.tensor(d, dtype=torch.long)
        return tokens.to(self.device, non_blocking=True), lengths, None

    def alone(self) -> Drafter:
        return NgramDrafter(self.max_ngram, self.min_ngram)


class RowModel(RowDrafter):
    """A stand-alone draft model for every row: its own cache, a row a sequence at the target's
    slots, catching up on each row's unseen tokens (one or two) in one forward, then drafting
    max(gammas) tokens for all rows (each row keeps its own gamma's)."""

    def __init__(self, model: Decoder, vocab_size: int | None = None, name: str = "model"):
        self.model, self.name = model, name
        self.vocab_size = vocab_size or model.config.vocab_size
        self.vocab_ids = getattr(model, "vocab_ids", None)

    def start(self, prompts: list[list[int]], row_start: Tensor, capacity: int) -> None:
        context = self.model.config.max_position_embeddings
        if capacity > context:
            raise SpecdecError(f"drafter '{self.name}' has a context of {context} tokens, shorter than {capacity}")
        device = self.model.device
        self.model.setup_cache(len(prompts), capacity)
        self.model.left_pad(row_start.to(device), per_row=True)
        self.row_start = row_start.tolist()
        self.seqs = [list(p) for p in prompts]
        ids, _ = left_padded(prompts, 0)
        self.model(ids.to(device), torch.zeros(len(prompts), dtype=torch.long, device=device), logits_to_keep=1)
        self.seen = [len(p) for p in prompts]  # each row's tokens in the drafter's cache

    def refill(self, b: int, prompt: list[int]) -> None:
        """The prompt prefilled into row b alone (at slot 0)."""
        with one_row(self.model, b):
            self.model(torch.tensor([prompt], device=self.model.device), torch.zeros(1, dtype=torch.long,
                       device=self.model.device), logits_to_keep=1)  # fmt: skip
        self.row_start[b], self.seqs[b], self.seen[b] = 0, list(prompt), len(prompt)

    def observe_tokens(self, b: int, tokens: list[int]) -> None:
        self.seqs[b] += tokens

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], Tensor | None]:
        device, B, g = self.model.device, len(self.seqs), max(gammas)
        seen = [min(s, len(seq) - 1) for s, seq in zip(self.seen, self.seqs, strict=True)]  # past a rejection: stale
        unseen = [seq[s:] for s, seq in zip(seen, self.seqs, strict=True)]
        width = max(map(len, unseen))
        x = torch.tensor([u + u[-1:] * (width - len(u)) for u in unseen], device=device)  # padded with copies
        starts = torch.tensor([r + s for r, s in zip(self.row_start, seen, strict=True)], device=device)
        last = torch.tensor([len(u) - 1 for u in unseen], device=device)
        logits = self.model(x, starts, logits_to_keep=0).logits  # [B, width, V']
        logits = logits[torch.arange(B, device=device), last]  # each row's after its newest token
        starts = starts + last + 1
        tokens, probs = [], []
        for i in range(g):
            logits = in_target_vocab(logits, self.vocab_size, self.vocab_ids)
            if sampler.greedy:
                token = argmax(logits)
            else:
                probs.append(sampler.probs(logits))
                token = sampler.sample(probs[-1])
            tokens.append(token)
            if i + 1 < g:
                logits = self.model(token[:, None], starts + i, logits_to_keep=1).logits[:, -1]
        self.seen = [len(seq) + g - 1 for seq in self.seqs]  # the drafts but the last are cached
        return torch.stack(tokens, 1), list(gammas), torch.stack(probs, 1) if probs else None

    def alone(self) -> Drafter:
        return ModelDrafter(self.model, vocab_size=self.vocab_size, name=self.name)


class RowEagle3(RowDrafter):
    """An EAGLE-3 drafter's chains for every row (its fused weights, eagle3.Eagle3Drafter._rows
    batched): its own cache a row a sequence, row b's position p at slot p. A round first runs each
    row's accepted positions with the target's features (the catch-up, padded to the longest
    row's), then drafts max(gammas) tokens for all rows, each reading the previous one's prenorm.
    Chains only: a tree drafter drafts chains of gamma here."""

    def __init__(self, drafter: Eagle3Drafter):
        self.d, self.name, self.hidden_layers = drafter, f"{drafter.name} (chains)", drafter.hidden_layers

    def start(self, prompts: list[list[int]], row_start: Tensor, capacity: int) -> None:
        cfg, target = self.d.model.config.layer, self.d.target
        shape = (len(prompts), 2 * cfg.num_kv_heads, capacity + 1, cfg.head_dim)
        self.kv = torch.zeros(shape, device=target.device, dtype=target.dtype)
        self.rope = rope_table(cfg, capacity + 1, target.device, target.dtype)
        self.slots = torch.arange(capacity + 1, device=target.device)
        self.seqs = [list(p) for p in prompts]
        self.pending: list[list[Tensor]] = [[] for _ in prompts]

    def refill(self, b: int, prompt: list[int]) -> None:
        self.seqs[b], self.pending[b] = list(prompt), []

    def observe_tokens(self, b: int, tokens: list[int]) -> None:
        self.seqs[b] += tokens

    def observe(self, b: int, hidden: Tensor) -> None:
        self.pending[b].append(hidden)

    def _rows(self, tokens: Tensor, feature: Tensor, starts: Tensor, row: int | None = None) -> Tensor:
        """Rows tokens [B, T] with features [B, T, H] at slots (= rope positions) starts[b] onward,
        each seeing its own row's slots up to its own: their prenorm [B, T, H]. row: the cache's row b
        alone (B = 1)."""
        cfg, (B, T) = self.d.model.config, tokens.shape
        kv = self.kv if row is None else self.kv[row : row + 1]
        group = cfg.layer.num_heads // cfg.layer.num_kv_heads
        slots = starts[:, None] + self.slots[:T]
        bound = int(starts.max()) + T
        mask = (self.slots[:bound] <= slots[..., None]).repeat(1, group, 1)[:, None]  # [B, 1, group T, bound]
        embeds = self.d.target.embed_tokens(tokens).view(B * T, -1)
        cs = self.rope[slots]  # [B, T, 2, D]
        out = layer_rows(self.d.w, cfg, embeds, feature.reshape(B * T, -1), B, cs[:, :, None, 0], cs[:, :, None, 1],
                         kv, slots, mask, bound)  # fmt: skip
        return out.view(B, T, -1)

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], Tensor | None]:
        d, B, g = self.d, len(self.seqs), max(gammas)
        w, eps, device = d.w, d.model.config.layer.rms_norm_eps, d.target.device
        feats = [torch.cat(p) if p else None for p in self.pending]  # rows L-1-k .. L-2 of each sequence
        self.pending = [[] for _ in range(B)]
        for b, f in enumerate(feats):  # a prompt just taken from the queue: its rows alone, all but the last
            if f is not None and f.shape[0] > g + 1:
                seq, k = self.seqs[b], f.shape[0]
                tokens = torch.tensor([seq[len(seq) - k : len(seq) - 1]], device=device)
                start = torch.tensor([len(seq) - 1 - k], device=device)
                self._rows(tokens, linear(f[:-1].to(w.dtype), w.fc)[None], start, row=b)
                feats[b] = f[-1:]
        counts = [1 if f is None else f.shape[0] for f in feats]  # (a stopped row: one row of zeros)
        m, H3 = max(counts), d.model.config.target_hidden_size * len(self.hidden_layers)
        features = torch.zeros(B, m, H3, device=device, dtype=w.dtype)
        tokens = []
        for b, (f, k, seq) in enumerate(zip(feats, counts, self.seqs, strict=True)):
            if f is not None:
                features[b, :k] = f.to(w.dtype)
            row = seq[len(seq) - k :]  # the tokens after those positions
            tokens.append(row + row[-1:] * (m - k))
        starts = torch.tensor([len(seq) - 1 - k for seq, k in zip(self.seqs, counts, strict=True)], device=device)
        fc = linear(features.view(B * m, -1), w.fc).view(B, m, -1)
        prenorm = self._rows(torch.tensor(tokens, device=device), fc, starts)
        last = torch.tensor(counts, device=device) - 1
        prenorm = prenorm[torch.arange(B, device=device), last][:, None]  # [B, 1, H] each row's newest
        starts = starts + last + 1  # the first draft's slot
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
                prenorm = self._rows(token[:, None], prenorm, starts + i)
        return torch.stack(drafted, 1), list(gammas), torch.stack(probs, 1) if probs else None

    def alone(self) -> Drafter:
        return self.d


def batch_drafter(drafter: Drafter) -> RowDrafter | None:
    """The batched form of a runtime drafter (prompt lookup, a stand-alone model, EAGLE-3 as chains),
    or None for the kinds that decode a prompt at a time (Medusa, MTP, truncate, layer skip, lookup
    first, draft exits)."""
    if isinstance(drafter, NgramDrafter):
        return RowLookup(drafter.max_ngram, drafter.min_ngram)
    if isinstance(drafter, Eagle3Drafter) and drafter.draft_exit is None:
        return RowEagle3(drafter)
    if isinstance(drafter, ModelDrafter) and not drafter.shares_target_cache and drafter.draft_exit is None:
        return RowModel(drafter.model, drafter.vocab_size, drafter.name)
    return None
