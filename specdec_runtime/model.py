"""A compact Llama-family decoder with a preallocated, position-indexed KV cache.

    model = Decoder.from_hf_state_dict(DecoderConfig.from_hf(hf_config), state_dict)
    model.setup_cache(batch=1, size=2048)
    out = model(ids, start=0, logits_to_keep=1)           # prefill: logits of the last prompt token
    out = model(ids[:, -1:], start=n)                     # one decode step at position n
    out = model(tree_ids, start=n, positions=pos, tree_mask=mask)   # verify a token tree
    out = model(ids, start=n, exit_layer=4)               # the target's first 4 layers as a drafter
    out = model(ids, start=n, skip=LayerSkip(attn={3, 5}, mlp={7}))  # self-speculative draft

Cache rows are slots; a forward of T tokens at `start` writes slots start..start+T-1 and attends
to slots 0..start+T-1. Rolling back is free: slots past the accepted length are overwritten by
the next forward. Logits match transformers' on the same weights (tests/runtime/test_model.py).

Fixed shapes (GPU): with `start` a 0-dim device tensor (`model.slot(n)`), a forward writes its
K/V with index_copy_ and attends over the whole cache under a mask, so its shapes depend on T
only and no Python int crosses from the device: what torch.compile with CUDA graphs needs.
`model.compile()` turns this on (specdec generate/bench --compile, on by default on CUDA);
`model.fixed_shapes = True` runs the same path eagerly (the CPU tests check it equals the default).

Batch-1 decoding on a CPU is bound by weight reads plus per-op dispatch, so the layout is chosen
for few, large ops: q/k/v and gate/up fused, weights stored [in, out] so the residual add folds
into addmm(x, h, W), RoPE as one complex multiply (q/k head dims interleaved at load time, which
leaves q.k unchanged), RMSNorm as one fused kernel, one K/V write per layer, GQA by folding query
groups into the sequence axis instead of repeating keys, no nn.Module calls in the layer loop.
"""

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec_runtime.config import DecoderConfig, rope_inv_freq


@dataclass(frozen=True)
class LayerSkip:
    """Sublayers to skip while drafting: indices of layers whose attention / MLP is bypassed."""

    attn: frozenset[int] = field(default_factory=frozenset)
    mlp: frozenset[int] = field(default_factory=frozenset)

    def __init__(self, attn: set[int] | frozenset[int] = frozenset(), mlp: set[int] | frozenset[int] = frozenset()):
        object.__setattr__(self, "attn", frozenset(attn))
        object.__setattr__(self, "mlp", frozenset(mlp))


class DecoderOutput(NamedTuple):
    logits: Tensor  # [B, T', V] for the last T' = logits_to_keep positions (all when 0)
    # When return_hidden: [B, T', H] after the final norm, or with hidden_layer=k the residual
    # stream after the first k layers at every position [B, T, H] (an MTP trunk's output).
    hidden: Tensor | None


