"""The `specdec` command.

    specdec prepare                                                         # convert the bundled model once
    specdec generate --prompt "Write a haiku about GPUs"                     # bundled target, autoregressive
    specdec generate --target smollm2-135m-instruct --drafter ngram \\
        --prompts prompts.jsonl --max-new-tokens 256 --temperature 0 --gamma 4 --output out.jsonl

Drafter specs: none | ngram[:N] | truncate:K | a draft model (bundled alias, local folder, Hub id)
| a Medusa export folder (`--tree` picks its tree; `--typical` enables Medusa's lossy typical acceptance)
| mtp: the multi-token-prediction heads exported with the target by recipes.mtp (`--target DIR --drafter mtp`)
| a layer-skip set (`--drafter runs/layerskip/skipset.json`, from recipes.layerskip).
Each output line holds the prompt's id, output_ids, text and stats; a summary table is printed.
"""

import argparse
import json
import sys
from pathlib import Path

from specdec_runtime.errors import SpecdecError


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that decodes (generate now, bench later)."""
    p.add_argument("--target", default="smollm2-135m-instruct", help="bundled alias, local HF folder or Hub id")
    p.add_argument(
        "--drafter",
        default="none",
        help="none | ngram[:N] | truncate:K | mtp (the target's own heads) | draft model | Medusa folder "
        "| layer-skip set (skipset.json)",
    )
    p.add_argument("--tree", help="Medusa: a JSON file of tree paths, or 'chain' (default: the export's tree)")
    p.add_argument(
        "--typical",
        action="store_true",
        help="typical acceptance for sampling (Medusa; LOSSY: output no longer follows the target exactly)",
    )
    p.add_argument("--posterior-threshold", type=float, default=0.09, help="typical acceptance: epsilon")
    p.add_argument("--posterior-alpha", type=float, default=0.3, help="typical acceptance: delta, scales exp(-entropy)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exactly the target's greedy output)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--gamma", type=int, default=None, help="draft tokens per round (default: the drafter's own, else 4)"
    )
    p.add_argument("--adaptive-gamma", action="store_true", help="+2 after a fully accepted draft, -1 otherwise")
    p.add_argument("--max-gamma", type=int, default=16)
    p.add_argument(
        "--confidence",
        type=float,
        default=0.0,
        help="stop drafting below this draft probability (0 = off; a layer-skip set's own threshold adapts)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative decoding: run and measure drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for prompts and report tau, acceptance and speed")
    add_decoding_args(gen)
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompts", type=Path, help="JSON lines: {'prompt': ...} or {'question_id', 'category', 'turns'}")
    src.add_argument("--prompt", help="a single prompt")
    gen.add_argument("--output", type=Path, help="write one JSON line per prompt here")
    gen.add_argument("--baseline", action="store_true", help="also decode autoregressively: speedup and losslessness")
    gen.add_argument("--no-warmup", action="store_true", help="skip the short untimed warm-up generation")
    prep = sub.add_parser("prepare", help="download or convert models once; print their local folders")
    prep.add_argument("models", nargs="*", default=["smollm2-135m-instruct"])
    return parser


def run_generate(args: argparse.Namespace) -> None:
    import torch
    from tqdm import tqdm

    from specdec_runtime.drafters import build_drafter
    from specdec_runtime.generate import check_fits
    from specdec_runtime.loading import load_model
    from specdec_runtime.measure import measure
    from specdec_runtime.prompts import Prompt, builtin_prompts, encode_prompt, read_prompts
    from specdec_runtime.sampling import Sampler

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompt is not None:
        prompts = [Prompt("0", args.prompt)]
    else:
        prompts = read_prompts(args.prompts or builtin_prompts("smoke"))
    Sampler(args.temperature, args.top_k, args.top_p)  # bad sampling options fail before loading anything
    if args.typical and not (0 < args.posterior_threshold < 1 and args.posterior_alpha > 0):
        raise SpecdecError("--typical needs 0 < --posterior-threshold < 1 and --posterior-alpha > 0")
    target = load_model(args.target, device=args.device, dtype=args.dtype)
    encoded = [encode_prompt(target.tokenizer, p.text, chat=not args.no_chat_template) for p in prompts]
    for p, ids in zip(prompts, encoded):  # every prompt must fit before any work starts
        check_fits(len(ids), args.max_new_tokens, target.context, f"prompt '{p.id}'")
    drafter = build_drafter(args.drafter, target, confidence=args.confidence, dtype=args.dtype, tree=args.tree)
    if args.gamma is None:
        args.gamma = getattr(drafter, "gamma", None) or 4
    typical = (args.posterior_threshold, args.posterior_alpha) if args.typical and args.temperature > 0 else None
    bar = lambda xs: tqdm(xs, desc=f"generate ({args.drafter})", unit="prompt", file=sys.stderr)  # noqa: E731
    out_file = None
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        out_file = args.output.open("w", encoding="utf-8")

    def write(i: int, g: "Generation", base: "Generation | None") -> None:  # noqa: F821
        """One JSON line per prompt, written as soon as it is done (an interrupted run keeps them)."""
        p = prompts[i]
        record = {
            "id": p.id,
            "category": p.category,
            "prompt": p.text,
            "output_ids": g.tokens,
            "text": target.tokenizer.decode(g.tokens, skip_special_tokens=True),
            "stop_reason": g.stop_reason,
            "stats": g.stats.to_dict(),
        }
        if base is not None:
            record["baseline_stats"] = base.stats.to_dict()
            record["identical_to_baseline"] = g.tokens == base.tokens
        out_file.write(json.dumps(record) + "\n")
        out_file.flush()

    try:
        report = measure(
            target.model,
            drafter,
            encoded,
            sampler=lambda: Sampler(
                args.temperature, args.top_k, args.top_p, seed=args.seed, device=target.model.device
            ),
            baseline=args.baseline,
            warmup=not args.no_warmup,
            progress=bar,
            on_result=write if out_file is not None else None,
            max_new_tokens=args.max_new_tokens,
            gamma=args.gamma,
            adaptive_gamma=args.adaptive_gamma,
            max_gamma=args.max_gamma,
            stop_ids=target.stop_ids,
            typical=typical,
        )
    finally:
        if out_file is not None:
            out_file.close()
    if len(prompts) == 1:
        print(target.tokenizer.decode(report.spec[0].tokens, skip_special_tokens=True))
    title = f"target {args.target} · drafter {args.drafter} · T={args.temperature} · gamma {args.gamma}"
    if typical:
        title += f" · typical acceptance ({typical[0]}, {typical[1]}): LOSSY"
    print_summary(title, prompts, report)


def print_summary(title: str, prompts: list, report: "Report") -> None:  # noqa: F821
    """A rich table: one row per category, and a total row when there are several."""
    from rich.console import Console
    from rich.table import Table

    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p.category or "-", []).append(i)
    rows = sorted(groups.items())
    if len(rows) > 1:
        rows.append(("all", list(range(len(prompts)))))
    table = Table(title=title)
    cols = ["category", "prompts", "new tokens", "tau", "accept", "accept by position", "tok/s", "draft s", "verify s"]
    if report.baseline:
        cols += ["AR tok/s", "speedup"] + (["lossless"] if report.greedy else [])
    for col in cols:
        table.add_column(col, justify="left" if col in ("category", "accept by position") else "right")
    for name, idx in rows:
        s = report.total("spec", idx)
        by_pos = " ".join(f"{a:.2f}" for a in s.acceptance_per_position[:8]) or "-"
        cells = [
            name,
            str(len(idx)),
            str(s.new_tokens),
            f"{s.tau:.2f}",
            f"{s.acceptance_rate:.2f}",
            by_pos,
            f"{s.tokens_per_s:.1f}",
            f"{s.draft_s:.2f}",
            f"{s.verify_s:.2f}",
        ]
        if report.baseline:
            cells += [f"{report.total('baseline', idx).tokens_per_s:.1f}", f"{report.speedup(idx):.2f}x"]
            if report.greedy:
                cells.append(f"{report.lossless_rate(idx):.0%}")
        table.add_row(*cells)
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            run_generate(args)
        elif args.command == "prepare":
            from specdec_runtime.loading import resolve_model

            for name in args.models:
                print(resolve_model(name))
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
