"""`specdec bench`: every drafter of one target, side by side, greedy and sampled.

    specdec bench --drafters none,ngram,truncate:28@1,runs/quickstart/export,runs/medusa/export \\
        --max-new-tokens 128 --output-dir runs/bench

    settings = BenchSettings(target="smollm2-135m-instruct", prompts=prompts_digest(prompts), ...)
    results = run_bench(target, prompts, encoded, ["none", "ngram"], settings, Path("runs/bench"))
    write_report(Path("runs/bench"), settings, results)    # results.md, results.json, *.png

Each mode first decodes every prompt autoregressively, once, shared by all drafters (it was once
per drafter: a bench of 3 drafters now decodes 3 + 1 passes instead of 6); then each drafter decodes
every prompt, followed per prompt by transformers' (assisted) generation with the same drafter
where transformers has one (reference.py). `paired` (`specdec bench --paired`) decodes each prompt
autoregressively again right beside each drafter's run of it (before it on even prompts, after
it on odd ones) and measures the drafter against that run, for machines whose speed drifts
between the shared pass and the drafter's. Speedups are ratios of runs in the same bench, on the
same prompts. The expected duration is printed after the first autoregressive pass, and one
progress bar covers the whole bench. A spec may end in @G to fix its draft length (`truncate:28@1`).

Each drafter's results go to drafters/<name>.json as soon as it is done; a rerun with the same
settings skips what is there (an interrupted bench resumes per drafter). A drafter that fails to
load or decode is reported with its error and the others still run.
"""

import hashlib
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.loading import LoadedModel
from specdec_runtime.measure import warm_up
from specdec_runtime.paths import resolve_model
from specdec_runtime.prompts import Prompt
from specdec_runtime.reference import assisted_kwargs, hf_generate
from specdec_runtime.sampling import Sampler
from specdec_runtime.stats import GenerationStats

MODES = ("greedy", "sampled")


@dataclass(frozen=True)
class BenchSettings:
    """Everything a bench's numbers depend on: a resumed bench must have the same."""

    target: str
    prompts: str  # prompts_digest()
    max_new_tokens: int
    temperature: float  # of the sampled mode
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    gamma: int | None = None  # for every drafter without its own @G (None: the drafter's own, else 4)
    adaptive_gamma: bool = False
    max_gamma: int = 16
    confidence: float = 0.0
    tree: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    products: str = "torch"  # a CPU's few-row products: cpu.products()
    threads: int | None = None  # CPU threads every run decodes on (None on a GPU)
    chat: bool = True
    reference: bool = True
    paired: bool = False  # autoregressive runs timed next to each drafter's (see bench_drafter)
    runtime: str = ""  # runtime_digest(): results measured by other runtime code do not resume


def prompts_digest(prompts: Sequence[Prompt], encoded: Sequence[Sequence[int]]) -> str:
    """A short hash of the prompts as the target sees them (ids, categories and token ids)."""
    h = hashlib.sha1()
    for p, ids in zip(prompts, encoded):
        h.update(json.dumps([p.id, p.category, list(ids)]).encode())
    return f"{len(prompts)} prompts, sha1 {h.hexdigest()[:12]}"


def runtime_digest() -> str:
    """A short hash of the runtime's code (specdec_runtime's Python and C sources): a bench resumed
    after the runtime changed would set new runs beside old ones measured with other code."""
    root = Path(__file__).parent
    h = hashlib.sha1()
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".c", ".h"):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return f"sha1 {h.hexdigest()[:12]}"


def parse_spec(spec: str) -> tuple[str, int | None]:
    """'truncate:28@1' -> ('truncate:28', 1); a spec without @G keeps gamma None."""
    head, at, tail = spec.strip().rpartition("@")
    if at and tail.isdigit() and head:
        return head, int(tail)
    return spec.strip(), None


