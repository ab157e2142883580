"""transformers' own (assisted) generation, as the outside reference our runtime is compared with.

    hf = load_hf_model("smollm2-135m-instruct").eval()
    kwargs, why_not = assisted_kwargs(hf, drafter, gamma=4)     # how transformers drafts like ours
    tokens = hf_generate(hf, prompt_ids, max_new_tokens=128, stop_ids=target.stop_ids, **kwargs)

transformers can draft like three of our drafters: n-gram prompt lookup (`prompt_lookup_num_tokens`),
a stand-alone draft model (`assistant_model`) and truncate:K (an assistant model made of the
target's first K layers, final norm and lm_head). For the others (Medusa, MTP, layer-skip sets, a
draft vocabulary) `assisted_kwargs` says why there is no reference. The assistant drafts a constant
gamma tokens with no confidence cut-off unless asked, as our loop does.
"""

from pathlib import Path
from typing import Any

import torch

from specdec_runtime.drafters.lookup import NgramDrafter
from specdec_runtime.drafters.protocol import Drafter
from specdec_runtime.drafters.standalone import ModelDrafter


def truncated_hf(hf: Any, k: int) -> Any:
    """An HF model made of the target's first k layers + its final norm and lm_head (copies)."""
    from transformers import AutoModelForCausalLM

    config = hf.config.__class__.from_dict({**hf.config.to_dict(), "num_hidden_layers": k})
    small = AutoModelForCausalLM.from_config(config, dtype=hf.dtype).to(hf.device)
    keep = {n: w for n, w in hf.state_dict().items() if not n.startswith("model.layers.") or int(n.split(".")[2]) < k}
    small.load_state_dict(keep, strict=False)  # a tied lm_head may be absent from the state dict
    small.generation_config = hf.generation_config
    return small.eval()


def assisted_kwargs(
    hf: Any,
    drafter: Drafter | None,
    *,
    gamma: int,
    adaptive_gamma: bool = False,
    confidence: float = 0.0,
    drafter_path: str | Path | None = None,
) -> tuple[dict[str, Any] | None, str | None]:
    """(generate() keyword arguments that make transformers draft like `drafter`, None) or
    (None, why it cannot). `drafter_path`: a stand-alone drafter's model folder."""
    if drafter is None:
        return {}, None  # plain transformers generate
    if isinstance(drafter, NgramDrafter):
        return {"prompt_lookup_num_tokens": gamma, "max_matching_ngram_size": drafter.max_ngram}, None
    if not isinstance(drafter, ModelDrafter):
        return None, f"transformers has no {type(drafter).__name__.removesuffix('Drafter')} assistant"
    if drafter.skip is not None:
        return None, "transformers has no layer-skip assistant"
    if drafter.vocab_ids is not None:
        return None, "a draft vocabulary: transformers' assistant needs a full lm_head"
    if drafter.shares_target_cache:
        assistant = truncated_hf(hf, drafter.exit_layer)
    elif drafter_path is not None:
        from transformers import AutoModelForCausalLM

        assistant = AutoModelForCausalLM.from_pretrained(drafter_path, dtype=hf.dtype).to(hf.device).eval()
    else:
        return None, "the drafter's model folder is unknown"
    g = assistant.generation_config
    g.num_assistant_tokens = gamma
    g.num_assistant_tokens_schedule = "heuristic" if adaptive_gamma else "constant"
    g.assistant_confidence_threshold = confidence
    return {"assistant_model": assistant}, None


@torch.inference_mode()
def hf_generate(
    hf: Any,
    prompt: list[int],
    *,
    max_new_tokens: int,
    stop_ids: frozenset[int] | set[int],
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    **assist: Any,
) -> list[int]:
    """transformers' generate for one prompt: the new tokens (a stop token, when hit, is the last)."""
    stop = sorted(stop_ids) or None
    sampling = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k or None, "top_p": top_p}
        torch.manual_seed(seed)
    out = hf.generate(
        torch.tensor([prompt], device=hf.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf.device),
        max_new_tokens=max_new_tokens,
        eos_token_id=stop,
        pad_token_id=stop[0] if stop else hf.generation_config.pad_token_id,
        **sampling,
        **assist,
    )
    return out[0, len(prompt) :].tolist()
