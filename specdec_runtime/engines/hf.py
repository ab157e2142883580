"""transformers' from_pretrained, run as its own code: the model class config.json names, built on
the meta device, against the folder's weights.

    verdict = causal_lm(Folder(path), draft=True)
"""

import re
from typing import Any

from specdec_runtime.engines.common import Engine, Folder, Verdict, compare, draft_vocab_rows, hf_parameters
from specdec_runtime.loading import load_draft_vocab

ENGINE = Engine(
    "transformers",
    "the installed transformers: its model class built on the meta device from config.json",
    ("modeling_utils.py (from_pretrained: model.safetensors or its index)", "generation/candidate_generator.py"),
)


def causal_lm(folder: Folder, target: dict[str, Any] | None = None, draft: bool = False) -> Verdict:
    """transformers' from_pretrained: model.safetensors (or its index, or pytorch_model.bin) into the
    class config.json names; a missing tensor is initialized at random with a warning, an unknown one
    ignored with a warning. A drafter with a draft vocabulary: its generation config must suppress
    the tokens outside it (the assistant's own generation config fills what the target's leaves unset)."""
    v = Verdict("transformers", str(folder.path), "draft_model" if draft else "model")
    params = hf_parameters(folder, v)
    if params is None:
        return v
    expected, optional, model = params
    index = folder.json("model.safetensors.index.json")
    if index is not None:
        files = [folder.path / f for f in sorted(set(index.get("weight_map", {}).values()))]
    elif (folder.path / "model.safetensors").is_file():
        files = [folder.path / "model.safetensors"]
    else:
        files = sorted(folder.path.glob("pytorch_model*.bin"))
    if not files or not all(f.is_file() for f in files):
        v.problems.append("no model.safetensors (or its index, or pytorch_model.bin): transformers finds no weights")
        return v
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    tensors = {k: s for k, s in Folder.tensors(files).items() if not any(p.search(k) for p in ignore)}
    patterns = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    optional |= {k for k in expected if any(re.search(p, k) for p in patterns)}
    v.problems += compare(
        tensors,
        expected,
        optional,
        unknown="the model has no parameter of that name: transformers ignores it (a warning)",
        missing="no tensor fills it: transformers initializes it at random (a warning)",
    )
    if draft:
        ids = load_draft_vocab(folder.path)
        if ids is not None:
            vocab = expected.get("lm_head.weight", (len(ids),))[0]
            suppressed = set((folder.json("generation_config.json") or {}).get("suppress_tokens") or [])
            left = vocab - len(ids) - len(suppressed - set(ids.tolist()))
            if left > 0:
                v.problems.append(
                    f"generation_config.json leaves {left} tokens outside the draft vocabulary unsuppressed: "
                    "transformers' assisted generation can draft them (suppress_tokens)"
                )
        v.problems += draft_vocab_rows(folder, "transformers drafts from every row where nothing suppresses them")
    return v
