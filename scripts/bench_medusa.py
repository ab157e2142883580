"""Tree decoding with trained Medusa heads: tau and speedup for several trees, side by side.

    python scripts/bench_medusa.py runs/medusa-quick/export --budgets 4,8,16,32 --prompts 16
    python scripts/bench_medusa.py runs/medusa2-quick/export --target runs/medusa2-quick/export/target

For each tree (chains of 1..heads top-1 candidates, then trees built from the export's calibrated
per-head accuracies for each node budget) every validation prompt is decoded autoregressively and
then with the heads (greedy), so each speedup is a ratio measured in the same run. Prints a
markdown table; --json writes the rows.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from specdec_runtime.drafters.medusa import MedusaDrafter, read_layout, read_tree
from specdec_runtime.loading import load_model
from specdec_runtime.measure import measure
from specdec_runtime.prompts import builtin_prompts, encode_prompt, read_prompts
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export", type=Path, help="a Medusa export folder (with medusa_tree.json)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--budgets", default="4,8,16,32", help="node budgets of calibrated trees")
    p.add_argument("--chains", default="1,2,3,4", help="chain depths (top-1 candidates only)")
    p.add_argument("--prompts", type=int, default=16, help="validation prompts (spread over categories)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    stored = read_tree(args.export)
    if stored is None or "accuracy" not in stored:
        sys.exit(f"{args.export} has no calibrated medusa_tree.json: export it with recipes.medusa")
    target = load_model(args.target, device="cpu", dtype="float32")
    heads, _ = read_layout(args.export)
    heads.share_if_equal(target.model.lm_head.weight.t())
    acc = torch.tensor(stored["accuracy"])
    every = read_prompts(builtin_prompts("prompts-val"))
    by_cat: dict[str, list] = {}
    for q in every:
        by_cat.setdefault(q.category, []).append(q)
    picked = [q for i in range(len(every)) for qs in by_cat.values() if i < len(qs) for q in [qs[i]]][: args.prompts]
    prompts = [torch.tensor(encode_prompt(target.tokenizer, q.text)) for q in picked]

    trees = [(f"chain {d}", Tree.chain(d)) for d in map(int, args.chains.split(",")) if d <= heads.num_heads]
    trees += [(f"tree {b}", Tree.from_accuracies(acc, b)) for b in map(int, args.budgets.split(","))]
    print(f"per-head top-1: {', '.join(f'{a:.2f}' for a in acc[:, 0])}; top-5: "
          f"{', '.join(f'{a:.2f}' for a in acc[:, :5].sum(1))}")  # fmt: skip
    rows = []
    print("| tree | nodes | expected tau | tau | accept by depth | tok/s | AR tok/s | speedup | lossless |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, tree in trees:
        drafter = MedusaDrafter(heads, target.model, tree, name=name)
        report = measure(
            target.model, drafter, prompts, sampler=Sampler, baseline=True,
            max_new_tokens=args.max_new_tokens, gamma=tree.depth, stop_ids=target.stop_ids,
        )  # fmt: skip
        s, ar = report.total(), report.total("baseline")
        row = {
            "tree": name,
            "nodes": len(tree),
            "expected_tau": Tree.expected_tau(tree.paths, acc),
            "tau": s.tau,
            "acceptance_per_depth": s.acceptance_per_position,
            "tokens_per_s": s.tokens_per_s,
            "ar_tokens_per_s": ar.tokens_per_s,
            "speedup": report.speedup(),
            "lossless": report.lossless_rate(),
        }
        rows.append(row)
        print(f"| {name} | {len(tree)} | {row['expected_tau']:.2f} | {s.tau:.2f} | "
              f"{' '.join(f'{a:.2f}' for a in s.acceptance_per_position)} | {s.tokens_per_s:.1f} | "
              f"{ar.tokens_per_s:.1f} | {row['speedup']:.2f}x | {row['lossless']:.0%} |", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