def slug(spec: str) -> str:
    """A file name for a drafter spec."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", spec).strip("_") or "drafter"


def check_settings(out: Path, settings: BenchSettings, fresh: bool) -> None:
    """Start a new bench in `out`, or resume one that used the same settings."""
    path = out / "settings.json"
    if fresh and (out / "drafters").is_dir():
        for f in (out / "drafters").glob("*.json"):
            f.unlink()
    if path.is_file() and not fresh:
        before = json.loads(path.read_text())
        changed = {k: (before.get(k), v) for k, v in asdict(settings).items() if before.get(k) != v}
        if changed:
            what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
            raise SpecdecError(
                f"{out} holds a bench with other settings ({what}): pass another --output-dir, or --fresh to "
                "discard its results"
            )
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, asdict(settings))


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (a killed bench never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def run_bench(
    target: LoadedModel,
    prompts: Sequence[Prompt],
    encoded: Sequence[list[int]],
    specs: Sequence[str],
    settings: BenchSettings,
    out: Path,
    *,
    modes: Sequence[str] = MODES,
    hf: Any = None,
    progress: Callable[[int], Any] | None = None,
) -> list[dict]:
    """Measure every drafter spec in every mode; one result dict per spec (see module docstring).
    progress(total) -> a tqdm-like bar over every decoding run of the bench (update, set_postfix_str)."""
    done = {}
    for spec in specs:
        path = result_path(out, spec)
        done[spec] = json.loads(path.read_text()) if path.is_file() else {"drafter": spec, "modes": {}}
        if all(m in done[spec]["modes"] for m in modes):
            print(f"bench: {spec}: resumed from {path}", file=sys.stderr)
    todo = [(spec, m) for spec in specs for m in modes if m not in done[spec]["modes"]]
    ar_modes = sorted({m for _, m in todo}, key=modes.index)
    bar = progress(len(encoded) * (len(ar_modes) + len(todo))) if progress and todo else None
    ar: dict[str, list[dict]] = {}
    for mode in ar_modes:  # one autoregressive pass per mode, shared by every drafter
        ar[mode] = autoregressive(target, encoded, mode, settings, bar)
        if len(ar) == 1:
            left = expected_duration(ar[mode], len(ar_modes) - 1, len(todo), hf is not None, settings.paired)
            print(left, file=sys.stderr)
    for spec, mode in todo:
        if bar is not None:
            bar.set_postfix_str(f"{spec} ({mode})")
        done[spec]["modes"][mode] = bench_drafter(target, prompts, encoded, spec, mode, settings, hf, ar[mode], bar)
        ok = {m: e for m, e in done[spec]["modes"].items() if "error" not in e}  # failures are retried next run
        if ok:
            write_json(result_path(out, spec), {"drafter": spec, "modes": ok})
    if bar is not None:
        bar.close()
    return [{"drafter": s, "modes": {m: done[s]["modes"][m] for m in modes if m in done[s]["modes"]}} for s in specs]


def result_path(out: Path, spec: str) -> Path:
    return out / "drafters" / f"{slug(spec)}.json"


def sampling_of(settings: BenchSettings, mode: str) -> dict[str, Any]:
    """A mode's sampling settings: greedy is temperature 0."""
    temperature = settings.temperature if mode == "sampled" else 0.0
    return dict(temperature=temperature, top_k=settings.top_k, top_p=settings.top_p)


def sampler_for(settings: BenchSettings, mode: str) -> Callable[[int], Sampler]:
    """Prompt i's sampler in a mode (seeded per prompt: the drafter's run and the AR run draw alike)."""
    sampling = sampling_of(settings, mode)
    return lambda i: Sampler(**sampling, seed=settings.seed + i)


def autoregressive(
    target: LoadedModel, encoded: Sequence[list[int]], mode: str, settings: BenchSettings, bar: Any
) -> list[dict]:
    """Every prompt decoded autoregressively in a mode (after a warm-up): {"tokens", "stats"} each."""
    sampler = sampler_for(settings, mode)
    kw = dict(max_new_tokens=settings.max_new_tokens, stop_ids=target.stop_ids, capacity=capacity_of(encoded, settings))
    if bar is not None:
        bar.set_postfix_str(f"autoregressive ({mode})")
    generate(target.model, encoded[0], None, sampler(0), **{**kw, "max_new_tokens": min(8, settings.max_new_tokens)})
    runs = []
    for i, ids in enumerate(encoded):
        g = generate(target.model, ids, None, sampler(i), **kw)
        runs.append({"tokens": g.tokens, "stats": g.stats.to_dict()})
        if bar is not None:
            bar.update()
    return runs


def capacity_of(encoded: Sequence[list[int]], settings: BenchSettings) -> int:
    return max(len(ids) for ids in encoded) + settings.max_new_tokens  # caches sized once


def expected_duration(ar: Sequence[dict], ar_left: int, runs: int, reference: bool, paired: bool = False) -> str:
    """What the rest of the bench should take, from the first autoregressive pass: each drafter run
    about one AR pass, transformers' reference about one more, a paired AR pass one more."""
    seconds = sum(r["stats"]["total_s"] for r in ar)
    left = seconds * (ar_left + runs * (1 + reference + paired))
    extras = [what for what, on in (("transformers' reference", reference), ("paired AR runs", paired)) if on]
    return (
        f"bench: autoregressive decoding took {seconds:.0f} s for {len(ar)} prompts; {runs} drafter runs "
        f"{'with ' + ' and '.join(extras) if extras else 'alone'} should take about {left / 60:.0f} min more"
    )


