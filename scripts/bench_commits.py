"""Batch-1 decoding speed at two commits, side by side: each commit checked out in a worktree of its
own, and the same measurement (measure(), autoregressive beside speculative) run in each in turn,
alternating, so a drifting machine favours neither. Prints a line per run and the means.

    python scripts/bench_commits.py 205878a HEAD --drafter runs/quickstart/export --rounds 2

Run it with nothing else on the machine (two PyTorch processes slow each other many times over).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ONE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import specdec_runtime
assert specdec_runtime.__file__.startswith(sys.argv[1]), specdec_runtime.__file__
from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.loading import load_model
from specdec_runtime.measure import measure
from specdec_runtime.prompts import builtin_prompts, encode_prompt, first_per_category, read_prompts
from specdec_runtime.sampling import Sampler
target = load_model(sys.argv[2], device="cpu", dtype="auto")
prompts = first_per_category(read_prompts(builtin_prompts("prompts-val")), int(sys.argv[5]))
encoded = [encode_prompt(target.tokenizer, p.text, chat=True) for p in prompts]
drafter = build_drafter(sys.argv[3], target)
report = measure(target.model, drafter, encoded, sampler=Sampler, baseline=True, max_new_tokens=int(sys.argv[4]),
                 gamma=(drafter.gamma if drafter is not None else None) or 4, stop_ids=target.stop_ids)
print(json.dumps({"ar": report.total("baseline").tokens_per_s, "spec": report.total().tokens_per_s}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("commits", nargs=2)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default="ngram")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--per-category", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    drafter = str(Path(args.drafter).resolve()) if Path(args.drafter).exists() else args.drafter
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for c in args.commits:
            trees[c] = Path(tmp) / c.replace("/", "_")
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees[c]), c], check=True,
                           capture_output=True)  # fmt: skip
        runs: dict[str, list[dict]] = {c: [] for c in args.commits}
        try:
            for _ in range(args.rounds):
                for c in args.commits:
                    cmd = [sys.executable, "-c", ONE, str(trees[c]), args.target, drafter, str(args.max_new_tokens),
                           str(args.per_category)]  # fmt: skip
                    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()
                    runs[c].append(json.loads(out[-1]))
                    print(c, runs[c][-1], flush=True)
        finally:
            for c in args.commits:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees[c])], check=False)
    for c, rs in runs.items():
        print(f"{c}: autoregressive {sum(r['ar'] for r in rs) / len(rs):.1f} tok/s, "
              f"speculative {sum(r['spec'] for r in rs) / len(rs):.1f} tok/s (mean of {len(rs)})")  # fmt: skip


if __name__ == "__main__":
    main()
