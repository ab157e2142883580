"""A decoder layer's weights and the functions a forward runs on them (model.Decoder's layer loop,
the EAGLE-3 layer, MTP heads): plain functions of tensors, so that one compiled version serves
every layer (model.Decoder.compile).

    h = attention(h, B, *block.attn_weights, cos, sin, kv, slots, mask, bound, block.eps)
    h = mlp(h, *block.mlp_weights, block.eps)
    y = linear(x, Weights.from_matrix(w, cpu_copy=True))   # x @ W, in the CPU kernel where it takes x

Batch-1 decoding on a CPU is bound by weight reads plus per-op dispatch, so the layout is chosen
for few, large ops: q/k/v and gate/up fused, weights stored [in, out] so the residual add folds
into addmm(x, h, W), RoPE on adjacent dim pairs (q/k head dims interleaved at load time, which
leaves q.k unchanged), RMSNorm as one fused kernel, one K/V write per layer, GQA by folding query
groups into the sequence axis instead of repeating keys, no nn.Module calls in the layer loop.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from specdec_runtime import cpu
from specdec_runtime.config import DecoderConfig, rope_inv_freq

LIVE_BLOCK = 128  # attend_live's blocks of slots (flex attention's default block size)


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
    to adjacent pairs (2i, 2i + 1). q.k is unchanged."""
    order = torch.arange(head_dim).view(2, head_dim // 2).t().reshape(-1)  # 0, D/2, 1, D/2 + 1, ...
    return w.view(n_heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape)


def apply_rope_(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotate the adjacent dim pairs of x [B, T, heads, D] in place: (a, b) -> (a c - b s, b c + a s).
    cos [T, 1, D] holds c twice per pair, sin [T, 1, D] holds (-s, s) per pair (see rope_table)."""
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (b, a) per pair, a copy
    x.mul_(cos).add_(swapped.mul_(sin))  # both products rounded to x's dtype, as transformers does


def rope_table(cfg: DecoderConfig, size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """[S, 2, D]: per position, cos repeated per dim pair and (-sin, sin) per pair, in the model's
    dtype (rounded from fp32 as transformers does)."""
    pos = torch.arange(size, device=device, dtype=torch.float32)
    freqs = pos[:, None] * rope_inv_freq(cfg).to(device)[None, :]  # [S, D/2]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    return torch.stack([cos.repeat_interleave(2, -1), torch.stack([-sin, sin], -1).flatten(-2)], dim=1)


class Weights(NamedTuple):
    """A Linear's tensors (Linear.params). On a CPU the model also keeps one copy of W for products of
    a few rows: packed for the runtime's CPU kernel where it is built for W's dtype (fp32), else
    W^T for MKL (see linear())."""

    w: Tensor  # [in, out]
    t: Tensor | None = None  # W^T [out, in]
    bias: Tensor | None = None
    packed: Tensor | None = None  # W in the CPU kernel's layout (cpu.pack)
    # A q/k/v projection's per-head RMSNorm weights [2, 2D] (queries', keys', each doubled as
    # rms_norm takes them), applied after it and before rope (Qwen3); None elsewhere
    norms: Tensor | None = None

    @classmethod
    def from_matrix(
        cls, w: Tensor, bias: Tensor | None = None, cpu_copy: bool = False, bf16: bool = False, pairs: bool = False
    ) -> "Weights":
        """W (+ bias), with its CPU copy when cpu_copy; bf16: the kernel's copy rounded to bf16 (half
        the bytes a product reads; a drafter's weights, see cpu.pack); pairs: in bf16 pairs,
        multiplied by rows rounded to bf16 too (a drafter's, where cpu.bf16_layout allows)."""
        if not cpu_copy:
            return cls(w, None, bias)
        packed = cpu.pack(w, bf16, pairs)
        if packed is not None:
            return cls(w, None, bias, packed)
        return cls(w, w.detach().t().contiguous(), bias)


def linear(x: Tensor, w: Weights, residual: Tensor | None = None) -> Tensor:
    """x [M, in] @ W (+ bias) (+ residual), one kernel where it can be. Where the model keeps a CPU
    copy: up to cpu.max_rows() fp32 rows without autograd go to the runtime's CPU kernel
    (w.packed), which streams the weight once over all threads (MKL's 1-row product runs on one
    core); where the kernel is not built, several rows go to MKL's W^T @ x^T (w.t; its x @ W
    re-reads W for every few rows: verifying 5 tokens cost 2.5 decode steps instead of 1.3-1.6;
    scripts/bench_cost.py). Otherwise one row reads W [in, out] (the GEMV streams it once), with
    the residual add folded into addmm."""
    weight, weight_t, bias, packed, _ = w
    if packed is not None and (y := cpu.matmul(x, w, residual)) is not None:
        return y
    if weight_t is not None and x.shape[0] > 1:
        if x.stride(-1) != 1:  # MKL's fast kernel wants x^T as a transposed view of row-major x
            x = x.contiguous()
        y = (weight_t @ x.t()).t()
        if residual is None and bias is None:
            return y.contiguous()  # row-major out, for the next product (and elementwise ops)
        if residual is not None:
            y = y + residual
    elif residual is not None:
        y = torch.addmm(residual, x, weight)  # the residual add folded into the matmul
    elif bias is not None:
        return torch.addmm(bias, x, weight)
    else:
        return x @ weight
    return y if bias is None else y + bias


def attention(
    x: Tensor,
    B: int,
    norm: Tensor,
    qkv: Weights,
    o: Weights,
    cos: Tensor,
    sin: Tensor,
    kv: Tensor,
    slots: Tensor,
    mask: Tensor | None,
    bound: int,
    eps: float,
) -> Tensor:
    """x + attention(norm(x)) for x [B*T, H]. Writes this layer's K/V into kv [B, 2Hkv, S, D] at
    slots [T], then attends over kv's first `bound` slots under mask [group * T, bound] (None:
    every slot). A function of tensors, so that one compiled version serves every layer. A few
    fp32 rows on a CPU run in the CPU kernel (cpu.attention, norm included)."""
    if (y := cpu.attention(x, B, norm, eps, x, qkv, o, cos, sin, kv, slots, mask, bound)) is not None:
        return y
    return self_attention(rms_norm(x, norm, eps), x, B, qkv, o, cos, sin, kv, slots, mask, bound, eps)


def self_attention(
    h: Tensor,
    residual: Tensor,
    B: int,
    qkv: Weights,
    o: Weights,
    cos: Tensor,
    sin: Tensor,
    kv: Tensor,
    slots: Tensor,
    mask: Tensor | None,
    bound: int,
    eps: float = 1e-6,
) -> Tensor:
    """residual + o(attention) of the normalized input h [B*T, in] (see attention(); an EAGLE-3
    layer's h is two normalized inputs side by side). eps: the q/k norms' (qkv.norms)."""
    if (y := cpu.attention(h, B, None, 0.0, residual, qkv, o, cos, sin, kv, slots, mask, bound)) is not None:
        return y
    q = queries(h, B, qkv, cos, sin, kv, slots, eps)
    return projected(attend(q, kv, mask, bound), residual, B, o)


def queries(
    h: Tensor, B: int, qkv: Weights, cos: Tensor, sin: Tensor, kv: Tensor, slots: Tensor, eps: float = 1e-6
) -> Tensor:
    """Attention's first part: q/k/v of h [B*T, in] (each q and k head RMS-normalized where qkv has
    norms, with eps) with rope, this layer's keys and values written into kv at slots [T]: the
    queries [B, Hkv, group * T, D] (GQA without repeating keys: each kv head's query group folded
    into the sequence axis)."""
    D = cos.shape[-1]
    Hkv = kv.shape[1] // 2
    H = qkv[0].shape[1] // D - 2 * Hkv
    T = h.shape[0] // B
    qkv_out = linear(h, qkv).view(B, T, H + 2 * Hkv, D)
    if qkv.norms is not None:  # Qwen3: per head, before rope
        qkv_out[:, :, :H] = rms_norm(qkv_out[:, :, :H], qkv.norms[0], eps)
        qkv_out[:, :, H : H + Hkv] = rms_norm(qkv_out[:, :, H : H + Hkv], qkv.norms[1], eps)
    apply_rope_(qkv_out[:, :, : H + Hkv], cos, sin)  # q and k heads at once
    if slots.dim() == 1:
        kv[:, :, slots] = qkv_out[:, :, H:].transpose(1, 2)  # keys and values [B, 2Hkv, T, D], one write
    else:  # a slot per row and token [B, T] (specdec_runtime.rows)
        kv[torch.arange(B, device=kv.device)[:, None], :, slots] = qkv_out[:, :, H:]
    return qkv_out[:, :, :H].transpose(1, 2).reshape(B, Hkv, (H // Hkv) * T, D)


def attend(q: Tensor, kv: Tensor, mask: Tensor | None, bound: int) -> Tensor:
    """The queries over kv's first `bound` slots under mask [group * T, bound] (None: all of them)."""
    k, v = kv[:, :, :bound].split(kv.shape[1] // 2, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attend_live(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, slots: Tensor) -> Tensor:
    """attend() over the whole of the keys and values k, v [B, Hkv, S, D] (a cache layer's halves)
    by flex attention, reading only their blocks of LIVE_BLOCK slots up to each row's newest new slot
    (slots [T], or [B, T] a row each): one shape, so one compiled kernel and one captured step, for
    every live length, where attend() needs a span per length, and a kernel that splits the slots
    among blocks at one query row (cuDNN's masked SDPA over 4,096 slots read 16 MB a layer in 72 us
    on an H200: docs/results.md). mask: bool, [group * T, S] or [B, 1, group * T, S]. Compiled only
    (eagerly flex attention computes every score), on its own (split_attention says why)."""
    B, S, G = q.shape[0], k.shape[2], q.shape[2]
    if S % LIVE_BLOCK:  # (the fast path's caches are: setup_cache sizes them in steps of 256 slots)
        raise ValueError(f"attend_live needs a cache of whole blocks of {LIVE_BLOCK} slots (got {S})")
    newest = slots[..., -1].expand(B)  # [B] (a step's slots are consecutive: its last is its newest)
    q_blocks = -(-G // LIVE_BLOCK)  # blocks of queries
    # (contiguous: flex attention's kernel for 128 queries or more indexes these as if they were; a
    # broadcast view handed every batch row the first's block count)
    live = (newest // LIVE_BLOCK + 1).to(torch.int32)[:, None, None].expand(B, 1, q_blocks).contiguous()
    blocks = torch.arange(S // LIVE_BLOCK, dtype=torch.int32, device=k.device).expand(B, 1, q_blocks, -1).contiguous()
    if mask.dim() == 2:
        mask_mod = lambda b, h, i, j: mask[i, j]  # noqa: E731
    else:
        mask_mod = lambda b, h, i, j: mask[b, 0, i, j]  # noqa: E731
    live_mask = BlockMask.from_kv_blocks(
        live, blocks, BLOCK_SIZE=LIVE_BLOCK, mask_mod=mask_mod, seq_lengths=(G, S), compute_q_blocks=False
    )
    return flex_attention(q, k, v, block_mask=live_mask)


def projected(out: Tensor, residual: Tensor, B: int, o: Weights) -> Tensor:
    """residual + o(out) for attend()'s [B, Hkv, group*T, D] -> [B*T, H*D] (CUDA's kernels may hand
    it back in another memory layout, the memory-efficient one's [B, group*T, Hkv, D]: reshape
    copies only then)."""
    T = residual.shape[0] // B
    H, D = o[0].shape[0] // out.shape[-1], out.shape[-1]
    out = out.reshape(B, H, T, D).transpose(1, 2).reshape(B * T, H * D)
    return linear(out, o, residual=residual)


def split_attention(first, last, x, B, norm, qkv, o, cos, sin, kv, slots, mask, bound, eps, flex=None) -> Tensor:
    """attention() on the fast path: its compiled halves (first: norm and queries(); last:
    projected()) around the SDPA over the step's span, which runs as it is inside the captured step,
    so that one compiled version serves every span (Decoder.forward); or around flex, attend_live()
    compiled on its own (Decoder.compile(attention="flex")), given the keys and values as views:
    compiled with the K/V write before it, or given the cache layer to split, inductor copied the
    whole layer every step to hand flex attention its keys and values (its generated code, CPU)."""
    q = first(x, B, norm, qkv, cos, sin, kv, slots, eps)
    if flex is None:
        return last(attend(q, kv, mask, bound), x, B, o)
    return last(flex(q, *kv.split(kv.shape[1] // 2, dim=1), mask, slots), x, B, o)


def normed_queries(x, B, norm, qkv, cos, sin, kv, slots, eps) -> Tensor:
    return queries(rms_norm(x, norm, eps), B, qkv, cos, sin, kv, slots, eps)


def mlp(x: Tensor, norm: Tensor, gate_up: Weights, down: Weights, eps: float) -> Tensor:
    """x + down(silu(gate(norm(x))) * up(norm(x))) for x [B*T, H] (a few fp32 rows of one sequence on
    a CPU: in the CPU kernel, cpu.mlp)."""
    if (y := cpu.mlp(x, norm, eps, gate_up, down)) is not None:
        return y
    h = rms_norm(x, norm, eps)
    gate, up = linear(h, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate).mul_(up), down, residual=x)


def moe(x: Tensor, norm: Tensor, router: Weights, gate_up: Tensor, down: Tensor, top_k: int, renorm: bool,
        eps: float) -> Tensor:  # fmt: skip
    """x + the router-weighted sum of the top_k experts' SwiGLU MLPs (Qwen3-MoE) for x [N, H];
    gate_up [E, H, 2I], down [E, I, H]. While N x top_k <= E (decoding, verifying a draft) each
    row reads only its chosen experts' weights, gathered (experts_gathered). More rows (a prefill, a
    batch's verify) go to torch's grouped products where it has them for the weights (on CUDA in
    bf16: experts_grouped), each chosen expert's weights read once for all its rows; neither reads a
    value on the host. Elsewhere they go expert by expert (experts_by_expert), a host read a layer."""
    h = rms_norm(x, norm, eps)
    probs = linear(h, router).float().softmax(-1)  # [N, E]
    weights, chosen = probs.topk(top_k, dim=-1)  # [N, k]
    if renorm:
        weights = weights / weights.sum(-1, keepdim=True)
    experts = (h, weights.to(h.dtype), chosen, gate_up, down)
    if h.shape[0] * top_k <= gate_up.shape[0]:
        return x + experts_gathered(*experts)
    if (product := grouped_product(h, gate_up, down)) is not None:
        return x + experts_grouped(*experts, product)
    return x + experts_by_expert(*experts)


def experts_gathered(h: Tensor, weights: Tensor, chosen: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """moe()'s experts' weighted sum [N, H] for rows h [N, H], each row's top-k experts chosen [N, k]
    with weights [N, k]: the chosen experts' weights gathered (a copy), in two batched products."""
    N, top_k = chosen.shape
    rows = h.repeat_interleave(top_k, dim=0)[:, None]  # [N k, 1, H]
    flat = chosen.flatten()
    gate, up = torch.bmm(rows, gate_up.index_select(0, flat)).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, down.index_select(0, flat))  # [N k, 1, H]
    return (y.view(N, top_k, -1) * weights[..., None]).sum(1)


def experts_grouped(h: Tensor, weights: Tensor, chosen: Tensor, gate_up: Tensor, down: Tensor, product) -> Tensor:
    """experts_gathered's sum by torch's grouped products (grouped_product()): the (row, expert) pairs
    sorted by expert, each expert's weights read once for its rows, in place."""
    N, top_k = chosen.shape
    experts, order = chosen.flatten().sort(stable=True)  # the pairs grouped by expert
    # [E] each expert's end among them (not bincount: on CUDA it reads its input's maximum on the host)
    ends = torch.searchsorted(experts, torch.arange(gate_up.shape[0], device=h.device), right=True, out_int32=True)
    gate, up = product(h.index_select(0, order // top_k), gate_up, offs=ends).chunk(2, dim=-1)
    y = product(F.silu(gate) * up, down, offs=ends)  # [N k, H] in expert order
    y = torch.empty_like(y).index_copy_(0, order, y)  # back in row order (a permutation: no atomic adds)
    return (y.view(N, top_k, -1) * weights[..., None]).sum(1)


def experts_by_expert(h: Tensor, weights: Tensor, chosen: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """experts_gathered's sum expert by expert over the rows that chose each (the experts read on the host)."""
    out = torch.zeros_like(h)
    for e in chosen.unique().tolist():
        row, slot = (chosen == e).nonzero(as_tuple=True)
        gate, up = (h[row] @ gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, row, (F.silu(gate) * up) @ down[e] * weights[row, slot, None])
    return out


# Where moe() hands many rows to torch's grouped product, by device: CUDA's bf16 kernels (no host read;
# grouped_product() says on which GPUs).
# Not a CPU's: there it ran slower than the loop over experts for a prefill's rows (2,048 rows:
# docs/results.md, scripts/bench_moe.py), and the loop's host read costs a CPU nothing.
GROUPED_DTYPES = {"cuda": (torch.bfloat16,)}


def grouped_product(h: Tensor, *experts: Tensor):
    """torch's grouped product (rows [M, in] sorted by expert, weights [E, in, out], offs: each
    expert's end) where moe() takes it for these tensors (GROUPED_DTYPES), every stride in
    multiples of 16 bytes as its kernels need; None elsewhere (moe() then goes expert by expert). On
    CUDA only at compute capability 9 and 10 (Hopper, Blackwell): elsewhere torch falls back to a
    product per expert after reading the ends on the host (its _grouped_mm_fallback), and so on ROCm."""
    product = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if product is None or h.dtype not in GROUPED_DTYPES.get(h.device.type, ()):
        return None
    if h.device.type == "cuda" and (torch.version.hip or torch.cuda.get_device_capability(h.device)[0] not in (9, 10)):
        return None
    # (the weights' strides, and their dims: the rows' and the activations' strides, H and I)
    steps = [s for t in experts for s in (*t.stride(), *t.shape[-2:]) if s != 1]
    if any(t.dtype != h.dtype or t.data_ptr() % 16 for t in experts) or any(s * h.element_size() % 16 for s in steps):
        return None
    return product


class Linear(nn.Module):
    """Holds a weight stored [in, out] (+ bias), and on request the copy a CPU's products of a few
    rows read (Weights.of, linear()); the decoder calls linear() on them directly."""

    def __init__(self, n_in: int, n_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None
        self.register_buffer("weight_t", None, persistent=False)
        self.register_buffer("weight_packed", None, persistent=False)

    @property
    def params(self) -> Weights:
        return Weights(self.weight, self.weight_t, self.bias, self.weight_packed)

    def keep_cpu_copy(self, bf16: bool = False) -> None:
        """bf16: the kernel's copy in bf16 (the weight's values must be bf16's: Decoder.bf16_weights)."""
        _, self.weight_t, _, self.weight_packed, _ = Weights.from_matrix(self.weight, cpu_copy=True, bf16=bf16)

    @property
    def cpu_copy(self) -> bool:
        """Whether keep_cpu_copy() ran."""
        return self.weight_t is not None or self.weight_packed is not None

    def forward(self, x: Tensor) -> Tensor:
        return linear(x.reshape(-1, x.shape[-1]), self.params).view(*x.shape[:-1], -1)


class Block(nn.Module):
    """One pre-norm layer's weights: x + attn(norm(x)), then x + mlp(norm(x)) (the functions above);
    moe: the MLP is the config's experts and their router (moe())."""

    def __init__(self, cfg: DecoderConfig, moe: bool = False):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(2 * cfg.hidden_size))  # [w, w], see rms_norm
        self.qkv = Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.qkv_bias)
        self.o = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias)
        self.mlp_norm = nn.Parameter(torch.ones(2 * cfg.hidden_size))
        self.router: Linear | None = None
        if moe:
            E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size  # noqa: E741
            self.router = Linear(H, E)
            self.experts_gate_up = nn.Parameter(torch.empty(E, H, 2 * I))
            self.experts_down = nn.Parameter(torch.empty(E, I, H))
            self.top_k, self.renorm = cfg.experts_per_token, cfg.norm_topk_prob
        else:
            self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
            self.down = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)
        # Qwen3: each query and key head RMS-normalized before rope ([q, k] weights, each doubled)
        self.qk_norm = nn.Parameter(torch.ones(2, 2 * cfg.head_dim)) if cfg.qk_norm else None

    @property
    def attn_weights(self) -> tuple[Tensor, Weights, Weights]:
        qkv = self.qkv.params if self.qk_norm is None else self.qkv.params._replace(norms=self.qk_norm)
        return self.attn_norm, qkv, self.o.params

    @property
    def mlp_weights(self) -> tuple[Tensor, Weights, Weights]:
        return self.mlp_norm, self.gate_up.params, self.down.params

    @property
    def mlp_params_read(self) -> int:
        """The MLP's parameters one token's step reads: all of a dense one; the router and the chosen
        experts of a mixture of experts."""
        if self.router is None:
            return self.gate_up.weight.numel() + self.down.weight.numel()
        per_expert = self.experts_gate_up[0].numel() + self.experts_down[0].numel()
        return self.router.weight.numel() + self.top_k * per_expert

    def feed_forward(self, x: Tensor, ffn=mlp) -> Tensor:  # noqa: ANN001
        """x + this layer's MLP: ffn (mlp() or its compiled version) of the dense weights, or moe()."""
        if self.router is None:
            return ffn(x, *self.mlp_weights, self.eps)
        w = (self.router.params, self.experts_gate_up, self.experts_down)
        return moe(x, self.mlp_norm, *w, self.top_k, self.renorm, self.eps)


def experts_state_dict(cfg: DecoderConfig, sd: dict[str, Tensor], m: str, o: str, prep) -> dict[str, Tensor]:
    """A Qwen3-MoE layer's router and experts (keys under `m`, the layer's "mlp.") as a Block's:
    router [H, E], experts_gate_up [E, H, 2I], experts_down [E, I, H]. From checkpoints as saved,
    one module per expert (experts.{e}.gate_proj...), or as transformers holds them in memory,
    stacked (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    if m + "experts.gate_up_proj" in sd:
        gate_up, down = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
    else:
        e = [f"{m}experts.{i}." for i in range(cfg.num_experts)]
        gate_up = torch.stack([torch.cat([sd[x + "gate_proj.weight"], sd[x + "up_proj.weight"]]) for x in e])
        down = torch.stack([sd[x + "down_proj.weight"] for x in e])
    return {
        o + "router.weight": prep(sd[m + "gate.weight"].t()),
        o + "experts_gate_up": prep(gate_up.transpose(1, 2)),
        o + "experts_down": prep(down.transpose(1, 2)),
    }


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
    }
    if m + "gate.weight" in sd:
        own |= experts_state_dict(cfg, sd, m, o, prep)
    else:
        own[o + "gate_up.weight"] = prep(torch.cat([sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]).t())
        own[o + "down.weight"] = prep(sd[m + "down_proj.weight"].t())
    if cfg.qk_norm:  # [D] each, in the heads' interleaved order (the norm's mean is the same in any order)
        qn, kn = (interleave_rope_dims(sd[a + n], 1, cfg.head_dim) for n in ("q_norm.weight", "k_norm.weight"))
        own[o + "qk_norm"] = prep(torch.stack([torch.cat([qn, qn]), torch.cat([kn, kn])]))
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
