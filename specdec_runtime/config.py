"""The decoder's own small config, read from a Hugging Face config.

    from transformers import AutoConfig
    cfg = DecoderConfig.from_hf(AutoConfig.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct"))

Supported families: Llama 2/3 (incl. llama3 and linear rope scaling), Mistral (incl. its sliding
window), Qwen2/Qwen2.5 (qkv bias), Qwen3 (per-head q/k RMSNorm, head_dim apart from the width),
SmolLM2 (a Llama). Anything else is refused with a message
that names what is supported.
"""

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec_runtime.errors import SpecdecError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {} means plain rope
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    model_type: str = "llama"
    qk_norm: bool = False  # RMSNorm over each query and key head before rope (Qwen3)
    # Mixture of experts (Qwen3-MoE): these layers' MLP is num_experts experts of
    # moe_intermediate_size, experts_per_token of them chosen per token by a router
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' router probabilities renormalized to sum to 1

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise SpecdecError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}: this config is not a valid GQA model"
            )

    @classmethod
    def from_hf(cls, hf: Any, any_family: bool = False) -> "DecoderConfig":
        """Translate a transformers config (v4 or v5 field names); refuse unsupported models.
        any_family: only the shape, whatever the family and activation (a drafter's layer sized
        after a target the runtime cannot run); the rope must still be one the runtime computes."""
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES and not any_family:
            raise SpecdecError(
                f"model_type '{model_type}' is not supported by specdec_runtime; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, SmolLM2)"
            )
        act = getattr(hf, "hidden_act", None) or getattr(hf, "hidden_activation", None) or "silu"
        if act != "silu" and not any_family:
            raise SpecdecError(f"hidden_act '{act}' is not supported: only silu (SwiGLU) MLPs")
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise SpecdecError(
                f"rope type '{rope_type}' is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise SpecdecError("partial rotary embeddings are not supported")
        rope_scaling = {} if rope_type == "default" else {**rope, "rope_type": rope_type}
        heads = hf.num_attention_heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        sliding = None
        if model_type == "mistral" or getattr(hf, "use_sliding_window", False):
            sliding = getattr(hf, "sliding_window", None)
        moe: dict[str, Any] = {}
        if model_type == "qwen3_moe" and hf.num_experts and not any_family:
            dense, step = set(getattr(hf, "mlp_only_layers", None) or ()), getattr(hf, "decoder_sparse_step", 1) or 1
            moe = dict(
                moe_layers=tuple(i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0),
                num_experts=hf.num_experts,
                experts_per_token=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size,
                norm_topk_prob=bool(hf.norm_topk_prob),
            )
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=getattr(hf, "intermediate_size", None) or hf.hidden_size * 4,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=getattr(hf, "rms_norm_eps", None) or 1e-6,
            max_position_embeddings=hf.max_position_embeddings,
            rope_theta=theta,
            rope_scaling=rope_scaling,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=sliding,
            model_type=model_type,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **moe,
        )


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """Inverse rope frequencies [head_dim / 2], with linear or llama3 scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    kind = cfg.rope_scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / cfg.rope_scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
        s = cfg.rope_scaling
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / hi) * ~(wavelen > old_len / lo)
        return torch.where(medium, smoothed, scaled)
    return inv_freq
