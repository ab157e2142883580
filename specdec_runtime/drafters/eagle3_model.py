"""The EAGLE-3 model (Li et al. 2025) that training and the runtime share: fc, one decoder layer, the
final norm and an lm_head over the draft vocabulary (its drafter: eagle3.py).

    config = Eagle3Config.for_target(target_config, aux_layers=(2, 15, 27), draft_vocab=ids)  # ids [N]
    model = Eagle3Model(config)
    out = model.step(embeds, features, positions, attend)     # (prenorm [B, T, H], logits [B, T, N])

It reads the target's residual streams after three of its layers (low, middle, high:
`aux_layers`), concatenated [3 * H_target] and projected by fc to its width H. Its one decoder
layer's attention reads [input_layernorm(embedding of the next token) ; hidden_norm(feature)]
(2H wide); the feature is also the layer's residual. The result, before the final norm
("prenorm"), is the feature of the drafter's next step, and after norm + lm_head its logits over
the draft vocabulary: the N most frequent target tokens, draft id i being target id i + d2t[i].
The token embedding is the target's own, frozen.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec_runtime.config import DecoderConfig, rope_inv_freq
from specdec_runtime.errors import SpecdecError

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q [B, h, T, D], k, v [B, h_kv, T, D]) -> [B, h, T, D]


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high taps, as vLLM and SpecForge take them: the residual streams after
    layers 2, N // 2 and N - 3 (vLLM reads them as the inputs of those layers' indices); where
    those collide (targets of fewer than 7 layers), after layers 1, N // 2 and N - 1."""
    taps = (2, num_layers // 2, num_layers - 3)
    return taps if taps[0] < taps[1] < taps[2] else (1, num_layers // 2, num_layers - 1)


@dataclass(frozen=True)
class Eagle3Config:
    layer: DecoderConfig  # the drafter's decoder layer (num_layers 1; rope settings as the target's)
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    draft_vocab_size: int
    norm_before_residual: bool = False  # the residual is hidden_norm(feature) instead of the feature
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size  # the target's

    @classmethod
    def for_target(cls, target: DecoderConfig, *, aux_layers: tuple[int, ...] | None, draft_vocab_size: int, **kw):
        """A drafter as wide as the target (EAGLE-3's choice): one plain Llama layer with the target's
        heads and rope and no biases, whatever the target's (a Qwen2 target's q/k/v biases are its
        own): the layer is new, and the engines build a bias-free one (vLLM's and SGLang's contracts
        in specdec_runtime.engines)."""
        n = target.num_layers
        aux = tuple(aux_layers) if aux_layers else default_aux_layers(n)
        if n < 4:
            raise SpecdecError(f"eagle3 needs a target of at least 4 layers (3 distinct taps); this one has {n}")
        # Ascending: the target hands its residual streams over in layer order (model.Decoder's taps).
        if len(aux) != 3 or not 1 <= aux[0] < aux[1] < aux[2] < n:
            raise SpecdecError(
                f"eagle3 aux layers {list(aux)}: give 3 ascending layer counts in 1..{n - 1} (the residual streams "
                f"after that many of the target's {n} layers), e.g. {list(default_aux_layers(n))}"
            )
        if not 0 < draft_vocab_size <= target.vocab_size:
            raise SpecdecError(
                f"eagle3 draft vocabulary of {draft_vocab_size} tokens: need 1..{target.vocab_size} (the target's)"
            )
        layer = replace(target, num_layers=1, qkv_bias=False, o_bias=False, mlp_bias=False, sliding_window=None,
                        model_type="llama", qk_norm=False)  # fmt: skip
        return cls(layer, target.hidden_size, aux, draft_vocab_size, **kw)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: Tensor) -> Tensor:  # as transformers: normalize in fp32, scale in the input dtype
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Eagle3Layer(nn.Module):
    """The decoder layer, with transformers' Llama weight names (q/k/v read 2H)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * H, cfg.num_heads * D, bias=cfg.qkv_bias)
        self.self_attn.k_proj = nn.Linear(2 * H, cfg.num_kv_heads * D, bias=cfg.qkv_bias)
        self.self_attn.v_proj = nn.Linear(2 * H, cfg.num_kv_heads * D, bias=cfg.qkv_bias)
        self.self_attn.o_proj = nn.Linear(cfg.num_heads * D, H, bias=cfg.o_bias)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.mlp.up_proj = nn.Linear(H, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, H, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(
        self, embeds: Tensor, feature: Tensor, cos: Tensor, sin: Tensor, attend: Attend, norm_before_residual: bool
    ) -> Tensor:
        """The layer's output before the model's final norm (= the next step's feature) [B, T, H]."""
        B, T, _ = feature.shape
        a = self.self_attn
        h = self.hidden_norm(feature)
        residual = h if norm_before_residual else feature
        x = torch.cat([self.input_layernorm(embeds), h], dim=-1)  # [B, T, 2H]
        q = a.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin  # cos, sin [B or 1, 1, T, D]
        out = attend(q, k, v).transpose(1, 2).reshape(B, T, -1)
        residual = residual + a.o_proj(out)
        m = self.mlp
        h = self.post_attention_layernorm(residual)
        return residual + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


class Eagle3Model(nn.Module):
    """fc [H, 3 H_target], layers.0, norm, lm_head [N, H], d2t [N] (int64), t2d [V] (bool): the
    speculators checkpoint's tensors, under its names."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        H, N = cfg.layer.hidden_size, cfg.draft_vocab_size
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg.layer)])
        self.norm = RMSNorm(H, cfg.layer.rms_norm_eps)
        self.lm_head = nn.Linear(H, N, bias=False)
        self.register_buffer("d2t", torch.zeros(N, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.layer), persistent=False)

    def set_draft_vocab(self, ids: Tensor) -> None:
        """Draft id i <-> target id ids[i] (ids sorted [N])."""
        ids = ids.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_ids(self) -> Tensor:
        """Target id of each draft id [N]."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [B or 1, 1, T, D] of positions [T] or [B, T] (rotate-half layout, as transformers)."""
        freqs = positions.float()[..., None] * self.inv_freq  # [..., T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        if emb.dim() == 2:
            emb = emb[None]
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def project(self, features: Tensor) -> Tensor:
        """The target's concatenated taps [..., 3 H_target] -> the drafter's feature [..., H]."""
        return self.fc(features)

    def layer_step(self, embeds: Tensor, feature: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """One pass of the layer over T rows: the prenorm [B, T, H] (the next step's feature).
        embeds: the target's embeddings of the next tokens; feature: fc's output (first step) or
        the previous step's prenorm."""
        cos, sin = self.rope(positions, feature.dtype)
        return self.layers[0](embeds, feature, cos, sin, attend, self.config.norm_before_residual)

    def head(self, prenorm: Tensor) -> Tensor:
        """Draft logits [..., N] over the draft vocabulary."""
        return self.lm_head(self.norm(prenorm))

    def step(self, embeds: Tensor, feature: Tensor, positions: Tensor, attend: Attend) -> tuple[Tensor, Tensor]:
        """layer_step and head: (prenorm [B, T, H], draft logits [B, T, N])."""
        prenorm = self.layer_step(embeds, feature, positions, attend)
        return prenorm, self.head(prenorm)


def grouped(k: Tensor, n_heads: int) -> Tensor:
    """Key/value heads repeated for their query groups [B, h_kv, S, D] -> [B, h, S, D]."""
    return k.repeat_interleave(n_heads // k.shape[1], dim=1)
