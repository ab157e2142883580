"""The frozen target's hidden states, computed once per example and kept on disk, so that epochs
do not rerun the target (Medusa-1 heads, EAGLE-3 drafters).

    key = cache_key(target_path, examples, dtype, what="eagle3 taps (2, 15, 27)")   # -> $SPECDEC_CACHE/hidden/<key>
    examples = cache_states(target, examples, folder, states=fn, pad_id=2, token_bytes=4 * H * 2)
    # fn(lm, input_ids, attention_mask) -> {"hidden": [B, T, H], ...}; each example's meta[name] is
    # a Stored reference to its [T, H], read from disk when a micro-batch needs it
    batch = padded(micro_batch, "hidden", device)                                  # [B, T, H], right-padded

A stream, never a whole share in memory: each process computes every world-th example, in
batches, and writes its states to shard files of about `shard_bytes` as it goes (safetensors, in
the target's dtype; each written under a temporary name and renamed, so a killed run leaves only
whole shards). A rerun reads the shards' headers, computes only the examples none of them holds,
and adds shards of its own. Training reads each example's states lazily from its shard (memory
mapped). Before computing, every process checks the disk the missing states need against the
folder's free space and refuses with a message when it does not fit.
"""

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from train.data import Example, collate

States = Callable[[Any, Tensor, Tensor], dict[str, Tensor]]
SHARD_BYTES = 1 << 30  # a shard holds about this much: a kill loses at most one, and memory holds one
HEADROOM = 1.05  # the free space asked beyond the states themselves (safetensors headers, the filesystem's own)


class Stored(NamedTuple):
    """One example's state in a shard file; load() reads it (that tensor only, memory mapped)."""

    path: str
    key: str
    version: int  # the shard's mtime (ns): a rewritten shard is opened afresh

    def load(self) -> Tensor:
        return _open(self.path, self.version).get_tensor(self.key)


@functools.lru_cache(maxsize=64)
def _open(path: str, version: int) -> Any:
    return safe_open(path, framework="pt", device="cpu")


def cache_key(target_path: str | Path, examples: list[Example], dtype: torch.dtype, what: str = "final") -> str:
    """A key for the states `what` of a target (by path and dtype) on these examples."""
    h = hashlib.sha256(json.dumps([str(Path(target_path).resolve()), str(dtype), what]).encode())
    for e in examples:
        h.update(json.dumps(e.ids).encode())
    return h.hexdigest()[:16]


