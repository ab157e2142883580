"""Drafters for batched decoding (specdec_runtime.batched): prompt lookup for every row, on the
host, and a stand-alone model batched like the target, each row at slots of its own.

    rows = batch_drafter(drafter)     # RowLookup, RowModel, or None where a kind decodes a prompt at a time
"""

import torch
from torch import Tensor

from specdec_runtime.drafters.lookup import NgramDrafter
from specdec_runtime.drafters.protocol import Drafter, RowDrafter
from specdec_runtime.drafters.standalone import ModelDrafter, in_target_vocab
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import left_padded
from specdec_runtime.model import Decoder
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
        if model.compiled:
            raise SpecdecError("batched drafting runs eagerly: use a drafter model without compile()")
        self.model, self.name = model, name
        self.vocab_size = vocab_size or model.config.vocab_size
        self.vocab_ids = getattr(model, "vocab_ids", None)

    def start(self, prompts: list[list[int]], row_start: Tensor, capacity: int) -> None:
        context = self.model.config.max_position_embeddings
        if capacity > context:
            raise SpecdecError(f"drafter '{self.name}' has a context of {context} tokens, shorter than {capacity}")
        device = self.model.device
        self.model.setup_cache(len(prompts), capacity)
        self.model.left_pad(row_start.to(device))
        self.row_start = row_start.tolist()
        self.seqs = [list(p) for p in prompts]
        ids, _ = left_padded(prompts, 0)
        self.model(ids.to(device), torch.zeros(len(prompts), dtype=torch.long, device=device), logits_to_keep=1)
        self.seen = [len(p) for p in prompts]  # each row's tokens in the drafter's cache

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


def batch_drafter(drafter: Drafter) -> RowDrafter | None:
    """The batched form of a runtime drafter (prompt lookup, a stand-alone model), or None for the
    kinds that decode a prompt at a time (EAGLE-3, Medusa, MTP, truncate, layer skip, lookup first)."""
    if isinstance(drafter, NgramDrafter):
        return RowLookup(drafter.max_ngram, drafter.min_ngram)
    if isinstance(drafter, ModelDrafter) and not drafter.shares_target_cache and drafter.draft_exit is None:
        return RowModel(drafter.model, drafter.vocab_size, drafter.name)
    return None
