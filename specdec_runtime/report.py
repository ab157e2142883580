"""What `specdec generate` writes: its --output file, streamed as prompts finish, and the summary
table it prints (rich), a row per category."""

import json
import os
import sys
from pathlib import Path

from specdec_runtime.errors import SpecdecError


class Output:
    """generate's --output: JSON lines streamed to FILE.part as prompts finish, renamed to FILE
    when the run ends, so an earlier FILE survives a failed or interrupted run."""

    def __init__(self, path: Path, prompts: Path | None):
        if path.is_dir():
            raise SpecdecError(f"--output {path} is a folder: give a file name (JSON lines)")
        if prompts is not None and path.resolve() == prompts.resolve():
            raise SpecdecError(f"--output {path} is the --prompts file: write the results to another file")
        self.path, self.partial, self.records = path, path.with_name(path.name + ".part"), 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.partial.open("w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.records += 1

    def finish(self) -> None:
        self.file.close()
        os.replace(self.partial, self.path)


def print_summary(title: str, prompts: list, report: "Report") -> None:  # noqa: F821
    """A rich table: one row per category, and a total row when there are several."""
    from rich.console import Console
    from rich.table import Table

    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p.category or "-", []).append(i)
    rows = sorted(groups.items())
    if len(rows) > 1:
        rows.append(("all", list(range(len(prompts)))))
    table = Table(title=title)
    cols = ["category", "prompts", "new tokens", "tau", "accept", "accept by position", "tok/s", "draft s", "verify s"]
    if report.baseline:
        cols += ["AR tok/s", "speedup"] + (["lossless"] if report.greedy else [])
    for col in cols:
        table.add_column(col, justify="left" if col in ("category", "accept by position") else "right")
    for name, idx in rows:
        s = report.total("spec", idx)
        by_pos = " ".join(f"{a:.2f}" for a in s.acceptance_per_position[:8]) or "-"
        by_pos += f" ({s.lookups})" if s.lookups else ""
        cells = [
            name,
            str(len(idx)),
            str(s.new_tokens),
            f"{s.tau:.2f}",
            f"{s.acceptance_rate:.2f}",
            by_pos,
            f"{s.tokens_per_s:.1f}",
            f"{s.draft_s:.2f}",
            f"{s.verify_s:.2f}",
        ]
        if report.baseline:
            cells += [f"{report.total('baseline', idx).tokens_per_s:.1f}", f"{report.speedup(idx):.2f}x"]
            if report.greedy:
                cells.append(f"{report.lossless_rate(idx):.0%}")
        table.add_row(*cells)
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def print_windows(every: int, updates: list, report: "Report") -> None:  # noqa: F821
    """Online adaptation: tau a window of `every` prompts, and the update that followed it."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"online adaptation: windows of {every} prompts, the drafter updated after each")
    for col in ("window", "prompts", "tau", "accept", "tok/s", "update s", "loss before -> after"):
        table.add_column(col, justify="right")
    n = len(report.spec)
    for w, first in enumerate(range(0, n, every)):
        s = report.total("spec", range(first, min(first + every, n)))
        u = updates[w] if w < len(updates) else None
        cells = [str(w), str(min(every, n - first)), f"{s.tau:.2f}", f"{s.acceptance_rate:.2f}"]
        cells.append(f"{s.tokens_per_s:.1f}")
        cells += [f"{u.seconds:.2f}", f"{u.before:.3f} -> {u.after:.3f}"] if u else ["-", "-"]
        table.add_row(*cells)
    Console(width=None if sys.stdout.isatty() else 200).print(table)
