"""The optional native CPU backend: compiled kernels for the few-row steps of decoding on a CPU.

The runtime's core is pure PyTorch. On a CPU, where batch-1 decoding is bound by reading the
weights and by per-op dispatch, this backend streams each packed weight once over all cores and
runs a whole sublayer, layer stack or EAGLE-3 draft in one call (kernel.py; how and why:
docs/cpu-backend.md). This module is all the core sees of it: what a model keeps at load, and
steps that return None where the backend does not take them, so the core runs torch's ops then.

    packed = cpu.pack(w)                          # at load: W [in, out] as the kernel reads it, or None
    y = cpu.matmul(x, weights, residual)          # a step's product, or None: torch's instead
    native = cpu.DecoderKernel(layers, norm, lm_head)  # a decoder's layer stack in one call (model.Decoder.native)
    if native.takes(rows): h, hidden, logits, greedy = native.run(...)
    drafter_kernel = cpu.Eagle3Kernel.from_layer(fused_layer, ...)  # an EAGLE-3 drafter's steps and tree draft

Where the kernel cannot be built or is turned off (SPECDEC_CPU_KERNEL=0; build.py says why), every
step returns None and nothing is packed: the core runs as on any other device. A CPU's rounds are
verified over host lists (host_rules.py), the kernel built or not.
"""

import torch
from torch import Tensor

from specdec_runtime.cpu import kernel
from specdec_runtime.cpu.build import PREFILL_CHUNK
from specdec_runtime.cpu.kernel import disabled, on_huge_pages, products, products_only, reads_bf16_weights

__all__ = [
    "PREFILL_CHUNK", "DecoderKernel", "Eagle3Kernel", "argmax", "attention", "bf16_layout", "disabled", "head_rows",
    "matmul", "max_rows", "mlp", "on_huge_pages", "pack", "products", "products_only", "reads_bf16_weights",
]  # fmt: skip


def max_rows() -> int:
    """The most rows of one sequence a kernel call takes (a step, a prefill chunk)."""
    return kernel.max_rows()


def pack(w: Tensor, bf16: bool = False, pairs: bool = False) -> Tensor | None:
    """W [in, out] in the kernel's layout (kernel.pack; bf16: rounded to bf16, pairs: in bf16 pairs),
    or None where the kernel does not take W (not fp32 on a CPU, not built, disabled())."""
    return kernel.pack(w, bf16, pairs=pairs) if kernel.packs(w) else None


def bf16_layout(weights: list[Tensor]) -> tuple[bool, bool]:
    """How a drafter's weight matrices [in, out] can be packed in bf16: (bf16, pairs). bf16 where the
    kernel packs every one; pairs where it also multiplies bf16 pairs (AVX512-BF16) and every K is even."""
    bf16 = all(kernel.packs(w) for w in weights)
    return bf16, bf16 and kernel.pairs() and all(w.shape[0] % 2 == 0 for w in weights)


def matmul(x: Tensor, w, residual: Tensor | None = None) -> Tensor | None:
    """x [M, in] @ W (+ bias) (+ residual) for layers.Weights w with a packed copy, or None where the
    kernel does not take x (too many rows, autograd, torch.compile)."""
    return kernel.matmul(x, w, residual) if w.packed is not None and kernel.usable(x) else None


def attention(x, B, norm, eps, residual, qkv, o, cos, sin, kv, slots, mask, bound) -> Tensor | None:
    """layers.self_attention of rows x [B*T, in] (normalized first where norm is given) in one call,
    or None where the kernel does not take them (a batch, a slot per row, weights not packed, ...)."""
    if slots.dim() != 1 or not kernel.sublayer_usable(x, B, qkv, o):  # (slots [B, T]: specdec_runtime.rows)
        return None
    return kernel.attention(x, norm, eps, residual, qkv, o, cos, sin, kv, slots, mask, bound)


def mlp(x: Tensor, norm: Tensor, eps: float, gate_up, down) -> Tensor | None:
    """layers.mlp of rows x [M, H] in one call, or None where the kernel does not take them."""
    if not kernel.sublayer_usable(x, 1, gate_up, down):  # row by row: any batch is one
        return None
    return kernel.mlp(x, norm, eps, gate_up, down)


def argmax(logits: Tensor) -> Tensor | None:
    """logits.argmax(-1) in one pass (the same index), or None where the kernel does not take them."""
    return kernel.argmax(logits) if kernel.serves_argmax(logits) else None


def head_rows(rows: Tensor, norm: Tensor, eps: float, head) -> Tensor | None:
    """The logits [M, V] of rows [M, H] as DecoderKernel.run computes them with its head (bitwise),
    or None where the kernel does not take them or the head is not packed."""
    return kernel.head_rows(rows, norm, eps, head) if head.packed is not None and kernel.usable(rows) else None