def bench_drafter(
    target: LoadedModel,
    prompts: Sequence[Prompt],
    encoded: Sequence[list[int]],
    spec: str,
    mode: str,
    settings: BenchSettings,
    hf: Any,
    ar: Sequence[dict],
    bar: Any = None,
) -> dict:
    """One drafter in one mode against the mode's shared autoregressive runs `ar`: {"gamma",
    "reference", "records": [...]} or {"error": ...}. With settings.paired, each prompt is decoded
    autoregressively again right beside the drafter's run (alternately before and after), and that
    run is its baseline: the shared pass runs minutes earlier, and a CPU whose speed drifts by a
    third within minutes (seen on the developers' machine) moves the ratios by as much."""
    name, gamma = parse_spec(spec)
    try:
        drafter = build_drafter(name, target, confidence=settings.confidence, dtype=settings.dtype, tree=settings.tree)
    except Exception as e:  # reported in the table; the other drafters still run
        if bar is not None:
            bar.update(len(encoded))
        return failure(spec, "load", e)
    gamma = gamma or settings.gamma or (drafter.gamma if drafter is not None else None) or 4
    assist, why_not = reference_kwargs(hf, drafter, name, gamma, settings)
    sampling = sampling_of(settings, mode)
    kw = dict(max_new_tokens=settings.max_new_tokens, stop_ids=target.stop_ids)
    spec_kw = dict(kw, capacity=capacity_of(encoded, settings), gamma=gamma)
    spec_kw |= dict(adaptive_gamma=settings.adaptive_gamma, max_gamma=settings.max_gamma)
    device = target.model.device
    sampler = sampler_for(settings, mode)

    def reference(ids: list[int], i: int, max_new_tokens: int) -> tuple[list[int], float]:
        t0 = perf_counter(device)
        seed = settings.seed + i
        tokens = hf_generate(hf, ids, **{**kw, "max_new_tokens": max_new_tokens}, **sampling, seed=seed, **assist)
        return tokens, perf_counter(device) - t0

    def autoregressive(ids: Any, i: int) -> dict:
        g = generate(target.model, ids, None, sampler(i), **kw, capacity=spec_kw["capacity"])
        return {"tokens": g.tokens, "stats": g.stats.to_dict()}

    records = []
    try:  # warm-up: first calls pay for allocations, lazy init and compilation
        if drafter is not None:
            warm_up(target.model, drafter, encoded[0], lambda: sampler(0), **spec_kw)
        if assist is not None:
            reference(encoded[0], 0, min(8, settings.max_new_tokens))
        for i, ids in enumerate(encoded):
            base = ar[i]
            paired = settings.paired and drafter is not None  # the same prompt, right beside: drift cancels
            if paired and i % 2 == 0:  # which side goes first alternates: what it leaves behind favours neither
                base = autoregressive(ids, i)
            if drafter is None:
                tokens, stats = base["tokens"], base["stats"]
            else:
                run = generate(target.model, ids, drafter, sampler(i), **spec_kw)
                tokens, stats = run.tokens, run.stats.to_dict()
            if paired and i % 2 == 1:
                base = autoregressive(ids, i)
            record = {
                "id": prompts[i].id,
                "category": prompts[i].category or "-",
                "tokens": tokens,
                "stats": stats,
                "ar_tokens": base["tokens"],
                "ar_stats": base["stats"],
            }
            if assist is not None:
                ref_tokens, seconds = reference(ids, i, settings.max_new_tokens)
                record["reference"] = {
                    "new_tokens": len(ref_tokens),
                    "seconds": seconds,
                    "same_as_ar": ref_tokens == base["tokens"],
                }
            records.append(record)
            if bar is not None:
                bar.update()
    except Exception as e:
        if bar is not None:  # the prompts it will not decode
            bar.update(len(encoded) - len(records))
        return failure(spec, "decode", e)
    return {"gamma": gamma if drafter is not None else 0, "reference": why_not or "yes", "records": records}


