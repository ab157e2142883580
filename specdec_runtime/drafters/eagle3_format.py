"""EAGLE-3 drafters on disk, in the speculators format vLLM and SGLang load.

    save_speculators(model, folder, verifier="meta-llama/Llama-3.1-8B-Instruct", verifier_architectures=[...],
                     speculative_tokens=5)
    model, drafting = read_speculators(folder)             # an Eagle3Model (fp32, CPU) and the drafting settings
    drafter = load_eagle3(folder, target)                  # an Eagle3Drafter for a LoadedModel
    is_eagle3_folder(folder)                               # what `specdec generate --drafter DIR` detects

config.json: `speculators_model_type: "eagle3"`, `speculators_config` (algorithm, proposal methods
with the draft length, the verifier's name and architectures), `transformer_layer_config` (the
drafter layer as a Llama config with one layer and the target's vocabulary), `draft_vocab_size`,
`target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, `norm_before_residual`. model.safetensors:
`fc.weight` [H, 3 H_target], `layers.0.*` (q/k/v read 2H; `hidden_norm`, `input_layernorm`,
`post_attention_layernorm`, the MLP; no biases), `norm.weight`, `lm_head.weight` [draft_vocab, H],
and, where the draft vocabulary is smaller than the target's, `d2t` (int64, target id = draft id +
d2t[draft id]) and `t2d` (bool [target vocabulary]): vLLM refuses them otherwise. The token
embedding is the target's and is not stored. specdec's own drafting settings (tree budget, top-k)
sit beside it in specdec_drafting.json. Every rule here is an engine's (specdec_runtime.engines).
"""

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from specdec_runtime.config import DecoderConfig
from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model
from specdec_runtime.errors import SpecdecError
from specdec_runtime.loading import LoadedModel

WEIGHTS = "model.safetensors"
DRAFTING = "specdec_drafting.json"  # {"gamma", "tree_budget", "top_k"}: how specdec drafts with it by default
SPECULATORS_VERSION = "0.7.0.1"  # the speculators release whose format this follows (vLLM does not check it)
SGLANG = "sglang"  # export/sglang/: SGLang's flat layout (LlamaForCausalLMEagle3, midlayer.* weights)


def layer_config(cfg: DecoderConfig) -> dict[str, Any]:
    """transformer_layer_config: the drafter's layer as a one-layer Llama config (transformers' names)."""
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        # vLLM gives o_proj a bias wherever attention_bias is set, SGLang never gives q/k/v one: no
        # attention_bias value loads a layer with q/k/v biases right in both (Eagle3Config.for_target).
        raise SpecdecError("an EAGLE-3 layer with biases loads wrong in vLLM or SGLang: train a bias-free one")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) or None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
    }


def speculators_config(
    cfg: Eagle3Config, *, verifier: str | None, verifier_architectures: list[str], speculative_tokens: int, dtype: str
) -> dict[str, Any]:
    """config.json. verifier: the target's Hub id (`vllm serve DIR` serves it), or None where it has none."""
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "transformer_layer_config": layer_config(cfg.layer),
        "draft_vocab_size": cfg.draft_vocab_size,
        # null when the drafter is as wide as the target (as speculators writes it)
        "target_hidden_size": None if cfg.target_hidden_size == cfg.layer.hidden_size else cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),  # vLLM's ids: the residual stream entering layer i
        "norm_before_residual": cfg.norm_before_residual,  # always written: vLLM reads a missing one as true
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": dtype,  # the stored tensors' (engines run the drafter in the target's dtype)
    }


