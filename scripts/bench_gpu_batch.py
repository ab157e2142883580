"""Batched speculative decoding at forced acceptance: what the runtime's batched rounds cost at each
batch size, on a Llama-3.1-8B-, Llama-3.2-1B- or SmolLM2-135M-shaped (the bundled target's) target built
on the spot (scripts/bench_gpu.py's: random weights, no download) with a random EAGLE-3 drafter drafting
chains (or, with --tree-budget, a tree a row) on the device.

    python scripts/bench_gpu_batch.py --shape 8b --accept-rate 0.8 --batch-sizes 1,4,16,64
    python scripts/bench_gpu_batch.py --shape 8b --accept-rate 0.8 --tree-budget 8 --top-k 4 --gamma 5  # trees
    python scripts/bench_gpu_batch.py --shape tiny --device cpu --batch-sizes 1,2,4 --max-new-tokens 16  # smoke run

Per batch size B, B x --prompts-per-row random prompts are decoded B at a time (measure(batch_size=B),
whose warm-up captures every step a stream reaches first; batch 1 is generate() with the same
drafter's chains or tree), speculatively and autoregressively at the same batch size, turn about. Each
drafted token is accepted with probability --accept-rate whatever its value (accept_rate, as
SGLang's simulated acceptance), which sets tau without a trained drafter: the outputs are not the
target's. Printed and written to --output-dir (results.md, results.json): tokens/s of both, tau,
the speedup, graphs compiled and steps captured inside the timed runs (both must be 0) and host
syncs per target forward (CUDA's sync debug mode).
"""

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/bench_gpu.py's target and drafter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_gpu import build, device_bandwidth, eagle3_drafter, syncs_per_round, weight_bytes, write_report  # noqa: E402

from specdec_runtime import graphs, rows  # noqa: E402
from specdec_runtime.batched import generate_many  # noqa: E402
from specdec_runtime.drafters.batched import RowEagle3  # noqa: E402
from specdec_runtime.generate import generate  # noqa: E402
from specdec_runtime.measure import measure  # noqa: E402
from specdec_runtime.sampling import Sampler  # noqa: E402


def forwards_of(target, decode) -> SimpleNamespace:
    """decode() -> generations, run with the target's forwards counted, as bench_gpu.syncs_per_round
    reads them (target_forwards): a batch's as they run (rows.forward), a batch of one's from its stats."""
    forwards, forward = [0], rows.forward

    def counted(decoder, *args, **kwargs):
        forwards[0] += decoder is target
        return forward(decoder, *args, **kwargs)

    rows.forward = counted
    try:
        out = decode()
    finally:
        rows.forward = forward
    return SimpleNamespace(target_forwards=forwards[0] or sum(g.stats.target_forwards for g in out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["1b", "8b", "smollm2", "tiny"], default="8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="auto: on CUDA")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--accept-rate", type=float, default=0.8, help="each drafted token accepted with this probability")
    ap.add_argument("--gamma", type=int, default=4, help="the drafter's chains (trees: its levels)")
    ap.add_argument("--tree-budget", type=int, default=0, help="> 0: trees of this many nodes, a tree a row")
    ap.add_argument("--top-k", type=int, default=4, help="the trees' frontier")
    ap.add_argument("--compile-drafter", action="store_true", help="the drafter's captured steps compiled too")
    ap.add_argument("--prompts-per-row", type=int, default=2, help="prompts per batch row, streamed")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--output-dir", type=Path, default=Path("runs/bench_gpu_batch"))
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    fast = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    t_start = time.perf_counter()
    args.k, args.residual_scale = 2, 0.05  # bench_gpu.build's
    args.top_k = args.top_k if args.tree_budget else 1
    _, target = build(args, device, dtype)
    if fast:
        target.compile(**({} if device.type == "cuda" else {"backend": "aot_eager"}))
    drafter = eagle3_drafter(target, args)  # on the device where the target's steps are captured
    g = torch.Generator().manual_seed(1)
    vocab = target.config.vocab_size
    kw = dict(max_new_tokens=args.max_new_tokens, gamma=args.gamma, accept_rate=args.accept_rate)
    capacity = args.prompt_len + args.max_new_tokens + max(args.gamma, args.tree_budget)  # measure's: the same caches
    results = []
    for B in sizes:
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
                   for _ in range(B * args.prompts_per_row)]  # fmt: skip
        d = drafter if B == 1 else RowEagle3(drafter)
        timed_from = []

        def progress(units, timed_from=timed_from):  # measure iterates this once its warm-up is done
            timed_from.append(graphs.compile_counts())
            yield from units

        t0 = time.perf_counter()
        report = measure(target, d, prompts, sampler=lambda: Sampler(seed=0), baseline=True, batch_size=B,
                         progress=progress, **kw)  # fmt: skip
        timed = [b - a for a, b in zip(timed_from[0], graphs.compile_counts())]
        spec, ar = report.total(), report.total("baseline")
        if B == 1:  # (measure's batch of one: generate with the drafter itself)
            decode = lambda p=prompts[0]: [generate(target, p, drafter, Sampler(seed=0), capacity=capacity, **kw)]  # noqa: E731
        else:
            decode = lambda d=d, p=prompts[:B], B=B: generate_many(target, p, d, Sampler(seed=0), rows=B,  # noqa: E731
                                                                   capacity=capacity, **kw)  # fmt: skip
        syncs = syncs_per_round(lambda decode=decode: forwards_of(target, decode), device)
        results.append({"batch": B, "ar_tok_s": ar.tokens_per_s, "spec_tok_s": spec.tokens_per_s, "tau": spec.tau,
                        "speedup": report.speedup(), "timed_compiles_captures": timed, "syncs_per_forward": syncs,
                        "seconds": time.perf_counter() - t0})  # fmt: skip
        print(results[-1], file=sys.stderr)

    name, bandwidth = device_bandwidth(device)
    drafting = f"trees of {args.tree_budget}, top-{args.top_k}, depth" if args.tree_budget else "chains of"
    lines = [
        f"{name}, {args.shape} shape, {args.dtype}, fast path {fast}, random prompts of {args.prompt_len} tokens, "
        f"{args.max_new_tokens} new tokens, {args.prompts_per_row} prompts per row; EAGLE-3 {drafting} "
        f"{args.gamma} (random weights, steps compiled {drafter.step_backend or 'no'}), forced acceptance "
        f"{args.accept_rate}; "
        f"{weight_bytes(target) / 1e9:.2f} GB of weights" + (f", {bandwidth} GB/s" if bandwidth else ""),
        "",
        "| batch | autoregressive tok/s | speculative tok/s | tau | speedup | compiled / captured in timed runs "
        "| host syncs per forward |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in results:
        lines.append(f"| {r['batch']} | {r['ar_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['tau']:.2f} | "
                     f"{r['speedup']:.2f}x | {r['timed_compiles_captures'][0]} / {r['timed_compiles_captures'][1]} | "
                     f"{fmt(r['syncs_per_forward'])} |")  # fmt: skip
    settings = vars(args) | {"output_dir": str(args.output_dir)}
    write_report(args.output_dir, lines, {"device": name, "settings": settings, "results": results}, t_start)


if __name__ == "__main__":
    main()
