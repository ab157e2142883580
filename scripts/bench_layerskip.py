"""Bayesian optimization vs random search for layer-skip sets, over several seeds, on one target.

    python scripts/bench_layerskip.py                                  # bundled target, 3 seeds x 100 trials
    python scripts/bench_layerskip.py --seeds 0,1,2 --trials 100 --objective proxy --plot docs/layerskip_trace.png

The target is loaded and calibrated once (its greedy outputs on the calibration prompts, and for
the proxy a cost model measured on this device). For each seed, a GP study and a random-search
study with the same budget run from the same random start (recipes.layerskip's search, studies in
--out). Then the best set of every study is validated for real on held-out prompts: greedy
self-speculative decoding vs autoregressive in the same process (tau, speedup, losslessness).
Prints a table, writes bench.json and the trace plot (median best-so-far per sampler, min-max band).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--startup", type=int, default=10)
    ap.add_argument("--objective", default="proxy", choices=("proxy", "speedup"))
    ap.add_argument("--cost-model", default="measured", choices=("measured", "params"))
    ap.add_argument("--max-skip-fraction", type=float, default=0.5)
    ap.add_argument("--keep-first", type=int, default=1)
    ap.add_argument("--keep-last", type=int, default=1)
    ap.add_argument("--gamma", type=int, default=8)
    ap.add_argument("--calibration-prompts", type=int, default=8)
    ap.add_argument("--calibration-tokens", type=int, default=64)
    ap.add_argument("--val-prompts", type=int, default=8)
    ap.add_argument("--val-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_layerskip")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "layerskip_trace.png")
    args = ap.parse_args()

    from tqdm import tqdm

    from specdec_runtime.drafters.layerskip import SkipSet, skip_drafter
    from specdec_runtime.loading import load_model
    from train.data import prompts_of
    from train.layerskip import (
        CostModel,
        Evaluator,
        ExitSettings,
        SearchSpace,
        best_trial,
        calibrate,
        finished,
        open_study,
        plot_traces,
        search,
    )
    from train.validate import validate

    target = load_model(args.target)
    n = target.config.num_layers
    space = SearchSpace(n, args.keep_first, args.keep_last, args.max_skip_fraction)
    if space.problems():
        sys.exit("\n".join(space.problems()))

    cal_prompts, _ = prompts_of(target.tokenizer, "builtin:train", args.calibration_prompts)
    val_prompts, val_cats = prompts_of(target.tokenizer, "builtin:val", args.val_prompts)
    cal = calibrate(target.model, cal_prompts, max_new_tokens=args.calibration_tokens, stop_ids=target.stop_ids)
    cost = None
    if args.objective == "proxy":
        cost = (CostModel.measure if args.cost_model == "measured" else lambda m, g: CostModel.from_params(m))(
            target.model, args.gamma
        )
    print(f"{args.target}: AR {cal.ar_tokens_per_s:.1f} tok/s on calibration; cost model {cost}")
    exit_settings = ExitSettings()
    evaluator = Evaluator(
        target.model,
        cal,
        objective=args.objective,
        gamma=args.gamma,
        exit_settings=exit_settings,
        cost=cost,
        max_new_tokens=args.calibration_tokens,
        stop_ids=target.stop_ids,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows, traces = [], {"BO (GP)": [], "random": []}
    for seed in seeds:
        for sampler, label in (("gp", "BO (GP)"), ("random", "random")):
            meta = {"target": args.target, "objective": args.objective, "sampler": sampler, "n": n}
            study = open_study(
                f"sqlite:///{(args.out / f'seed{seed}.db').resolve()}",
                sampler,
                sampler=sampler,
                seed=seed,
                n_startup=args.startup,
                meta=meta,
            )
            search(
                study,
                space,
                evaluator,
                n_trials=args.trials,
                sampler=sampler,
                seed=seed,
                n_startup=args.startup,
                progress=lambda d, t, desc=f"seed {seed} {sampler}": tqdm(total=t, initial=d, desc=desc, unit="trial"),
            )
            values = [t.value for t in finished(study)][: args.trials]
            traces[label].append(values)
            best = best_trial(study)
            skip = space.skip_of(best.params)
            skipset = SkipSet(sorted(skip.attn), sorted(skip.mlp), n, args.target, target.config.hidden_size)
            m = validate(
                target.model,
                skip_drafter(target, skipset),
                val_prompts,
                val_cats,
                stop_ids=target.stop_ids,
                gamma=args.gamma,
                max_new_tokens=args.val_tokens,
                progress=False,
            )
            rows.append(
                {
                    "seed": seed,
                    "sampler": label,
                    "best": best.value,
                    "found_at": best.number + 1,
                    "skipped": len(skip.attn) + len(skip.mlp),
                    "attn": sorted(skip.attn),
                    "mlp": sorted(skip.mlp),
                    "cal_tau": best.user_attrs.get("tau"),
                    "val_tau": m["tau"],
                    "val_speedup": m["speedup"],
                    "lossless": m["lossless"],
                }
            )
            print(json.dumps(rows[-1]))
    what = "estimated speedup (proxy)" if args.objective == "proxy" else "measured speedup"
    print(f"\n| seed | sampler | best {what} | found at trial | skipped sublayers | val tau | val speedup | lossless |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['seed']} | {r['sampler']} | {r['best']:.3f} | {r['found_at']} | {r['skipped']} | "
            f"{r['val_tau']:.2f} | {r['val_speedup']:.2f}x | {r['lossless']:.0%} |"
        )
    for label in traces:
        sel = [r for r in rows if r["sampler"] == label]
        print(
            f"median over seeds, {label}: best {statistics.median(r['best'] for r in sel):.3f}, "
            f"val speedup {statistics.median(r['val_speedup'] for r in sel):.2f}x, "
            f"val tau {statistics.median(r['val_tau'] for r in sel):.2f}"
        )
    settings = vars(args) | {"out": str(args.out), "plot": str(args.plot)}
    record = {"args": settings, "cost": cost.__dict__ if cost else None, "rows": rows}
    (args.out / "bench.json").write_text(json.dumps(record, indent=2))
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    title = f"layer-skip search on {args.target}: {len(seeds)} seeds x {args.trials} trials"
    plot_traces(traces, args.plot, ylabel=what, title=title)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
