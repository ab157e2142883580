"""Compiled kernels for a few rows on a CPU (decode, verify and draft steps): products and sublayers.

A decode step multiplies one row by every weight matrix, so it is bound by reading the weights. MKL
computes a one-row fp32 product on one core, and its products of 2-16 rows re-read the weight for
every few rows (docs/cpu-backend.md). `csrc/skinny.c` streams each weight once, split over torch's
own OpenMP threads, for 1 to max_rows() rows, from a copy packed in panels of output columns
(pack(): for each k, the panel's columns of W side by side, multiplied by x[k] broadcast: an outer
product; fp32, or bf16 for a drafter's weights), up to 12 rows a pass from registers, the stream
prefetched ahead while the rows' multiply-adds run, so up to ~12 rows cost about what one row costs
and a prompt's prefill beats MKL's GEMM up to max_rows() rows. It sums every output in one fixed
order whatever the row count: row for row, a verify step's products (and a prefill's) are bitwise
those of a decode step. scripts/bench_cost.py measures it against torch's products.

`csrc/layers.c` runs a whole attention or MLP sublayer of such a step in one call (norm, products,
rope, cache write, attention, gated activation), where torch dispatches some twenty small ops whose
overhead is a large share of a small model's decode step, and a one-sequence step's whole layer
stack in one call (decoder_layers(), from a LayerStack of pointers taken once); it keeps the same
row-for-row guarantee. The core reaches these through the package's interface (cpu/__init__.py):
a decoder's steps (DecoderKernel: decoder_layers()), layers.attention(), self_attention() and mlp()
rows otherwise (sublayer_usable()), an EAGLE-3 drafter's draft step (eagle3_rows()) and its whole
tree draft (eagle3_draft()). `csrc/argmax.c` takes greedy decoding's argmax of the logits (argmax(),
sampling.argmax) in one pass. Every change, measured: docs/log/cpu-kernel.md. build.py compiles
and loads them; the package's __init__ is what the rest of the runtime calls.

A model's packed weights live side by side in one mapping on 2 MiB pages (on_huge_pages(): Linux's
transparent huge pages, asked for with madvise), not 4 KiB ones: a decode step of the bundled target
reads 547 MB, ~134,000 small pages a step; on 2 MiB pages a plain stream read 5-10% faster here and
a decode step ran 2-5% faster. SPECDEC_HUGE_PAGES=0 keeps them in torch's memory.
"""

import contextlib
import ctypes
import functools
import mmap
import os
from typing import NamedTuple

import torch
from torch import Tensor

from specdec_runtime.cpu.build import library, max_rows, pairs, panel

HUGE = "SPECDEC_HUGE_PAGES"  # 0: on_huge_pages() keeps tensors where they are
HUGE_PAGE = 2 << 20
_enabled = True  # see disabled()
_sublayers = True  # see products_only()


@contextlib.contextmanager
def disabled():
    """torch's products inside this block (benchmarks and tests compare the two); models loaded
    inside it keep W^T for them (packs())."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


@contextlib.contextmanager
def products_only():
    """The kernel's products but torch's other ops inside this block: the sublayers as before
    layers.c (benchmarks compare the three paths)."""
    global _sublayers
    before, _sublayers = _sublayers, False
    try:
        yield
    finally:
        _sublayers = before


def _serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel computes products of this device and dtype here: fp32 on a CPU, on and built."""
    return _enabled and torch.device(device).type == "cpu" and dtype == torch.float32 and library() is not None


def usable(x: Tensor) -> bool:
    """Whether linear() hands x's product to the kernel: few rows it serves (_serves), no autograd,
    not under torch.compile (which traces torch's ops)."""
    return _takes(x.device, x.dtype, x.shape[0])


def _takes(device: torch.device, dtype: torch.dtype, rows: int) -> bool:
    """usable() for rows of this device and dtype."""
    return (
        not torch.compiler.is_compiling()  # first: what follows asks the library (ctypes), which it cannot trace
        and not torch.is_grad_enabled()
        and _serves(device, dtype)  # before max_rows(): a GPU's rows never load the library
        and rows <= max_rows()
    )


