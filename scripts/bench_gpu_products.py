"""The decode step's weight products alone, against the HBM bandwidth: the Llama-3.1-8B shape's five
products (q/k/v fused, o, gate/up fused, down, the head) at one row, in the runtime's weight layout
([in, out], x @ W) and in nn.Linear's ([out, in], F.linear), each through cuBLAS and through
inductor's own reduction kernel (torch.compile with coordinate_descent_tuning, which turns a one-row
product into a Triton reduction). Why: the 8B decode step reaches 61-67% of the bandwidth bound,
and its products ran at 3.1-4.2 TB/s with cuBLAS's split-K reductions and memsets beside them
(docs/log/gpu.md, "Where a round goes at 8B"); this says which layout and kernel the runtime's
products should take.

    python scripts/bench_gpu_products.py                          # on a CUDA GPU: the 8B shape, bf16
    python scripts/bench_gpu_products.py --variants in-out:cublas,out-in:cublas   # cuBLAS only (no compiling)
    python scripts/bench_gpu_products.py --shape tiny --device cpu --layers 2     # a seconds-long smoke run

Each product runs once per layer over that layer's own random weights (as many different matrices
as the shape has layers, so that the L2 cache holds none of them; the head: --head-copies), one row
of activations, on CUDA all in one CUDA graph replayed --reps times: a product's time is a replay's
over the matrices, launch costs excluded as in the runtime's captured steps. Printed and written to
--output-dir (results.md, results.json): microseconds and GB/s per product and variant, the
fraction of the bandwidth, and a decode step's products (layers x the four + the head) in ms.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import SHAPES, device_bandwidth, write_report  # noqa: E402

VARIANTS = ("in-out:cublas", "out-in:cublas", "in-out:triton", "out-in:triton")


def products(shape: dict) -> dict[str, tuple[int, int]]:
    """{name: (in, out)} of a layer's four products and the head."""
    H, I, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]  # noqa: E741
    D = H // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * D
    return {"qkv": (H, qkv), "o": (H, H), "gate_up": (H, 2 * I), "down": (I, H), "head": (H, V)}


def product_fn(variant: str, device: torch.device):
    layout, kernel = variant.split(":")
    fn = (lambda x, w: x @ w) if layout == "in-out" else (lambda x, w: F.linear(x, w))  # noqa: E731
    if kernel == "triton":
        # inductor's one-row mm/addmm decompositions apply with coordinate_descent_tuning only
        fn = torch.compile(fn, fullgraph=True, dynamic=False, options={"coordinate_descent_tuning": True})
    return fn


def per_product_us(fn, x: torch.Tensor, weights: list[torch.Tensor], reps: int) -> float:
    """Microseconds of fn(x, w), averaged over the matrices and reps (a CUDA graph of one pass over
    them on CUDA; a timed loop elsewhere)."""
    for w in weights[:2]:  # compiling, cuBLAS's workspace and heuristics
        fn(x, w)
    if x.device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            for w in weights:
                fn(x, w)
        return (time.perf_counter() - t0) / (reps * len(weights)) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:  # warm-up on the capture stream, as torch.cuda.graphs asks
            fn(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(weights))


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--layers", type=int, default=None, help="matrices per product (default: the shape's layers)")
    ap.add_argument("--head-copies", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="HBM bandwidth (default: from the GPU's name)")
    ap.add_argument("--output-dir", type=Path, default=Path("runs/bench_gpu_products"))
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    if device.type != "cuda" and any(v.endswith(":triton") for v in variants):
        variants = [v for v in variants if v.endswith(":cublas")]
        print("(off CUDA: the cuBLAS-named variants only, as torch's CPU products)")
    shape = SHAPES[args.shape]
    layers = args.layers or shape["num_hidden_layers"]
    name, bandwidth = device_bandwidth(device, args.bandwidth_gbs)
    fns = {v: product_fn(v, device) for v in variants}
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(1, max(n for n, _ in products(shape).values()), device=device, dtype=dtype, generator=g)
    us: dict[str, dict[str, float]] = {}
    t_start = time.perf_counter()
    for prod, (n_in, n_out) in products(shape).items():
        count = args.head_copies if prod == "head" else layers
        row = x[:, :n_in].contiguous()
        stored = [torch.randn(n_in, n_out, device=device, dtype=dtype, generator=g) * 0.02 for _ in range(count)]
        for layout in ("in-out", "out-in"):
            mine = [v for v in variants if v.startswith(layout + ":")]
            if not mine:
                continue
            weights = stored if layout == "in-out" else [w.t().contiguous() for w in stored]
            for v in mine:
                us.setdefault(prod, {})[v] = per_product_us(fns[v], row, weights, args.reps)
                print(f"{prod} {v}: {us[prod][v]:.1f} us", flush=True)
            del weights
        del stored
        if device.type == "cuda":
            torch.cuda.empty_cache()
    mb = {p: n_in * n_out * dtype.itemsize / 1e6 for p, (n_in, n_out) in products(shape).items()}
    step_mb = shape["num_hidden_layers"] * sum(mb[p] for p in mb if p != "head") + mb["head"]
    frac = lambda gbs: f" ({gbs / bandwidth:.0%})" if bandwidth else ""  # noqa: E731
    lines = [
        f"{name}, {args.shape} shape, {args.dtype}, one row; {layers} matrices a product (head: {args.head_copies}), "
        f"{'in one CUDA graph' if device.type == 'cuda' else 'a timed loop'}; bandwidth {bandwidth or '?'} GB/s",
        "",
        "| product | MB | " + " | ".join(f"{v} us (GB/s)" for v in variants) + " |",
        "|---|---:|" + "---:|" * len(variants),
    ]
    for p in us:
        cells = [f"{us[p][v]:.1f} ({mb[p] / us[p][v] * 1e3:.0f}{frac(mb[p] / us[p][v] * 1e3)})" for v in variants]
        lines.append(f"| {p} | {mb[p]:.1f} | " + " | ".join(cells) + " |")
    L = shape["num_hidden_layers"]  # (step in ms: MB / ms is GB/s)
    step = {v: (L * sum(us[p][v] for p in us if p != "head") + us["head"][v]) / 1e3 for v in variants}
    cells = [f"{step[v]:.3f} ms ({step_mb / step[v]:.0f}{frac(step_mb / step[v])})" for v in variants]
    lines.append(f"| a decode step's products ({L} layers + head) | {step_mb:.0f} | " + " | ".join(cells) + " |")
    data = {"device": name, "shape": args.shape, "dtype": args.dtype, "us": us, "mb": mb, "step_ms": step}
    write_report(args.output_dir, lines, data | {"bandwidth_gbs": bandwidth}, t_start)


if __name__ == "__main__":
    main()
