"""A compact Llama-family decoder with a preallocated, position-indexed KV cache.

    model = Decoder.from_hf_state_dict(DecoderConfig.from_hf(hf_config), state_dict)
    model.setup_cache(batch=1, size=2048)
    out = model.prefill(ids, logits_to_keep=1)             # the prompt: logits of its last token
    out = model(ids[:, -1:], start=n)                      # one decode step at slot n
    out = model(tree_ids, start=n, tree=(depth, ancestor)) # verify a token tree
    out = model(ids, start=n, exit_layer=4, taps=(4,))     # the first 4 layers as a drafter (+ their output)
    out = model(residual, start=n, first_layer=4)          # ... and verification resuming from it
    out = model(ids, start=n, skip=LayerSkip(attn={3, 5}, mlp={7}))  # self-speculative draft

Cache rows are slots; a forward of T tokens at `start` writes slots start..start+T-1 and attends to
the slots before them. Rolling back is free: slots past the accepted length are masked out and
overwritten by the next forward. Logits match transformers' on the same weights
(tests/runtime/test_model.py).

One execution path. Every forward writes its K/V at its slots (an index_put_) and attends over
the first `bound` slots of the cache under a mask built on the device from the start slot, a 0-dim
tensor: causal, a token tree's ancestor pattern, a sliding window. Eagerly (CPU, and the prefill
everywhere) bound is start + T, so a step reads only the live slots. On the fast path bound is a
span: the smallest of 256, 512, 1024, ... slots (and the whole cache) that holds start + T, each
span its own captured step, so a step reads about the live slots while its shapes stay fixed. All
spans of a step are captured together, and only its attention depends on the span: the compiled
functions are the same for every span (the attention's two halves, with the SDPA between them).
With compile(attention="flex") a step attends over the whole cache instead, by flex attention
compiled between the two halves, which reads the cache's blocks of 128 slots up to the newest slot
only (layers.attend_live): one captured step a shape, whatever the live length.

The fast path (`model.compile()`; `specdec generate --compile`, on by default on CUDA). Each
distinct step, a role and a token count T (decode T = 1, a chain's g + 1, a tree's nodes, a
drafter's exit layer, a verification resuming at layer K, ...), is captured once per span (above;
once with flex attention) as one CUDA graph covering the whole forward, embedding to logits, with
static input and output buffers (graphs.CapturedStep, one private memory pool each). A call copies
its inputs in (the token ids, the start slot with one fill_ from the host's int: no host sync) and
replays the graph. Lifetimes are explicit: a step's outputs are valid until that same step runs
again, and whoever keeps one longer copies it. Inside the graphs the layers' attention and MLP are
torch.compile'd functions of plain tensors (kernel fusion; one compiled artifact serves every layer
of a given T), compiled while the step is first captured. The KV cache is allocated once for the
largest capacity asked for and kept across generate calls; growing it drops the graphs (they point
at the old cache), which a caller avoids by reserving the largest capacity up front (generate(...,
capacity=)). After warm-up nothing is compiled or captured again (tests/runtime/test_fast_path.py
counts both). Off CUDA the captured steps are emulated with the same buffers and lifetimes, which
is what the CPU tests exercise.

The layers themselves, their weights' layout and the functions a step runs: layers.py.
"""

from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec_runtime import cpu, rows
from specdec_runtime.cache import SPAN, KVCache, cache_spans
from specdec_runtime.config import DecoderConfig
from specdec_runtime.errors import SpecdecError
from specdec_runtime.graphs import CapturedStep, allow_many_compiles
from specdec_runtime.layers import (
    Block,
    Linear,
    attend_live,
    attention,
    block_state_dict,
    mlp,
    normed_queries,
    projected,
    rms_norm,
    rope_table,
    split_attention,
)


@dataclass(frozen=True)
class LayerSkip:
    """Sublayers to skip while drafting: indices of layers whose attention / MLP is bypassed."""

    attn: frozenset[int] = field(default_factory=frozenset)
    mlp: frozenset[int] = field(default_factory=frozenset)

    def __init__(self, attn: set[int] | frozenset[int] = frozenset(), mlp: set[int] | frozenset[int] = frozenset()):
        object.__setattr__(self, "attn", frozenset(attn))
        object.__setattr__(self, "mlp", frozenset(mlp))