def reference_kwargs(
    hf: Any, drafter: Any, name: str, gamma: int, settings: BenchSettings
) -> tuple[dict | None, str | None]:
    """transformers' generate() arguments for the reference run of this drafter, or (None, why not)."""
    if hf is None:
        return None, "off (--no-reference)"
    try:
        standalone = isinstance(drafter, ModelDrafter) and not drafter.shares_target_cache
        return assisted_kwargs(
            hf,
            drafter,
            gamma=gamma,
            adaptive_gamma=settings.adaptive_gamma,
            confidence=settings.confidence,
            drafter_path=resolve_model(name) if standalone else None,
        )
    except Exception as e:  # the drafter itself still runs
        return None, f"failed: {type(e).__name__}: {e}"


def failure(spec: str, stage: str, e: Exception) -> dict:
    """The result of a drafter that failed: its error, for the table (the traceback goes to stderr)."""
    message = str(e) if isinstance(e, SpecdecError) else f"{type(e).__name__}: {e}"
    print(f"bench: drafter '{spec}' failed to {stage}: {message}", file=sys.stderr)
    if not isinstance(e, SpecdecError):  # a user's mistake needs no traceback; anything else does
        traceback.print_exception(e, file=sys.stderr)
    return {"error": f"failed to {stage}: {message}"}


def perf_counter(device: torch.device) -> float:
    """Wall time, after the device's queued work is done (a host sync, outside the timed loops)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ---------------------------------------------------------------- summaries


def summarize(records: Sequence[dict], greedy: bool) -> dict:
    """Totals over some prompts' records: tau, acceptance, tok/s, speedup, losslessness, reference."""
    s = GenerationStats.total([GenerationStats.from_dict(r["stats"]) for r in records])
    ar = GenerationStats.total([GenerationStats.from_dict(r["ar_stats"]) for r in records])
    out = {
        "prompts": len(records),
        "new_tokens": s.new_tokens,
        "tau": s.tau,
        "acceptance_rate": s.acceptance_rate,
        "acceptance_per_position": s.acceptance_per_position,
        "lookups": s.lookups,
        "tok_s": s.tokens_per_s,
        "ar_tok_s": ar.tokens_per_s,
        "speedup": s.tokens_per_s / ar.tokens_per_s if ar.tokens_per_s else None,
        "draft_s": s.draft_s,
        "verify_s": s.verify_s,
        "lossless": sum(r["tokens"] == r["ar_tokens"] for r in records) / len(records) if greedy else None,
        "ref_tok_s": None,
        "vs_ref": None,
    }
    refs = [r["reference"] for r in records if "reference" in r]
    if refs and len(refs) == len(records):
        ref_tok_s = sum(r["new_tokens"] for r in refs) / sum(r["seconds"] for r in refs)
        out |= {"ref_tok_s": ref_tok_s, "vs_ref": s.tokens_per_s / ref_tok_s}
    return out


def by_category(records: Sequence[dict], greedy: bool) -> dict[str, dict]:
    """summarize() per category, plus 'all'."""
    cats: dict[str, list[dict]] = {}
    for r in records:
        cats.setdefault(r["category"], []).append(r)
    return {c: summarize(cats[c], greedy) for c in sorted(cats)} | {"all": summarize(records, greedy)}


def summaries(results: Sequence[dict]) -> list[dict]:
    """One row per (drafter, mode): its summary per category, or its error."""
    rows = []
    for res in results:
        for mode, entry in res["modes"].items():
            row = {"drafter": res["drafter"], "mode": mode}
            if "error" in entry:
                rows.append(row | {"error": entry["error"]})
            else:
                cats = by_category(entry["records"], mode == "greedy")
                rows.append(row | {"gamma": entry["gamma"], "reference": entry["reference"], "categories": cats})
    return rows


