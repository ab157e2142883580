"""Drafters: what proposes tokens for the target to verify.

    drafter = ModelDrafter(draft_model)                                   # a small stand-alone model
    drafter = ModelDrafter(target, exit_layer=6, shares_target_cache=True)  # truncate:6
    drafter = NgramDrafter(max_ngram=3)                                     # prompt lookup
    drafter = build_drafter("truncate:6", target)                          # from a CLI spec
    drafter.start(prompt, capacity)
    draft = drafter.draft(ids, gamma=4, sampler=sampler)   # Draft(tokens [g], probs [g, V] | None)

The protocol is two methods. `start` is called once per prompt, after the target's prefill.
`draft` receives the whole sequence so far, ids [L]: the target has verified ids[:L-1] into its
KV cache and ids[L-1] is the newest token; it returns up to gamma tokens that should follow (or a
token tree at most gamma deep). A drafter that reads the target's hidden states (Medusa, MTP heads)
also has `observe(hidden [k, H])`: after every target forward the loop passes the hidden states of
the positions it accepted, in order, the last one being the position that produced the newest
token (after the prefill: the prompt's). They are final-norm states (only the last prompt row
after the prefill), or, when the drafter sets `hidden_layer = k`, the residual stream after the
target's first k layers (every prompt row).
"""

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import Tensor

from specdec_runtime.errors import SpecdecError
from specdec_runtime.model import Decoder, LayerSkip
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree

if TYPE_CHECKING:
    from specdec_runtime.loading import LoadedModel


class Draft(NamedTuple):
    tokens: Tensor  # [g] proposed ids, 0 <= g <= gamma
    probs: Tensor | None  # [g, V] the distributions they were sampled from; None if deterministic
    # Early-exit drafters have already run the target's first `resume_layer` layers on every token
    # the target will verify (ids[L-1] and the g drafts): their residual stream [1, g + 1, H] lets
    # verification resume at that layer instead of recomputing it (LayerSkip's cache reuse).
    residual: Tensor | None = None
    resume_layer: int = 0
    # A token tree (Medusa): tokens are its nodes after the root, verified in one forward with
    # tree attention; the loop keeps the accepted branch's KV entries.
    tree: Tree | None = None


class Drafter(Protocol):
    name: str

    def start(self, prompt: Tensor, capacity: int) -> None:
        """Reset for a new prompt [P]; sequences will not exceed `capacity` tokens."""

    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        """Propose up to gamma tokens to follow ids [L]."""


def empty_draft(device: torch.device) -> Draft:
    return Draft(torch.empty(0, dtype=torch.long, device=device), None)


class ModelDrafter:
    """Drafts with a Decoder: a stand-alone model, or the target itself cut short / with skips.

    With shares_target_cache (truncate:K, layer-skip) the drafter is the target run with
    exit_layer / skip: it reads the target's verified cache entries and writes its guesses into
    slots the next verification overwrites, so it never re-reads the context. An early-exit
    drafter (exit_layer, no skip) also hands its layer-K residual stream to verification, which
    then only runs layers K.. (the first K were the target's own computation already). A
    stand-alone model keeps its own cache and only feeds the tokens it has not seen (one or two).
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
        name: str = "model",
    ):
        self.model, self.exit_layer, self.skip = model, exit_layer, skip
        self.vocab_size = vocab_size or model.config.vocab_size  # the target's vocabulary
        self.shares_target_cache, self.confidence, self.name = shares_target_cache, confidence, name
        self.seen = 0  # own cache: leading positions that hold the current sequence
        self.vocab_ids = getattr(model, "vocab_ids", None)  # [N] a draft vocabulary's ids, if any

    def start(self, prompt: Tensor, capacity: int) -> None:
        if self.shares_target_cache:
            return
        context = self.model.config.max_position_embeddings
        if capacity > context:
            raise SpecdecError(
                f"drafter '{self.name}' has a context of {context} tokens, shorter than prompt + "
                f"max_new_tokens = {capacity}: lower max_new_tokens or use a drafter with a longer context"
            )
        self.model.setup_cache(1, capacity)
        self.model(prompt[None], 0, logits_to_keep=1)
        self.seen = prompt.shape[0]

    def _residual(self, x: Tensor, start: int) -> Tensor:
        """The drafter's residual stream [1, T, H] for x [1, T] fed at `start` (before its head)."""
        return self.model.run_layers(self.model.embed_tokens(x), start, 0, self.exit_layer, skip=self.skip)

    def _logits(self, residual: Tensor) -> Tensor:
        """Draft logits [V_target] at the last position of a residual stream [1, T, H]."""
        logits = self.model.head(residual, logits_to_keep=1).logits[0, -1]
        V = self.vocab_size
        if self.vocab_ids is not None:  # a draft vocabulary: ids outside it get probability 0
            full = logits.new_full((V,), float("-inf"))
            return full.index_copy_(0, self.vocab_ids, logits)
        if logits.shape[-1] > V:  # ids the target does not have can never be proposed
            logits = logits[:V]
        elif logits.shape[-1] < V:  # ids the drafter does not have get probability 0
            logits = torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))
        return logits

    @torch.inference_mode()
    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        L = ids.shape[0]
        seen = L - 1 if self.shares_target_cache else min(self.seen, L - 1)
        x, pos = ids[seen:L][None], seen  # the tokens the drafter has not processed yet
        reuse = self.shares_target_cache and self.exit_layer is not None and self.skip is None
        tokens, probs, residuals = [], [], []
        for _ in range(gamma):
            residual = self._residual(x, pos)
            if reuse:
                residuals.append(residual)
            logits = self._logits(residual)
            pos += x.shape[1]
            if sampler.greedy:
                token, p = logits.argmax(), None
            else:
                p = sampler.probs(logits)
                token = sampler.sample(p)
                probs.append(p)
            tokens.append(token)
            x = token.view(1, 1)
            # Draft-confidence cut-off (host sync per draft token, only when enabled).
            if self.confidence > 0:
                conf = (p if p is not None else logits.float().softmax(-1))[token]
                if conf.item() < self.confidence:
                    break
        self.seen = pos  # ids[:L] and all drafted tokens but the last are now cached
        drafted, q = torch.stack(tokens), torch.stack(probs) if probs else None
        if not reuse:
            return Draft(drafted, q)
        residuals.append(self._residual(drafted[-1:][None], pos))  # the last draft's first K layers
        return Draft(drafted, q, torch.cat(residuals, dim=1), self.exit_layer)