def products(device: torch.device, dtype: torch.dtype) -> str:
    """Which products a model on device/dtype runs for its decode and verify steps (benchmarks
    record it): "kernel" or "torch"."""
    return "kernel" if _serves(device, dtype) else "torch"


def packs(w: Tensor) -> bool:
    """Whether a model keeps W [in, out] packed for the kernel (Weights.from_matrix): fp32 on a CPU, the
    kernel built and not disabled(). (A model loaded inside disabled() keeps W^T for MKL instead,
    as it would without the kernel: what benchmarks compare against.)"""
    return _serves(w.device, w.dtype)


def reads_bf16_weights(device: torch.device) -> bool:
    """Whether a bf16 model on `device` runs as its bf16 weights in the kernel, with fp32
    activations (model.Decoder.from_hf_state_dict): a CPU where the kernel computes fp32 products.
    Its products read half the bytes of fp32 weights, widened exactly, so a decode step runs at
    about twice the fp32 speed on any CPU, where torch's bf16 ops ran at a quarter of the memory
    bound even on a CPU with AVX512-BF16 (scripts/bench_cost.py)."""
    return _serves(device, torch.float32)


def pack(w: Tensor, bf16: bool = False, width: int | None = None, pairs: bool = False) -> Tensor:
    """W [K, N] (in, out) as skinny.c reads it: in panels of `width` output columns (default: the
    kernel's panel()), each [K, width], N padded to a multiple of width with zero columns: [ceil(N /
    width), K, width], streamed once in order by a product. fp32, or rounded to bf16 (half the bytes,
    widened exactly in the kernel: for a drafter, whose weights need not be exact). pairs (bf16, K
    even, where the kernel multiplies them: pairs()): each panel [K / 2, width, 2], k = 2i and 2i + 1
    of an output side by side, multiplied by rows rounded to bf16 (a drafter's, the lm_head's screen)."""
    width = width or panel()
    K, N = w.shape
    padded = torch.nn.functional.pad(w.detach(), (0, -N % width))
    if pairs:
        if not bf16 or K % 2:
            raise ValueError(f"pack: pairs need bf16 and an even K, got bf16={bf16}, K={K}")
        return padded.view(K // 2, 2, -1, width).permute(2, 0, 3, 1).contiguous().to(torch.bfloat16)
    packed = padded.view(K, -1, width).permute(1, 0, 2).contiguous()
    return packed.to(torch.bfloat16) if bf16 else packed


def on_huge_pages(tensors: list[Tensor]) -> list[Tensor]:
    """Copies of these CPU tensors side by side (each at a 4 KiB boundary) in one anonymous mapping
    that Linux backs with 2 MiB pages (transparent huge pages, madvise before the first write), for
    the weights a step streams (Decoder.keep_cpu_copies): far fewer page translations a step, and
    the hardware prefetcher's streams, which stop at a page's end, run on. Each copy keeps the
    mapping alive. The tensors themselves where that cannot help or is not available: less than a
    page in all, not on the CPU, not Linux, or SPECDEC_HUGE_PAGES=0. (Where THP is off, the mapping
    is one of plain pages: no slower than torch's.)"""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 4096) * 4096
    if (
        total < HUGE_PAGE
        or os.environ.get(HUGE, "1") == "0"
        or any(t.device.type != "cpu" for t in tensors)
        or not hasattr(mmap, "MADV_HUGEPAGE")
    ):
        return tensors
    # A length of whole huge pages: Linux starts such a mapping at a huge page's boundary. One page
    # more, so the copies can start at a boundary where it does not (that page is never touched).
    length = -(-total // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    try:
        mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return tensors
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive, as do its views
    start = -raw.data_ptr() % HUGE_PAGE
    copies = []
    for t, at in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        copy = raw[start + at : start + at + n].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t))
    return copies


