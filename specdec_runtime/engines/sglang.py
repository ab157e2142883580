"""SGLang's loader of an EAGLE-3 drafter in its flat layout (LlamaForCausalLMEagle3).

    verdict = eagle3(Folder(path / "sglang"), target)
"""

from typing import Any

from specdec_runtime.engines.common import Engine, Folder, Verdict, compare, eagle3_layer, fits_target, weight_files

ENGINE = Engine(
    "SGLang",
    "sglang f4eac503897bf4b8965d0e774a459c0a0a871b95 (2026-05-28)",
    (
        "python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3), models/llama.py",
        "python/sglang/srt/model_loader/loader.py (_prepare_weights), configs/model_config.py (dtype)",
    ),
)


def eagle_draft_tokens(gamma: int, tree_budget: int, top_k: int) -> tuple[int, int]:
    """(--speculative-eagle-topk, --speculative-num-draft-tokens) of drafts gamma deep: SGLang counts
    the verified root among the draft tokens (a chain of gamma: topk 1, gamma + 1; a tree of n
    nodes: its top-k, n + 1)."""
    return (top_k, tree_budget + 1) if tree_budget else (1, gamma + 1)


def eagle3(folder: Folder, target: dict[str, Any] | None = None) -> Verdict:
    """SGLang's LlamaForCausalLMEagle3 (llama_eagle3.py): q/k/v are one qkv_proj without a bias,
    o_proj has one where attention_bias or bias is set, the MLP never; unknown tensors are skipped
    and missing ones never reported; the target taps the outputs of layers eagle_config's ids + 1."""
    v = Verdict("sglang", str(folder.path), "eagle3")
    c = folder.json()
    if c is None:
        v.problems.append("no config.json")
        return v
    if "LlamaForCausalLMEagle3" not in (c.get("architectures") or []):
        v.problems.append(f"architectures {c.get('architectures')}: SGLang's EAGLE-3 drafter is LlamaForCausalLMEagle3")
        return v
    if c.get("model_type", "llama") != "llama":
        v.problems.append(f"model_type {c['model_type']!r}: SGLang parses its EAGLE-3 drafter's config as a Llama one")
    if c.get("hidden_act", "silu") != "silu":
        v.problems.append(f"hidden_act {c['hidden_act']!r}: SGLang's Llama MLP is silu only")
    if c.get("num_hidden_layers", 1) != 1:
        v.problems.append("more than one layer: SGLang before 2026-05 refuses it ('only supports 1 layer')")
    if "draft_vocab_size" not in c:
        v.problems.append("no draft_vocab_size: SGLang reads config.draft_vocab_size")
    if c.get("tie_word_embeddings"):
        v.problems.append("tie_word_embeddings: SGLang then drafts from the embedding, not lm_head")
    dtype = c.get("dtype") or c.get("torch_dtype")
    if dtype in (None, "float32"):  # model_config._get_and_verify_dtype: float32 under --dtype auto -> float16
        v.problems.append(f"dtype {dtype}: SGLang's --dtype auto runs a float32 (or unstated) drafter in float16")
    ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        v.notes.append("no eagle_config ids: SGLang taps the inputs of layers (2, N // 2, N - 3)")
    elif list(ids) != sorted(set(ids)) or len(ids) != 3:
        v.problems.append(f"aux ids {ids}: SGLang taps by membership, in layer order, and sizes its buffers for 3")
    elif target and max(ids) + 1 >= target.get("num_hidden_layers", 1 << 30):
        v.problems.append(f"aux id {max(ids)}: SGLang cannot tap the output of the target's last layer")
    if target and c.get("max_position_embeddings", 8192) < target.get("max_position_embeddings", 0):
        v.problems.append("max_position_embeddings below the target's: SGLang refuses the drafter's shorter context")
    H, V = c["hidden_size"], c["vocab_size"]
    Vd = c.get("draft_vocab_size") or V
    T = c.get("target_hidden_size") or H
    v.problems += fits_target(V, T, target)
    bias = bool(c.get("bias", False))
    o_bias = bool(c.get("attention_bias")) or bias
    expected = eagle3_layer("midlayer.", c, qkv_bias=False, o_bias=o_bias, mlp_bias=False)
    expected |= {"fc.weight": (H, 3 * T), "norm.weight": (H,), "lm_head.weight": (Vd, H), "embed_tokens.weight": (V, H)}
    if bias:
        expected["fc.bias"] = (H,)
    optional = {"d2t"}  # absent: draft ids are target ids
    if T == H:
        optional.add("embed_tokens.weight")  # set_embed: replaced by the target's
    if c.get("draft_vocab_size") is None:
        optional.add("lm_head.weight")  # load_lm_head_from_target
    expected["d2t"] = (Vd,)
    v.problems += weight_files(folder)
    tensors = {k.replace("layers.0.", "midlayer.", 1): s for k, s in Folder.tensors(folder.root_weights()).items()}
    tensors = {k.removeprefix("model."): s for k, s in tensors.items() if "t2d" not in k}
    v.problems += compare(
        tensors,
        expected,
        optional,
        unknown="SGLang has no parameter of that name and skips it silently",
        missing="no tensor fills it, and SGLang reports none: it stays uninitialized memory",
    )
    return v
