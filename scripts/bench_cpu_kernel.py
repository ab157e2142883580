"""What the CPU kernel (specdec_runtime/cpu_kernel.py) buys in generation: torch's products vs the
kernel's, autoregressive and speculative, interleaved per prompt so the machine's drift hits both.

    python scripts/bench_cpu_kernel.py --drafter runs/quickstart/export+lookup
    python scripts/bench_cpu_kernel.py --drafter ngram --per-category 1 --max-new-tokens 64

For each validation prompt, in alternating order: both product paths, each decoding the prompt
autoregressively and then with the drafter (greedy). Prints tokens/s per path and mode, the
speculative speedup within each path, the kernel's speedup within each mode, and whether every
output was the same token for token.
"""

import argparse
import contextlib

import torch
from tqdm import tqdm

from specdec_runtime import cpu_kernel
from specdec_runtime.drafter_spec import build_drafter
from specdec_runtime.generate import generate
from specdec_runtime.loading import load_model
from specdec_runtime.prompts import builtin_prompts, encode_prompt, first_per_category, read_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default="ngram", help="a drafter spec, as `specdec generate --drafter` takes")
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernel.kernel() is None:
        raise SystemExit("the CPU kernel cannot be used here (the line above says why): nothing to compare")
    target = load_model(args.target, device="cpu", dtype=torch.float32)
    drafter = build_drafter(args.drafter, target)
    prompts = first_per_category(read_prompts(builtin_prompts("prompts-val")), args.per_category)
    paths = {"torch": cpu_kernel.disabled, "kernel": contextlib.nullcontext}
    tokens, seconds, outputs = {}, {}, {}
    for i, prompt in enumerate(tqdm(prompts, desc="prompts")):
        ids = encode_prompt(target.tokenizer, prompt.text, chat=True)
        for path in list(paths)[:: 1 if i % 2 else -1]:
            with paths[path]():
                for mode, d in (("autoregressive", None), ("speculative", drafter)):
                    g = generate(
                        target.model,
                        ids,
                        d,
                        max_new_tokens=args.max_new_tokens,
                        gamma=args.gamma,
                        stop_ids=target.stop_ids,
                        capacity=len(ids) + args.max_new_tokens,
                    )
                    tokens[path, mode] = tokens.get((path, mode), 0) + g.stats.new_tokens
                    seconds[path, mode] = seconds.get((path, mode), 0.0) + g.stats.total_s
                    outputs.setdefault(i, set()).add(tuple(g.tokens))
    rate = {key: tokens[key] / seconds[key] for key in tokens}
    same = sum(len(o) == 1 for o in outputs.values())
    print(
        f"\n{len(prompts)} prompts, greedy, {args.max_new_tokens} new tokens, {args.threads} threads, "
        f"drafter {args.drafter} (gamma {args.gamma})\n"
    )
    print("| products | autoregressive tok/s | speculative tok/s | speculative / autoregressive |")
    print("|---|---:|---:|---:|")
    for path in paths:
        ar, spec = rate[path, "autoregressive"], rate[path, "speculative"]
        print(f"| {path} | {ar:.1f} | {spec:.1f} | {spec / ar:.2f}x |")
    kernel_gain = [rate["kernel", m] / rate["torch", m] for m in ("autoregressive", "speculative")]
    print(f"| kernel / torch | {kernel_gain[0]:.2f}x | {kernel_gain[1]:.2f}x | |")
    print(f"\nthe 4 outputs identical on {same} of {len(prompts)} prompts")


if __name__ == "__main__":
    main()
