"""What the CPU kernels (specdec_runtime/cpu/kernel.py) buy in generation: torch's ops, the kernel's
products in torch's sublayers, and the kernel's whole sublayers (layers.c), autoregressive and
speculative, interleaved per prompt so the machine's drift hits all three.

    python scripts/bench_cpu_kernel.py --drafter runs/quickstart/export+lookup
    python scripts/bench_cpu_kernel.py --drafter ngram --per-category 1 --max-new-tokens 64

For each validation prompt, in rotating order: each path decodes the prompt autoregressively and
then with the drafter (greedy). Prints tokens/s per path and mode, the speculative speedup within
each path, each path's speedup over torch's within each mode, and whether every output was the
same token for token.
"""

import argparse
import contextlib

import torch
from tqdm import tqdm

from specdec_runtime.cpu import kernel as cpu_kernel
from specdec_runtime.drafters.spec import build_drafter
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
    if cpu_kernel.library() is None:
        raise SystemExit("the CPU kernel cannot be used here (the line above says why): nothing to compare")
    paths = {"torch": cpu_kernel.disabled, "products": cpu_kernel.products_only, "sublayers": contextlib.nullcontext}
    # The torch path's target and drafter keep W^T for MKL's products (loaded inside disabled()),
    # the kernel paths' the kernel's packed copies.
    loaded = {}
    for path in ("torch", "sublayers"):
        with paths[path]():
            target = load_model(args.target, device="cpu", dtype=torch.float32)
            loaded[path] = target, build_drafter(args.drafter, target)
    loaded["products"] = loaded["sublayers"]
    prompts = first_per_category(read_prompts(builtin_prompts("prompts-val")), args.per_category)
    tokens, seconds, outputs = {}, {}, {}
    for i, prompt in enumerate(tqdm(prompts, desc="prompts")):
        ids = encode_prompt(target.tokenizer, prompt.text, chat=True)
        order = list(paths)
        for path in order[i % 3 :] + order[: i % 3]:
            target, drafter = loaded[path]
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
    print("| kernel path | autoregressive tok/s | speculative tok/s | speculative / autoregressive |")
    print("|---|---:|---:|---:|")
    for path in paths:
        ar, spec = rate[path, "autoregressive"], rate[path, "speculative"]
        print(f"| {path} | {ar:.1f} | {spec:.1f} | {spec / ar:.2f}x |")
    for path in list(paths)[1:]:
        gain = [rate[path, m] / rate["torch", m] for m in ("autoregressive", "speculative")]
        print(f"| {path} / torch | {gain[0]:.2f}x | {gain[1]:.2f}x | |")
    print(f"\nthe {2 * len(paths)} outputs identical on {same} of {len(prompts)} prompts")


if __name__ == "__main__":
    main()