def stored_states(folder: Path) -> dict[int, dict[str, Stored]]:
    """What the folder's shards hold: example index -> {state name: Stored}, read from their headers."""
    found: dict[int, dict[str, Stored]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        version = f.stat().st_mtime_ns
        for key in _open(str(f), version).keys():
            name, _, index = key.rpartition(".")
            found.setdefault(int(index), {})[name] = Stored(str(f), key, version)
    return found


def disk_needed(examples: list[Example], token_bytes: int) -> int:
    """Bytes the states of these examples take on disk: token_bytes a token (every state, its dtype)."""
    return sum(len(e.ids) for e in examples) * token_bytes


def check_disk(folder: Path, need: int, free: int | None = None) -> int:
    """Refuse, before any state is computed, where the folder's filesystem lacks `need` bytes;
    returns the free bytes it checked against."""
    free = shutil.disk_usage(folder).free if free is None else free
    if need * HEADROOM > free:
        raise RuntimeError(
            f"the hidden-state store needs {_size(need)} more in {folder}, which has {_size(free)} free: "
            "point responses.cache_dir at a larger disk, train on fewer examples (data.max_samples), or compute "
            "the states as training runs (eagle3.cache_hidden=false / medusa.cache_hidden=false; no disk, the "
            "target runs every epoch)"
        )
    return free


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


@torch.no_grad()
def cache_states(
    target: Any,
    examples: list[Example],
    folder: Path,
    *,
    states: States,
    pad_id: int,
    token_bytes: int,
    batch_size: int = 8,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], Any] = lambda: None,
    progress: Any = None,
    shard_bytes: int = SHARD_BYTES,
    say: Callable[[str], Any] = lambda line: None,
    together: Callable[[int], int] | None = None,
) -> list[Example]:
    """The examples with meta[name] = Stored for every state `states` computes (see the module
    docstring). token_bytes: the bytes of one token's states, for the disk check, whose figures
    `say` gets before anything is computed. together: for a target split across the processes,
    whose every forward is a collective: n -> the most forwards any process runs (each runs that
    many, the extra ones on one token)."""
    folder.mkdir(parents=True, exist_ok=True)
    done = stored_states(folder)
    barrier()  # every process has read the same shards before any writes one: the same check everywhere
    missing = [e for i, e in enumerate(examples) if i not in done]
    need = disk_needed(missing, token_bytes)
    free = check_disk(folder, need)
    if missing:
        say(f"hidden-state store {folder}: {len(missing):,} of {len(examples):,} examples to compute, "
            f"{_size(need)} on disk ({_size(free)} free)")  # fmt: skip
    mine = sorted((i for i in range(rank, len(examples), world) if i not in done), key=lambda i: len(examples[i].ids))
    batches = -(-len(mine) // batch_size)
    idle = together(batches) - batches if together else 0
    if mine:  # by length: less padding
        _compute(target, examples, mine, folder, states, pad_id, batch_size, rank, progress, shard_bytes)
    if idle:  # the forwards the busiest process still runs (their gathers need this one)
        one = torch.full((1, 1), pad_id, device=next(target.parameters()).device)
        for _ in range(idle):
            states(target, one, torch.ones_like(one))
    barrier()
    stored = stored_states(folder)
    names = sorted({n for s in stored.values() for n in s})
    lacking = [i for i in range(len(examples)) if set(stored.get(i, ())) != set(names)] if names else [0]
    if lacking:
        raise RuntimeError(f"hidden-state store {folder} lacks {len(lacking)} examples: delete it and rerun")
    return [Example(e.ids, e.loss_mask, {**e.meta, **stored[i]}) for i, e in enumerate(examples)]


def _compute(target, examples, mine, folder, states, pad_id, batch_size, rank, progress, shard_bytes) -> None:
    """This process's missing examples, batch by batch, into new shards of about shard_bytes."""
    taken = [int(f.stem.rpartition("-")[2]) for f in folder.glob(f"shard-r{rank}-*.safetensors")]
    number = max(taken, default=-1) + 1  # after this rank's shards from earlier runs
    out: dict[str, Tensor] = {}
    size = 0
    bar = progress(len(mine)) if progress else None
    device = next(target.parameters()).device
    for start in range(0, len(mine), batch_size):
        idx = mine[start : start + batch_size]
        batch = collate([examples[i] for i in idx], pad_id)
        computed = states(target, batch["input_ids"].to(device), batch["attention_mask"].to(device))
        for name, value in computed.items():
            for b, i in enumerate(idx):
                out[f"{name}.{i}"] = row = value[b, : len(examples[i].ids)].to("cpu").contiguous()
                size += row.numel() * row.element_size()
        if size >= shard_bytes or start + batch_size >= len(mine):
            path = folder / f"shard-r{rank}-{number:05d}.safetensors"
            save_file(out, str(path.with_suffix(".tmp")))
            os.replace(path.with_suffix(".tmp"), path)
            out, size, number = {}, 0, number + 1
        if bar is not None:
            bar.update(len(idx))
    if bar is not None:
        bar.close()


def padded(examples: list[Example], name: str, device: torch.device) -> Tensor:
    """The stored state `name` of a micro-batch, right-padded like collate(): [B, T, *]."""
    rows = [e.meta[name].load() if isinstance(e.meta[name], Stored) else e.meta[name] for e in examples]
    T = max(len(e.ids) for e in examples)
    out = rows[0].new_zeros(len(examples), T, *rows[0].shape[1:])
    for b, row in enumerate(rows):
        out[b, : row.shape[0]] = row
    return out.to(device)