class DecoderOutput(NamedTuple):
    logits: Tensor | None  # [B, T', V] for the last T' = logits_to_keep positions (all when 0); None without head
    # With taps=(k1, k2, ...): the residual streams after the first k1, k2, ... layers at every
    # position, concatenated [B, T, len(taps) * H] (an MTP trunk's output, EAGLE-3's features).
    hidden: Tensor | None
    # The logits' argmax [B, T'] where the forward computed it beside them (the CPU kernel's head:
    # cpu.DecoderKernel.run), the index argmax(logits) gives; None elsewhere.
    greedy: Tensor | None = None


class AttentionInputs(NamedTuple):
    """What every layer of one forward shares: rope rows, the new tokens' slots, the mask."""

    cos: Tensor  # [T, 1, D]
    sin: Tensor  # [T, 1, D]
    slots: Tensor  # [T]
    mask: Tensor | None  # [group * T, bound]
    bound: int  # slots attended to: start + T eagerly, the whole cache on the fast path


class Decoder(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 (dense and MoE) decoder for inference, with its own KV cache."""

    def __init__(self, cfg: DecoderConfig, head_size: int | None = None):
        super().__init__()
        self.config = cfg
        # Tied embeddings are stored once, as the lm_head's [H, V]; lookups read its columns. A
        # drafter with a draft vocabulary (head_size < V rows) keeps its full embedding table apart.
        tied = cfg.tie_word_embeddings and head_size is None
        self.embed = None if tied else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, moe=i in cfg.moe_layers) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(2 * cfg.hidden_size))  # [w, w], see rms_norm
        self.lm_head = Linear(cfg.hidden_size, head_size or cfg.vocab_size)
        self.vocab_ids: Tensor | None = None  # [head_size] vocabulary ids of the head's outputs
        self.cache: KVCache | None = None
        self.kv_layers: list[Tensor] = []  # per-layer views of the cache
        self.rope: Tensor | None = None  # [S, 2, D] cos / signed sin per slot, built with the cache
        self.slots: Tensor | None = None  # [S] 0, 1, ..., S-1 on the device
        self.row_start: Tensor | None = None  # [B] each row's first slot under left padding (left_pad())
        self.steps: dict[tuple, CapturedStep] | None = None  # the fast path's captured steps (compile())
        self.layer_fns = (attention, mlp)  # compile() swaps in compiled versions for the captured steps
        self.compile_backend: str | None = None  # compile()'s (a drafter's steps may be compiled with it)
        self.live_spans = True  # fast-path steps attend over a span of the cache (spans()); False: all of it
        self.attention_kernel = "sdpa"  # compile()'s: "flex" attends over the live blocks of the whole cache
        self._native: cpu.DecoderKernel | None = None  # the CPU kernel's view of the layers (native())
        # A bf16 model on a CPU with the kernel: fp32 parameters holding bf16 values, packed in bf16
        # for the kernel (from_hf_state_dict). Activations, cache and logits are fp32.
        self.bf16_weights = False

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the weights' values: the model's dtype, but bf16 for a bf16 model on a CPU,
        which computes in fp32 from its bf16 weights (bf16_weights). transformers' model of the same
        arithmetic: load_hf_model(name, dtype, weight_dtype)."""
        return torch.bfloat16 if self.bf16_weights else self.dtype

    @property
    def compiled(self) -> bool:
        return self.steps is not None

    @property
    def can_compile(self) -> bool:  # not yet with experts (a prefill goes expert by expert: layers.moe)
        return not self.config.moe_layers

    @torch.inference_mode()
    def setup_cache(self, batch: int, size: int) -> None:
        """Make room for `size` slots: the cache is allocated once and only ever grows (on the fast
        path in steps of 256 slots, and for rows.captured_rows(batch) rows, dropping the captured
        steps, which point at the old cache). New sequences start at slot 0 in every row (left_pad(None))."""
        self.row_start = None
        batch = rows.captured_rows(batch) if self.steps is not None else batch
        if self.cache is not None and self.cache.size >= size and self.cache.kv.shape[1] == batch:
            return
        if self.steps is not None:
            size = -(-size // SPAN) * SPAN
            self.steps.clear()
        self.cache, self.kv_layers = None, []  # free the old one before allocating
        self.cache = KVCache(self.config, batch, size, self.device, self.dtype)
        self.kv_layers = list(self.cache.kv.unbind(0))
        self.slots = torch.arange(size, device=self.device)
        self.rope = rope_table(self.config, size, self.device, self.dtype)

    def left_pad(self, row_start: Tensor | None, per_row: bool = False) -> None:
        """Rows of a batch that start at different slots (prompts left-padded to one length): row b
        attends to slots row_start[b] and later only; None: every row starts at slot 0. Positions stay
        the slots in every row: attention sees RoPE positions only through their differences, so a
        row's shift changes nothing but rounding. Eager forwards only (generate.generate_batch);
        per_row: for forwards with a start slot per row (specdec_runtime.rows), captured too."""
        if row_start is not None and self.steps is not None and not per_row:
            raise SpecdecError("left-padded batches run eagerly: use a Decoder without compile()")
        if row_start is not None and not per_row and not bool(row_start.any()):
            row_start = None  # (a slot per row reads its rows' first slots whatever they are: no host read)
        self.row_start = row_start

    def compile(self, backend: str = "inductor", attention: str = "sdpa") -> None:
        """Turn on the fast path (module docstring): captured steps, with the layers' attention and
        MLP compiled by torch.compile (fullgraph, static shapes). CUDA graphs on CUDA; elsewhere
        the steps are emulated (the CPU tests trace the compiled functions with backend='aot_eager').
        attention: "sdpa", torch's SDPA over the span that holds the live slots (a captured step per
        span), or "flex", flex attention over the whole cache, compiled on its own between the
        attention's halves, reading the cache's blocks up to the newest slot (layers.attend_live:
        one captured step a shape)."""
        if not self.can_compile:
            raise SpecdecError("the fast path captures no mixture-of-experts layers yet: --compile off")
        if attention not in ("sdpa", "flex"):
            raise SpecdecError(f"attention is 'sdpa' or 'flex' (got {attention!r})")
        allow_many_compiles()
        opts = dict(fullgraph=True, dynamic=False, backend=backend)
        self.compile_backend, self.attention_kernel = backend, attention
        flex = torch.compile(attend_live, **opts) if attention == "flex" else None
        halves = torch.compile(normed_queries, **opts), torch.compile(projected, **opts)
        self.layer_fns = (partial(split_attention, *halves, flex=flex), torch.compile(mlp, **opts))
        self.steps = {}
        if self.cache is not None and self.cache.size % SPAN:  # (an eager cache: the next setup_cache sizes it anew)
            self.cache, self.kv_layers = None, []

    def keep_cpu_copies(self) -> None:
        """Keep every weight also in the layout a CPU's products of a few rows stream once (twice
        the weights' memory; 1.5 times with bf16_weights): the CPU kernel's, or W^T for MKL where
        it is not built (linear()); the packed ones side by side on huge pages
        (cpu.on_huge_pages)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.keep_cpu_copy(self.bf16_weights)
        packed = [m for m in linears if m.weight_packed is not None]
        for m, copy in zip(packed, cpu.on_huge_pages([m.weight_packed for m in packed])):
            m.weight_packed = copy
        self._native = None

    def native(self) -> "cpu.DecoderKernel | None":
        """The CPU kernel's view of this model's layers and head (cpu.DecoderKernel: a forward's whole
        stack in one call), where the model keeps CPU copies (keep_cpu_copies); built on first use
        and again whenever the weights' tensors may have been replaced (load_state_dict, to())."""
        if self._native is None and self.lm_head.cpu_copy and not self.config.moe_layers:  # (no experts in it)
            layers = [(*b.attn_weights, *b.mlp_weights) for b in self.layers]
            self._native = cpu.DecoderKernel(layers, self.norm, self.lm_head.params)
        return self._native

    def __getstate__(self):  # copies and pickles build their own (its pointers are this model's)
        return {**super().__getstate__(), "_native": None}

    def _apply(self, fn, *args, **kwargs):
        self._native = None
        return super()._apply(fn, *args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        """nn.Module's, and the CPU copies of the weights (Weights.from_matrix) made again where kept (a
        bf16_weights model rounds what it loads to bf16, as its weights are)."""
        self._native = None
        result = super().load_state_dict(*args, **kwargs)
        if self.bf16_weights:
            with torch.no_grad():
                for p in self.parameters():
                    p.copy_(p.bfloat16())
        if any(isinstance(m, Linear) and m.cpu_copy for m in self.modules()):
            self.keep_cpu_copies()
        return result

    def embed_tokens(self, ids: Tensor) -> Tensor:
        """Token embeddings [B, T, H]."""
        panels = self.embedding_panels()
        if panels.shape[2] == 1:
            return F.embedding(ids, self.embedding)
        width = panels.shape[2]
        return panels[ids // width, :, ids % width]  # [B, T, H]: the indexed dimensions first

    @property
    def embedding(self) -> Tensor:
        """The embedding table [V, H]; tied, a view of the lm_head's [H, V] columns (the rows of its
        transpose when that is kept)."""
        if self.embed is not None:
            return self.embed.weight
        head = self.lm_head
        return head.weight.t() if head.weight_t is None else head.weight_t

    def embedding_panels(self) -> Tensor:
        """The embedding table as panels [V / P, H, P], token t at [t // P, :, t % P]: where it is
        tied to an lm_head the CPU kernel reads, that packed copy (cpu.pack: a token's H
        values 4 P bytes apart in one run, which the hardware prefetcher streams), else the table
        itself as [V, H, 1]. A tied table's [H, V] weight holds a token's values a row (4 V bytes)
        apart, each on its own page, which the prefetcher cannot stream (docs/log/cpu-kernel.md)."""
        packed = self.lm_head.weight_packed
        if self.embed is None and packed is not None and packed.dtype == self.lm_head.weight.dtype:
            return packed
        return self.embedding[:, :, None]

    def attention_inputs(
        self,
        start: Tensor,
        T: int,
        bound: int | None,
        tree: tuple[Tensor, Tensor] | None = None,
        fold: bool = True,
        span: int | None = None,
        row_start: Tensor | None = None,
    ) -> AttentionInputs:
        """Rope rows, slots and mask of T new tokens at slot `start` (0-dim). bound: the live slots
        (start + T, known on the host) or None for the first `span` slots (the fast path; None: the
        whole cache), stale ones masked. tree = (depth [T], ancestor [T, T]) for a token tree
        (positions start + depth). fold=False: the mask's rows once, not repeated per folded query
        head (the CPU kernel reads row t for every head). A slot per row (start [B]):
        rows.attention_inputs, row b's first slot row_start[b] (default: left_pad's)."""
        if start.dim():
            return AttentionInputs(*rows.attention_inputs(self, start, T, bound or span, row_start, tree))
        slots = start + self.slots[:T]  # [T]
        positions = slots if tree is None else start + tree[0]
        cs = self.rope[positions]  # [T, 2, D]
        live = bound is not None
        bound = bound if live else span or self.slots.shape[0]
        return AttentionInputs(
            cs[:, None, 0], cs[:, None, 1], slots, self._mask(slots, positions, tree, bound, live, fold), bound
        )

    def _mask(
        self, slots: Tensor, positions: Tensor, tree: tuple[Tensor, Tensor] | None, bound: int, live: bool, fold: bool
    ) -> Tensor | None:
        """[group * T, bound] bool (rows repeat per folded query head; [T, bound] unless fold), or
        None when every slot is seen (one new token after `live` slots only). Slots past the newest
        are stale (rejected drafts, earlier prompts) and masked out. Under left_pad, [B, 1, group *
        T, bound]: each row also masks the slots before its start."""
        T, window, padded = slots.shape[0], self.config.sliding_window, self.row_start is not None
        if live and T == 1 and tree is None and (window is None or bound <= window) and not padded:
            return None
        k_slot = self.slots[:bound]
        if tree is None:
            mask = k_slot[None, :] <= slots[:, None]  # causal
        else:  # the prefix, then the tree's own pattern on the new slots
            mask = (k_slot[None, :] < slots[:1, None]).expand(T, -1).clone()
            mask.index_copy_(1, slots, tree[1])
        if window is not None:
            k_pos = k_slot if tree is None else k_slot.index_copy(0, slots, positions)
            mask &= k_pos[None, :] > positions[:, None] - window
        group = self.config.num_heads // self.config.num_kv_heads
        if padded:  # [B, T, bound] -> [B, 1 (kv heads), group * T, bound]
            mask = mask[None] & (k_slot[None, None, :] >= self.row_start[:, None, None])
            return mask.repeat(1, group, 1)[:, None]
        return mask.repeat(group, 1) if group > 1 and fold else mask

    @torch.inference_mode()
    def prefill(self, ids: Tensor, **kwargs) -> DecoderOutput:
        """A forward at slot 0 that always runs eagerly (prompts of any length: no graph per length).

        Where the CPU kernel runs this model's layers (one sequence, fp32, packed weights), a prompt
        longer than a kernel call takes (cpu.max_rows()) runs in chunks of cpu.PREFILL_CHUNK tokens,
        each attending to the slots before it, instead of through torch's ops: its rows are bitwise
        those of one kernel call and of decode steps (cpu.DecoderKernel.chunks)."""
        opts, (B, T) = self._options(ids, **kwargs), ids.shape[:2]
        native = self._native_for(B)
        if native is None or not native.chunks(T):
            return self._forward(ids, self.slots[0], T, **opts)
        keep, head = opts.pop("logits_to_keep"), opts.pop("head")
        logits, hidden = [], []
        for a in range(0, T, cpu.PREFILL_CHUNK):
            b = min(a + cpu.PREFILL_CHUNK, T)
            wanted = b - a if keep == 0 else max(0, b - max(a, T - keep))  # logits of this chunk's rows
            here = dict(logits_to_keep=0 if wanted == b - a else wanted, head=head and wanted > 0)
            out = self._forward(ids[:, a:b], self.slots[a], b, **here, **opts)
            logits += [out.logits] if out.logits is not None else []
            hidden += [out.hidden] if out.hidden is not None else []
        logits = torch.cat(logits, dim=1) if logits else None
        return DecoderOutput(logits, torch.cat(hidden, dim=1) if hidden else None)

    def _native_for(self, B: int) -> "cpu.DecoderKernel | None":
        """native() for a forward of B rows: the CPU kernel runs one sequence, unpadded."""
        return self.native() if B == 1 and self.row_start is None else None

    @torch.inference_mode()  # inference only: training uses the transformers model
    def forward(self, x: Tensor, start: int | list[int], **kwargs) -> DecoderOutput:
        """Run x at cache slots start..start+T-1; on the fast path as a captured step. start a list of
        B host ints: row b at slots start[b] onward (specdec_runtime.rows).

        x: token ids [B, T], or with first_layer=k the residual stream [B, T, H] after k layers.
        tree: (depth [T], ancestor [T, T] bool) of a token tree: rope positions start + depth, and
        each token sees the prefix and its ancestors. exit_layer: stop after this many layers and
        apply the final norm + lm_head (early exit). skip: sublayers to bypass. logits_to_keep:
        only project the last n positions (0 = all). taps: return the residual streams after these
        layer counts (see DecoderOutput). head=False: no norm / lm_head (logits None). argmax_only:
        the caller reads only the logits' argmax (greedy decoding): where the CPU kernel runs the
        head, it finds it exactly from the head's screen (cpu.DecoderKernel.screen) and the logits are None;
        elsewhere the output is as without it.
        """
        if isinstance(start, list):  # a slot per row (specdec_runtime.rows)
            return rows.forward(self, x, start, **kwargs)
        T = x.shape[1]
        if self.cache is None or start + T > self.cache.size:
            raise ValueError(f"KV cache too small for slots up to {start + T}: call setup_cache first")
        opts = self._options(x, **kwargs)
        if self.steps is None:
            return self._forward(x, self.slots[start], start + T, **opts)
        tree = opts.pop("tree")
        opts.pop("argmax_only")  # the captured step's head is torch's: its logits are computed anyway
        key = (tuple(x.shape), x.dtype, tree is not None, *opts.values())
        inputs = {"x": x} | ({"depth": tree[0], "ancestor": tree[1]} if tree is not None else {})
        return self._replay(key, opts, inputs, T, start)

    def _replay(self, key: tuple, opts: dict, inputs: dict[str, Tensor], T: int, start: int | list[int]):
        """Step `key` over the span holding its slots, on inputs at `start` (a slot, or one per row); first
        seen, captured for every span at once, so none is captured inside a timed prompt (rows.capture)."""
        spans = cache_spans(self.cache.size, self._by_span)
        starts = start if isinstance(start, list) else [start]
        span = next(s for s in spans if s >= max(starts) + T)
        if key + (span,) not in self.steps:
            for s in spans:
                if key + (s,) not in self.steps:
                    fn = partial(self._step, span=s, **opts)
                    self.steps[key + (s,)] = rows.capture(self, fn, inputs, starts, T, s, isinstance(start, list))
        return self.steps[key + (span,)](start=start, **inputs)

    def spans(self) -> list[int]:
        """The cache spans a fast-path step attends over (module docstring): 256, 512, ... below the
        cache's size, and the size (live_spans False, or flex attention, which reads the live blocks
        of the whole cache: the whole cache only)."""
        return list(cache_spans(self.cache.size, self._by_span))

    @property
    def _by_span(self) -> bool:
        """Whether a fast-path step is captured per span (SDPA's), or once over the whole cache."""
        return self.live_spans and self.attention_kernel == "sdpa"

    def _step(self, x: Tensor, start: Tensor, depth: Tensor | None = None, ancestor: Tensor | None = None,
              row_start: Tensor | None = None, *, span: int, **opts):  # fmt: skip
        """A captured step's body: the forward over the first `span` slots, with the compiled layers
        (row_start: a step of a slot per row's, rows._captured)."""
        tree = None if depth is None else (depth, ancestor)
        return self._forward(
            x, start, None, tree=tree, layer_fns=self.layer_fns, span=span, row_start=row_start, **opts
        )

    def _options(
        self,
        x: Tensor,
        *,
        first_layer: int = 0,
        exit_layer: int | None = None,
        skip: LayerSkip | None = None,
        tree: tuple[Tensor, Tensor] | None = None,
        logits_to_keep: int = 0,
        taps: tuple[int, ...] = (),
        head: bool = True,
        argmax_only: bool = False,
    ) -> dict:
        """The forward's keyword options, checked and normalized (also the captured step's key)."""
        last = self.config.num_layers if exit_layer is None else exit_layer
        taps = tuple(taps)
        if not 0 <= first_layer <= last <= self.config.num_layers or any(not first_layer <= k <= last for k in taps):
            raise ValueError(f"layers: need 0 <= first_layer <= taps <= exit_layer <= {self.config.num_layers}")
        if (first_layer > 0) != x.is_floating_point():
            raise ValueError("pass token ids with first_layer=0, a residual stream [B, T, H] with first_layer > 0")
        opts = dict(first_layer=first_layer, last=last, skip=skip, tree=tree, logits_to_keep=logits_to_keep)
        return opts | dict(taps=taps, head=head, argmax_only=argmax_only)

    def _forward(
        self,
        x: Tensor,
        start: Tensor,
        bound: int | None,
        *,
        first_layer: int,
        last: int,
        skip: LayerSkip | None,
        tree: tuple[Tensor, Tensor] | None,
        logits_to_keep: int,
        taps: tuple[int, ...],
        head: bool,
        argmax_only: bool = False,
        layer_fns: tuple = (attention, mlp),
        span: int | None = None,
        row_start: Tensor | None = None,
    ) -> DecoderOutput:
        """The forward itself, at 0-dim slot `start` or a slot per row [B] (bound, span, row_start: see there)."""
        B, T = x.shape[:2]
        native = self._native_for(B) if layer_fns == (attention, mlp) else None
        in_kernel = native is not None and native.takes(B * T)
        if first_layer == 0 and not in_kernel:
            x = self.embed_tokens(x)
        a = self.attention_inputs(start, T, bound, tree, fold=not in_kernel, span=span, row_start=row_start)
        if span is not None and a.mask is not None and self.attention_kernel == "sdpa":  # an additive mask, once a step
            # (the SDPA converts a boolean one in every layer, outside the compiled code: docs/log/gpu.md)
            additive = torch.zeros(a.mask.shape, dtype=self.dtype, device=a.mask.device)
            a = a._replace(mask=additive.masked_fill_(~a.mask, float("-inf")))
        attn, ffn = layer_fns
        skip_attn = skip.attn if skip is not None else ()
        skip_mlp = skip.mlp if skip is not None else ()
        h, tapped = x.reshape(B * T, -1), []  # the layers work on [B*T, H] (token ids [B*T] into the kernel)
        if in_kernel:
            c = self.config  # the CPU kernel runs the embedding, the layers and the head where it is packed in one call
            dims = (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size)
            embed = self.embedding_panels() if first_layer == 0 else None
            rows = h.view(-1) if embed is not None else h
            h, hidden, logits, greedy = native.run(
                rows, first_layer, last, (skip_attn, skip_mlp), taps, dims, c.rms_norm_eps, a, self.cache.kv, head,
                logits_to_keep, embed, argmax_only,
            )  # fmt: skip
            if greedy is not None:
                hidden = hidden.view(B, T, -1) if hidden is not None else None
                logits = logits.view(B, -1, logits.shape[-1]) if logits is not None else None
                return DecoderOutput(logits, hidden, greedy.view(B, -1))
            return self._head_out(h, hidden, B, T, logits_to_keep, head)
        for i in range(first_layer, last):
            if i in taps:
                tapped.append(h)
            blk = self.layers[i]
            if i not in skip_attn:
                h = attn(h, B, *blk.attn_weights, a.cos, a.sin, self.kv_layers[i], a.slots, a.mask, a.bound, blk.eps)
            if i not in skip_mlp:
                h = blk.feed_forward(h, ffn)
        if last in taps:
            tapped.append(h)
        hidden = torch.cat(tapped, dim=-1) if len(tapped) > 1 else tapped[0] if tapped else None
        return self._head_out(h, hidden, B, T, logits_to_keep, head)

    def _head_out(
        self, h: Tensor, hidden: Tensor | None, B: int, T: int, logits_to_keep: int, head: bool
    ) -> DecoderOutput:
        """The forward's output from the last layer's rows h [B*T, H] and the taps [B*T, taps * H]."""
        hidden = hidden.view(B, T, -1) if hidden is not None else None
        if not head:
            return DecoderOutput(None, hidden)
        h = h.view(B, T, -1)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        lm_head, eps = self.lm_head.params, self.config.rms_norm_eps
        rows = h.reshape(-1, h.shape[-1])
        logits = cpu.head_rows(rows, self.norm, eps, lm_head)  # as the stack's call computes them, where it can
        if logits is not None:
            return DecoderOutput(logits.view(B, h.shape[1], -1), hidden)
        return DecoderOutput(self.lm_head(rms_norm(h, self.norm, eps)), hidden)

    @classmethod
    @torch.no_grad()
    def from_hf_state_dict(
        cls,
        cfg: DecoderConfig,
        sd: dict[str, Tensor],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        vocab_ids: Tensor | None = None,
        cpu_copies: bool | None = None,
    ) -> "Decoder":
        """Build from a transformers Llama/Mistral/Qwen2 state dict: q/k/v and gate/up fused, weights
        stored [in, out], q/k rows interleaved for rope. Parameters are created once, on `device`.

        vocab_ids [N]: keep only these rows of the lm_head (a drafter's draft vocabulary); its
        logits then cover those ids, in that order, and `model.vocab_ids` maps them back.
        cpu_copies: also keep every weight as a CPU's few-row products read it (see linear();
        default: on a CPU). bf16 on a CPU whose kernel is built (cpu.reads_bf16_weights):
        the bf16 weights, held as fp32 values and packed in bf16 for the kernel, with fp32
        activations (bf16_weights): half the bytes a step reads, and transformers' fp32 arithmetic
        on the bf16 checkpoint, where torch's bf16 ops on a CPU are slow and round every activation.
        float32 there, from weights that are all bf16 values (a checkpoint saved in bf16, as most
        are): the same, which is then the fp32 model exactly, bitwise, at half the bytes.
        """
        on_cpu = torch.device(device).type == "cpu"
        cpu_copies = on_cpu if cpu_copies is None else cpu_copies
        bf16_weights = (
            cpu_copies
            and cpu.reads_bf16_weights(torch.device(device))
            and (dtype == torch.bfloat16 or dtype == torch.float32 and holds_bf16_values(sd.values()))
        )
        with torch.device("meta"):
            model = cls(cfg, None if vocab_ids is None else len(vocab_ids))
        if bf16_weights:  # the bf16 values, in fp32
            prep = lambda w: w.to(device=device, dtype=torch.bfloat16).float().contiguous()  # noqa: E731
        else:
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
        model.bf16_weights = bf16_weights
        if vocab_ids is not None:
            model.vocab_ids = vocab_ids.to(device=device, dtype=torch.long)
        if cpu_copies:
            model.keep_cpu_copies()
        return model.eval()


def holds_bf16_values(tensors) -> bool:
    """Whether every floating tensor is bf16 or holds only bf16 values (exact in bf16)."""
    for t in tensors:
        if t.is_floating_point() and t.dtype != torch.bfloat16 and not torch.equal(t, t.bfloat16().to(t.dtype)):
            return False
    return True
