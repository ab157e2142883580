"""A Decoder as a drafter: a small stand-alone model, or the target itself cut short (truncate:K)
or with sublayers skipped (layer skip).

    drafter = ModelDrafter(draft_model)                                     # a small stand-alone model
    drafter = ModelDrafter(target, exit_layer=6, shares_target_cache=True)  # truncate:6
"""

import torch
from torch import Tensor

from specdec_runtime.drafters.protocol import Draft, Drafter, DraftExit
from specdec_runtime.errors import SpecdecError
from specdec_runtime.model import Decoder, LayerSkip
from specdec_runtime.sampling import Sampler


class ModelDrafter(Drafter):
    """Drafts with a Decoder: a stand-alone model, or the target itself cut short / with skips.

    With shares_target_cache (truncate:K, layer-skip) the drafter is the target run with
    exit_layer / skip: it reads the target's verified cache entries and writes its guesses into
    slots the next verification overwrites, so it never re-reads the context. Its first layers up
    to the first one it exits at or skips from (`resume_layer`) are the target's own computation,
    so it hands their residual stream to verification, which then only runs layers resume_layer..
    A stand-alone model keeps its own cache and only feeds the tokens it has not seen (one or two).

    Drafting stops early after an unsure token when a DraftExit is given (`confidence` > 0 is a
    fixed threshold); an adaptive DraftExit learns from how many tokens of each draft were accepted.
    """

    def __init__(
        self,
        model: Decoder,
        *,
        vocab_size: int | None = None,
        exit_layer: int | None = None,
        skip: LayerSkip | None = None,
        shares_target_cache: bool = False,
        confidence: float = 0.0,
        draft_exit: DraftExit | None = None,
        gamma: int | None = None,
        name: str = "model",
    ):
        self.model, self.exit_layer, self.skip = model, exit_layer, skip
        self.vocab_size = vocab_size or model.config.vocab_size  # the target's vocabulary
        self.shares_target_cache, self.name = shares_target_cache, name
        self.gamma = gamma  # the draft length it was tuned for (a CLI default), if any
        self.draft_exit = draft_exit or (DraftExit(confidence, adaptive=False) if confidence > 0 else None)
        self.seen = 0  # own cache: leading positions that hold the current sequence
        self.drafted_from = 0  # own cache: where the last draft's tokens begin
        self.residual_rows: Tensor | None = None  # [1, n, H] residual streams for verification (_residual_rows)
        self.vocab_ids = getattr(model, "vocab_ids", None)  # [N] a draft vocabulary's ids, if any
        self.last: tuple[int, int, bool] | None = None  # (L, drafted, full) of the previous draft
        # Layers run exactly as the target runs them: up to the first exit or skipped sublayer.
        stops = [model.config.num_layers, *(skip.attn | skip.mlp if skip is not None else ())]
        stops += [exit_layer] if exit_layer is not None else []
        self.resume_layer = min(stops) if shares_target_cache else 0

    def start(self, prompt: Tensor, capacity: int) -> None:
        self.last = None
        if self.shares_target_cache:
            return
        context = self.model.config.max_position_embeddings
        if capacity > context:
            raise SpecdecError(
                f"drafter '{self.name}' has a context of {context} tokens, shorter than prompt + "
                f"max_new_tokens = {capacity}: lower max_new_tokens or use a drafter with a longer context"
            )
        self.model.setup_cache(1, capacity)
        self.model.prefill(prompt[None], logits_to_keep=1)
        self.seen = self.drafted_from = prompt.shape[0]

    def pass_round(self) -> None:
        self.last = None  # the draft exit learns only from rounds this drafter drafted
        # Another drafter's tokens follow: its own cached drafts hold them no more (the next draft's
        # min(seen, L - 1) keeps them only when its own draft was verified right after).
        self.seen = min(self.seen, self.drafted_from)

    def _logits(self, logits: Tensor) -> Tensor:
        return in_target_vocab(logits, self.vocab_size, self.vocab_ids)

    def _residual_rows(self, n: int) -> Tensor:
        """The buffer [1, n, H] that collects the residual streams handed to verification; the
        drafter owns it, and verification reads it before the next draft overwrites it."""
        if self.residual_rows is None or self.residual_rows.shape[1] < n:
            H = self.model.config.hidden_size
            self.residual_rows = torch.empty(1, n, H, device=self.model.device, dtype=self.model.dtype)
        return self.residual_rows

    @torch.inference_mode()
    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        L = ids.shape[0]
        if self.draft_exit is not None and self.last is not None:
            # The previous draft was verified: the sequence grew by its accepted tokens + one.
            prev_L, drafted, full = self.last
            self.draft_exit.update(min(max(L - prev_L - 1, 0), drafted), drafted, full)
        seen = L - 1 if self.shares_target_cache else min(self.seen, L - 1)
        K = self.resume_layer
        opts = dict(exit_layer=self.exit_layer, skip=self.skip, logits_to_keep=1, taps=(K,) if K else ())
        if self.model.compiled:
            # Catch up a token a step: a step of several tokens (after a fully accepted draft, or
            # rounds LookupFirst drafted) is a shape no warm-up runs, which would be compiled and
            # captured mid-generation, inside a timed prompt.
            for p in range(seen, L - 1):
                self.model(ids[p : p + 1][None], p, **opts)
            seen = L - 1
        x, pos = ids[seen:L][None], seen  # the tokens the drafter has not processed yet
        residual_rows = self._residual_rows(gamma + 1) if K else None
        tokens, probs = [], []
        for i in range(gamma):
            out = self.model(x, pos, **opts)
            if K:  # x is the newest token alone (a shared cache is never behind)
                residual_rows[:, i] = out.hidden[:, -1]
            logits = self._logits(out.logits[0, -1])
            pos += x.shape[1]
            if sampler.greedy:
                token, p = logits.argmax(), None
            else:
                p = sampler.probs(logits)
                token = sampler.sample(p)
                probs.append(p)
            tokens.append(token)
            x = token.view(1, 1)
            # Draft exit (host sync per draft token, only when enabled).
            if self.draft_exit is not None:
                conf = (p if p is not None else logits.float().softmax(-1))[token]
                if self.draft_exit.stop(conf.item()):
                    break
        self.seen, self.drafted_from = pos, L  # ids[:L] and all drafted tokens but the last are now cached
        self.last = (L, len(tokens), len(tokens) == gamma)
        drafted, q = torch.stack(tokens), torch.stack(probs) if probs else None
        if not K:
            return Draft(drafted, q)
        # The last draft token's first K layers, which verification would otherwise recompute.
        g = len(tokens)
        residual_rows[:, g] = self.model(x, pos, exit_layer=K, taps=(K,), head=False).hidden[:, -1]
        return Draft(drafted, q, residual_rows[:, : g + 1], K)


def in_target_vocab(logits: Tensor, V: int, vocab_ids: Tensor | None) -> Tensor:
    """Draft logits [..., V] over the target's vocabulary from a drafter's own [..., V'] (a draft
    vocabulary, or a vocabulary of another size, mapped onto the target's)."""
    if vocab_ids is not None:  # a draft vocabulary: ids outside it get probability 0
        full = logits.new_full((*logits.shape[:-1], V), float("-inf"))
        return full.index_copy_(-1, vocab_ids, logits)
    if logits.shape[-1] > V:  # ids the target does not have can never be proposed
        return logits[..., :V]
    if logits.shape[-1] < V:  # ids the drafter does not have get probability 0
        return torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))
    return logits
