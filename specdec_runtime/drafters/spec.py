"""Drafters from their command-line specs (`specdec generate --drafter SPEC`, `specdec bench`).

    drafter = build_drafter("truncate:6", target)                 # target: a LoadedModel
    drafter = build_drafter("runs/medusa/export", target, tree="chain")

This module knows every drafter kind; the kinds' own modules (drafters, medusa, mtp, layerskip)
know nothing of each other or of the command line.
"""

from pathlib import Path

import torch

from specdec_runtime.drafters.eagle3_format import is_eagle3_folder, load_eagle3
from specdec_runtime.drafters.layerskip import SkipSet, is_skipset_file, skip_drafter
from specdec_runtime.drafters.lookup import LookupFirst, NgramDrafter
from specdec_runtime.drafters.medusa import is_medusa_folder, load_medusa
from specdec_runtime.drafters.mtp import load_mtp
from specdec_runtime.drafters.phrases import PhraseTable
from specdec_runtime.drafters.protocol import Drafter
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.loading import LoadedModel, check_same_vocab, load_model

LOOKUP = "+lookup"


def _int_arg(spec: str, kind: str) -> int:
    arg = spec.split(":", 1)[1] if ":" in spec else ""
    if not arg.isdigit():
        raise SpecdecError(f"drafter '{spec}': expected {kind}:N with a positive integer N")
    return int(arg)


def build_drafter(
    spec: str,
    target: LoadedModel,
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
    DIR             an EAGLE-3 drafter (speculators format); tree: 'chain' for chains, None for
                    the drafting of its export (an EAGLE-2 tree, or chains); confidence > 0: chains
                    stop after a token drafted below it
    DIR             exported Medusa heads (FasterDecoding or vLLM layout); tree: a JSON file of
                    paths, 'chain', or None for the tree calibrated at export
    FILE.json       a layer-skip set from recipes.layerskip (self-speculative: the target with
                    sublayers skipped, adaptive draft exit; confidence > 0 fixes the threshold)
    NAME            a stand-alone draft model: bundled alias, local HF folder or Hub id
    SPEC+lookup     prompt lookup (n-grams of 2-3 tokens; 8 tokens, or gamma if longer) where it matches,
                    then the phrase table of an export that has one (specdec_phrases/), SPEC
                    otherwise (LookupFirst); on a CPU an EAGLE-3 drafter's 2 best nodes are merged
                    into each lookup's chain (lookup_merge)
    """
    spec = spec.strip()
    if spec.endswith(LOOKUP) and spec != LOOKUP:
        inner_spec = spec[: -len(LOOKUP)]
        inner = build_drafter(inner_spec, target, confidence=confidence, dtype=dtype, tree=tree)
        if inner is None:
            raise SpecdecError(f"drafter '{spec}': lookup needs a drafter to fall back on; plain lookup is 'ngram'")
        return LookupFirst(inner, table=phrase_table(inner_spec, target))
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
        return load_mtp(target)
    if is_skipset_file(spec):
        return skip_drafter(target, SkipSet.load(spec), confidence=confidence, name=spec)
    if is_eagle3_folder(Path(spec).expanduser()):
        if tree not in (None, "chain"):
            raise SpecdecError(f"--tree {tree}: an EAGLE-3 drafter builds its own trees; use --tree chain for chains")
        budget = 0 if tree == "chain" else None
        eagle3 = load_eagle3(Path(spec).expanduser(), target, tree_budget=budget, confidence=confidence)
        eagle3.source = Path(spec).expanduser()
        return eagle3
    if is_medusa_folder(Path(spec).expanduser()):
        return load_medusa(Path(spec).expanduser(), target, tree)
    if tree is not None:
        raise SpecdecError(f"--tree applies to Medusa heads; '{spec}' is not a Medusa export")
    drafter = load_model(
        spec, device=target.model.device, dtype=dtype if dtype != "auto" else target.model.weight_dtype
    )
    check_same_vocab(target, drafter)
    if target.model.compiled:  # a compiled target gets a compiled draft model
        drafter.model.compile()
    model = ModelDrafter(drafter.model, vocab_size=target.config.vocab_size, confidence=confidence, name=spec)
    model.source = drafter.path
    return model


def phrase_table(spec: str, target: LoadedModel) -> PhraseTable | None:
    """The phrase table of export folder `spec` (specdec_phrases/), on the target's device, if it has one."""
    phrases = Path(spec).expanduser() / PhraseTable.FILE
    return PhraseTable.load(phrases, target.model.device) if phrases.is_file() else None


def as_chains(drafter: Drafter | None, spec: str, target: LoadedModel, **kw) -> Drafter | None:
    """`drafter` (build_drafter(spec, target, **kw)) drafting chains, as SpecTr's sequences and batches
    take them: a tree drafter (an EAGLE-3 export's trees, Medusa's) built again with tree='chain'."""
    if drafter is None or not drafter.tree_nodes:
        return drafter
    return build_drafter(spec, target, **{**kw, "tree": "chain"})
