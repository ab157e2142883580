"""What compiling the EAGLE-3 drafter's captured steps costs (Eagle3Drafter(compile_steps=True)): each
step made, its seconds and the graphs dynamo compiled for it, on the tests' tiny target, for one
prompt decoded after the target's own steps are warm.

    python scripts/bench_drafter_compile.py                     # CPU inductor (C++ kernels)
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python scripts/bench_drafter_compile.py   # nothing from the disk cache
    python scripts/bench_drafter_compile.py --device cuda       # Triton kernels, real CUDA graphs

A lease's minutes go to compiling these on a GPU (an 8B drafter's steps outlasted 80 s on an H200:
docs/log/gpu.md), so their number is what this shows.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (the tests' tiny models)
from specdec_runtime import graphs  # noqa: E402
from specdec_runtime.generate import generate  # noqa: E402
from tests.runtime.test_fast_path import PROMPT, eagle3_tree, pair  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="inductor", help="torch.compile backend: inductor | aot_eager")
    p.add_argument("--device", default="cpu")
    p.add_argument("--gamma", type=int, default=3, help="tree levels")
    p.add_argument("--max-new-tokens", type=int, default=20)
    args = p.parse_args()
    torch._dynamo.reset()
    _, target, hf = pair(device=args.device)
    target.compile(backend=args.backend)
    kw = dict(max_new_tokens=args.max_new_tokens, gamma=args.gamma)
    t = time.perf_counter()
    generate(target, PROMPT, eagle3_tree(target, hf, on_device=True), **kw)  # the target's steps, a drafter's captured
    print(f"target and drafter steps as they are: {time.perf_counter() - t:.1f} s, graphs {graphs.compile_counts()[0]}")

    made, init = [], graphs.CapturedStep.__init__

    def timed(self, fn, inputs, *a, **k):  # noqa: ANN001, ANN202
        before, t = graphs.compile_counts()[0], time.perf_counter()
        init(self, fn, inputs, *a, **k)
        name = getattr(fn, "keywords", None) or getattr(fn, "__name__", "step")
        made.append((name, {n: tuple(v.shape) for n, v in inputs.items() if v.dim()}, time.perf_counter() - t,
                     graphs.compile_counts()[0] - before))  # fmt: skip

    graphs.CapturedStep.__init__ = timed
    drafter = eagle3_tree(target, hf, on_device=True, compile_steps=True)
    t = time.perf_counter()
    generate(target, PROMPT, drafter, **kw)
    total = time.perf_counter() - t
    graphs.CapturedStep.__init__ = init
    print(f"\n{args.backend} on {args.device}, torch {torch.__version__}\n")
    print("| step | input shapes | seconds | graphs compiled |")
    print("|---|---|---:|---:|")
    for name, shapes, seconds, compiled in made:
        print(f"| {name} | {shapes} | {seconds:.1f} | {compiled} |")
    print(f"| all {len(made)} steps (the prompt's decoding included) | | {total:.1f} | {sum(m[3] for m in made)} |")


if __name__ == "__main__":
    main()
