"""The EAGLE-3 training-time test's memory and speed: one training step (forward and backward) of a
drafter for the bundled target's shape, each in a process of its own (its peak resident memory
over the process's before the step), at T tokens and 7 unrolled steps, micro-batch 1:

    python scripts/bench_ttt_memory.py                       # T = 512, 1024, 2048, 4096
    python scripts/bench_ttt_memory.py --lengths 512,1024 --steps 7
    python scripts/bench_ttt_memory.py --lengths "" --store STORE  # packing only

`before`: the attention that kept [B, h, T, T + k] fp32 scores a step (tests/train/test_ttt.py's
MaterializedAttention, the code it replaced); `now`: one SDPA call a step; `now + checkpoint`:
eagle3.checkpoint_steps. Then packed against padded micro-batches of 8 sequences whose lengths
are the quickstart's (read from a hidden-state store's shapes, --store; random order, as
trainer.group_by_length=false makes them): tokens a second of the real tokens. Prints tables.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def training(draft_vocab: int, steps: int, checkpoint_steps: bool):
    """An Eagle3Training for SmolLM2-135M's shape (random weights; the target's embedding random too)."""
    from specdec_runtime.config import DecoderConfig
    from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model
    from specdec_runtime.loading import load_hf_config
    from specdec_runtime.paths import resolve_model
    from train.eagle3 import Eagle3Training

    target = DecoderConfig.from_hf(load_hf_config(resolve_model("smollm2-135m-instruct")))
    torch.manual_seed(0)
    model = Eagle3Model(Eagle3Config.for_target(target, aux_layers=None, draft_vocab_size=draft_vocab))
    model.set_draft_vocab(torch.arange(draft_vocab))
    embed = torch.randn(target.vocab_size, target.hidden_size) * 0.02
    head = torch.randn(draft_vocab, target.hidden_size) * 0.02
    return Eagle3Training(model, embed, head, steps=steps, decay=0.8, checkpoint_steps=checkpoint_steps), target


def batch(lengths: list[int], H: int, draft_vocab: int, packed: bool, budget: int):
    """Inputs of one micro-batch of sequences of these lengths, right-padded or packed."""
    from train.eagle3 import pack

    g = torch.Generator().manual_seed(len(lengths))
    B, T = len(lengths), max(lengths)
    ids, mask = torch.randint(0, draft_vocab, (B, T), generator=g), torch.zeros(B, T - 1, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, : n - 1] = True
    taps, final = torch.randn(B, T, 3 * H, generator=g), torch.randn(B, T, H, generator=g)
    if not packed:
        return (ids, torch.ones_like(ids), mask, taps, final), {}
    p = pack(lengths, budget, ids, mask, taps, final)
    return (p["input_ids"], p["documents"] >= 0, p["target_mask"], p["taps"], p["final"]), {"documents": p["documents"]}


def one(args: argparse.Namespace) -> None:
    """A single measurement, printed as JSON: peak RSS growth over the step, seconds a step."""
    if args.variant == "before":
        from tests.train.test_ttt import MaterializedAttention
        from train import eagle3

        eagle3.TTTAttention = MaterializedAttention
    model, target = training(args.draft_vocab, args.steps, args.variant == "checkpoint")
    lengths = [int(n) for n in args.one.split(",")]
    inputs, kw = batch(lengths, target.hidden_size, args.draft_vocab, args.variant == "packed", args.budget)
    times = []
    for i in range(args.repeats + 1):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        loss, _, _ = model(*inputs, **kw)
        loss.backward()
        times.append(time.perf_counter() - start)
        if i == 0:
            peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
        model.zero_grad(set_to_none=True)
    print(json.dumps({"peak": peak, "seconds": sorted(times[1:])[len(times[1:]) // 2]}))


def run(args: argparse.Namespace, variant: str, lengths: list[int]) -> dict:
    cmd = [sys.executable, __file__, "--one", ",".join(map(str, lengths)), "--variant", variant,
           "--steps", str(args.steps), "--draft-vocab", str(args.draft_vocab), "--budget", str(args.budget),
           "--repeats", str(args.repeats)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def store_lengths(store: Path) -> list[int]:
    from safetensors import safe_open

    lengths = []
    for shard in sorted(store.glob("shard-*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            lengths += [f.get_slice(k).get_shape()[0] for k in f.keys() if k.startswith("final.")]  # noqa: SIM118
    return lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,1024,2048,4096")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=2048, help="the quickstart's")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--store", type=Path, help="a hidden-state store whose examples give the lengths (packing)")
    p.add_argument("--budget", type=int, default=4096, help="packed rows' tokens (a micro-batch of 8 x 512 in one)")
    p.add_argument("--batches", type=int, default=6, help="micro-batches of 8 timed, packed and padded")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="now", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return one(args)
    torch.set_num_threads(torch.get_num_threads())
    print(f"one training step, {args.steps} unrolled steps, micro-batch 1, draft vocabulary {args.draft_vocab}, "
          f"SmolLM2-135M's shape, {torch.get_num_threads()} threads\n")  # fmt: skip
    lengths = [int(T) for T in args.lengths.split(",") if T]
    if lengths:
        print("| T | before: peak MiB | s | now: peak MiB | s | now + checkpoint: peak MiB | s |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for T in lengths:
        rows[T] = {v: run(args, v, [T]) for v in ("before", "now", "checkpoint")}
        cells = " | ".join(f"{rows[T][v]['peak'] / 2**20:.0f} | {rows[T][v]['seconds']:.2f}"
                           for v in ("before", "now", "checkpoint"))  # fmt: skip
        print(f"| {T} | {cells} |", flush=True)
    Ts = sorted(rows)
    for a, b in zip(Ts, Ts[1:]):
        ratio = {v: rows[b][v]["peak"] / rows[a][v]["peak"] for v in ("before", "now", "checkpoint")}
        print(f"\npeak T={b} / T={a}: before {ratio['before']:.2f}x, now {ratio['now']:.2f}x, "
              f"now + checkpoint {ratio['checkpoint']:.2f}x", end="")  # fmt: skip
    print()
    if args.store:
        lengths = [min(n, args.budget) for n in store_lengths(args.store)]
        g = torch.Generator().manual_seed(0)
        order = torch.randperm(len(lengths), generator=g).tolist()
        groups = [[lengths[i] for i in order[k * 8 : k * 8 + 8]] for k in range(args.batches)]
        tokens = sum(map(sum, groups))
        padded = sum(run(args, "now", grp)["seconds"] for grp in groups)
        packed = sum(run(args, "packed", grp)["seconds"] for grp in groups)
        print(f"\n{args.batches} micro-batches of 8 of the store's {len(lengths)} examples (random order), "
              f"{tokens} tokens: padded {tokens / padded:.0f} tok/s, packed into rows of {args.budget} "
              f"{tokens / packed:.0f} tok/s, {padded / packed:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
