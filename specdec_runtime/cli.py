"""The `specdec` command.

    specdec prepare                                                         # convert the bundled model once
    specdec generate --prompt "Write a haiku about GPUs"                     # bundled target, autoregressive
    specdec generate --target smollm2-135m-instruct --drafter ngram \\
        --prompts prompts.jsonl --max-new-tokens 256 --temperature 0 --gamma 4 --output out.jsonl
    specdec check-export runs/eagle3/export                                   # will vLLM, SGLang, ... load it?
    specdec push runs/eagle3/export me/smollm2-eagle3                         # checked, then uploaded

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


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The target and where it runs (every command that decodes)."""
    p.add_argument("--target", default="smollm2-135m-instruct", help="bundled alias, local HF folder or Hub id")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (fp32 on CPU, bf16 on CUDA) | fast (bf16 where measured faster than fp32) | float32 | bfloat16 "
        "| float16",
    )
    p.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="the fast path: each decode, draft and verify step one CUDA graph (auto: on CUDA only)",
    )
    p.add_argument(
        "--threads", type=int, default=0, help="CPU threads (0: what decodes fastest here, timed if there is a choice)"
    )
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as raw text")
    p.add_argument("--seed", type=int, default=0)


def add_decoding_args(p: argparse.ArgumentParser, max_new_tokens: int = 256) -> None:
    """Options of the speculative loop and the sampler (generate and bench)."""
    p.add_argument("--tree", help="Medusa: a JSON file of tree paths, or 'chain' (default: the export's tree)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
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


DRAFTERS_HELP = (
    "none | ngram[:N] | truncate:K | mtp (the target's own heads) | draft model | EAGLE-3 or Medusa folder "
    "| layer-skip set (skipset.json); SPEC+lookup: prompt lookup first, then an export's phrase table"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Speculative decoding: run and measure drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for prompts and report tau, acceptance and speed")
    add_model_args(gen)
    gen.add_argument("--drafter", default="none", help=DRAFTERS_HELP)
    add_decoding_args(gen)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exactly the target's greedy output)")
    gen.add_argument(
        "--typical",
        action="store_true",
        help="typical acceptance for sampling (Medusa; LOSSY: output no longer follows the target exactly)",
    )
    gen.add_argument("--posterior-threshold", type=float, default=0.09, help="typical acceptance: epsilon")
    gen.add_argument(
        "--posterior-alpha", type=float, default=0.3, help="typical acceptance: delta, scales exp(-entropy)"
    )
    src = gen.add_mutually_exclusive_group()
    src.add_argument("--prompts", type=Path, help="JSON lines: {'prompt': ...} or {'question_id', 'category', 'turns'}")
    src.add_argument("--prompt", help="a single prompt")
    gen.add_argument(
        "--batch-size", type=int, default=1, help="prompts decoded together, each accepting its own drafts"
    )
    gen.add_argument(
        "--drafts", type=int, default=1, help="SpecTr: sequences sampled a round, verified together (sampling only)"
    )
    gen.add_argument("--adapt-every", type=int, help="online adaptation: update the drafter every N prompts served")
    gen.add_argument("--adapt-steps", type=int, default=4, help="online adaptation: AdamW steps an update")
    gen.add_argument("--adapt-lr", type=float, default=3e-4, help="online adaptation: learning rate")
    gen.add_argument("--adapt-keep", type=int, default=0, help="online adaptation: prompts an update trains on (0: 4N)")
    gen.add_argument("--adapt-save", type=Path, help="online adaptation: save the adapted drafter in this new folder")
    gen.add_argument("--output", type=Path, help="write one JSON line per prompt here")
    gen.add_argument("--baseline", action="store_true", help="also decode autoregressively: speedup and losslessness")
    gen.add_argument("--no-warmup", action="store_true", help="skip the short untimed warm-up generation")

    bench = sub.add_parser("bench", help="compare drafters side by side: tables, JSON and plots in --output-dir")
    add_model_args(bench)
    bench.add_argument(
        "--drafters",
        default="none,ngram",
        help=f"comma-separated: {DRAFTERS_HELP}; SPEC@G fixes that drafter's gamma (e.g. truncate:28@1)",
    )
    add_decoding_args(bench, max_new_tokens=128)
    bench.add_argument("--temperature", type=float, default=0.7, help="of the sampled mode")
    bench.add_argument("--modes", default="greedy,sampled", help="greedy, sampled or both")
    bench.add_argument(
        "--prompts", type=Path, help="JSON lines (MT-Bench / Spec-Bench form); default: the 64 validation prompts"
    )
    bench.add_argument("--per-category", type=int, default=0, help="only the first N prompts of each category")
    bench.add_argument("--output-dir", type=Path, default=Path("runs/bench"))
    bench.add_argument("--fresh", action="store_true", help="discard the results already in --output-dir")
    bench.add_argument(
        "--no-reference", action="store_true", help="skip transformers' (assisted) generation as the outside reference"
    )
    bench.add_argument(
        "--paired",
        action="store_true",
        help="time autoregressive decoding again right before each drafter's run of each prompt (twice the "
        "decoding, but ratios a machine whose speed drifts cannot move)",
    )
    bench.add_argument(
        "--batch-sizes",
        help="e.g. 1,4,16: each drafter at each batch size against autoregressive at the same size (batch.md, "
        "speedup_vs_batch.png) instead of the per-category bench",
    )
    bench.add_argument(
        "--drafts",
        help="e.g. 1,2,4: SpecTr, that many sampled sequences a round, at temperatures 0.7 and 1.0 against "
        "autoregressive decoding (drafts.md) instead of the per-category bench",
    )
    bench.add_argument("--wandb", action="store_true", help="log to Weights & Biases (WANDB_MODE=offline works)")
    bench.add_argument("--wandb-project", default="specdec")

    tune = sub.add_parser(
        "tune", help="which drafting settings pay at which batch size and temperature: tune.json, with the engines'"
    )
    add_model_args(tune)
    tune.add_argument("--drafter", required=True, help="the drafter to tune (" + DRAFTERS_HELP + ")")
    tune.add_argument("--batch-sizes", default="1,4", help="comma-separated batch sizes")
    tune.add_argument("--temperatures", default="0,0.7", help="comma-separated; 0 = greedy")
    tune.add_argument("--gammas", default="1,2,3,4,5", help="chain lengths tried (beside its own tree at batch 1)")
    tune.add_argument("--top-k", type=int, default=0)
    tune.add_argument("--top-p", type=float, default=1.0)
    tune.add_argument("--max-new-tokens", type=int, default=64)
    tune.add_argument("--prompts", type=Path, help="JSON lines (default: the validation prompts)")
    tune.add_argument("--per-category", type=int, default=2, help="the first N prompts of each category (0: all)")
    tune.add_argument("--output", type=Path, default=Path("tune.json"))

    prep = sub.add_parser("prepare", help="download or convert models once; print their local folders")
    prep.add_argument("models", nargs="*", default=["smollm2-135m-instruct"])
    check = sub.add_parser(
        "check-export",
        help="whether each engine an export is for (vLLM, SGLang, transformers, FasterDecoding) will load it",
    )
    check.add_argument("folder", type=Path, help="an export folder (a run's export/)")
    check.add_argument("--engine", action="append", help="check this engine, claimed or not (repeatable)")
    push = sub.add_parser("push", help="check an export, then upload it to a Hugging Face Hub repo")
    push.add_argument("folder", type=Path)
    push.add_argument("repo_id", help="OWNER/NAME (created if needed)")
    push.add_argument("--public", action="store_true", help="a public repo (default: private)")
    push.add_argument("--revision", help="a branch to push to (created if needed)")
    push.add_argument("--force", action="store_true", help="push even where check-export says an engine would fail")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Every setting generate and bench share, checked before anything is loaded or written."""
    from specdec_runtime.hardware import resolve_device, resolve_dtype
    from specdec_runtime.sampling import Sampler

    resolve_dtype(args.dtype, resolve_device(args.device))
    Sampler(args.temperature, args.top_k, args.top_p)
    problems = []
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.gamma is not None and args.gamma < 1:
        problems.append(f"--gamma must be >= 1, got {args.gamma} (for autoregressive decoding: --drafter none)")
    if args.max_gamma < 1:
        problems.append(f"--max-gamma must be >= 1, got {args.max_gamma}")
    if not 0 <= args.confidence < 1:
        problems.append(f"--confidence must be in [0, 1), got {args.confidence}")
    if args.threads < 0:
        problems.append(f"--threads must be >= 0 (0 = the fastest, timed), got {args.threads}")
    if problems:
        raise SpecdecError("; ".join(problems))


def check_batch(args: argparse.Namespace, largest: int) -> None:
    """Batched decoding's settings (largest: the largest batch size asked for), before anything loads."""
    if largest < 1:
        raise SpecdecError(f"batch sizes must be >= 1, got {largest}")
    if largest == 1:
        return
    if getattr(args, "typical", False) or getattr(args, "adaptive_gamma", False) or getattr(args, "confidence", 0):
        raise SpecdecError("--typical, --adaptive-gamma and --confidence decode one prompt at a time: --batch-size 1")


def batched(drafter, spec: str, batch_size: int) -> tuple:
    """(the drafter as batches decode with it, the batch size it runs at): a kind that decodes a prompt
    at a time runs at batch size 1, and says so."""
    from specdec_runtime.drafters.batched import batch_drafter

    if batch_size == 1 or drafter is None:
        return drafter, batch_size
    rows = batch_drafter(drafter)
    if rows is None:
        print(f"drafter {spec} decodes one prompt at a time (a draft exit's, as --confidence sets): batch size 1",
              file=sys.stderr)  # fmt: skip
        return drafter, 1
    return rows, batch_size


def load_target(args: argparse.Namespace) -> "LoadedModel":  # noqa: F821
    """The target on its device, compiled for CUDA graphs when --compile asks (auto: on CUDA)."""
    import torch

    from specdec_runtime.hardware import cpu_threads, resolve_device
    from specdec_runtime.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    elif resolve_device(args.device).type == "cpu":
        choice = cpu_threads("decode")
        torch.set_num_threads(choice.threads)
        print(f"threads: {choice} (--threads N to set them)", file=sys.stderr)
    target = load_model(args.target, device=args.device, dtype=args.dtype)
    if args.compile == "on" or (args.compile == "auto" and target.model.device.type == "cuda"):
        if args.compile == "auto" and not target.model.can_compile:
            print("the fast path captures no mixture-of-experts layers yet: decoding eagerly", file=sys.stderr)
        else:
            target.model.compile()
    return target


def encode_all(target: "LoadedModel", prompts: list, args: argparse.Namespace) -> list[list[int]]:  # noqa: F821
    """Token ids of every prompt; all must fit the context before any work starts."""
    from specdec_runtime.generate import check_fits
    from specdec_runtime.prompts import encode_prompt

    encoded = [encode_prompt(target.tokenizer, p.text, chat=not args.no_chat_template) for p in prompts]
    for p, ids in zip(prompts, encoded):
        check_fits(len(ids), args.max_new_tokens, target.context, f"prompt '{p.id}'")
    return encoded


def run_generate(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from specdec_runtime.drafters.spec import build_drafter
    from specdec_runtime.measure import measure
    from specdec_runtime.prompts import Prompt, builtin_prompts, read_prompts
    from specdec_runtime.report import Output, print_summary, print_windows
    from specdec_runtime.sampling import Sampler
    from specdec_runtime.stats import GenerationStats

    # Everything a user can get wrong fails here, before a model loads or a file is written.
    check_args(args)
    if args.typical and not (0 < args.posterior_threshold < 1 and args.posterior_alpha > 0):
        raise SpecdecError("--typical needs 0 < --posterior-threshold < 1 and --posterior-alpha > 0")
    check_batch(args, args.batch_size)
    if args.drafts < 1:
        raise SpecdecError(f"--drafts must be >= 1 (sequences sampled a round), got {args.drafts}")
    if args.drafts > 1 and (args.drafter.strip().lower() in ("none", "ar", "") or args.batch_size > 1 or args.typical):
        raise SpecdecError("--drafts > 1 needs a drafter, --batch-size 1 and no --typical")
    if args.adapt_every is not None:
        from specdec_runtime.drafters.online import check_adapting

        check_adapting(args.adapt_every, args.adapt_steps, args.adapt_lr, args.adapt_save, args.batch_size)
    if args.prompt is not None:
        if not args.prompt.strip():
            raise SpecdecError("--prompt is empty: give the text to continue")
        prompts = [Prompt("0", args.prompt)]
    else:
        prompts = read_prompts(args.prompts or builtin_prompts("smoke"))
    output = Output(args.output, args.prompts) if args.output else None
    target = load_target(args)
    encoded = encode_all(target, prompts, args)
    drafter = build_drafter(args.drafter, target, confidence=args.confidence, dtype=args.dtype, tree=args.tree)
    if args.gamma is None:
        args.gamma = (drafter.gamma if drafter is not None else None) or 4
    drafter, batch_size = batched(drafter, args.drafter, args.batch_size)
    if args.drafts > 1:
        from specdec_runtime.drafters.multi import MultiDraft
        from specdec_runtime.drafters.spec import as_chains

        chains = as_chains(drafter, args.drafter, target, confidence=args.confidence, dtype=args.dtype, tree=args.tree)
        drafter = MultiDraft(chains, args.drafts)  # (SpecTr draws chains)
    adapter = None
    if args.adapt_every is not None:  # refuses a drafter that cannot learn, before decoding starts
        from specdec_runtime.drafters.online import OnlineAdapter

        adapter = OnlineAdapter(drafter, target.model, every=args.adapt_every, steps=args.adapt_steps, lr=args.adapt_lr,
                                keep=args.adapt_keep)  # fmt: skip
    typical = (args.posterior_threshold, args.posterior_alpha) if args.typical and args.temperature > 0 else None
    bar = lambda xs: tqdm(xs, desc=f"generate ({args.drafter})", unit="prompt", file=sys.stderr)  # noqa: E731

    served = []  # the generations so far, in prompt order

    def write(i: int, g: "Generation", base: "Generation | None") -> None:  # noqa: F821
        """One JSON line per prompt, written as soon as it is done (an interrupted run keeps them); with
        online adaptation, the drafter updated after the window's last prompt first."""
        served.append(g)
        update = adapter.served(encoded[i], g.tokens) if adapter is not None else None
        if output is None:
            return
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
        if adapter is not None:  # the window's tau so far: its last prompt's record has the window's
            w = i // adapter.every
            window = [r.stats for r in served[w * adapter.every :]]
            record["adapt"] = {"window": w, "window_tau": round(GenerationStats.total(window).tau, 4)}
            record["adapt"] |= {"update": update.to_dict()} if update else {}
        output.write(record)

    try:
        report = measure(
            target.model,
            drafter,
            encoded,
            sampler=lambda: Sampler(args.temperature, args.top_k, args.top_p, seed=args.seed),
            baseline=args.baseline,
            warmup=not args.no_warmup,
            progress=bar,
            on_result=write if output is not None or adapter is not None else None,
            teacher=adapter.record if adapter is not None else None,
            max_new_tokens=args.max_new_tokens,
            gamma=args.gamma,
            adaptive_gamma=args.adaptive_gamma,
            max_gamma=args.max_gamma,
            stop_ids=target.stop_ids,
            typical=typical,
            batch_size=batch_size,
        )
    except KeyboardInterrupt:
        done = output.records if output is not None else 0
        kept = f"; their results are in {output.partial}, and {args.output} is unchanged" if output else ""
        print(f"\nspecdec: interrupted after {done} of {len(prompts)} prompts{kept}. Run the same command "
              "again to generate them all.", file=sys.stderr)  # fmt: skip
        sys.exit(130)
    if output is not None:
        output.finish()
    if len(prompts) == 1:
        print(target.tokenizer.decode(report.spec[0].tokens, skip_special_tokens=True))
    title = f"target {args.target} · drafter {args.drafter} · T={args.temperature} · gamma {args.gamma}"
    title += f" · batch {batch_size}" if batch_size > 1 else ""
    title += f" · SpecTr, {args.drafts} drafts" if args.drafts > 1 else ""
    if typical:
        title += f" · typical acceptance ({typical[0]}, {typical[1]}): LOSSY"
    print_summary(title, prompts, report)
    if adapter is not None:
        print_windows(adapter.every, adapter.updates, report)
        if args.adapt_save:
            print(f"adapted drafter: {adapter.save(args.adapt_save)}")


def run_bench(args: argparse.Namespace) -> None:
    import torch
    from tqdm import tqdm

    from specdec_runtime import bench, cpu
    from specdec_runtime.loading import load_hf_model
    from specdec_runtime.prompts import builtin_prompts, first_per_category, read_prompts

    # Everything a user can get wrong fails here, before a model loads or a file is written.
    check_args(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(bench.MODES):
        raise SpecdecError(f"--modes {args.modes!r}: use greedy, sampled or greedy,sampled")
    if "sampled" in modes and args.temperature <= 0:
        raise SpecdecError("the sampled mode needs --temperature > 0 (or --modes greedy)")
    specs = [s.strip() for s in args.drafters.split(",") if s.strip()]
    if not specs or len(set(specs)) != len(specs):
        raise SpecdecError(f"--drafters {args.drafters!r}: give a comma-separated list without repeats")
    if args.per_category < 0:
        raise SpecdecError(f"--per-category must be >= 0 (0 = every prompt), got {args.per_category}")
    if args.output_dir.exists() and not args.output_dir.is_dir():
        raise SpecdecError(f"--output-dir {args.output_dir} is a file: give a folder for the bench's results")
    prompts = read_prompts(args.prompts or builtin_prompts("prompts-val"))
    if args.per_category > 0:
        prompts = first_per_category(prompts, args.per_category)
    if args.batch_sizes is not None and args.drafts is not None:
        raise SpecdecError("--batch-sizes and --drafts are two sweeps: run them one at a time")
    if args.batch_sizes is not None:
        return run_batch_sweep(args, prompts, specs, modes)
    if args.drafts is not None:
        return run_drafts_sweep(args, prompts, specs)

    target = load_target(args)
    encoded = encode_all(target, prompts, args)
    m = target.model
    native = m.native()  # the CPU kernel's view of the model, where it runs there
    settings = bench.BenchSettings(
        target=args.target,
        prompts=bench.prompts_digest(prompts, encoded),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        gamma=args.gamma,
        adaptive_gamma=args.adaptive_gamma,
        max_gamma=args.max_gamma,
        confidence=args.confidence,
        tree=args.tree,
        device=m.device.type,
        dtype=str(m.weight_dtype).removeprefix("torch."),
        products=cpu.products(m.device, m.dtype)
        + " (bf16 weights, fp32 activations)" * m.bf16_weights
        + "; greedy steps read the lm_head's bf16 screen" * (native is not None and native.screen() is not None),
        chat=not args.no_chat_template,
        reference=not args.no_reference,
        paired=args.paired,
        threads=torch.get_num_threads() if m.device.type == "cpu" else None,
        runtime=bench.runtime_digest(),
    )
    bench.check_settings(args.output_dir, settings, args.fresh)
    # transformers' model of the same arithmetic (a bf16 target on a CPU computes in fp32: Decoder.weight_dtype)
    hf = None if args.no_reference else load_hf_model(args.target, m.dtype, m.weight_dtype).to(m.device).eval()
    bar = lambda total: tqdm(total=total, desc="bench", unit="run", file=sys.stderr)  # noqa: E731
    results = bench.run_bench(
        target, prompts, encoded, specs, settings, args.output_dir, modes=modes, hf=hf, progress=bar
    )
    table, rows, plots = bench.write_report(args.output_dir, settings, results)
    print(table)
    if args.wandb:
        bench.log_wandb(args.output_dir, settings, rows, plots, args.wandb_project)
    print(f"wrote {args.output_dir}/results.md, results.json, " + ", ".join(p.name for p in plots), file=sys.stderr)
    failed = sorted({r["drafter"] for r in rows if "error" in r})
    if failed:
        raise SpecdecError(f"{len(failed)} of {len(specs)} drafters failed ({', '.join(failed)}): see the table above")


def run_batch_sweep(args: argparse.Namespace, prompts: list, specs: list[str], modes: list[str]) -> None:
    """bench --batch-sizes (specdec_runtime.sweeps), its settings checked before the target loads."""
    from tqdm import tqdm

    from specdec_runtime import sweeps

    sizes = numbers(args.batch_sizes, "--batch-sizes", int, 1)
    check_batch(args, max(sizes))
    target = load_target(args)
    encoded = encode_all(target, prompts, args)
    runs = sum(len(modes) * len(sizes) for s in specs if s != "none")
    bar = tqdm(total=runs, desc="bench --batch-sizes", unit="run", file=sys.stderr)
    rows = sweeps.sweep(
        target, encoded, specs, sizes, modes, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, max_new_tokens=args.max_new_tokens, gamma=args.gamma, dtype=args.dtype,
        progress=lambda row: bar.update(),
    )  # fmt: skip
    bar.close()
    title = f"{args.target}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, {target.model.device.type}"
    table, plot = sweeps.write(args.output_dir, rows, title)
    print(table)
    print(f"wrote {args.output_dir}/batch.md, batch.json, {plot.name}", file=sys.stderr)


def run_drafts_sweep(args: argparse.Namespace, prompts: list, specs: list[str]) -> None:
    """bench --drafts (specdec_runtime.sweeps.drafts_sweep)."""
    from tqdm import tqdm

    from specdec_runtime import sweeps

    ks = numbers(args.drafts, "--drafts", int, 1)
    target = load_target(args)
    encoded = encode_all(target, prompts, args)
    temperatures = (0.7, 1.0)
    bar = tqdm(total=len(ks) * len(temperatures) * len([s for s in specs if s != "none"]), desc="bench --drafts",
               unit="run", file=sys.stderr)  # fmt: skip
    rows = sweeps.drafts_sweep(
        target, encoded, specs, ks, temperatures, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_new_tokens=args.max_new_tokens, gamma=args.gamma, dtype=args.dtype, progress=lambda row: bar.update(),
    )  # fmt: skip
    bar.close()
    title = (
        f"SpecTr: {args.target}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, {target.model.device.type}"
    )
    table = sweeps.drafts_markdown(rows, title)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "drafts.md").write_text(table)
    (args.output_dir / "drafts.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table)
    print(f"wrote {args.output_dir}/drafts.md, drafts.json", file=sys.stderr)


def numbers(text: str, flag: str, kind: type, least: float) -> list:
    """'1,4,16' -> [1, 4, 16] (ascending, no repeats), each >= least, else a SpecdecError naming the flag."""
    try:
        values = sorted({kind(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SpecdecError(f"{flag} {text!r}: give comma-separated numbers, e.g. 1,4,16") from None
    if not values or values[0] < least:
        raise SpecdecError(f"{flag} {text!r}: every value must be >= {least}")
    return values


def run_tune(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from specdec_runtime import tune
    from specdec_runtime.prompts import builtin_prompts, first_per_category, read_prompts
    from specdec_runtime.sampling import Sampler

    # Everything a user can get wrong fails here, before a model loads or a file is written.
    sizes = numbers(args.batch_sizes, "--batch-sizes", int, 1)
    temperatures = numbers(args.temperatures, "--temperatures", float, 0)
    gammas = numbers(args.gammas, "--gammas", int, 1)
    for t in temperatures:
        Sampler(t, args.top_k, args.top_p)
    if args.max_new_tokens < 1 or args.per_category < 0:
        raise SpecdecError("--max-new-tokens must be >= 1 and --per-category >= 0")
    if args.drafter.strip().lower() in ("", "none", "ar"):
        raise SpecdecError("--drafter: give the drafter to tune (autoregressive decoding is every setting's baseline)")
    if args.output.is_dir():
        raise SpecdecError(f"--output {args.output} is a folder: give a file name (tune.json)")
    check_batch(args, max(sizes))
    prompts = read_prompts(args.prompts or builtin_prompts("prompts-val"))
    if args.per_category > 0:
        prompts = first_per_category(prompts, args.per_category)
    target = load_target(args)
    encoded = encode_all(target, prompts, args)
    bar = tqdm(desc="tune", unit="run", file=sys.stderr)
    result = tune.tune(
        target, args.drafter, encoded, sizes, temperatures, gammas, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, max_new_tokens=args.max_new_tokens, dtype=args.dtype, progress=lambda *_: bar.update(),
    )  # fmt: skip
    bar.close()
    result = {"target": args.target} | result
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(tune.table(result))
    print(f"wrote {args.output}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            run_generate(args)
        elif args.command == "bench":
            run_bench(args)
        elif args.command == "tune":
            run_tune(args)
        elif args.command == "prepare":
            from specdec_runtime.paths import resolve_model

            for name in args.models:
                print(resolve_model(name))
        elif args.command == "check-export":
            from specdec_runtime.export_check import check_export

            report = check_export(args.folder, args.engine)
            print(report.text())
            if not report.ok:
                sys.exit(2)
        elif args.command == "push":
            from specdec_runtime.hub import push_folder

            try:
                url = push_folder(args.folder, args.repo_id, private=not args.public, revision=args.revision,
                                  check=not args.force)  # fmt: skip
            except SpecdecError:
                raise
            except Exception as e:  # the network, the token, the Hub's answer: said in one line
                raise SpecdecError(f"the push to {args.repo_id} failed: {type(e).__name__}: {e}") from e
            print(f"pushed {args.folder} to {url}")
    except SpecdecError as e:
        print(f"specdec: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
