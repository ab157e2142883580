"""The frozen target's hidden states, computed once per example and kept on disk, so that epochs
do not rerun the target (Medusa-1 heads, EAGLE-3 drafters).

    key = cache_key(target_path, examples, dtype, what="eagle3 taps (2, 15, 27)")   # -> $SPECDEC_CACHE/hidden/<key>
    examples = cache_states(target, examples, folder, states=fn, pad_id=2, batch_size=8)
    # fn(lm, input_ids, attention_mask) -> {"hidden": [B, T, H], ...}; each example's meta[name] is its [T, H]
    batch = padded(micro_batch, "hidden", device)                                  # [B, T, H], right-padded

Each process computes every world-th example into its own safetensors part (in the target's dtype);
then all read all parts. A killed computation leaves no part file (each is written then renamed),
so a rerun computes the missing ones.
"""

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from train.data import Example, collate

States = Callable[[Any, Tensor, Tensor], dict[str, Tensor]]


def cache_key(target_path: str | Path, examples: list[Example], dtype: torch.dtype, what: str = "final") -> str:
    """A key for the states `what` of a target (by path and dtype) on these examples."""
    h = hashlib.sha256(json.dumps([str(Path(target_path).resolve()), str(dtype), what]).encode())
    for e in examples:
        h.update(json.dumps(e.ids).encode())
    return h.hexdigest()[:16]


@torch.no_grad()
def cache_states(
    target: Any,
    examples: list[Example],
    folder: Path,
    *,
    states: States,
    pad_id: int,
    batch_size: int = 8,
    rank: int = 0,
    world: int = 1,
    barrier: Any = lambda: None,
    progress: Any = None,
) -> list[Example]:
    """The examples with meta[name] [T, *] attached for every state `states` computes (see the
    module docstring)."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f"part-{rank}-of-{world}.safetensors"
    if not (folder / "done").is_file() and not part.is_file():
        mine = sorted(range(rank, len(examples), world), key=lambda i: len(examples[i].ids))  # less padding
        out: dict[str, Tensor] = {}
        bar = progress(len(mine)) if progress else None
        for idx in [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]:
            batch = collate([examples[i] for i in idx], pad_id)
            dev = next(target.parameters()).device
            computed = states(target, batch["input_ids"].to(dev), batch["attention_mask"].to(dev))
            for name, value in computed.items():
                for b, i in enumerate(idx):
                    out[f"{name}.{i}"] = value[b, : len(examples[i].ids)].to("cpu").contiguous()
            if bar is not None:
                bar.update(len(idx))
        if bar is not None:
            bar.close()
        save_file(out, str(part.with_suffix(".tmp")))
        part.with_suffix(".tmp").rename(part)
    barrier()
    stored: dict[str, Tensor] = {}
    for f in sorted(folder.glob("part-*.safetensors")):
        stored |= load_file(str(f))
    names = sorted({k.rsplit(".", 1)[0] for k in stored})
    missing = [i for i in range(len(examples)) if any(f"{n}.{i}" not in stored for n in names)] if names else [0]
    if missing:
        raise RuntimeError(f"hidden-state cache {folder} lacks {len(missing)} examples: delete it and rerun")
    if rank == 0:
        (folder / "done").write_text("")
    return [
        Example(e.ids, e.loss_mask, {**e.meta, **{n: stored[f"{n}.{i}"] for n in names}})
        for i, e in enumerate(examples)
    ]


def padded(examples: list[Example], name: str, device: torch.device) -> Tensor:
    """The cached state `name` of a micro-batch, right-padded like collate(): [B, T, *]."""
    T = max(len(e.ids) for e in examples)
    first = examples[0].meta[name]
    out = first.new_zeros(len(examples), T, *first.shape[1:])
    for b, e in enumerate(examples):
        out[b, : len(e.ids)] = e.meta[name]
    return out.to(device)
