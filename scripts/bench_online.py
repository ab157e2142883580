"""Online adaptation on a shifted stream: tau per window of a drafter served as it is and the same
drafter adapting (specdec_runtime.drafters.online), side by side, each output checked against the target's
own greedy output, and the wall-clock cost of the updates. Prints a markdown table.

    python scripts/make_prompts.py ...   # or any JSON-lines prompt file of one kind of prompt
    python scripts/bench_online.py --drafter runs/quickstart/export --prompts coding.jsonl --every 8
    python scripts/bench_online.py --drafter runs/quickstart/export --category coding --skip 64 --prompts-count 64

--category picks one category of the built-in training prompts (the quickstart drafter trained on
the first 56 of each: --skip 64 serves prompts it never saw).
"""

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def stream(args) -> list:
    """The prompts served, in order."""
    from specdec_runtime.prompts import Prompt, builtin_prompts, read_jsonl, read_prompts

    if args.prompts:
        prompts = read_prompts(args.prompts)
    else:  # a category of the built-in training prompts, first user turn (some records are chats)
        prompts = []
        for _, r in read_jsonl(builtin_prompts("prompts-train")):
            if r.get("category") == args.category:
                turns = r.get("turns") or [m["content"] for m in r["messages"] if m["role"] == "user"]
                text = turns[0]
                prompts.append(Prompt(r["question_id"], text, args.category))
    return prompts[args.skip : args.skip + args.prompts_count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", required=True, help="an EAGLE-3 export or a stand-alone draft model")
    parser.add_argument("--prompts", type=Path, help="JSON lines (default: --category of the built-in prompts)")
    parser.add_argument("--category", default="coding")
    parser.add_argument("--skip", type=int, default=64)
    parser.add_argument("--prompts-count", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--keep", type=int, default=0)
    parser.add_argument("--gamma", type=int)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    from specdec_runtime.drafters.online import OnlineAdapter
    from specdec_runtime.drafters.spec import build_drafter
    from specdec_runtime.generate import generate
    from specdec_runtime.loading import load_model
    from specdec_runtime.prompts import encode_prompt
    from specdec_runtime.sampling import Sampler
    from specdec_runtime.stats import GenerationStats

    target = load_model(args.target, device="cpu", dtype="float32")
    prompts = [encode_prompt(target.tokenizer, p.text) for p in stream(args)]
    capacity = max(len(p) for p in prompts) + args.max_new_tokens
    kw = dict(max_new_tokens=args.max_new_tokens, stop_ids=target.stop_ids, capacity=capacity)
    # the target's own greedy outputs, kept beside the figures for the next run on the same prompts
    key = hashlib.sha256(json.dumps([args.target, args.max_new_tokens, prompts]).encode()).hexdigest()[:16]
    cached = ROOT / "runs" / "online" / f"reference-{key}.json"
    if cached.is_file():
        reference = json.loads(cached.read_text())
    else:
        t0 = time.perf_counter()
        reference = [generate(target.model, p, None, Sampler(), **kw).tokens for p in prompts]
        print(f"{len(prompts)} prompts, autoregressive reference in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(reference))

    sides = {}
    for side in ("as trained", "adapting"):
        drafter = build_drafter(args.drafter, target)
        gamma = args.gamma or drafter.gamma or 4
        adapter = None
        if side == "adapting":
            adapter = OnlineAdapter(drafter, target.model, every=args.every, steps=args.steps, lr=args.lr,
                                    keep=args.keep)  # fmt: skip
        runs, t0 = [], time.perf_counter()
        for p in prompts:
            g = generate(target.model, p, drafter, Sampler(), gamma=gamma,
                         teacher=adapter.record if adapter else None, **kw)  # fmt: skip
            runs.append(g)
            if adapter:
                adapter.served(p, g.tokens)
        wall = time.perf_counter() - t0
        windows = [GenerationStats.total([g.stats for g in runs[i : i + args.every]]).tau
                   for i in range(0, len(runs), args.every)]  # fmt: skip
        sides[side] = dict(
            windows=windows,
            identical=sum(g.tokens == r for g, r in zip(runs, reference)),
            wall_s=wall,
            updates=[u.to_dict() for u in adapter.updates] if adapter else [],
        )
        print(f"{side}: {wall:.0f} s, windows {' '.join(f'{t:.2f}' for t in windows)}", file=sys.stderr)

    plain, adapting = sides["as trained"], sides["adapting"]
    update_s = sum(u["seconds"] for u in adapting["updates"])
    print(f"\n{len(prompts)} prompts, windows of {args.every}, {args.max_new_tokens} new tokens, greedy; "
          f"updates: {args.steps} steps, lr {args.lr}, the last {max(args.keep, args.every)} prompts\n")  # fmt: skip
    print("| window | tau, as trained | tau, adapting | ratio |")
    print("|---:|---:|---:|---:|")
    for w, (a, b) in enumerate(zip(plain["windows"], adapting["windows"])):
        print(f"| {w} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")
    first, last = adapting["windows"][0], adapting["windows"][-1]
    print(f"\nadapting: last window / first window {last / first:.2f}x; as trained: "
          f"{plain['windows'][-1] / plain['windows'][0]:.2f}x")  # fmt: skip
    print(f"identical to the target's greedy output: as trained {plain['identical']}/{len(prompts)}, "
          f"adapting {adapting['identical']}/{len(prompts)}")  # fmt: skip
    print(f"updates: {len(adapting['updates'])}, {update_s:.1f} s in all "
          f"({update_s / adapting['wall_s']:.0%} of the adapting run's {adapting['wall_s']:.0f} s)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(dict(args=vars(args) | {"json": None, "prompts": str(args.prompts)},
                                             sides=sides), indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
