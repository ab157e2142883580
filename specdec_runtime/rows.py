"""Forwards whose rows sit at slots of their own (specdec_runtime.batched): `Decoder.forward(x,
starts)` with starts a list of B host ints, row b's T tokens at slots starts[b]..starts[b] + T - 1.

    target.setup_cache(B, capacity); target.left_pad(row_start, per_row=True)
    out = rows.prefill(target, ids, logits_to_keep=1)      # every row at slot 0, eagerly
    out = target(x, [17, 12, 30])                          # row b at slots starts[b] onward
    with rows.one_row(target, b):                          # a prompt from the queue into row b alone
        rows.prefill(target, ids_b[None])

Each row of the cache is one sequence. Under Decoder.left_pad a row's tokens begin at its
row_start, and its RoPE positions are its slots less row_start (exact: a row decodes at the
positions it has alone); the mask lets a token see its own row's slots from row_start to its own.
The starts are the caller's host ints, so nothing is read back to size a forward.

On the fast path (Decoder.compile) a forward is a captured step of a fixed batch size, as the
engines capture theirs: the cache holds captured_rows(B) rows (1, 2, 4, then multiples of 8 up to
256, then of 16: vLLM's default capture sizes), a batch of fewer rows runs padded with rows that
write only the cache rows nobody reads, and the step takes x, the starts and the rows' first
slots as inputs. As for one sequence, a step is captured once per cache span (model.py), every
span at once; the prefills run eagerly (prompts of any length).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from specdec_runtime.graphs import CapturedStep


def captured_rows(B: int) -> int:
    """The batch size a captured step of B rows runs at (the module docstring's fixed set)."""
    if B <= 4:
        return 1 << (B - 1).bit_length()
    step = 8 if B <= 256 else 16
    return -(-B // step) * step


@torch.inference_mode()
def forward(decoder, x: Tensor, starts: list[int], eager: bool = False, **kwargs):
    """decoder's forward (its keyword options) of x [B, T] (ids, or a residual stream [B, T, H] with
    first_layer) with row b at slots starts[b] onward: a captured step on the fast path, unless
    eager."""
    B, T = x.shape[:2]
    opts, cache = decoder._options(x, **kwargs), decoder.cache
    end = max(starts) + T
    if cache is None or len(starts) != B or end > cache.size or B > decoder.kv_layers[0].shape[0]:
        raise ValueError(f"a slot per row needs {B} starts and a cache of {B} rows and {end} slots: call setup_cache")
    if eager or decoder.steps is None:
        start = torch.tensor(starts).to(decoder.device, non_blocking=True)  # (from the host: nothing waits)
        with _on_rows(decoder, slice(0, B), decoder.row_start):  # (a captured batch size's cache holds more)
            return decoder._forward(x, start, end, **opts)
    return _captured(decoder, x, starts, opts)


def prefill(decoder, ids: Tensor, **kwargs):
    """Every row's prompt (left-padded ids [B, T]) at slot 0, eagerly (prompts of any length)."""
    return forward(decoder, ids, [0] * ids.shape[0], eager=True, **kwargs)


@contextmanager
def _on_rows(decoder, rows: slice, row_start: Tensor | None) -> Iterator[None]:
    """Eager forwards on these rows of the cache alone (views: the writes land in the batch's
    cache), with their first slots row_start."""
    kept = decoder.kv_layers, decoder.row_start
    if rows != slice(0, kept[0][0].shape[0]):
        decoder.kv_layers = [kv[rows] for kv in kept[0]]
    decoder.row_start = row_start
    try:
        yield
    finally:
        decoder.kv_layers, decoder.row_start = kept


def _captured(decoder, x: Tensor, starts: list[int], opts: dict):
    """The forward as the captured step of the cache's rows (padded rows at slot 0), its outputs
    the step's buffers' first B rows (valid until that step runs again)."""
    B, T = x.shape[:2]
    R = decoder.cache.kv.shape[1]  # captured_rows(B): setup_cache sized it so
    row_start = decoder.row_start if decoder.row_start is not None else torch.zeros_like(decoder.slots[:B])
    if R > B:
        x = torch.cat([x, x.new_zeros(R - B, *x.shape[1:])])
        row_start = torch.cat([row_start, row_start.new_zeros(R - B)])
    tree, _ = opts.pop("tree"), opts.pop("argmax_only")  # (the step's head is torch's: its logits are computed anyway)
    inputs = {"x": x, "row_start": row_start}
    if tree is not None:  # (padded rows: any tree of the shape)
        inputs |= {"depth": _padded(tree[0], R), "ancestor": _padded(tree[1], R)}
    key = ("rows", tuple(x.shape), x.dtype, tree is not None, *opts.values())
    out = decoder._replay(key, opts, inputs, T, starts + [0] * (R - B))
    return out if R == B else type(out)(*(None if t is None else t[:B] for t in out))  # (a DecoderOutput)


def _padded(t: Tensor, R: int) -> Tensor:
    """t [B, ...] with its first row repeated up to R rows."""
    return t if t.shape[0] == R else torch.cat([t, t[:1].expand(R - t.shape[0], *t.shape[1:])])


def capture(decoder, fn, inputs: dict[str, Tensor], starts: list[int], T: int, span: int, per_row: bool):
    """fn captured as decoder's step over `span` slots, each row at a start the span holds: its own,
    or for a row whose slots end past the span, the span's last T slots, whose K/V the capture's
    runs overwrite and which are put back after (a replay reads its start from its input buffer).
    per_row: the step's start is a slot per row [B], else one slot (0-dim)."""
    at = [max(0, min(s, span - T)) for s in starts]
    kv = decoder.cache.kv  # [layers, B, 2 Hkv, S, D]
    kept = [(b, a, kv[:, b, :, a : a + T].clone()) for b, (a, s) in enumerate(zip(at, starts)) if a != s]
    start = torch.tensor(at, device=decoder.device) if per_row else decoder.slots[at[0]]
    step = CapturedStep(fn, inputs | {"start": start})
    for b, a, values in kept:
        kv[:, b, :, a : a + T] = values
    return step


def keep_rows(decoder, rows: list[int]) -> None:
    """These rows of an eager decoder's cache (and their first slots), in this order (ascending),
    moved to its first rows: a batch whose other sequences are done and whose queue is empty runs on
    its live rows alone (an eager forward of B rows runs on the cache's first B). The cache keeps
    its size, so the next call of as many rows finds it allocated."""
    move_rows(decoder.cache.kv, rows, dim=1)
    if decoder.row_start is not None:
        decoder.row_start = decoder.row_start.index_select(0, torch.tensor(rows, device=decoder.device))


def move_rows(t: Tensor, rows: list[int], dim: int = 0) -> None:
    """t's entries `rows` (ascending) along dim moved to its first len(rows), in place: one copy per
    row that moves, nothing allocated (gathered at once, the rows kept of a cache would take as much
    memory again: 23.6 GiB for 63 rows of Qwen3-30B-A3B's 4,096 slots, a mixture of experts that runs
    eagerly on a GPU). Ascending, no row is overwritten before it moves (row i takes rows[i] >= i)."""
    if any(a >= b for a, b in zip(rows, rows[1:])):
        raise ValueError(f"rows to keep go in ascending order (got {rows})")
    for i, b in enumerate(rows):
        if b != i:
            t.select(dim, i).copy_(t.select(dim, b))


def one_row(decoder, b: int):
    """Forwards (at starts [0]) on row b of a batch's cache alone: a prompt prefilled into a row
    its sequence left (batched decoding's queue), the other rows untouched. Row b starts at slot 0."""
    if decoder.row_start is not None:  # (a view's fill: a Python scalar written in is a host copy, a sync)
        decoder.row_start[b : b + 1].zero_()
    # (a row_start, never None: one row without one would be the one-sequence kernel's)
    return _on_rows(decoder, slice(b, b + 1), torch.zeros(1, dtype=torch.long, device=decoder.device))


def attention_inputs(
    decoder, start: Tensor, T: int, bound: int, row_start: Tensor | None, tree: tuple[Tensor, Tensor] | None = None
) -> tuple:
    """(cos, sin [B, T, 1, D], slots [B, T], mask [B, 1, group * T, bound], bound) of T new tokens a
    row at slots start [B] onward, row b's first slot row_start[b] (None: left_pad's, else 0).
    tree = (depth [B, T], ancestor [B, T, T]) of a token tree per row: node t at position start[b] +
    depth[b, t] sees the row's prefix and its ancestors (itself included)."""
    slots = start[:, None] + decoder.slots[:T]  # [B, T]
    if row_start is None:
        row_start = decoder.row_start if decoder.row_start is not None else torch.zeros_like(start)
    offsets = decoder.slots[:T] if tree is None else tree[0]
    positions = (start[:, None] + offsets - row_start[:, None]).clamp_(min=0)  # (a left pad's own rows: 0)
    cs = decoder.rope[positions]  # [B, T, 2, D]
    k_slot = decoder.slots[:bound]
    q = slots[:, :, None]
    if tree is None:
        mask = k_slot <= q
        k_pos = k_slot - row_start[:, None]  # [B, bound]
    else:
        rel = k_slot - start[:, None]  # [B, bound] a slot's node in the row's tree, where 0 <= rel < T
        node = rel.clamp(0, T - 1)
        in_tree = (rel >= 0) & (rel < T)
        mask = (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree[1].gather(2, node[:, None, :].expand(-1, T, -1)))
        k_pos = torch.where(in_tree, start[:, None] + tree[0].gather(1, node), k_slot) - row_start[:, None]
    mask &= k_slot >= row_start[:, None, None]  # [B, T, bound]
    window = decoder.config.sliding_window
    if window is not None:
        mask &= k_pos[:, None, :] > positions[:, :, None] - window
    mask |= k_slot == q  # a left pad's slots see themselves (no row of -inf only)
    group = decoder.config.num_heads // decoder.config.num_kv_heads
    return cs[:, :, None, 0], cs[:, :, None, 1], slots, mask.repeat(1, group, 1)[:, None], bound
