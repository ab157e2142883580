"""EAGLE-3 chains against EAGLE-2 dynamic trees, each alone and with prompt lookup first, side by side.

    python scripts/bench_eagle3_trees.py runs/quickstart/export
    python scripts/bench_eagle3_trees.py runs/quickstart/export --drafting chain:2,chain:3,tree:4x4:2,tree:8x4:3
    python scripts/bench_eagle3_trees.py runs/quickstart/export --device cuda --lookup only --compiled both

Drafting settings: `chain:G` (chains of G tokens), `chain:G@C` (up to G, stopping after a token
the drafter gives a probability below C) or `tree:BxK:D` (a tree of B nodes at most D
deep, expanding the K most likely nodes of each level; Eagle3Drafter). With lookup, the export's
phrase table drafts where the prompt does not match, as `specdec bench` runs `DIR+lookup`. Every validation prompt is
decoded once autoregressively and once per setting (alone and with lookup first; --lookup off / only),
greedy, in an order that rotates from prompt to prompt, so the machine's drift hits every setting
alike and each speedup is a ratio within one run. Prints a markdown table: tau, tokens/s, speedup
over the autoregressive runs, drafting and verify-forward milliseconds per target forward, and
whether every output was the autoregressive one.
"""

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.eagle3_format import read_speculators
from specdec_runtime.drafters.lookup import LookupFirst
from specdec_runtime.drafters.phrases import PhraseTable
from specdec_runtime.drafters.protocol import Drafter
from specdec_runtime.generate import generate
from specdec_runtime.loading import load_model
from specdec_runtime.measure import warm_up
from specdec_runtime.prompts import builtin_prompts, encode_prompt, first_per_category, read_prompts
from specdec_runtime.sampling import Sampler
from specdec_runtime.stats import GenerationStats


@dataclass(frozen=True)
class Setting:
    name: str
    drafter: Drafter | None
    gamma: int


def parse_drafting(spec: str) -> tuple[int, int, int, float]:
    """'chain:G' -> (0, 1, G, 0); 'chain:G@C' -> (0, 1, G, C); 'tree:BxK:D' -> (B, K, D, 0):
    (tree_budget, top_k, depth, draft-exit confidence)."""
    kind, _, rest = spec.partition(":")
    try:
        if kind == "chain":
            depth, _, conf = rest.partition("@")
            return 0, 1, int(depth), float(conf or 0)
        if kind == "tree":
            size, depth = rest.split(":")
            budget, top_k = size.split("x")
            return int(budget), int(top_k), int(depth), 0.0
    except ValueError:
        pass
    raise SystemExit(f"drafting '{spec}': use chain:G, chain:G@C or tree:BxK:D, e.g. chain:2, chain:5@0.3, tree:4x4:2")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export", help="an EAGLE-3 export folder (speculators format)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafting", default="chain:2,tree:3x3:2,tree:4x4:2,tree:4x3:3,tree:8x4:4")
    p.add_argument(
        "--lookup",
        choices=["both", "off", "only"],
        default="both",
        help="each setting alone and with prompt lookup first (both), alone (off), or with lookup (only)",
    )
    p.add_argument(
        "--compiled",
        choices=["off", "both", "only"],
        default="off",
        help="on CUDA, each setting with the drafter's captured steps compiled by inductor too (both) or only",
    )
    p.add_argument("--per-category", type=int, default=2, help="validation prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="the target's: float32 | bfloat16")
    p.add_argument("--device", default="cpu", help="cpu | cuda (there every step is one captured CUDA graph)")
    args = p.parse_args()
    drafting = [(s, parse_drafting(s)) for s in args.drafting.split(",")]
    torch.set_num_threads(args.threads)

    target = load_model(args.target, device=args.device, dtype=args.dtype)
    if target.model.device.type == "cuda":
        target.model.compile()  # as `specdec bench` runs it there: the drafter's steps are captured too
    model, _ = read_speculators(args.export)
    phrases = Path(args.export) / PhraseTable.FILE
    table = PhraseTable.load(phrases, target.model.device) if phrases.is_file() else None
    if args.compiled != "off" and target.model.device.type != "cuda":
        raise SystemExit("--compiled: the drafter's steps are captured (and so compiled) on CUDA only")
    settings = [Setting("autoregressive", None, 1)]
    compiled = {"off": [False], "both": [False, True], "only": [True]}[args.compiled]
    for (spec, (budget, top_k, depth, conf)), steps in itertools.product(drafting, compiled):
        drafter = Eagle3Drafter(model, target.model, tree_budget=budget, top_k=top_k, gamma=depth, confidence=conf,
                                compile_steps=steps)  # fmt: skip
        tail = " (compiled steps)" if steps else ""
        if args.lookup != "only":
            settings.append(Setting(spec + tail, drafter, depth))
        if args.lookup != "off":
            lookup = LookupFirst(drafter, table=table)
            settings.append(Setting(spec + lookup.name.removeprefix(drafter.name) + tail, lookup, depth))
    prompts = first_per_category(read_prompts(builtin_prompts("prompts-val")), args.per_category)
    ids = [encode_prompt(target.tokenizer, q.text, chat=True) for q in prompts]
    room = max(map(len, ids)) + args.max_new_tokens
    kw = dict(max_new_tokens=args.max_new_tokens, stop_ids=target.stop_ids, capacity=room)
    for s in settings:  # first calls pay for allocations: keep them out of the numbers
        warm_up(target.model, s.drafter, ids[0], Sampler, gamma=s.gamma, **kw)

    stats: dict[str, list[GenerationStats]] = {s.name: [] for s in settings}
    same = 0
    for i, prompt in enumerate(tqdm(ids, desc="prompts")):
        k = i % len(settings)
        outputs = set()
        for s in settings[k:] + settings[:k]:
            g = generate(target.model, prompt, s.drafter, Sampler(), gamma=s.gamma, **kw)
            stats[s.name].append(g.stats)
            outputs.add(tuple(g.tokens))
        same += len(outputs) == 1

    total = {name: GenerationStats.total(runs) for name, runs in stats.items()}
    ar = total["autoregressive"].tokens_per_s
    where = f"{args.threads} threads" if args.device == "cpu" else str(target.model.device)
    print(f"\n{len(ids)} validation prompts, {args.max_new_tokens} new tokens, greedy, {where}, "
          f"target weights {target.model.weight_dtype}; drafter {args.export}\n")  # fmt: skip
    print("| drafting | tau | tok/s | speedup | draft ms / forward | verify forward ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, t in total.items():
        per = 1e3 / t.target_forwards
        print(f"| {name} | {t.tau:.2f} | {t.tokens_per_s:.1f} | {t.tokens_per_s / ar:.3f}x | "
              f"{t.draft_s * per:.2f} | {t.target_s * per:.2f} |")  # fmt: skip
    print(f"\nevery setting's output identical to the autoregressive one on {same} of {len(ids)} prompts")


if __name__ == "__main__":
    main()
