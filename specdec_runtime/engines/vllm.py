"""vLLM's loaders, as its releases have them: an EAGLE-3 drafter in the speculators format, a causal
LM (a draft model, or a model), and Medusa heads (0.32, the last release with Medusa).

    verdict = eagle3(Folder(path), target)     # Verdict: problems (it would not load, or load wrong) and notes
"""

from typing import Any

from specdec_runtime.engines.common import (
    Engine,
    Expected,
    Folder,
    Verdict,
    compare,
    draft_vocab_rows,
    eagle3_layer,
    fits_target,
    hf_parameters,
    layer_dims,
    names,
    weight_files,
)
from specdec_runtime.paths import is_hub_id

ENGINE = Engine(
    "vLLM",
    "vllm 0.33.0 (4ba787ec9); Medusa: 0.32.0 (5df63a720), the last release with it",
    (
        "transformers_utils/configs/speculators/base.py, algos.py (update_eagle3)",
        "model_executor/models/llama_eagle3.py, qwen3_eagle3.py, llama.py, utils.py (AutoWeightsLoader)",
        "model_executor/model_loader/default_loader.py (_prepare_weights), weight_utils.py",
        "transformers_utils/config.py (maybe_override_with_speculators), config/speculative.py",
        "0.32.0: model_executor/models/medusa.py, transformers_utils/configs/medusa.py",
    ),
)