def matmul(x: Tensor, w: tuple, residual: Tensor | None = None) -> Tensor:
    """x [M, K] @ W (+ bias [N]) (+ residual [M, N]) from a Weights' packed copy, fp32 on a CPU (usable(x))."""
    x = x.contiguous()
    M, K = x.shape
    N = w.w.shape[1]
    if w.w.shape[0] != K or w.packed is None or w.packed.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"matmul: need packed float32 or bf16 weights for [{M}, {K}] rows, got W {tuple(w.w.shape)}")
    if residual is not None:
        residual = residual.expand(M, N).contiguous()  # a copy where it is not: kept alive through the call
    y = _out(M, N)
    res, bias = _ptr(residual), _ptr(w.bias)
    library().skinny_matmul(x.data_ptr(), M, K, w.packed.data_ptr(), _bf16(w), N, bias, res, y.data_ptr(), _threads())
    return y


def stream_sum(x: Tensor) -> float:
    """The sum of fp32 x (contiguous, numel a multiple of 32) read as one plain stream over torch's
    threads: the read bandwidth benchmarks hold products to (scripts/bench_cost.py)."""
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() % 32:
        raise ValueError("stream_sum: need a contiguous float32 tensor of a multiple of 32 elements")
    return library().stream_sum(x.data_ptr(), x.numel(), _threads())


def serves_argmax(x: Tensor) -> bool:
    """Whether argmax() takes these logits: fp32 on a CPU where the kernel serves (not under
    torch.compile, which traces torch's ops)."""
    return not torch.compiler.is_compiling() and x.dim() > 0 and x.shape[-1] > 0 and _serves(x.device, x.dtype)


