"""`specdec bench --batch-sizes 1,4,16`: what each drafter buys at each batch size; `specdec bench
--drafts 1,2,4`: what SpecTr's k sequences a round buy when sampling.

Per drafter, mode and batch size, the prompts are decoded that many at a time (in their order),
speculatively and autoregressively at the same batch size, batch beside batch
(measure(batch_size=)); a row gives both tokens/s, tau, the speedup and, greedy, how many outputs
equal the autoregressive ones. A drafter that decodes one prompt at a time (drafters/batched.py
says which) gets its batch-1 row only, and the table says so. Every size decodes the same way,
batch 1 included (on a compiled target, CUDA's default, in captured steps: rows.captured_rows), so
that the column compares like with like. Writes batch.md, batch.json and speedup_vs_batch.png to
the output folder.

Per drafter, temperature (0.7 and 1.0: SpecTr changes nothing greedy) and k, the prompts are
decoded with k sampled sequences a round (drafters/multi.py) beside autoregressive decoding
(measure(baseline=True)): drafts.md and drafts.json.
"""

import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from specdec_runtime.drafters.batched import batch_drafter
from specdec_runtime.drafters.multi import MultiDraft
from specdec_runtime.drafters.spec import as_chains, build_drafter
from specdec_runtime.loading import LoadedModel
from specdec_runtime.measure import measure
from specdec_runtime.sampling import Sampler


def _drafters(target: LoadedModel, specs: Sequence[str], gamma: int | None, dtype: str, chains: bool = False):
    """(spec, drafter, its gamma) of each spec but none (autoregressive decoding is every row's
    baseline); chains: tree drafters as chains (as_chains)."""
    for spec in specs:
        if spec == "none":
            continue
        drafter = build_drafter(spec, target, dtype=dtype)
        if chains:
            drafter = as_chains(drafter, spec, target, dtype=dtype)
        yield spec, drafter, gamma or drafter.gamma or 4


def _figures(target: LoadedModel, drafter, encoded: Sequence[list[int]], sampler: Callable[[], Sampler], **kw) -> dict:
    """The prompts decoded with the drafter beside autoregressive decoding (measure(baseline=True)):
    both tokens/s, tau, the speedup and, greedy, the share of outputs equal to autoregressive ones."""
    report = measure(target.model, drafter, encoded, baseline=True, sampler=sampler, stop_ids=target.stop_ids, **kw)
    spec, ar = report.total("spec"), report.total("baseline")
    return {"tok_s": spec.tokens_per_s, "ar_tok_s": ar.tokens_per_s, "tau": spec.tau, "speedup": report.speedup(),
            "lossless": report.lossless_rate()}  # fmt: skip


def _markdown(title: str, header: Sequence[str], left: int, cells: Sequence[Sequence[str]]) -> str:
    """A markdown table under a heading, its first `left` columns left-aligned."""
    rule = ["---"] * left + ["---:"] * (len(header) - left)
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells]) + "\n"


def sweep(
    target: LoadedModel,
    encoded: Sequence[list[int]],
    specs: Sequence[str],
    sizes: Sequence[int],
    modes: Sequence[str],
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    max_new_tokens: int,
    gamma: int | None,
    dtype: str,
    progress=None,
) -> list[dict]:
    """One row per drafter, mode and batch size."""
    rows = []
    for spec, drafter, g in _drafters(target, specs, gamma, dtype):
        batched = batch_drafter(drafter)
        for mode in modes:
            sampler = partial(Sampler, temperature if mode == "sampled" else 0.0, top_k, top_p, seed=seed)
            for B in sizes:
                row = {"drafter": spec, "mode": mode, "batch": B, "gamma": g}
                if B > 1 and batched is None:
                    rows.append(row | {"note": "decodes one prompt at a time"})
                    continue
                rows.append(row | _figures(target, batched if B > 1 else drafter, encoded, sampler, batch_size=B,
                                           gamma=g, max_new_tokens=max_new_tokens))  # fmt: skip
                if progress is not None:
                    progress(rows[-1])
    return rows


def markdown(rows: Sequence[dict], title: str) -> str:
    cells = []
    for r in rows:
        first = [r["drafter"], r["mode"], str(r["batch"])]
        if "note" in r:
            cells.append(first + [r["note"], "", "", "", ""])
            continue
        lossless = "-" if r["lossless"] is None else f"{r['lossless']:.0%}"
        cells.append(first + [f"{r['ar_tok_s']:.1f}", f"{r['tok_s']:.1f}", f"{r['tau']:.2f}", f"{r['speedup']:.2f}x",
                              lossless])  # fmt: skip
    header = ["drafter", "mode", "batch", "AR tok/s", "spec tok/s", "tau", "speedup", "lossless"]
    return _markdown(title, header, 2, cells)


def plot(rows: Sequence[dict], out: Path) -> Path:
    """speedup_vs_batch.png: speedup over autoregressive decoding against batch size, a line per
    drafter and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key in dict.fromkeys((r["drafter"], r["mode"]) for r in rows if "speedup" in r):
        mine = [r for r in rows if (r["drafter"], r["mode"]) == key and "speedup" in r]
        ax.plot([r["batch"] for r in mine], [r["speedup"] for r in mine], marker="o", label=f"{key[0]} ({key[1]})")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over autoregressive (same batch)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "speedup_vs_batch.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out: Path, rows: Sequence[dict], title: str) -> tuple[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, title)
    (out / "batch.md").write_text(table)
    (out / "batch.json").write_text(json.dumps(list(rows), indent=1) + "\n")
    return table, plot(rows, out)


def drafts_sweep(
    target: LoadedModel,
    encoded: Sequence[list[int]],
    specs: Sequence[str],
    ks: Sequence[int],
    temperatures: Sequence[float],
    *,
    top_k: int,
    top_p: float,
    seed: int,
    max_new_tokens: int,
    gamma: int | None,
    dtype: str,
    progress=None,
) -> list[dict]:
    """One row per drafter, temperature and k (SpecTr's sequences a round; 1: speculative sampling)."""
    rows = []
    for spec, drafter, g in _drafters(target, specs, gamma, dtype, chains=True):  # SpecTr draws chains
        for t in temperatures:
            for k in ks:
                row = {"drafter": spec, "temperature": t, "drafts": k, "gamma": g}
                sampler = partial(Sampler, t, top_k, top_p, seed=seed)
                rows.append(row | _figures(target, MultiDraft(drafter, k), encoded, sampler, gamma=g,
                                           max_new_tokens=max_new_tokens))  # fmt: skip
                if progress is not None:
                    progress(rows[-1])
    return rows


def drafts_markdown(rows: Sequence[dict], title: str) -> str:
    cells = [[r["drafter"], str(r["temperature"]), str(r["drafts"]), str(r["gamma"]), f"{r['ar_tok_s']:.1f}",
              f"{r['tok_s']:.1f}", f"{r['tau']:.2f}", f"{r['speedup']:.2f}x"] for r in rows]  # fmt: skip
    header = ["drafter", "temperature", "drafts", "gamma", "AR tok/s", "spec tok/s", "tau", "speedup"]
    return _markdown(title, header, 1, cells)