class KVCache(nn.Module):
    """Keys and values of every layer in one buffer [layers, B, 2 * Hkv, S, D], indexed by slot:
    heads 0..Hkv-1 are keys, Hkv.. values, so a layer writes both with one copy."""

    def __init__(self, cfg: DecoderConfig, batch: int, size: int, device: torch.device, dtype: torch.dtype):
        super().__init__()
        shape = (cfg.num_layers, batch, 2 * cfg.num_kv_heads, size, cfg.head_dim)
        self.register_buffer("kv", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.n_kv = cfg.num_kv_heads

    @property
    def size(self) -> int:
        return self.kv.shape[3]

    @property
    def k(self) -> Tensor:
        return self.kv[:, :, : self.n_kv]  # [layers, B, Hkv, S, D]

    @property
    def v(self) -> Tensor:
        return self.kv[:, :, self.n_kv :]

    @torch.inference_mode()
    def move(self, src: Tensor, dst: int) -> None:
        """Copy slots `src` [n] to dst..dst+n-1 in every layer (keeps an accepted tree path)."""
        self.kv[:, :, :, dst : dst + src.numel()] = self.kv.index_select(3, src)


def rms_norm(x: Tensor, weight2: Tensor, eps: float) -> Tensor:
    """RMSNorm of x [..., H] with its weight stored twice, weight2 = [w, w] [2H].

    In fp32 it runs as one fused kernel: LayerNorm of [x, -x] has mean 0 and variance mean(x^2),
    so it equals RMSNorm (F.rms_norm is six kernels on CPU; at batch 1 each costs more than the
    math). Half precision follows transformers: normalize in fp32, cast back, then scale.
    """
    H = x.shape[-1]
    if x.dtype == torch.float32:
        return F.layer_norm(torch.cat([x, -x], dim=-1), (2 * H,), weight2, None, eps)[..., :H]
    return weight2[:H] * F.rms_norm(x.float(), (H,), eps=eps).to(x.dtype)


def interleave_rope_dims(w: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """Reorder a q/k projection's output rows [n_heads * D, ...] from rotate-half pairs (i, i + D/2)
    to adjacent pairs (2i, 2i + 1), so rope is a complex multiply. q.k is unchanged."""
    order = torch.arange(head_dim).view(2, head_dim // 2).t().reshape(-1)  # 0, D/2, 1, D/2 + 1, ...
    return w.view(n_heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape)


def apply_rope_(x: Tensor, cis: Tensor) -> None:
    """Rotate adjacent dim pairs of x [B, T, heads, D] by cis [T, 1, D/2] (complex, or its real
    view [T, 1, D/2, 2] on the fixed-shape path: compilers do not take complex tensors), in place."""
    if not cis.is_complex():
        xs = x.float().unflatten(-1, (-1, 2))  # [B, T, h, D/2, 2]
        cos, sin = cis[..., 0], cis[..., 1]
        x0, x1 = xs[..., 0], xs[..., 1]
        x.copy_(torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2))
    elif x.dtype == torch.float32:
        torch.view_as_complex(x.unflatten(-1, (-1, 2))).mul_(cis)  # one kernel
    else:  # no complex bf16/fp16 kernels: rotate in fp32 and write back
        xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        x.copy_(torch.view_as_real(xc * cis).flatten(-2))


class Linear(nn.Module):
    """Holds a weight stored [in, out] (+ bias); the decoder calls torch.mm/addmm on it directly."""

    def __init__(self, n_in: int, n_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = x.reshape(-1, x.shape[-1]) @ self.weight
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)


class Block(nn.Module):
    """One pre-norm layer: x + attn(norm(x)), then x + mlp(norm(x)). Works on x flattened to [B*T, H]."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group, self.eps = cfg.num_heads // cfg.num_kv_heads, cfg.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(2 * cfg.hidden_size))  # [w, w], see rms_norm
        self.qkv = Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.qkv_bias)
        self.o = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias)
        self.mlp_norm = nn.Parameter(torch.ones(2 * cfg.hidden_size))
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)

    def attention(
        self, x: Tensor, B: int, cis: Tensor, kv_cache: Tensor, start: int | Tensor, mask: Tensor | None
    ) -> Tensor:
        """x + attention(norm(x)) for x [B*T, H]; writes this layer's K/V [B, 2Hkv, S, D] at slots
        start.. (an int), or at the slots [T] of a tensor (fixed shapes: attends over the whole cache)."""
        H, Hkv, D = self.n_heads, self.n_kv, self.head_dim
        T = x.shape[0] // B
        h = rms_norm(x, self.attn_norm, self.eps)
        qkv = h @ self.qkv.weight if self.qkv.bias is None else torch.addmm(self.qkv.bias, h, self.qkv.weight)
        qkv = qkv.view(B, T, H + 2 * Hkv, D)
        apply_rope_(qkv[:, :, : H + Hkv], cis)  # q and k heads at once
        new_kv = qkv[:, :, H:].transpose(1, 2)  # keys and values: [B, 2Hkv, T, D]
        if isinstance(start, int):
            kv_cache[:, :, start : start + T] = new_kv
            kv_cache = kv_cache[:, :, : start + T]
        else:
            kv_cache.index_copy_(2, start, new_kv)
        # GQA without repeating keys: each kv head's query group is folded into the sequence axis.
        q = qkv[:, :, :H].transpose(1, 2).reshape(B, Hkv, self.group * T, D)
        k, v = kv_cache.split(Hkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.view(B, H, T, D).transpose(1, 2).reshape(B * T, H * D)
        y = torch.addmm(x, out, self.o.weight)  # residual folded into the matmul
        return y if self.o.bias is None else y + self.o.bias

    def mlp(self, x: Tensor) -> Tensor:
        """x + down(silu(gate(norm(x))) * up(norm(x))) for x [B*T, H]."""
        h = rms_norm(x, self.mlp_norm, self.eps)
        gu = (
            h @ self.gate_up.weight
            if self.gate_up.bias is None
            else torch.addmm(self.gate_up.bias, h, self.gate_up.weight)
        )
        gate, up = gu.chunk(2, dim=-1)
        y = torch.addmm(x, F.silu(gate, inplace=True).mul_(up), self.down.weight)
        return y if self.down.bias is None else y + self.down.bias


class Decoder(nn.Module):
    """Llama / Mistral / Qwen2 decoder for inference, with its own KV cache."""

    def __init__(self, cfg: DecoderConfig, head_size: int | None = None):
        super().__init__()
        self.config = cfg
        # Tied embeddings are stored once, as the lm_head's [H, V]; lookups read its columns. A
        # drafter with a draft vocabulary (head_size < V rows) keeps its full embedding table apart.
        tied = cfg.tie_word_embeddings and head_size is None
        self.embed = None if tied else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(2 * cfg.hidden_size))  # [w, w], see rms_norm
        self.lm_head = Linear(cfg.hidden_size, head_size or cfg.vocab_size)
        self.vocab_ids: Tensor | None = None  # [head_size] vocabulary ids of the head's outputs
        self.cache: KVCache | None = None
        self.kv_layers: list[Tensor] = []  # per-layer views of the cache
        self.cis: Tensor | None = None  # [S, 1, D/2] complex rope table, built with the cache
        self.cos_sin: Tensor | None = None  # [S, 1, D/2, 2] its real view, (cos, sin) (fixed-shape path)
        self.slots: Tensor | None = None  # [S] 0, 1, ..., S-1 on the device: slot(n) is a view, no copy
        self.fixed_shapes = False  # decode / verify with tensor starts (see the module docstring)
        self.compiled: dict[str, Callable] = {}  # torch.compile'd run_layers and head (compile())

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.inference_mode()
    def setup_cache(self, batch: int, size: int) -> None:
        """Allocate the KV cache and rope table for `size` slots (kept if already big enough)."""
        if self.cache is not None and self.cache.size >= size and self.cache.kv.shape[1] == batch:
            return
        if self.fixed_shapes:  # every cache size is a new graph for the compiler: grow in steps of 256
            size = -(-size // 256) * 256
        self.cache, self.kv_layers = None, []  # free the old one before allocating
        self.cache = KVCache(self.config, batch, size, self.device, self.dtype)
        self.kv_layers = list(self.cache.kv.unbind(0))
        self.slots = torch.arange(size, device=self.device)
        freqs = self.slots[:, None].float() * rope_inv_freq(self.config).to(self.device)[None, :]  # [S, D/2]
        # cos/sin rounded to the model dtype first, as transformers does.
        cos, sin = freqs.cos().to(self.dtype).float(), freqs.sin().to(self.dtype).float()
        self.cis = torch.complex(cos, sin)[:, None, :]
        self.cos_sin = torch.view_as_real(self.cis)  # [S, 1, D/2, 2], the same memory
        if self.compiled:  # CUDA graphs keep the cache's address and write into it
            for t in (self.cache.kv, *self.kv_layers, self.slots, self.cos_sin):
                torch._dynamo.mark_static_address(t)

    def slot(self, n: int) -> int | Tensor:
        """What forward() takes as `start` for cache slot n: n, or on the fixed-shape path a 0-dim
        view of the device's slot table (no host-to-device copy, no sync)."""
        return self.slots[n] if self.fixed_shapes else n

    def compile(self, mode: str | None = "reduce-overhead", backend: str = "inductor") -> None:
        """torch.compile the layers and the head for the fixed-shape path (mode reduce-overhead:
        CUDA graphs). Each (T, layer range, skip set) is one graph, compiled on first use; if
        compiling fails the model warns once and runs eagerly. The CPU tests trace it with
        backend='aot_eager'."""
        for name in ("recompile_limit", "cache_size_limit"):  # many (T, range) graphs per model
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
        self.fixed_shapes = True
        opts = dict(fullgraph=True, dynamic=False, backend=backend) | ({"mode": mode} if backend == "inductor" else {})
        self.compiled = {
            "run_layers": torch.compile(self._run_layers, **opts),
            "head": torch.compile(self._head, **opts),
        }
        if self.cache is not None:  # mark the existing cache as static: allocate it again
            batch, size = self.cache.kv.shape[1], self.cache.size
            self.cache = None
            self.setup_cache(batch, size)

    def _call(self, name: str, *args) -> Tensor | DecoderOutput:
        """The compiled `name` (if any) on the fixed-shape path, else the eager one."""
        fn = self.compiled.get(name)
        if fn is not None:
            try:
                return fn(*args)
            except Exception as e:  # a compiler failure must not cost the user their run
                warnings.warn(
                    f"torch.compile of Decoder.{name} failed ({type(e).__name__}: {e}); running eagerly", stacklevel=3
                )
                self.compiled.pop(name)
        return getattr(self, "_" + name)(*args)

    def embed_tokens(self, ids: Tensor) -> Tensor:
        """Token embeddings [B, T, H]."""
        table = self.lm_head.weight.t() if self.embed is None else self.embed.weight
        return F.embedding(ids, table)

    @torch.inference_mode()  # inference only: training uses the transformers model
    def forward(
        self,
        ids: Tensor,
        start: int | Tensor,
        *,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
        exit_layer: int | None = None,
        skip: LayerSkip | None = None,
        logits_to_keep: int = 0,
        return_hidden: bool = False,
        hidden_layer: int | None = None,
    ) -> DecoderOutput:
        """Run `ids` [B, T] at cache slots start..start+T-1 (start: an int, or model.slot(n) on the
        fixed-shape path).

        positions: rope positions [T] (default: the slots); a token tree passes start + depths.
        tree_mask: [T, T] bool, which new tokens each new token sees (the prefix is always seen).
        exit_layer: stop after this many layers and apply the final norm + lm_head (early exit).
        skip: sublayers to bypass. logits_to_keep: only project the last n positions (0 = all).
        return_hidden: also return the final-norm hidden states, or with hidden_layer=k the
        residual stream after layer k-1 at every position.
        """
        kw = dict(positions=positions, tree_mask=tree_mask, skip=skip)
        x = self.embed_tokens(ids)
        if not return_hidden or hidden_layer is None:
            return self.head(self.run_layers(x, start, 0, exit_layer, **kw), logits_to_keep, return_hidden)
        tapped = self.run_layers(x, start, 0, hidden_layer, **kw)
        out = self.head(self.run_layers(tapped, start, hidden_layer, exit_layer, **kw), logits_to_keep)
        return DecoderOutput(out.logits, tapped)

    @torch.inference_mode()
    def run_layers(
        self,
        x: Tensor,
        start: int | Tensor,
        first: int = 0,
        last: int | None = None,
        *,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
        skip: LayerSkip | None = None,
    ) -> Tensor:
        """The residual stream [B, T, H] after layers first..last-1, from x [B, T, H] at slots start..

        forward() is embed -> run_layers(0, N) -> head. Starting at first > 0 resumes from a
        residual stream computed earlier, e.g. an early-exit drafter's (see generate.py).
        """
        T = x.shape[1]
        if isinstance(start, int):
            if self.cache is None or start + T > self.cache.size:
                raise ValueError(f"KV cache too small for slots up to {start + T}: call setup_cache first")
            return self._run_layers(x, start, first, last, positions, tree_mask, skip)
        return self._call("run_layers", x, start, first, last, positions, tree_mask, skip)

    def _run_layers(
        self,
        x: Tensor,
        start: int | Tensor,
        first: int,
        last: int | None,
        positions: Tensor | None,
        tree_mask: Tensor | None,
        skip: LayerSkip | None,
    ) -> Tensor:
        B, T, _ = x.shape
        if isinstance(start, int):
            cis = self.cis[start : start + T] if positions is None else self.cis[positions]
            mask = self._mask(start, T, positions, tree_mask)
        else:  # fixed shapes: start becomes the slots [T]
            start = start + self.slots[:T]
            cis = self.cos_sin[start if positions is None else positions]
            mask = self._fixed_mask(start, positions, tree_mask)
        skip_attn = skip.attn if skip is not None else ()
        skip_mlp = skip.mlp if skip is not None else ()
        x = x.reshape(B * T, -1)  # the layers work on [B*T, H]
        for i in range(first, self.config.num_layers if last is None else last):
            block = self.layers[i]
            if i not in skip_attn:
                x = block.attention(x, B, cis, self.kv_layers[i], start, mask)
            if i not in skip_mlp:
                x = block.mlp(x)
        return x.view(B, T, -1)

    @torch.inference_mode()
    def head(self, x: Tensor, logits_to_keep: int = 0, return_hidden: bool = False) -> DecoderOutput:
        """Final norm + lm_head on the residual stream x [B, T, H] (its last logits_to_keep positions)."""
        if logits_to_keep:  # before the compiled call: a prefill's length must not make a new graph
            x = x[:, -logits_to_keep:]
        if self.compiled:
            return self._call("head", x, return_hidden)
        return self._head(x, return_hidden)

    def _head(self, x: Tensor, return_hidden: bool = False) -> DecoderOutput:
        h = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return DecoderOutput(self.lm_head(h), h if return_hidden else None)  # logits [B, T', V]

    def _mask(self, start: int, T: int, positions: Tensor | None, tree_mask: Tensor | None) -> Tensor | None:
        """Boolean [group * T, start + T] mask (rows repeat per folded query head), or None if not needed."""
        window = self.config.sliding_window
        end = start + T
        if T == 1 and tree_mask is None and (window is None or end <= window):
            return None  # one new token sees every slot
        slots = torch.arange(end, device=self.device)
        if tree_mask is None:
            mask = slots[None, :] <= slots[start:, None]  # causal with an offset
        else:
            mask = torch.ones(T, end, dtype=torch.bool, device=self.device)
            mask[:, start:] = tree_mask
        if window is not None and end > window:
            q_pos = slots[start:] if positions is None else positions
            k_pos = slots.clone()
            if positions is not None:
                k_pos[start:] = positions
            mask &= k_pos[None, :] > q_pos[:, None] - window
        group = self.config.num_heads // self.config.num_kv_heads
        return mask.repeat(group, 1) if group > 1 else mask

    def _fixed_mask(self, slots: Tensor, positions: Tensor | None, tree_mask: Tensor | None) -> Tensor:
        """_mask for the fixed-shape path: [group * T, S] over the whole cache, from slot tensors [T].
        Slots past the newest are stale (rejected drafts, earlier prompts) and masked out."""
        T, k_slot = slots.shape[0], self.slots
        if tree_mask is None:
            mask = k_slot[None, :] <= slots[:, None]  # causal
        else:  # the prefix, then the tree's own pattern on the new slots
            mask = (k_slot[None, :] < slots[:1, None]).expand(T, -1).clone()
            mask.index_copy_(1, slots, tree_mask)
        window = self.config.sliding_window
        if window is not None:
            q_pos = slots if positions is None else positions
            k_pos = k_slot if positions is None else k_slot.index_copy(0, slots, positions)
            mask &= k_pos[None, :] > q_pos[:, None] - window
        group = self.config.num_heads // self.config.num_kv_heads
        return mask.repeat(group, 1) if group > 1 else mask

    @classmethod
    @torch.no_grad()
    def from_hf_state_dict(
        cls,
        cfg: DecoderConfig,
        sd: dict[str, Tensor],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        vocab_ids: Tensor | None = None,
    ) -> "Decoder":
        """Build from a transformers Llama/Mistral/Qwen2 state dict: q/k/v and gate/up fused, weights
        stored [in, out], q/k rows interleaved for rope. Parameters are created once, on `device`.

        vocab_ids [N]: keep only these rows of the lm_head (a drafter's draft vocabulary); its
        logits then cover those ids, in that order, and `model.vocab_ids` maps them back.
        """
        with torch.device("meta"):
            model = cls(cfg, None if vocab_ids is None else len(vocab_ids))
        prep = lambda w: w.to(device=device, dtype=dtype).contiguous()  # noqa: E731
        twice = lambda w: prep(torch.cat([w, w]))  # noqa: E731  (norm weights, see rms_norm)
        own = {"norm": twice(sd["model.norm.weight"])}
        embed = sd["model.embed_tokens.weight"]
        head = embed if cfg.tie_word_embeddings else sd["lm_head.weight"]  # [V, H]
        if vocab_ids is not None:
            head = head[vocab_ids.long().cpu()]
        if model.embed is not None:
            own["embed.weight"] = prep(embed)
        own["lm_head.weight"] = prep(head.t())
        for i in range(cfg.num_layers):
            own |= block_state_dict(cfg, sd, f"model.layers.{i}.", f"layers.{i}.", prep)
        model.load_state_dict(own, strict=True, assign=True)
        if vocab_ids is not None:
            model.vocab_ids = vocab_ids.to(device=device, dtype=torch.long)
        return model.eval()


def block_state_dict(cfg: DecoderConfig, sd: dict[str, Tensor], src: str, dst: str, prep) -> dict[str, Tensor]:
    """One transformers decoder layer's weights (keys under `src`) as a Block's (keys under `dst`):
    q/k/v and gate/up fused, [in, out], q/k rows interleaved for rope, norms doubled; prep(w)
    places a tensor on the right device and dtype."""
    a, m, o = src + "self_attn.", src + "mlp.", dst
    twice = lambda w: prep(torch.cat([w, w]))  # noqa: E731  (norm weights, see rms_norm)
    q = interleave_rope_dims(sd[a + "q_proj.weight"], cfg.num_heads, cfg.head_dim)
    k = interleave_rope_dims(sd[a + "k_proj.weight"], cfg.num_kv_heads, cfg.head_dim)
    own = {
        o + "attn_norm": twice(sd[src + "input_layernorm.weight"]),
        o + "mlp_norm": twice(sd[src + "post_attention_layernorm.weight"]),
        o + "qkv.weight": prep(torch.cat([q, k, sd[a + "v_proj.weight"]]).t()),
        o + "o.weight": prep(sd[a + "o_proj.weight"].t()),
        o + "gate_up.weight": prep(torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]).t()),
        o + "down.weight": prep(sd[m + "down_proj.weight"].t()),
    }
    if cfg.qkv_bias:
        qb = interleave_rope_dims(sd[a + "q_proj.bias"], cfg.num_heads, cfg.head_dim)
        kb = interleave_rope_dims(sd[a + "k_proj.bias"], cfg.num_kv_heads, cfg.head_dim)
        own[o + "qkv.bias"] = prep(torch.cat([qb, kb, sd[a + "v_proj.bias"]]))
    if cfg.o_bias:
        own[o + "o.bias"] = prep(sd[a + "o_proj.bias"])
    if cfg.mlp_bias:
        own[o + "gate_up.bias"] = prep(torch.cat([sd[m + "gate_proj.bias"], sd[m + "up_proj.bias"]]))
        own[o + "down.bias"] = prep(sd[m + "down_proj.bias"])
    return own