def argmax(x: Tensor) -> Tensor:
    """x.argmax(-1) of logits x [..., V] (serves_argmax), the index torch gives: the first of equal
    maxima, the first NaN where a row has one (csrc/argmax.c)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.long)
    if rows.shape[0]:
        library().argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), out.data_ptr(), _threads())
    return out.view(x.shape[:-1])


def _threads() -> int:
    return torch.get_num_threads()


def _bf16(*weights: tuple) -> int:
    """How these Weights (of one call) are packed: 0 in fp32, 1 in bf16, 2 in bf16 pairs (pack())."""
    kinds = {(w.packed.dtype, w.packed.dim()) for w in weights}
    if len(kinds) != 1:
        raise ValueError(f"the CPU kernel needs one packed layout per call, got {sorted(map(str, kinds))}")
    dtype, dim = kinds.pop()
    return 0 if dtype != torch.bfloat16 else 2 if dim == 4 else 1


def _out(*shape: int) -> Tensor:
    """An output buffer the kernel writes: fp32 in CPU memory, whatever torch's default dtype or device."""
    return torch.empty(*shape, dtype=torch.float32, device="cpu")


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _attention_args(
    caller: str, kv: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """slots and mask as layers.c reads them (contiguous rows), after checking kv, cos and sin."""
    if not kv.is_contiguous() or cos.stride(-1) != 1 or sin.stride(0) != cos.stride(0):
        raise ValueError(f"{caller}: kv must be contiguous and cos / sin rows share one stride")
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    return slots.contiguous(), mask


def _ran(status: int) -> None:
    if status != 0:
        raise MemoryError("the CPU kernel could not allocate its scratch buffer")


def stack_usable(x: Tensor) -> bool:
    """Whether rows x [T, H] of one sequence can run a whole layer stack in the kernel (with packed
    weights: cpu.DecoderKernel): usable(x) and sublayers on."""
    return stack_takes(x.device, x.dtype, x.shape[0])


def stack_takes(device: torch.device, dtype: torch.dtype, rows: int) -> bool:
    """stack_usable() for `rows` rows of this device and dtype (a forward's tokens, before their
    embedding: the kernel gathers it)."""
    return _sublayers and _takes(device, dtype, rows)


def sublayer_usable(x: Tensor, B: int, *weights: tuple) -> bool:
    """Whether a sublayer of rows x [B*T, in] runs in the kernel (layers.c): usable(x), batch 1,
    and every weight (layers.Weights) kept packed, without q/k norms (layers.c has none)."""
    return _sublayers and B == 1 and all(w.packed is not None and w.norms is None for w in weights) and usable(x)


def attention(
    x: Tensor,
    norm: Tensor | None,
    eps: float,
    residual: Tensor,
    qkv: tuple,
    o: tuple,
    cos: Tensor,
    sin: Tensor,
    kv: Tensor,
    slots: Tensor,
    mask: Tensor | None,
    bound: int,
) -> Tensor:
    """layers.self_attention(norm(x) or x, residual, ...) for one sequence (sublayer_usable): keys and
    values written into kv [1, 2Hkv, S, D] at slots [T], attention over the first `bound` slots under
    mask [group * T, bound] (its first T rows are read; None: all of them)."""
    x, residual = x.contiguous(), residual.contiguous()
    M, K = x.shape
    D, S, Hkv = kv.shape[-1], kv.shape[-2], kv.shape[1] // 2
    H = qkv.w.shape[1] // D - 2 * Hkv
    Hd = o.w.shape[1]
    slots, mask = _attention_args("attention", kv, cos, sin, slots, mask)
    out = _out(M, Hd)
    # fmt: off
    _ran(library().attention_block(
        x.data_ptr(), M, K, _ptr(norm), eps, residual.data_ptr(),
        qkv.packed.data_ptr(), _bf16(qkv, o), _ptr(qkv.bias), H, Hkv, D, o.packed.data_ptr(), _ptr(o.bias), Hd,
        cos.data_ptr(), sin.data_ptr(), cos.stride(0), kv.data_ptr(), S, slots.data_ptr(),
        _ptr(mask), 0 if mask is None else mask.stride(0), bound, out.data_ptr(), _threads(),
    ))
    # fmt: on
    return out


def mlp(x: Tensor, norm: Tensor, eps: float, gate_up: tuple, down: tuple) -> Tensor:
    """layers.mlp(x, ...) (sublayer_usable): x + down(silu(gate) * up) of norm(x) [T, H]."""
    x = x.contiguous()
    M, Hd = x.shape
    intermediate = down.w.shape[0]
    out = _out(M, Hd)
    # fmt: off
    _ran(library().mlp_block(
        x.data_ptr(), M, Hd, norm.data_ptr(), eps, gate_up.packed.data_ptr(), _bf16(gate_up, down), _ptr(gate_up.bias),
        intermediate,
        down.packed.data_ptr(), _ptr(down.bias), out.data_ptr(), _threads(),
    ))
    # fmt: on
    return out


class LayerStack(NamedTuple):
    """A decoder's layers as layers.c's decoder_layers reads them: every layer's weights' pointers,
    PER_LAYER (10) a layer, built once (stack()); `storages` keeps the memory they point at alive,
    even where a tensor's storage is later swapped (`param.data = ...`)."""

    pointers: ctypes.Array
    bf16: int
    storages: list


def stack(layers: list[tuple]) -> LayerStack | None:
    """The LayerStack of layers [(attn_norm, qkv, o, mlp_norm, gate_up, down)] (layers.Weights), or None
    where a weight is not packed."""
    weights = [w for layer in layers for w in layer if not isinstance(w, Tensor)]  # the norms aside
    if not all(w.packed is not None and getattr(w, "norms", None) is None for w in weights):
        return None  # (q/k norms: layers.c has none; torch's ops run such layers)
    tensors = []
    for attn_norm, qkv, o, mlp_norm, gate_up, down in layers:
        tensors += [attn_norm, qkv.packed, qkv.bias, o.packed, o.bias, mlp_norm, gate_up.packed, gate_up.bias]
        tensors += [down.packed, down.bias]
    pointers = (ctypes.c_void_p * len(tensors))(*map(_ptr, tensors))
    return LayerStack(pointers, _bf16(*weights), [t.untyped_storage() for t in tensors if t is not None])


@functools.lru_cache(maxsize=256)
def _layer_arrays(first: int, last: int, skip: tuple, taps: tuple) -> tuple[ctypes.Array, ctypes.Array, int]:
    """decoder_layers' flags and tap_at arrays (and the number of taps), built once per layer plan:
    a decode step's Python runs cold after the weights' stream, each object it builds costs."""
    layers = range(first, last + 1)
    flags = (ctypes.c_int * len(layers))(*((i in skip[0]) + 2 * (i in skip[1]) for i in layers))
    tapped = sorted(set(taps))
    tap_at = (ctypes.c_long * len(layers))(*(tapped.index(i) if i in tapped else -1 for i in layers))
    return flags, tap_at, len(tapped)


def decoder_layers(
    s: LayerStack,
    x: Tensor,
    first: int,
    last: int,
    skip: tuple[frozenset[int], frozenset[int]],
    taps: tuple[int, ...],
    dims: tuple[int, int, int, int],
    eps: float,
    cos: Tensor,
    sin: Tensor,
    kv: Tensor,
    slots: Tensor,
    mask: Tensor | None,
    bound: int,
    head: tuple[Tensor, tuple] | None = None,
    keep: int = 0,
    embed: Tensor | None = None,
    screen: "HeadScreen | None" = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Layers [first, last) of a decoder (model.Decoder._forward) on rows x [T, Hd] of one sequence
    (stack_usable), in one call: (x after them, the taps' residual streams side by side [T, taps *
    Hd] or None, the logits or None, their argmax or None). x may instead be token ids [T], with
    embed the embedding table in panels [V / P, Hd, P] (model.Decoder.embedding_panels): the
    kernel gathers their rows. skip: (attention, MLP) layer sets skipped; dims: (H, Hkv, D,
    intermediate); kv: the whole cache [L, 1, 2Hkv, S, D]; the rest as attention(). head: (the
    final norm's doubled weight, the lm_head's Weights, packed) to also compute the logits [R, V]
    of the last R = keep rows (all where keep is 0) and their argmax [R] (argmax()'s) in the same
    call. screen: the head's screen (head_screen()) to compute only the argmax, exactly, reading
    half the head's bytes; the logits are then None."""
    H, Hkv, D, intermediate = dims
    tokens = x.contiguous() if embed is not None else None
    M, Hd = (tokens.shape[0], embed.shape[1]) if tokens is not None else x.shape
    x = _out(M, Hd) if tokens is not None else x.contiguous().clone()
    if screen is not None and (head is None or _bf16(head[1])):
        raise ValueError("decoder_layers: a screen needs an fp32 head")
    P, es0, es1, es2 = (embed.shape[2], *embed.stride()) if embed is not None else (1, 0, 0, 0)
    slots, mask = _attention_args("decoder_layers", kv, cos, sin, slots, mask)
    flags, tap_at, ntaps = _layer_arrays(first, last, (frozenset(skip[0]), frozenset(skip[1])), tuple(taps))
    out = _out(M, ntaps * Hd) if ntaps else None
    norm, lm_head = head if head is not None else (None, None)
    V, keep = (0 if lm_head is None else lm_head.w.shape[1]), (keep if 0 < keep < M else 0)
    logits = None if lm_head is None else _out(keep or M, V)
    best = None if lm_head is None else torch.empty(keep or M, dtype=torch.long)
    # fmt: off
    _ran(library().decoder_layers(
        x.data_ptr(), _ptr(tokens), _ptr(embed), P, es0, es1, es2, M, Hd, first, last, s.pointers, s.bf16, flags,
        eps, H, Hkv, D, intermediate, kv.data_ptr(), kv.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
        kv.shape[-2], slots.data_ptr(), _ptr(mask), 0 if mask is None else mask.stride(0), bound, tap_at, _ptr(out),
        ntaps, _ptr(norm), None if lm_head is None else lm_head.packed.data_ptr(),
        0 if lm_head is None else _bf16(lm_head), *((None, 0, None) if screen is None else screen.args()), V, keep,
        _ptr(logits), _ptr(best), _threads(),
    ))
    # fmt: on
    return x, out, None if screen is not None else logits, best


def head_rows(x: Tensor, norm: Tensor, eps: float, head: tuple) -> Tensor:
    """The logits [M, V] of rows x [M, H] (usable(x)): head(norm(x)) as decoder_layers computes them
    with its head, so that a forward whose layers ran apart (a batch's, sublayer by sublayer) gets
    bitwise the logits of one whose head ran in the stack's call. norm: the doubled weight [2H];
    head: the lm_head's packed Weights."""
    x = x.contiguous()
    M, H = x.shape
    logits = _out(M, head.w.shape[1])
    _ran(library().head_rows(x.data_ptr(), M, H, norm.data_ptr(), eps, head.packed.data_ptr(), _bf16(head),
                            head.w.shape[1], logits.data_ptr(), _threads()))  # fmt: skip
    return logits


class HeadScreen(NamedTuple):
    """An fp32 lm_head as decoder_layers reads it to find a row's argmax exactly from about half its
    bytes (layers.c: head_part; head_screen())."""

    packed: Tensor  # the head in bf16: pack()'s panels, or [panels, K / 2, panel, 2] where pairs
    pairs: bool  # multiplied in bf16 pairs, the rows rounded to bf16 too (AVX512-BF16: skinny.c's screen_part)
    norms: Tensor  # [V + 1] fp32: each output's weights' 2-norm, rounded up; then the largest

    def args(self) -> tuple:
        return self.packed.data_ptr(), int(self.pairs), self.norms.data_ptr()


def head_screen(head: tuple) -> HeadScreen:
    """The HeadScreen of an fp32 head (the lm_head's packed Weights): its weights rounded to bf16, in
    pairs where the kernel multiplies them (pairs(), an even K), and its outputs' norms."""
    w = head.w.detach()
    norms = w.double().norm(dim=0)  # [V] ||w_v||: the weights of output v are column v of W [K, V]
    norms = torch.cat([norms, norms.max().view(1)])
    up = norms.float()
    up = torch.where(up.double() < norms, torch.nextafter(up, torch.tensor(float("inf"))), up)
    in_pairs = pairs() and w.shape[0] % 2 == 0
    return HeadScreen(pack(w, bf16=True, pairs=in_pairs), in_pairs, up)


class Eagle3Weights(NamedTuple):
    """An EAGLE-3 drafter's tensors as layers.c's eagle3_rows reads them: E3_WEIGHTS (14) pointers
    in its order, built once (eagle3_weights()); `tensors` keeps the memory they point at alive."""

    pointers: ctypes.Array
    bf16: int
    vocab: int  # the draft vocabulary: the head's outputs
    tensors: tuple


def eagle3_weights(fc: tuple, input_norm: Tensor, hidden_norm: Tensor, qkv: tuple, o: tuple, post_norm: Tensor,
                   gate_up: tuple, down: tuple, norm: Tensor, head: tuple) -> Eagle3Weights | None:  # fmt: skip
    """The Eagle3Weights of a drafter's fused layer (eagle3.FusedLayer; norms doubled), or None where
    a weight is not packed or the kernel is not built."""
    weights = (fc, qkv, o, gate_up, down, head)
    if library() is None or not all(w.packed is not None for w in weights):
        return None
    tensors = (fc.packed, input_norm, hidden_norm, qkv.packed, qkv.bias, o.packed, o.bias, post_norm,
               gate_up.packed, gate_up.bias, down.packed, down.bias, norm, head.packed)  # fmt: skip
    if any(t is not None and not t.is_contiguous() for t in tensors):
        return None
    pointers = (ctypes.c_void_p * len(tensors))(*map(_ptr, tensors))
    return Eagle3Weights(pointers, _bf16(*weights), head.w.shape[1], tensors)


def eagle3_rows(
    w: Eagle3Weights,
    tokens: Tensor,
    embed: Tensor,
    inputs: Tensor,
    project: bool,
    dims: tuple[int, int, int, int, int],
    eps: float,
    norm_before_residual: bool,
    head_from: int,
    rope: Tensor,
    first: int,
    step: int,
    kv: Tensor,
    slots: Tensor,
    mask: Tensor | None,
    bound: int,
) -> tuple[Tensor, Tensor]:
    """An EAGLE-3 drafter's step for rows of one sequence in one call (eagle3.Eagle3Drafter._run):
    (prenorm [M, H], draft logits [M - head_from, N] of rows head_from..). tokens [M] (ids);
    embed: the target's embedding in panels [V / P, H, P], token t at [t // P, :, t % P] (any
    strides; model.Decoder.embedding_panels); inputs: the target's taps [M, Kt] to project
    with fc (project) or the previous step's prenorm [M, H]; dims: (H, heads, kv heads, head dim,
    intermediate); rope [S, 2, D] (layers.rope_table), row m at position first + m * step; kv the
    drafter's cache [1, 2Hkv, S, D]; slots, mask, bound as attention()."""
    H, Hq, Hkv, D, intermediate = dims
    if embed.dtype != torch.float32 or inputs.dtype != torch.float32:
        raise ValueError(f"eagle3_rows: need a float32 embedding and inputs, got {embed.dtype} and {inputs.dtype}")
    tokens, inputs = tokens.contiguous(), inputs.contiguous()
    M, N = tokens.shape[0], w.vocab
    cos, sin = rope[first, 0], rope[first, 1]
    slots, mask = _attention_args("eagle3_rows", kv, cos, sin, slots, mask)
    prenorm, logits = _out(M, H), _out(max(M - head_from, 0), N)
    taps, feature = (inputs, None) if project else (None, inputs)
    # fmt: off
    _ran(library().eagle3_rows(
        tokens.data_ptr(), M, embed.data_ptr(), embed.shape[2], *embed.stride(), _ptr(taps), inputs.shape[1],
        _ptr(feature), w.pointers, w.bf16, int(norm_before_residual), eps, H, Hq, Hkv, D, intermediate, N, head_from,
        cos.data_ptr(), sin.data_ptr(), step * rope.stride(0), kv.data_ptr(), kv.shape[-2], slots.data_ptr(),
        _ptr(mask), 0 if mask is None else mask.stride(0), bound, prenorm.data_ptr(), logits.data_ptr(), _threads(),
    ))
    # fmt: on
    return prenorm, logits


def eagle3_draft(
    w: Eagle3Weights,
    tokens: Tensor,
    taps: Tensor,
    first: int,
    draft_ids: Tensor,
    levels: int,
    K: int,
    budget: int,
    embed: Tensor,
    dims: tuple[int, int, int, int, int],
    eps: float,
    norm_before_residual: bool,
    rope: Tensor,
    kv: Tensor,
) -> list[tuple[int, int, int]]:
    """An EAGLE-2 tree draft in one call (eagle3.Eagle3Drafter._draft on a CPU): the catch-up rows
    (tokens [M], the accepted positions' taps [M, Kt] at positions first..first + M - 1, causal),
    the tree's levels from the newest row (eagle3_tree), then its `budget` best nodes, in the order
    Eagle3Drafter._best takes them: (parent's place in the list or -1, rank among its siblings,
    draft id) each. The rest as eagle3_rows and eagle3_tree."""
    H, Hq, Hkv, D, intermediate = dims
    if embed.dtype != torch.float32 or taps.dtype != torch.float32:
        raise ValueError(f"eagle3_draft: need a float32 embedding and taps, got {embed.dtype} and {taps.dtype}")
    if not kv.is_contiguous() or rope.stride(-1) != 1:
        raise ValueError("eagle3_draft: kv and rope must be contiguous")
    tokens, taps = tokens.contiguous(), taps.contiguous()
    out = torch.empty(3 * budget, dtype=torch.long)
    # fmt: off
    n = library().eagle3_draft(
        tokens.data_ptr(), tokens.shape[0], taps.data_ptr(), taps.shape[1], first, embed.data_ptr(), embed.shape[2],
        *embed.stride(), w.pointers, w.bf16, int(norm_before_residual), eps, H, Hq, Hkv, D, intermediate, w.vocab,
        rope[0, 0].data_ptr(), rope[0, 1].data_ptr(), rope.stride(0), kv.data_ptr(), kv.shape[-2],
        draft_ids.data_ptr(), levels, K, budget, out.data_ptr(), _threads(),
    )
    # fmt: on
    _ran(0 if n >= 0 else -1)
    flat = out[: 3 * n].tolist()
    return [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, 3 * n, 3)]
