"""Validation tau (measured, and the held-out estimate) against the training tokens a drafter saw.

    python -m recipes.eagle3 experiment=eagle3_quickstart validate.every=50 output_dir=runs/e3-curve
    python scripts/plot_tau_tokens.py runs/e3-curve --plot docs/eagle3_tau_tokens.png

Reads the run's log.jsonl: every validation (`val/tau`, `val/speedup`, `val/tau_estimate_chain`)
at its step, and the training tokens up to that step. The log holds one step's loss-token count
every trainer.log_every steps, so the tokens seen are that count times the steps it stands for
(the batches are shuffled, so it is an estimate within a few percent). Prints a table and saves
a plot; several run folders (e.g. more data) share one plot.
"""

import argparse
import json
from pathlib import Path


def curve(run: Path) -> list[dict]:
    """One row per validation: step, epoch, tokens seen, tau, estimate, speedup."""
    rows, seen, last_step, epoch = [], 0.0, 0, 0.0
    for line in (run / "log.jsonl").read_text().splitlines():
        entry = json.loads(line)
        step = entry["step"]
        if "train/tokens" in entry:
            seen += entry["train/tokens"] * (step - last_step)
            last_step, epoch = step, entry.get("train/epoch", epoch)
        if "val/tau" in entry:
            rows.append(
                {
                    "step": step,
                    "epoch": epoch,
                    "tokens": seen,
                    "tau": entry["val/tau"],
                    "estimate": entry.get("val/tau_estimate_chain"),
                    "speedup": entry.get("val/speedup"),
                }
            )
    if not rows:
        raise SystemExit(f"{run}/log.jsonl has no validation: train with validate.every=N (N > 0)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (output_dir) with validations in log.jsonl")
    ap.add_argument("--plot", type=Path, default=Path("docs/eagle3_tau_tokens.png"))
    args = ap.parse_args()

    curves = {run: curve(run) for run in args.runs}
    print("| run | step | epoch | training tokens | tau | held-out estimate | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for run, rows in curves.items():
        for r in rows:
            est = "-" if r["estimate"] is None else f"{r['estimate']:.2f}"
            speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
            seen = f"{r['tokens'] / 1e3:.0f}k"
            print(f"| {run.name} | {r['step']} | {r['epoch']:.2f} | {seen} | {r['tau']:.2f} | {est} | {speed} |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for run, rows in curves.items():
        x = [r["tokens"] / 1e3 for r in rows]
        left.plot(x, [r["tau"] for r in rows], "o-", label=f"{run.name}: measured")
        if all(r["estimate"] is not None for r in rows):
            left.plot(x, [r["estimate"] for r in rows], "x--", label=f"{run.name}: held-out estimate")
        if all(r["speedup"] is not None for r in rows):
            right.plot(x, [r["speedup"] for r in rows], "o-", label=run.name)
    left.set(xlabel="training loss tokens seen (thousands)", ylabel="tau (tokens per target forward)")
    right.set(xlabel="training loss tokens seen (thousands)", ylabel="speedup over autoregressive")
    right.axhline(1.0, color="grey", lw=0.8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("EAGLE-3 drafter: validation against training tokens")
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
