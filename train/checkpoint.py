"""Checkpoints a run resumes from: accelerate state (model, optimizer, scheduler, RNG) + a small trainer state.

    save_checkpoint(accelerator, out / "checkpoints", step=100, state={"loss": 1.2}, keep=2)
    step, extra = resume(accelerator, out / "checkpoints")  # (0, {}) when the run starts fresh
    path = latest_checkpoint(out / "checkpoints")           # None when there is none
    state, extra = load_checkpoint(accelerator, path)       # {"step": 100, ...}, extra tensors

A checkpoint is written to step-N.tmp and renamed to step-N once complete, so an interrupted save
never shadows the previous checkpoint; only complete step-N folders are resumed from.
"""

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

STATE = "trainer_state.json"
PATTERN = re.compile(r"^step-(\d+)$")


def latest_checkpoint(folder: Path) -> Path | None:
    steps = [
        (int(m.group(1)), p) for p in folder.glob("step-*") if (m := PATTERN.match(p.name)) and (p / STATE).is_file()
    ]
    return max(steps)[1] if steps else None


def save_checkpoint(
    accelerator: Any,
    folder: Path,
    *,
    step: int,
    state: dict[str, Any],
    tensors: dict[str, torch.Tensor] | None = None,
    keep: int = 2,
) -> Path:
    """Save on all processes (DeepSpeed/FSDP shard their state); rank 0 finalizes and prunes."""
    final, tmp = folder / f"step-{step:07d}", folder / f"step-{step:07d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every process has written its RNG state before the rename
    if accelerator.is_main_process:
        if tensors:
            torch.save(tensors, tmp / "extra.pt")
        (tmp / STATE).write_text(json.dumps({**state, "step": step}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        complete = sorted(p for p in folder.glob("step-*") if PATTERN.match(p.name))
        for old in complete[: max(0, len(complete) - keep)]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator: Any, path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Restore accelerate state from `path`; returns the trainer state and the extra tensors."""
    accelerator.load_state(str(path))
    extra = path / "extra.pt"
    tensors = torch.load(extra, map_location="cpu", weights_only=True) if extra.is_file() else {}
    return json.loads((path / STATE).read_text()), tensors


def resume(accelerator: Any, folder: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """(first step, extra tensors) from the latest checkpoint in `folder`, restored into the
    accelerator, or (0, {}) when there is none."""
    ckpt = latest_checkpoint(folder)
    if ckpt is None:
        return 0, {}
    state, extra = load_checkpoint(accelerator, ckpt)
    accelerator.print(f"resumed from {ckpt} at step {state['step']}")
    return state["step"], extra