def sglang_layout(
    model: Eagle3Model, sd: dict[str, torch.Tensor], serving_dtype: str
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, weights) in SGLang's flat EAGLE-3 layout: a one-layer Llama config with
    architecture LlamaForCausalLMEagle3 and `midlayer.*` weights (sd: weights(model), renamed).
    SGLang reads aux layer id j as the output of layer j and adds one (specdec's k is the residual
    stream entering layer k: j = k - 1). Its dtype is the one SGLang runs the drafter in: with none,
    or float32, `--dtype auto` takes fp16."""
    cfg = model.config
    ids = [k - 1 for k in cfg.aux_layers]
    config = layer_config(cfg.layer) | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": cfg.draft_vocab_size,
        "torch_dtype": serving_dtype,
        "dtype": serving_dtype,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids},
    }
    return config, {k.replace("layers.0.", "midlayer.", 1): v for k, v in sd.items()}


def save_speculators(
    model: Eagle3Model,
    folder: Path,
    *,
    verifier: str | None,
    verifier_architectures: list[str],
    drafting: dict[str, int],
    sglang_dtype: str | None = None,
) -> Path:
    """config.json + model.safetensors (+ specdec_drafting.json) in `folder`; with sglang_dtype (the
    dtype SGLang serves it in), also SGLang's flat layout in folder/sglang/."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sd = weights(model)
    config = speculators_config(
        model.config,
        verifier=verifier,
        verifier_architectures=verifier_architectures,
        speculative_tokens=int(drafting["gamma"]),
        dtype=str(sd["fc.weight"].dtype).removeprefix("torch."),
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(sd, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / DRAFTING).write_text(json.dumps(drafting, indent=2) + "\n")
    if sglang_dtype is not None:
        sg_config, sg_weights = sglang_layout(model, sd, sglang_dtype)
        (folder / SGLANG).mkdir(exist_ok=True)
        (folder / SGLANG / "config.json").write_text(json.dumps(sg_config, indent=2) + "\n")
        save_file(sg_weights, str(folder / SGLANG / WEIGHTS), metadata={"format": "pt"})
    return folder


def weights(model: Eagle3Model) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: d2t int64 and t2d bool where the draft vocabulary is smaller than
    the target's (vLLM has no d2t parameter otherwise, and refuses one), the rest as the model holds
    them (the token embedding is the target's and is left out: vLLM and SGLang then take the target's)."""
    sd = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    d2t, t2d = sd.pop("d2t"), sd.pop("t2d")
    if model.config.draft_vocab_size < model.config.vocab_size:
        sd["d2t"], sd["t2d"] = d2t.to(torch.int64), t2d.to(torch.bool)
    return sd


def is_eagle3_folder(folder: Path) -> bool:
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return json.loads(cfg.read_text()).get("speculators_model_type") == "eagle3"
    except ValueError:
        return False


def read_speculators(folder: Path) -> tuple[Eagle3Model, dict[str, int]]:
    """The model (fp32, CPU) of a speculators EAGLE-3 folder and its drafting settings."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text())
    if c.get("speculators_model_type") != "eagle3":
        raise SpecdecError(f"{folder}/config.json is not a speculators EAGLE-3 config (speculators_model_type)")
    unsupported = [k for k in ("norm_before_fc", "fc_norm", "norm_output") if c.get(k)]
    if unsupported or c["transformer_layer_config"].get("num_hidden_layers", 1) != 1:
        raise SpecdecError(
            f"{folder}: an EAGLE-3 variant specdec_runtime does not run ({', '.join(unsupported) or 'several layers'})"
        )
    if not (folder / WEIGHTS).is_file():
        raise SpecdecError(f"{folder} has an EAGLE-3 config but no {WEIGHTS}")
    settings = {k: v for k, v in c["transformer_layer_config"].items() if v is not None}
    sd = load_file(str(folder / WEIGHTS))
    # Biases as stored: a Qwen2 target's drafter of before Eagle3Config.for_target went bias-free has
    # q/k/v biases and none on o_proj, whatever attention_bias says (`specdec check-export` names the
    # engines that cannot load it).
    has = lambda name: f"layers.0.{name}.bias" in sd  # noqa: E731
    layer = replace(
        DecoderConfig.from_hf(LlamaConfig(**settings)),
        qkv_bias=has("self_attn.q_proj"),
        o_bias=has("self_attn.o_proj"),
        mlp_bias=has("mlp.down_proj"),
    )
    if "d2t" not in sd:  # a draft vocabulary as large as the target's: the identity
        sd["d2t"] = torch.zeros(c["draft_vocab_size"], dtype=torch.long)
        sd["t2d"] = torch.ones(layer.vocab_size, dtype=torch.bool)
    aux = tuple(c["eagle_aux_hidden_state_layer_ids"])
    target_hidden = c.get("target_hidden_size") or sd["fc.weight"].shape[1] // len(aux)
    cfg = Eagle3Config(
        layer,
        target_hidden,
        aux,
        c["draft_vocab_size"],
        norm_before_residual=bool(c.get("norm_before_residual", False)),
    )
    model = Eagle3Model(cfg)
    missing, unexpected = model.load_state_dict(
        {k: v for k, v in sd.items() if not k.startswith("embed")}, strict=False
    )
    if missing or unexpected:
        raise SpecdecError(f"{folder}/{WEIGHTS}: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
    method = next(iter(c["speculators_config"].get("proposal_methods") or []), {})
    drafting = {"gamma": int(method.get("speculative_tokens", 4)), "tree_budget": 0, "top_k": 4}
    if (folder / DRAFTING).is_file():
        drafting |= json.loads((folder / DRAFTING).read_text())
    return model.float().eval(), drafting


def load_eagle3(
    folder: str | Path, target: LoadedModel, tree_budget: int | None = None, confidence: float = 0.0
) -> Eagle3Drafter:
    """An Eagle3Drafter from an exported folder for a loaded target (tree_budget: override; 0 = chains;
    confidence: chains stop after a token drafted with a probability below it)."""
    model, d = read_speculators(Path(folder))
    budget = d["tree_budget"] if tree_budget is None else tree_budget
    return Eagle3Drafter(model, target.model, tree_budget=budget, top_k=d["top_k"], gamma=d["gamma"],
                         name=f"eagle3:{Path(folder).name}", confidence=confidence)  # fmt: skip
