"""What a token tree costs the target: one forward over 1 + N tree tokens vs one decode step.

    python scripts/bench_tree_cost.py --nodes 4,8,16,32,64

Trees come from a fixed accuracy profile (their shape barely matters for the cost); the prefix is
200 tokens. Prints ms per forward and the ratio to a single-token decode step, plus the cost of 4
Medusa heads with shared and with own lm_heads.
"""

import argparse
import time

import torch

from specdec_runtime.loading import load_model
from specdec_runtime.medusa import MedusaHeads
from specdec_runtime.tree import Tree


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--nodes", default="4,8,16,24,32,48,64")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    m = load_model(args.target, device="cpu", dtype="float32").model
    V, H = m.config.vocab_size, m.config.hidden_size
    m.setup_cache(1, 512)
    m.prefill(torch.randint(0, V, (1, 200)))
    one = timed(lambda: m(torch.randint(0, V, (1, 1)), 200), args.reps)
    print(f"| tokens verified | ms | x one decode step |\n|---|---:|---:|\n| 1 | {one:.1f} | 1.00 |")
    profile = torch.tensor([[0.6, 0.2, 0.1, 0.05]] * 4)
    for n in map(int, args.nodes.split(",")):
        t = Tree.from_accuracies(profile, n).tensors
        x = torch.randint(0, V, (1, n + 1))
        ms = timed(lambda x=x, t=t: m(x, 200, tree=(t["depth"], t["ancestor"])), args.reps)
        print(f"| 1 + {n} | {ms:.1f} | {ms / one:.2f} |")
    for share in (True, False):
        heads = MedusaHeads(H, V, 4, 1, share_lm_head=share)
        h = torch.randn(1, H)
        with torch.inference_mode():
            ms = timed(lambda heads=heads, h=h: heads(h, m.lm_head).topk(8, dim=-1), args.reps)
        print(f"4 heads, {'shared' if share else 'own'} lm_head: {ms:.1f} ms per round")


if __name__ == "__main__":
    main()
