"""A forward whose rows sit at slots of their own (specdec_runtime.batched): `Decoder.forward(x,
start)` with start [B], row b's T tokens at slots start[b]..start[b] + T - 1.

Each row of the cache is one sequence. Under Decoder.left_pad a row's tokens begin at its
row_start, and its RoPE positions are its slots less row_start (exact: a row decodes at the
positions it has alone); the mask lets a token see its own row's slots from row_start to its own.
These forwards run eagerly, on a compiled Decoder too (the fast path's captured steps take one
start slot; a batch's cache, of another shape, drops them: setup_cache)."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from specdec_runtime.errors import SpecdecError


def bound(decoder, start: Tensor, T: int) -> int:
    """The slots a forward at per-row `start` [B] attends over (one host read of the starts)."""
    end = int(start.max()) + T
    if decoder.cache is None or end > decoder.cache.size or start.shape[0] != decoder.kv_layers[0].shape[0]:
        raise ValueError(f"per-row starts need a cache of {start.shape[0]} rows and {end} slots: call setup_cache")
    return end


@contextmanager
def one_row(decoder, b: int) -> Iterator[None]:
    """Forwards (at a start [1]) on row b of a batch's cache alone: a prompt prefilled into a row
    its sequence left (batched decoding's queue), the other rows untouched. Row b starts at slot 0."""
    kept = decoder.kv_layers, decoder.row_start
    if decoder.row_start is not None:
        decoder.row_start[b] = 0
    decoder.kv_layers = [kv[b : b + 1] for kv in kept[0]]  # views: the writes land in the batch's cache
    decoder.row_start = torch.zeros(1, dtype=torch.long, device=decoder.device)  # (never the one-sequence kernel)
    try:
        yield
    finally:
        decoder.kv_layers, decoder.row_start = kept


def attention_inputs(decoder, start: Tensor, T: int, bound: int, tree) -> tuple:
    """(cos, sin [B, T, 1, D], slots [B, T], mask [B, 1, group * T, bound], bound) of T new tokens a
    row at slots start [B] onward."""
    if tree is not None:
        raise SpecdecError("a slot per row takes chains, not token trees")
    slots = start[:, None] + decoder.slots[:T]  # [B, T]
    row_start = decoder.row_start if decoder.row_start is not None else torch.zeros_like(start)
    positions = (slots - row_start[:, None]).clamp_(min=0)  # (a left pad's own rows: position 0)
    cs = decoder.rope[positions]  # [B, T, 2, D]
    k_slot = decoder.slots[:bound]
    q = slots[:, :, None]
    mask = (k_slot <= q) & (k_slot >= row_start[:, None, None])  # [B, T, bound]
    window = decoder.config.sliding_window
    if window is not None:
        mask &= k_slot > q - window
    mask |= k_slot == q  # a left pad's slots see themselves (no row of -inf only)
    group = decoder.config.num_heads // decoder.config.num_kv_heads
    return cs[:, :, None, 0], cs[:, :, None, 1], slots, mask.repeat(1, group, 1)[:, None], bound