class DecoderKernel:
    """One decoder's layer stack as the kernel runs it in one call (kernel.decoder_layers): pointers
    to its layers' packed weights, taken once, and its lm_head's screen (kernel.head_screen: the
    head again in bf16, with which a greedy step finds its argmax exactly from half the head's
    bytes), built on first greedy use. model.Decoder makes a new one whenever its weights' tensors
    may have been replaced."""

    def __init__(self, layers: list[tuple], norm: Tensor, lm_head):
        self.stack = kernel.stack(layers)  # None where a weight is not packed
        self.norm, self.lm_head = norm, lm_head
        self.device, self.dtype = lm_head.w.device, lm_head.w.dtype
        self._screen: kernel.HeadScreen | None = None

    def takes(self, rows: int) -> bool:
        """Whether one call runs `rows` rows of one sequence through the whole stack."""
        return self.stack is not None and kernel.stack_takes(self.device, self.dtype, rows)

    def chunks(self, T: int) -> bool:
        """Whether a prompt of T tokens is prefilled in chunks of PREFILL_CHUNK, each one call (a
        chunk's rows are taken, the whole prompt's are not): bitwise the rows of one call and of
        decode steps, in about half torch's time (docs/log/cpu-kernel.md)."""
        return T > PREFILL_CHUNK and self.takes(PREFILL_CHUNK) and T > max_rows()

    def screen(self) -> "kernel.HeadScreen | None":
        """The lm_head's screen, or None where the head is not packed in fp32 (~0.3 s and half the
        head's memory more, on first use)."""
        head = self.lm_head
        if self._screen is None and head.packed is not None and head.packed.dtype == torch.float32:
            screen = kernel.head_screen(head)
            self._screen = screen._replace(packed=on_huge_pages([screen.packed])[0])
        return self._screen

    def run(
        self,
        rows: Tensor,
        first: int,
        last: int,
        skip: tuple,
        taps: tuple,
        dims: tuple,
        eps: float,
        a,
        kv: Tensor,
        head: bool,
        keep: int,
        embed: Tensor | None,
        argmax_only: bool,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """Layers [first, last) on rows [T, H] (or token ids [T] with embed, the embedding in panels),
        and the final norm and lm_head where head and it is packed. a: the forward's
        model.AttentionInputs (mask rows not repeated per query head); kv: the whole cache. Returns
        (rows after them, taps [T, taps * H] or None, logits or None, their argmax or None: only
        where the head ran here; with argmax_only, from the screen, and the logits None)."""
        fused = (self.norm, self.lm_head) if head and self.lm_head.packed is not None else None
        screen = self.screen() if fused is not None and argmax_only else None
        return kernel.decoder_layers(
            self.stack, rows, first, last, skip, taps, dims, eps, a.cos, a.sin, kv, a.slots, a.mask, a.bound,
            fused, keep, embed, screen,
        )  # fmt: skip


class Eagle3Kernel:
    """An EAGLE-3 drafter's fused layer (drafters/eagle3.FusedLayer) as the kernel runs it: a draft
    step's rows in one call (rows()) and a whole EAGLE-2 tree draft in one call (draft())."""

    def __init__(self, weights: kernel.Eagle3Weights, dims: tuple, eps: float, norm_before_residual: bool):
        self.weights, self.dims, self.eps, self.norm_before_residual = weights, dims, eps, norm_before_residual

    @classmethod
    def from_layer(cls, layer: tuple, dims: tuple, eps: float, norm_before_residual: bool) -> "Eagle3Kernel | None":
        """None where a weight is not packed or the kernel is not built. dims: (H, heads, kv heads,
        head dim, intermediate)."""
        weights = kernel.eagle3_weights(*layer)
        return None if weights is None else cls(weights, dims, eps, norm_before_residual)

    def rows(self, tokens, embed, inputs, project, head_from, rope, first, step, kv, slots, mask, bound):
        """(prenorm, draft logits) of a draft step (kernel.eagle3_rows), or None where the kernel does
        not take inputs' rows."""
        if not kernel.stack_usable(inputs):
            return None
        return kernel.eagle3_rows(
            self.weights, tokens, embed, inputs, project, self.dims, self.eps, self.norm_before_residual, head_from,
            rope, first, step, kv, slots, mask, bound,
        )  # fmt: skip

    def draft(self, tokens, taps, first, draft_ids, levels, top_k, budget, embed, rope, kv):
        """A tree draft's nodes (kernel.eagle3_draft), or None where the kernel does not take taps' rows."""
        if not kernel.stack_usable(taps):
            return None
        return kernel.eagle3_draft(
            self.weights, tokens, taps, first, draft_ids, levels, top_k, budget, embed, self.dims, self.eps,
            self.norm_before_residual, rope, kv,
        )  # fmt: skip