def eagle3(folder: Folder, target: dict[str, Any] | None = None) -> Verdict:
    """vLLM 0.33.0's speculators path: config.json -> SpeculatorsConfig (base.py, algos.update_eagle3)
    -> Eagle3LlamaForCausalLM (llama_eagle3.py) or Eagle3Qwen3ForCausalLM by the layer's model_type."""
    v = Verdict("vllm", str(folder.path), "eagle3")
    c = folder.json()
    if c is None:
        v.problems.append("no config.json")
        return v
    if c.get("model_type") not in (None, "speculators"):  # HFConfigParser.parse: else a plain model config
        v.problems.append(f"top-level model_type {c['model_type']!r}: vLLM reads it as a plain model, not a speculator")
    if c.get("speculators_model_type") != "eagle3":
        v.problems.append(f"speculators_model_type is {c.get('speculators_model_type')!r}, not 'eagle3'")
        return v
    layer = c.get("transformer_layer_config")
    if not isinstance(layer, dict):
        v.problems.append("no transformer_layer_config: vLLM builds the draft layer from it")
        return v
    kind = layer.get("model_type", "llama")  # algos.update_eagle3: llama -> Eagle3Llama, qwen3 -> Eagle3Qwen3
    if kind not in ("llama", "qwen3"):
        v.problems.append(f"transformer_layer_config.model_type {kind!r}: vLLM's EAGLE-3 drafters are llama and qwen3")
        return v
    if layer.get("hidden_act", "silu") != "silu":
        v.problems.append(f"hidden_act {layer['hidden_act']!r}: vLLM's Llama MLP is silu only")
    H, V = layer["hidden_size"], layer["vocab_size"]
    Vd = c.get("draft_vocab_size") or V
    T = c.get("target_hidden_size") or H
    v.problems += fits_target(V, T, target)
    aux = c.get("eagle_aux_hidden_state_layer_ids")
    # The Llama drafter sizes fc from num_aux_hidden_states (or eagle_config's ids), else 3; the target
    # hands its taps over sorted and distinct (interfaces.py), so fc's columns follow ascending ids.
    nested = (layer.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
    n_aux = layer.get("num_aux_hidden_states") or len(nested) or 3
    if aux is not None:
        if list(aux) != sorted(set(aux)):
            v.problems.append(f"eagle_aux_hidden_state_layer_ids {aux}: vLLM taps them sorted and distinct")
        if len(aux) != n_aux:
            v.problems.append(f"{len(aux)} aux layers, but vLLM's drafter reads {n_aux} (num_aux_hidden_states)")
        if target and max(aux, default=0) >= target.get("num_hidden_layers", 1 << 30):
            v.problems.append(f"aux layer {max(aux)}: the target has {target['num_hidden_layers']} layers")
    else:
        v.notes.append("no eagle_aux_hidden_state_layer_ids: vLLM taps the target at (2, N // 2, N - 3)")
    if "norm_before_residual" not in c:
        v.problems.append("no norm_before_residual: vLLM takes a missing one as true (specdec and speculators: false)")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if c.get(flag):
            v.notes.append(f"{flag} is set: vLLM adds that norm")
    # Biases (llama.py LlamaAttention: bias_o_proj = attention_bias or bias; llama_eagle3.py: the
    # replaced qkv_proj has attention_bias only; MLP: mlp_bias). Qwen3's o_proj never has one.
    attention_bias = bool(layer.get("attention_bias", False))
    expected = eagle3_layer(
        "layers.0.",
        layer,
        qkv_bias=attention_bias,
        o_bias=(attention_bias or bool(layer.get("bias", False))) and kind == "llama",
        mlp_bias=bool(layer.get("mlp_bias", False)),
    )
    if kind == "qwen3":
        D = layer_dims(layer)[3]
        expected |= {"layers.0.self_attn.q_norm.weight": (D,), "layers.0.self_attn.k_norm.weight": (D,)}
    expected |= {"fc.weight": (H, n_aux * T), "norm.weight": (H,), "lm_head.weight": (Vd, H)}
    expected["embed_tokens.weight"] = (V, H)
    optional = {"embed_tokens.weight"}  # absent: the target's (llm_base_proposer)
    if Vd == V:
        optional.add("lm_head.weight")  # absent: the target's
    else:
        expected["d2t"] = (Vd,)  # the draft_id_to_target_id parameter exists only then
    if c.get("norm_before_fc"):
        expected["input_norm.weight"] = (n_aux * T,)
    if c.get("fc_norm"):
        expected |= {f"fc_norm.{i}.weight": (T,) for i in range(n_aux)}
    v.problems += weight_files(folder)
    tensors = {k: s for k, s in Folder.tensors(folder.root_weights()).items() if "t2d" not in k}  # t2d: skipped
    if "d2t" in tensors and Vd == V:
        v.problems.append("d2t with a draft vocabulary as large as the target's: vLLM has no parameter for it (error)")
        tensors.pop("d2t")
    prefixed = sorted(k for k in tensors if k.startswith("model."))
    if prefixed:
        v.problems.append(f"{names(prefixed)}: vLLM prefixes every name with 'model.' itself (an error)")
        tensors = {k: s for k, s in tensors.items() if k not in prefixed}
    biases = {k for k in tensors if k.endswith(".bias") and k not in expected}
    v.problems += compare(
        {k: s for k, s in tensors.items() if k not in biases},
        expected,
        optional,
        unknown="vLLM has no parameter of that name (ValueError: There is no module or parameter named ...)",
        missing="no tensor fills it, and vLLM's EAGLE-3 loader reports none: it stays uninitialized memory",
    )
    if biases:  # AutoWeightsLoader.ignore_unexpected_suffixes gets ".bias"
        v.problems.append(f"{names(sorted(biases))}: vLLM's layer has no such bias and drops it silently")
    _verifier(c, v)
    return v


def _verifier(c: dict[str, Any], v: Verdict) -> None:
    """`vllm serve DIR` (maybe_override_with_speculators): the target is speculators_config.verifier.
    name_or_path, which must name a Hub repository (0.33: not a local path), and the draft length
    proposal_methods[0].speculative_tokens."""
    s = c.get("speculators_config") or {}
    name = (s.get("verifier") or {}).get("name_or_path")
    if name is None:
        v.notes.append(
            "no verifier Hub id (speculators_config.verifier.name_or_path): `vllm serve DIR` cannot find the target; "
            "`vllm serve TARGET --speculative-config '{\"model\": DIR, \"method\": \"eagle3\", ...}'` works"
        )
    elif not is_hub_id(name):
        v.problems.append(
            f"verifier {name!r} is no Hub id: `vllm serve DIR` serves the target named there and refuses local paths "
            "(set model.hub_id when training, or edit speculators_config.verifier.name_or_path)"
        )
    methods = s.get("proposal_methods") or [{}]
    if not methods[0].get("speculative_tokens"):
        v.problems.append("no proposal_methods[0].speculative_tokens: `vllm serve DIR` reads the draft length there")


def causal_lm(folder: Folder, target: dict[str, Any] | None = None, draft: bool = False) -> Verdict:
    """vLLM loading a causal LM (a stand-alone drafter: config/speculative.py, method draft_model; an
    MTP export or an adapted target: as a model): every root *.safetensors goes to the model class's
    load_weights, which takes transformers' names; an unknown name is an error, a missing one too
    (the strict check: 'Following weights were not initialized from checkpoint')."""
    v = Verdict("vllm", str(folder.path), "draft_model" if draft else "model")
    params = hf_parameters(folder, v)
    if params is None:
        return v
    expected, optional, _ = params
    v.problems += weight_files(folder)
    tensors = Folder.tensors(folder.root_weights())
    tensors = {k: s for k, s in tensors.items() if "rotary_emb.inv_freq" not in k}
    v.problems += compare(
        tensors,
        expected,
        optional,
        unknown="vLLM's model has no parameter of that name (ValueError: There is no module or parameter named ...)",
        missing="no tensor fills it (vLLM: 'weights were not initialized from checkpoint')",
    )
    if draft:
        config = folder.json() or {}
        if target and target.get("vocab_size") not in (None, config.get("vocab_size")):
            v.problems.append(
                f"vocab_size {config.get('vocab_size')}: vLLM needs a draft model's to be the target's "
                f"({target['vocab_size']})"
            )
        sniffed = [s for s in ("eagle3", "eagle-", "dflash", "dspark") if s in folder.path.resolve().as_posix().lower()]
        if sniffed:
            v.notes.append(
                f"the path holds {sniffed[0]!r}: vLLM takes such a draft for an EAGLE/DFlash drafter; name the folder "
                "or Hub repo otherwise"
            )
        v.problems += draft_vocab_rows(folder, "vLLM drafts from every row of lm_head")
    return v


def medusa(folder: Folder, target: dict[str, Any] | None = None) -> Verdict:
    """vLLM 0.32.0's Medusa (configs/medusa.py, models/medusa.py; removed in 0.33): MedusaConfig
    renames every key holding 'num' and 'heads' to num_heads ('layers': num_hidden_layers);
    blocks.{h}.layers.{l}.weight (+ .bias with medusa_fc_bias), lm_heads.{h}.weight; FasterDecoding
    names are remapped; tensors without a parameter are ignored, a parameter without one is an error."""
    v = Verdict("vllm", str(folder.path), "medusa")
    c = folder.json()
    if c is None:
        v.problems.append("no config.json")
        return v
    if c.get("model_type") != "medusa":
        v.notes.append("no model_type 'medusa': vLLM takes it as Medusa only with method 'medusa'")
    heads_keys = [k for k in c if "num" in k and "heads" in k]
    layers_keys = [k for k in c if "num" in k and "layers" in k]
    for keys, what in ((heads_keys, "num_heads"), (layers_keys, "num_hidden_layers")):
        if len(keys) > 1:
            v.problems.append(f"{', '.join(keys)}: vLLM renames each to {what} and keeps whichever comes last")
    n_heads, n_layers = c.get(heads_keys[-1], 5) if heads_keys else 5, c.get(layers_keys[-1], 1) if layers_keys else 1
    H, V = c.get("hidden_size", 4096), c.get("vocab_size", 32001)
    truncated = c.get("truncated_vocab_size") or V
    if target and target.get("vocab_size") not in (None, V):
        v.problems.append(f"vocab_size {V}: vLLM resets it to the target's ({target['vocab_size']}) for Medusa")
    expected: Expected = {}
    for h in range(n_heads):
        for layer in range(n_layers):
            expected[f"blocks.{h}.layers.{layer}.weight"] = (H, H)
            if c.get("medusa_fc_bias", False):
                expected[f"blocks.{h}.layers.{layer}.bias"] = (H,)
        if not c.get("original_lm_head", False):
            expected[f"lm_heads.{h}.weight"] = (V, H)
    if c.get("original_lm_head", False):
        expected["lm_head.weight"] = (truncated, H)
    elif truncated < V:
        v.problems.append("truncated_vocab_size below vocab_size with a head per Medusa head: vLLM's load asserts")
    v.problems += weight_files(folder)
    tensors = {_medusa_name(k): s for k, s in Folder.tensors(folder.root_weights()).items()}
    dropped = sorted(k for k in tensors if k not in expected and k.endswith(".bias"))
    v.problems += compare(
        {k: s for k, s in tensors.items() if k in expected},
        expected,
        set(),
        unknown="",
        missing="no tensor fills it (vLLM: 'weights were not initialized from checkpoint')",
    )
    if dropped:
        v.problems.append(f"{names(dropped)}: vLLM builds no bias there (medusa_fc_bias) and ignores it silently")
    extra = sorted(k for k in tensors if k not in expected and not k.endswith(".bias"))
    if extra:
        v.notes.append(f"{names(extra)} not read (num_speculative_tokens sets how many heads vLLM builds)")
    v.notes.append(f"vLLM up to 0.32 (Medusa was removed in 0.33): num_speculative_tokens at most {n_heads}")
    return v


def _medusa_name(name: str) -> str:
    """models/medusa.py _remap_old_checkpoint_key: FasterDecoding's {h}.{l}.linear.* and {h}.{n}.weight."""
    name = name.replace("medusa_heads.", "")
    parts = name.split(".")
    if len(parts) >= 3 and parts[0].isdigit() and parts[1].isdigit():
        if "linear" in parts[2:]:
            return f"blocks.{parts[0]}.layers.{parts[1]}.{'.'.join(parts[parts.index('linear') + 1 :])}"
        return f"lm_heads.{parts[0]}.{'.'.join(parts[2:])}"
    return name
