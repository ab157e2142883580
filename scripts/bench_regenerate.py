"""In-process regeneration throughput on a target: the runtime's batched decoding against
transformers' generate, the same conversations and batch size, side by side in one run.

    python scripts/bench_regenerate.py                                  # bundled target, 32 built-in prompts
    python scripts/bench_regenerate.py --prompts 64 --batch-size 32 --max-new-tokens 128

Each repeat runs both backends (in alternating order) through train/regenerate.InProcess on the
first user's turn of each built-in training prompt; tokens/s counts the tokens generated. It also
says whether the two backends wrote the same text (greedy: they should, up to near-ties).
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from recipes.run import load_tokenizer  # noqa: E402
from specdec_runtime.hardware import cpu_threads  # noqa: E402
from specdec_runtime.loading import load_hf_model  # noqa: E402
from train.data import load_conversations  # noqa: E402
from train.regenerate import InProcess  # noqa: E402
from train.validate import runtime_decoder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(cpu_threads("decode").threads)  # what the runtime decodes on here
    _, tokenizer, pad_id, _, stop_ids = load_tokenizer(args.target)
    hf = load_hf_model(args.target).eval()
    models = {"transformers": hf, "runtime": runtime_decoder(hf, None, torch.device("cpu"), fast_path=False)}
    convs = [c.prompt for c in load_conversations("builtin:train")[: args.prompts]]
    print(f"{args.target}, {len(convs)} prompts, batch {args.batch_size}, up to {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    rates: dict[str, list[float]] = {k: [] for k in models}
    texts: dict[str, list[str]] = {}
    for r in range(args.repeats):
        for name in list(models)[:: 1 if r % 2 == 0 else -1]:
            engine = InProcess(models[name], tokenizer, pad_id=pad_id, stop_ids=stop_ids,
                               max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)  # fmt: skip
            generate, tokens = engine.generate, [0]

            def counted(batch, generate=generate, tokens=tokens):
                out = generate(batch)
                tokens[0] += sum(len(o) for o in out)
                return out

            engine.generate = counted
            start = time.perf_counter()
            texts[name] = engine.replies(convs)
            seconds = time.perf_counter() - start
            rates[name].append(tokens[0] / seconds)
            print(
                f"  repeat {r}: {name:<12} {tokens[0]:>6} tokens in {seconds:6.1f} s: {tokens[0] / seconds:7.1f} tok/s"
            )
    print(f"{'backend':<12} {'tok/s (mean)':>12}")
    for name, values in rates.items():
        print(f"{name:<12} {sum(values) / len(values):12.1f}")
    ratio = sum(rates["runtime"]) / sum(rates["transformers"])
    same = sum(a == b for a, b in zip(texts["runtime"], texts["transformers"]))
    print(f"runtime / transformers: {ratio:.2f}x; the same text for {same} of {len(convs)} prompts")


if __name__ == "__main__":
    main()