def _int_arg(spec: str, kind: str) -> int:
    arg = spec.split(":", 1)[1] if ":" in spec else ""
    if not arg.isdigit():
        raise SpecdecError(f"drafter '{spec}': expected {kind}:N with a positive integer N")
    return int(arg)


def build_drafter(
    spec: str,
    target: "LoadedModel",
    *,
    confidence: float = 0.0,
    dtype: str | torch.dtype | None = "auto",
    tree: str | None = None,
) -> Drafter | None:
    """A drafter from its command-line spec; None for plain autoregressive decoding.

    none            autoregressive (no drafter)
    ngram[:N]       prompt lookup with n-grams of up to N tokens (default 3)
    truncate:K      the target's first K layers + its final norm and lm_head (no training)
    mtp             the target's own multi-token-prediction heads (a target exported by recipes.mtp)
    DIR             exported Medusa heads (FasterDecoding or vLLM layout); tree: a JSON file of
                    paths, 'chain', or None for the tree calibrated at export
    NAME            a stand-alone draft model: bundled alias, local HF folder or Hub id
    """
    from pathlib import Path

    from specdec_runtime.loading import check_same_vocab, load_model
    from specdec_runtime.medusa import is_medusa_folder, load_medusa

    spec = spec.strip()
    if spec.lower() in ("", "none", "ar"):
        return None
    if spec == "ngram" or spec.startswith("ngram:"):
        return NgramDrafter(_int_arg(spec, "ngram") if ":" in spec else 3)
    if spec == "truncate" or spec.startswith("truncate:"):
        k, n = _int_arg(spec, "truncate"), target.config.num_layers
        if not 1 <= k < n:
            raise SpecdecError(f"drafter '{spec}': K must be in 1..{n - 1} (the target has {n} layers)")
        return ModelDrafter(target.model, exit_layer=k, shares_target_cache=True, confidence=confidence, name=spec)
    if spec == "mtp":
        from specdec_runtime.mtp import load_mtp

        return load_mtp(target)
    if is_medusa_folder(Path(spec).expanduser()):
        return load_medusa(Path(spec).expanduser(), target, tree)
    if tree is not None:
        raise SpecdecError(f"--tree applies to Medusa heads; '{spec}' is not a Medusa export")
    drafter = load_model(spec, device=target.model.device, dtype=dtype if dtype != "auto" else target.model.dtype)
    check_same_vocab(target, drafter)
    return ModelDrafter(drafter.model, vocab_size=target.config.vocab_size, confidence=confidence, name=spec)


class NgramDrafter:
    """Prompt lookup decoding: find an earlier occurrence of the last n tokens and propose what
    followed it (n from max_ngram down to min_ngram). Needs no model; it pays off when the output
    copies from the prompt or repeats itself (summaries, extraction, code edits)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, f"ngram:{max_ngram}"

    def start(self, prompt: Tensor, capacity: int) -> None:
        pass

    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        seq = ids.cpu()  # host lookup (a device sync on GPU)
        L = seq.shape[0]
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            windows = seq[: L - 1].unfold(0, n, 1)  # [L - n, n]; excludes the suffix itself
            begins = (windows == seq[L - n :]).all(dim=1).nonzero().flatten() + n
            if begins.numel():
                # The latest match that still has gamma tokens after it, else the earliest one.
                full = begins[begins + gamma <= L]
                begin = int(full[-1] if full.numel() else begins[0])
                return Draft(ids[begin : begin + gamma], None)
        return empty_draft(ids.device)
