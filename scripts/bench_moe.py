"""A mixture-of-experts layer's experts (layers.moe) for N rows in each of its three ways, side by
side, each time the median of its runs: the chosen experts' weights gathered (a copy, then batched
products), torch's grouped products over the rows sorted by expert, and the loop over experts (a
host read: on a GPU it waits for the router).

    python scripts/bench_moe.py --device cuda --dtype bfloat16          # Qwen3-30B-A3B's layer shape
    python scripts/bench_moe.py --device cpu --dtype float32

moe() takes the gathered weights up to experts / top-k rows (decoding, one sequence's verify),
above that the grouped products where layers.GROUPED_DTYPES has the device and dtype (a prefill, a
batch's verify), else the loop. Random weights of the shape (the cost does not depend on the
values); the gathered way only up to 4 x experts / top-k rows (its copy grows with the rows).
Prints a markdown table; --output-dir: its rows in results.json there too.
"""

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from specdec_runtime import layers


def timed(fn, device: torch.device, runs: int) -> float:
    """fn's median wall time in ms over `runs` runs (after two warm-up runs), synchronized on CUDA."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    times = []
    for i in range(runs + 2):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768, help="each expert's (moe_intermediate_size)")
    ap.add_argument("--rows", default="1,4,16,40,320,2048", help="rows of a step (tokens x batch rows)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--output-dir", type=Path, default=None)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    E, k, H, I = args.experts, args.top_k, args.hidden, args.intermediate  # noqa: E741
    torch.manual_seed(0)
    t = dict(device=device, dtype=dtype)
    router = torch.randn(H, E, **t) / H**0.5
    gate_up, down = torch.randn(E, H, 2 * I, **t) / H**0.5, torch.randn(E, I, H, **t) / I**0.5
    takes_grouped = layers.grouped_product(torch.empty(1, H, **t), gate_up, down) is not None
    policy, layers.GROUPED_DTYPES = layers.GROUPED_DTYPES, {device.type: (dtype,)}  # (timed wherever torch has them)
    try:
        product = layers.grouped_product(torch.empty(1, H, **t), gate_up, down)
    finally:
        layers.GROUPED_DTYPES = policy
    print(f"{device} {dtype}: {E} experts, top-{k}, hidden {H}, expert intermediate {I}; torch {torch.__version__}")
    print("| rows | moe() takes | gathered (ms) | grouped (ms) | by expert (ms) |")
    print("|---:|---|---:|---:|---:|")
    results = []
    for N in map(int, args.rows.split(",")):
        h = torch.randn(N, H, **t)
        weights, chosen = (h @ router).float().softmax(-1).topk(k, dim=-1)
        experts = (h, weights.to(dtype), chosen, gate_up, down)
        takes = "gathered" if N * k <= E else "grouped" if takes_grouped else "by expert"
        with torch.inference_mode():
            gathered = timed(partial(layers.experts_gathered, *experts), device, args.runs) if N * k <= 4 * E else None
            grouped = timed(partial(layers.experts_grouped, *experts, product), device, args.runs) if product else None
            by_expert = timed(partial(layers.experts_by_expert, *experts), device, args.runs)
        cells = [f"{ms:.3f}" if ms is not None else "-" for ms in (gathered, grouped, by_expert)]
        print(f"| {N} | {takes} | " + " | ".join(cells) + " |")
        results.append(dict(rows=N, takes=takes, gathered_ms=gathered, grouped_ms=grouped, by_expert_ms=by_expert))
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        shape = dict(experts=E, top_k=k, hidden=H, intermediate=I, device=str(device), dtype=args.dtype)
        (args.output_dir / "results.json").write_text(json.dumps(dict(shape=shape, results=results), indent=1))


if __name__ == "__main__":
    main()
