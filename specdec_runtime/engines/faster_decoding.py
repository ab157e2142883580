"""FasterDecoding's Medusa loader (medusa_model.py), on a heads-only folder.

    verdict = medusa(Folder(path), target)
"""

import re
from typing import Any

from specdec_runtime.engines.common import Engine, Expected, Folder, Verdict, compare
from specdec_runtime.paths import is_hub_id

ENGINE = Engine(
    "FasterDecoding Medusa",
    "FasterDecoding/Medusa e2a5d20c048a9b0a4092e6933c34313687422518 (transformers 4.34)",
    ("medusa/model/medusa_model.py (MedusaConfig, MedusaModelABC.from_pretrained, ResBlock)",),
)


def medusa(folder: Folder, target: dict[str, Any] | None = None) -> Verdict:
    """FasterDecoding's MedusaModel.from_pretrained (medusa_model.py) on a heads-only folder (its
    "v0.1" path, taken where AutoConfig fails: config.json without model_type): the base from
    base_model_name_or_path, then medusa_lm_head.pt (torch.load; never a .safetensors) into 5 heads
    whatever medusa_num_heads says, `[ResBlock] * medusa_num_layers` (one module repeated), with
    load_state_dict(strict=False): a key that fits nothing is dropped silently."""
    v = Verdict("faster_decoding", str(folder.path), "medusa")
    c = folder.json()
    if c is None:
        v.problems.append("no config.json")
        return v
    if "model_type" in c:
        v.problems.append("config.json has a model_type: FasterDecoding loads it as a whole model, heads inside")
        return v
    n_heads, n_layers = c.get("medusa_num_heads", 5), c.get("medusa_num_layers", 1)
    base = c.get("base_model_name_or_path")
    if "base_model_name_or_path" not in c:
        v.problems.append("no base_model_name_or_path: FasterDecoding loads lmsys/vicuna-7b-v1.3 as the base")
    elif base is None:
        v.problems.append("base_model_name_or_path is null: FasterDecoding has no base to load (the target's Hub id)")
    elif not is_hub_id(base):
        v.problems.append(f"base_model_name_or_path {base!r} is no Hub id: it names a folder on one machine")
    if n_heads != 5:
        v.problems.append(
            f"{n_heads} heads: FasterDecoding's v0.1 loader builds 5 whatever medusa_num_heads says "
            + ("(the missing ones stay at random)" if n_heads < 5 else "(the others are dropped)")
        )
    if n_layers > 1:
        v.problems.append(
            f"{n_layers} residual blocks per head: FasterDecoding repeats one module ([ResBlock] * n), so the last "
            "block's weights serve them all"
        )
    if target:
        if target.get("model_type") not in ("llama", "mistral"):
            v.problems.append(f"a {target.get('model_type')} base: FasterDecoding runs Llama and Mistral only")
        if target.get("rope_type") not in (None, "default", "linear", "dynamic"):
            v.problems.append(f"rope {target['rope_type']!r}: FasterDecoding's transformers (4.34) has no such rope")
    pt = folder.path / "medusa_lm_head.pt"
    if not pt.is_file():
        v.problems.append("no medusa_lm_head.pt: FasterDecoding reads only that file (else it asks the Hub for it)")
        return v
    tensors = Folder.tensors([pt])
    H, V = c.get("hidden_size"), c.get("vocab_size")
    if H is None or V is None:  # the heads' vocabulary projection [V, H]
        H, V = next((s[1], s[0]) for k, s in tensors.items() if k == f"0.{n_layers}.weight")
    built = min(n_heads, 5)  # heads past 5 are dropped, heads short of 5 left at random: said above
    expected: Expected = {}
    for h in range(built):
        for layer in range(min(n_layers, 1)):  # one module per head: more layers are said above
            expected |= {f"{h}.{layer}.linear.weight": (H, H), f"{h}.{layer}.linear.bias": (H,)}
        expected[f"{h}.{n_layers}.weight"] = (V, H)
    kept = {k: s for k, s in tensors.items() if not (k[0].isdigit() and int(k.split(".")[0]) >= built)}
    kept = {k: s for k, s in kept.items() if not re.fullmatch(r"\d+\.([1-9]\d*)\.linear\.(weight|bias)", k)}
    v.problems += compare(
        kept,
        expected,
        set(),
        unknown="FasterDecoding's heads have no such parameter: dropped silently (strict=False)",
        missing="no tensor fills it, and strict=False says nothing: it keeps its random initialization",
    )
    return v
