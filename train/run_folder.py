"""The run folder: one run at a time, and a record of the settings that actually ran.

    lock = RunLock(out)              # raises SpecdecError naming the run that holds the folder
    lock.release()
    changes = config_changes(saved, new, allowed=RESUMABLE)   # {"optim.lr": (0.001, 0.01), ...}
    write_config(out, new, yaml_text, changes, step=30)       # config.yaml, + config_history.jsonl
    truncate_log(out / "log.jsonl", step=30)                  # a resumed run logs its redone steps once

The lock is an advisory fcntl lock on output_dir/.lock, which also holds the owner's pid, host,
start time and command, and is removed when the run ends. The operating system drops the lock when
its process dies (however it dies), so a lock file left by a killed run is found stale and taken
over. A process may take a folder it already holds again (a run that raised, then reran in the
same Python process, as the tests do).
"""

import datetime
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from specdec_runtime.errors import SpecdecError

LOCK = ".lock"
HISTORY = "config_history.jsonl"
_held: dict[Path, Any] = {}  # lock files this process holds, by folder


class RunLock:
    """An exclusive lock on a run folder for this process (see the module docstring)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder).resolve()
        if self.folder in _held:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK
        while True:
            f = open(path, "a+")  # noqa: SIM115 (held open for the run's lifetime)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                owner = _describe(f.read())
                f.close()
                raise SpecdecError(
                    f"output_dir {self.folder} is in use by another run ({owner}): wait for it to end or stop "
                    "it, or give this run another output_dir"
                ) from None
            if path.exists() and os.fstat(f.fileno()).st_ino == path.stat().st_ino:
                break  # the lock file is still the folder's (its last owner may have just removed it)
            f.close()
        f.seek(0)
        previous = f.read().strip()
        if previous:
            print(f"note: {self.folder}: the run that held it before ({_describe(previous)}) is gone", file=sys.stderr)
        f.seek(0)
        f.truncate()
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": _now(), "command": " ".join(sys.argv)}
        f.write(json.dumps(owner) + "\n")
        f.flush()
        _held[self.folder] = f

    def release(self) -> None:
        """Remove the lock file and unlock (in that order: see the inode check above)."""
        f = _held.pop(self.folder, None)
        if f is not None:
            (self.folder / LOCK).unlink(missing_ok=True)
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()


def _describe(text: str) -> str:
    try:
        o = json.loads(text)
        return f"pid {o['pid']} on {o['host']} since {o['since']}: {o['command']}"
    except (ValueError, KeyError, TypeError):
        return "owner unknown"


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# ---------------------------------------------------------------- settings


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1}} -> {"optim.lr": 1} (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out |= flatten(v, key + ".")
        else:
            out[key] = v
    return out


def config_changes(saved: dict[str, Any], new: dict[str, Any], allowed: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Settings that differ between two resolved configs, {dotted key: (saved, new)}, leaving out
    the keys under `allowed` (dotted prefixes)."""
    a, b = flatten(saved), flatten(new)
    changed = {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}
    return {k: v for k, v in changed.items() if not any(k == p or k.startswith(p + ".") for p in allowed)}


def describe_changes(changes: dict[str, tuple]) -> str:
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())


def write_config(folder: Path, yaml_text: str, changes: dict[str, tuple], step: int) -> None:
    """config.yaml = what runs from now on (atomically); changes from the saved one are appended
    to config_history.jsonl with the step they apply from."""
    if changes:
        record = {"time": _now(), "from_step": step, "changes": {k: list(v) for k, v in changes.items()}}
        with (folder / HISTORY).open("a") as f:
            f.write(json.dumps(record) + "\n")
    tmp = folder / "config.yaml.tmp"
    tmp.write_text(yaml_text)
    os.replace(tmp, folder / "config.yaml")


def truncate_log(path: Path, step: int) -> None:
    """Drop the log lines of steps after `step` (a resumed run redoes them and logs them again)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = [line for line in lines if _step_of(line) <= step]
    if len(keep) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")  # a line cut by a crash