# ---------------------------------------------------------------- report


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def markdown(settings: BenchSettings, rows: Sequence[dict]) -> str:
    """The overview table (one row per drafter and mode) and, per mode, tau / speedup by category."""
    s = settings
    sampled = any(r.get("mode") == "sampled" for r in rows)  # its settings only where it ran
    lines = [
        f"target `{s.target}` · {s.prompts} · max {s.max_new_tokens} new tokens · {s.device} {s.dtype}"
        + (f" · {s.threads} CPU threads" if s.threads else "")
        + (f" · sampled: T={s.temperature}, top-k {s.top_k or 'off'}, top-p {s.top_p}" if sampled else ""),
        "",
        "| drafter | mode | gamma | tau | accept by position | tok/s | AR tok/s | speedup | lossless "
        "| transformers tok/s | ours / transformers |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            error = r["error"] if len(r["error"]) <= 160 else r["error"][:159] + "…"  # whole in results.json
            lines.append(f"| {r['drafter']} | {r['mode']} | | | {error} | | | | | | |")
            continue
        a = r["categories"]["all"]
        by_pos = " ".join(f"{x:.2f}" for x in a["acceptance_per_position"][:8]) or "-"
        by_pos += f" ({a['lookups']})" if a.get("lookups") else ""
        ref = fmt(a["ref_tok_s"], ".1f") if a["ref_tok_s"] is not None else f"n/a: {r['reference']}"
        lines.append(
            f"| {r['drafter']} | {r['mode']} | {r['gamma']} | {a['tau']:.2f} | {by_pos} | {a['tok_s']:.1f} "
            f"| {a['ar_tok_s']:.1f} | {fmt(a['speedup'], '.2f', 'x')} | {fmt(a['lossless'], '.0%')} | {ref} "
            f"| {fmt(a['vs_ref'], '.2f', 'x')} |"
        )
    for mode in dict.fromkeys(r["mode"] for r in rows):
        ok = [r for r in rows if r["mode"] == mode and "error" not in r]
        if not ok:
            continue
        cats = list(ok[0]["categories"])
        lines += ["", f"{mode}: tau / speedup by category", ""]
        lines += ["| drafter | " + " | ".join(cats) + " |", "|---|" + "---:|" * len(cats)]
        for r in ok:
            c = r["categories"]
            cells = [f"{c[k]['tau']:.2f} / {fmt(c[k]['speedup'], '.2f', 'x')}" if k in c else "-" for k in cats]
            lines.append(f"| {r['drafter']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict], out: Path) -> list[Path]:
    """speedup_tau.png (per mode: speedup and tau per drafter and category) and acceptance.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    modes = list(dict.fromkeys(r["mode"] for r in ok))
    if not modes:
        return []
    fig, axes = plt.subplots(len(modes), 2, figsize=(13, 3.6 * len(modes)), squeeze=False)
    for row_axes, mode in zip(axes, modes):
        mine = [r for r in ok if r["mode"] == mode]
        cats = list(mine[0]["categories"])
        width = 0.8 / len(mine)
        for ax, key, label in zip(row_axes, ("speedup", "tau"), ("speedup over autoregressive", "tau")):
            for j, r in enumerate(mine):
                vals = [(r["categories"].get(c) or {}).get(key) or 0.0 for c in cats]
                ax.bar([i + j * width for i in range(len(cats))], vals, width, label=r["drafter"])
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
            ax.set_title(f"{label} ({mode})")
        row_axes[1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    paths = [out / "speedup_tau.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 3.6), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for r in (r for r in ok if r["mode"] == mode):
            acc = r["categories"]["all"]["acceptance_per_position"]
            if acc:
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["drafter"])
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | drafted)")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"acceptance by draft position ({mode})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "acceptance.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def write_report(out: Path, settings: BenchSettings, results: Sequence[dict]) -> tuple[str, list[dict], list[Path]]:
    """results.md, results.json and the plots in `out`; returns (markdown, summary rows, plot paths)."""
    rows = summaries(results)
    table = markdown(settings, rows)
    (out / "results.md").write_text(table)
    write_json(out / "results.json", {"settings": asdict(settings), "summary": rows})
    return table, rows, plot(rows, out)


def log_wandb(out: Path, settings: BenchSettings, rows: Sequence[dict], plots: Sequence[Path], project: str) -> None:
    """Log the bench to Weights & Biases: settings, the summary table, per-drafter metrics, the plots
    (WANDB_MODE=offline writes the run under out/wandb)."""
    import wandb

    run_id = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:12]
    run = wandb.init(
        project=project, name=f"bench {settings.target}", dir=str(out), id=run_id, resume="allow",
        job_type="bench", config=asdict(settings),
    )  # fmt: skip
    columns = ["drafter", "mode", "category", "gamma", "tau", "tok_s", "ar_tok_s", "speedup", "lossless", "vs_ref"]
    table = wandb.Table(columns=columns + ["error"])
    metrics: dict[str, Any] = {}
    for r in rows:
        if "error" in r:
            table.add_data(r["drafter"], r["mode"], "all", *[None] * (len(columns) - 3), r["error"])
            continue
        for cat, c in r["categories"].items():
            table.add_data(r["drafter"], r["mode"], cat, r["gamma"], *[c[k] for k in columns[4:]], None)
        for k in ("tau", "tok_s", "speedup", "lossless", "vs_ref"):
            if r["categories"]["all"][k] is not None:
                metrics[f"{r['mode']}/{r['drafter']}/{k}"] = r["categories"]["all"][k]
    run.log({"bench/summary": table, **metrics, **{f"bench/{p.stem}": wandb.Image(str(p)) for p in plots}})
    run.finish()
