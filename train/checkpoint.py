"""Checkpoints a run resumes from: accelerate state (model, optimizer, scheduler, RNG) + a small trainer state.

    save_checkpoint(accelerator, out / "checkpoints", step=100, state={"stats": {...}, "history": [...]}, keep=2)
    step, state, extra = resume(accelerator, out / "checkpoints")  # (0, {}, {}) when the run starts fresh
    path = latest_checkpoint(out / "checkpoints")           # the newest complete one, or None
    state, extra = load_checkpoint(accelerator, path)       # {"step": 100, ...}, extra tensors

A checkpoint is written to step-N.tmp, then its manifest (every file's size and SHA-256) is written
last, and the folder is renamed to step-N: an interrupted save never shadows the previous
checkpoint. Before resuming, rank 0 checks the newest step-N against its manifest; a damaged one
(a truncated file, a disk error) is set aside as step-N.corrupt, with a message naming it, and
the next newest is checked, so a run resumes from its newest intact checkpoint.
"""

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

STATE = "trainer_state.json"
MANIFEST = "manifest.json"
PATTERN = re.compile(r"^step-(\d+)$")


def _checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint folders (renamed into place), oldest first."""
    return sorted((int(m.group(1)), p) for p in folder.glob("step-*") if (m := PATTERN.match(p.name)) and p.is_dir())


def latest_checkpoint(folder: Path) -> Path | None:
    found = _checkpoints(folder)
    return found[-1][1] if found else None


def manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of every file under folder but the manifest itself."""
    out = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        h = hashlib.sha256()
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
        out[str(f.relative_to(folder))] = {"size": f.stat().st_size, "sha256": h.hexdigest()}
    return out


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with a checkpoint folder (None when it matches its manifest)."""
    file = path / MANIFEST
    if not file.is_file():  # written before checkpoints had manifests: trusted as before
        return None if (path / STATE).is_file() else f"neither {MANIFEST} nor {STATE}"
    try:
        expected = json.loads(file.read_text())
    except ValueError:
        return f"{MANIFEST} is not valid JSON"
    found = manifest(path)
    for name, meta in expected.items():
        if name not in found:
            return f"{name} is missing"
        if found[name]["size"] != meta["size"]:
            return f"{name} has {found[name]['size']} bytes, {meta['size']} expected"
        if found[name]["sha256"] != meta["sha256"]:
            return f"{name} does not match its checksum"
    return None


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
        (tmp / MANIFEST).write_text(json.dumps(manifest(tmp), indent=1))  # last: it vouches for the rest
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        complete = [p for _, p in _checkpoints(folder)]
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


def set_aside_damaged(folder: Path, print_line: Any = print) -> None:
    """Check the newest checkpoints against their manifests (rank 0), renaming each damaged one to
    step-N.corrupt, until the newest is intact (or none is left)."""
    while (path := latest_checkpoint(folder)) is not None and (why := checkpoint_problem(path)) is not None:
        aside = path.with_name(path.name + ".corrupt")
        shutil.rmtree(aside, ignore_errors=True)
        path.rename(aside)
        print_line(f"checkpoint {path} is damaged ({why}): set aside as {aside.name}; resuming from an older one")


def resume(accelerator: Any, folder: Path) -> tuple[int, dict[str, Any], dict[str, torch.Tensor]]:
    """(first step, trainer state, extra tensors) from the newest intact checkpoint in `folder`,
    restored into the accelerator, or (0, {}, {}) when there is none."""
    if accelerator.is_main_process:
        set_aside_damaged(folder, accelerator.print)
    accelerator.wait_for_everyone()
    ckpt = latest_checkpoint(folder)
    if ckpt is None:
        return 0, {}, {}
    state, extra = load_checkpoint(accelerator, ckpt)
    accelerator.print(f"resumed from {ckpt} at step {state['step']}")
    return state["step"], state, extra
