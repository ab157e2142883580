"""The KV cache: keys and values of every layer in one buffer indexed by slot (model.Decoder's,
a batch's rows, MTP heads'), and the spans of it a fast-path step attends over."""

from functools import lru_cache

import torch
from torch import Tensor, nn

from specdec_runtime.config import DecoderConfig


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


SPAN = 256  # the fast path's smallest span; its caches are sized in steps of it (Decoder.setup_cache)


@lru_cache(maxsize=64)
def cache_spans(size: int, live: bool) -> tuple[int, ...]:
    """Decoder.spans() for a cache of `size` slots, computed once per size (every fast-path step asks)."""
    if not live:
        return (size,)
    return tuple(SPAN << i for i in range(max(0, (size - 1) // SPAN).bit_length()) if SPAN << i < size) + (size,)
