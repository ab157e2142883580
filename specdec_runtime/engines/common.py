"""What the engines' checks share: a model folder as loaders see it, a checkpoint's tensors held
against the parameters an engine builds, and a verdict.

    folder = Folder(path); folder.json(); Folder.tensors(folder.root_weights())   # names -> (shape, dtype)
    problems = compare(tensors, expected, optional, unknown="...", missing="...")
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec_runtime.loading import load_draft_vocab


@dataclass(frozen=True)
class Engine:
    name: str
    source: str  # the release or commit whose loader the check follows
    files: tuple[str, ...]  # where its rules are, in that source


@dataclass
class Verdict:
    """One engine's reading of one folder: problems (it would not load it, or load it wrong) and notes."""

    engine: str  # a key of ENGINES
    folder: str  # relative to the export
    role: str  # what the engine loads it as: "eagle3", "draft_model", "model", "medusa"
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class Folder:
    """A model folder as loaders see it: its config.json and the tensors of its weight files (from
    the safetensors headers; .bin and .pt files are opened memory-mapped)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def json(self, name: str = "config.json") -> dict[str, Any] | None:
        file = self.path / name
        return json.loads(file.read_text()) if file.is_file() else None

    def root_weights(self) -> list[Path]:
        """vLLM's and SGLang's DefaultModelLoader._prepare_weights: the folder's root only, the first
        of *.safetensors, *.bin, *.pt with a match; model.safetensors.index.json limits safetensors."""
        for pattern in ("*.safetensors", "*.bin", "*.pt"):
            files = sorted(self.path.glob(pattern))
            if files:
                index = self.json("model.safetensors.index.json") if pattern == "*.safetensors" else None
                if index is not None:
                    listed = set(index.get("weight_map", {}).values())
                    files = [f for f in files if f.name in listed]
                return files
        return []

    @staticmethod
    def tensors(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
        """{name: (shape, dtype)} of these weight files (a name in several: the last)."""
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for f in files:
            if f.suffix == ".safetensors":
                with open(f, "rb") as fh:
                    header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
                out |= {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"}
            else:
                import torch

                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                out |= {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
        return out


Expected = dict[str, tuple[int, ...]]  # parameter name -> shape
INTEGERS = {"I64", "I32", "I16", "I8", "U8", "int64", "int32", "int16", "int8", "uint8"}  # safetensors', torch's names


def compare(
    tensors: dict[str, tuple[tuple[int, ...], str]],
    expected: Expected,
    optional: set[str],
    unknown: str,
    missing: str,
) -> list[str]:
    """Problems of a checkpoint's tensors against the parameters an engine builds: shapes that differ,
    parameters no tensor fills (`missing` says what the engine does then), tensors no parameter takes
    (`unknown`)."""
    problems = []
    absent = sorted(set(expected) - set(tensors) - optional)
    if absent:
        problems.append(f"{names(absent)}: the engine creates {'them' if len(absent) > 1 else 'it'}, {missing}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        problems.append(f"{names(extra)} in the checkpoint: {unknown}")
    for name in sorted(set(tensors) & set(expected)):
        if tuple(tensors[name][0]) != tuple(expected[name]):
            problems.append(f"{name} is {list(tensors[name][0])}, the engine's parameter {list(expected[name])}")
    if "d2t" in tensors and tensors["d2t"][1] not in INTEGERS:  # vLLM's long parameter, SGLang's d2t + arange
        problems.append(f"d2t is {tensors['d2t'][1]}: the engines read it as integer token offsets")
    return problems



def names(items: list[str]) -> str:
    """The first few of them, and how many more."""
    shown = ", ".join(items[:4])
    return shown + (f" (+{len(items) - 4} more)" if len(items) > 4 else "")


def layer_dims(c: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """(hidden, heads, kv heads, head dim, intermediate) of a Llama-style config dict."""
    H, heads = c["hidden_size"], c["num_attention_heads"]
    return H, heads, c.get("num_key_value_heads") or heads, c.get("head_dim") or H // heads, c["intermediate_size"]


def eagle3_layer(prefix: str, c: dict[str, Any], *, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> Expected:
    """An EAGLE-3 decoder layer's parameters: q/k/v read [embedding ; feature] (2H)."""
    H, heads, kv, D, inter = layer_dims(c)
    out: Expected = {}
    for name, rows in (("q_proj", heads * D), ("k_proj", kv * D), ("v_proj", kv * D)):
        out[f"{prefix}self_attn.{name}.weight"] = (rows, 2 * H)
        if qkv_bias:
            out[f"{prefix}self_attn.{name}.bias"] = (rows,)
    out[f"{prefix}self_attn.o_proj.weight"] = (H, heads * D)
    if o_bias:
        out[f"{prefix}self_attn.o_proj.bias"] = (H,)
    for name, shape in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
        out[f"{prefix}mlp.{name}.weight"] = shape
        if mlp_bias:
            out[f"{prefix}mlp.{name}.bias"] = (shape[0],)
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        out[f"{prefix}{norm}.weight"] = (H,)
    return out


def fits_target(vocab: int, hidden: int, target: dict[str, Any] | None) -> list[str]:
    """An EAGLE-3 drafter reads the target's embedding (its vocabulary) and hidden states (their width)."""
    if not target:
        return []
    want = {"vocabulary": (vocab, target.get("vocab_size")), "hidden size": (hidden, target.get("hidden_size"))}
    return [f"{what} {got}: the target's is {its}" for what, (got, its) in want.items() if its not in (None, got)]


def weight_files(folder: Folder) -> list[str]:
    files = folder.root_weights()
    if not files:
        return [f"no *.safetensors, *.bin or *.pt in {folder.path.name}/ (loaders read the folder's root only)"]
    if any(f.name.startswith("consolidated") for f in folder.path.glob("*.safetensors")):
        return ["a consolidated*.safetensors file: vLLM then loads the folder in Mistral's format"]
    return []


def hf_parameters(folder: Folder, v: Verdict) -> tuple[Expected, set[str], Any] | None:
    """(parameters and shapes, those a checkpoint may leave out, the model) of the transformers model
    class config.json names, built on the meta device (no memory)."""
    if folder.json() is None:
        v.problems.append("no config.json")
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder.path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError) as e:
        v.problems.append(f"transformers cannot build a causal LM from its config.json: {e}")
        return None
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    optional = set()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "tie_word_embeddings", False):
        optional |= {k for k in expected if k.startswith("lm_head.")}
    return expected, optional, model


def draft_vocab_rows(folder: Folder, who: str) -> list[str]:
    """A drafter with a draft vocabulary: its full-size lm_head's rows outside it must never win an
    argmax. A row that is the mean of the rows inside gives the mean of their logits, never above
    their maximum (what specdec writes); a zero row gives 0, above them all where they are negative."""
    ids = load_draft_vocab(folder.path)
    if ids is None:
        return []
    from safetensors import safe_open

    for f in folder.path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            if "lm_head.weight" in fh.keys():
                head = fh.get_tensor("lm_head.weight").float()
                break
    else:
        return []
    outside = head.new_ones(head.shape[0], dtype=bool)
    outside[ids] = False
    if not outside.any():
        return []
    mean = head[ids].mean(0)
    if not (head[outside] - mean).abs().max() <= 1e-4 * max(1.0, float(mean.abs().max())):
        return [
            f"lm_head rows outside the {len(ids)}-token draft vocabulary are not the mean of the rows inside: {who}, "
            "so it can draft tokens the drafter was never trained to produce (zero rows: wherever every logit "
            "inside is negative)"
        ]
    return []
