"""Peak memory and speed of one MTP training step: naive summed loss vs sequential per-head backward.

    python scripts/bench_mtp_memory.py                          # n = 1, 2, 4, 8 heads, table + plot
    python scripts/bench_mtp_memory.py --seq-len 4096 --heads 1,4 --plot docs/mtp_memory.png

Each (heads, mode) runs in a fresh process: the model (Llama-shaped, the bundled target's
49152-token vocabulary, tied embeddings) is built, then one forward + backward on a batch of
--batch x --seq-len tokens is measured. On CPU the peak is the process's high-water mark of
resident memory (VmHWM; tensors this large are mmapped and returned to the system when freed),
reported as the step's peak above the memory held before the step (model weights) and as the
total; on CUDA it is torch.cuda.max_memory_allocated. The optimizer step is left out: its state
is the same in both modes. tokens/s is the mean over --steps further steps in the same process.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(args: argparse.Namespace) -> dict:
    from transformers import LlamaConfig

    from train.mtp import MTPModel, mtp_step

    device = torch.device(args.device)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.trunk_layers + 1,
        num_attention_heads=args.attn_heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = MTPModel.from_config(cfg, args.n).to(device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device)
    n_pos = args.batch * (args.seq_len - args.n)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.bf16 else None

    def step() -> None:
        kw = {"autocast": autocast} if autocast else {}
        mtp_step(
            model,
            ids,
            weights=[1.0] * args.n,
            scale=1 / n_pos,
            backward=torch.Tensor.backward,
            sequential=args.mode == "sequential",
            **kw,
        )

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        before = rss_kib("VmRSS") * 1024
        step()
        peak = rss_kib("VmHWM") * 1024
    times = []
    for _ in range(args.steps):
        model.zero_grad(set_to_none=False)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tok_s = args.batch * args.seq_len / (sum(times) / len(times)) if times else float("nan")
    params = sum(p.numel() for p in model.parameters())
    return {"n": args.n, "mode": args.mode, "before": before, "peak": peak, "tokens_per_s": tok_s, "params": params}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="1,2,4,8")
    p.add_argument("--vocab", type=int, default=49152, help="the bundled target's vocabulary size")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--trunk-layers", type=int, default=4)
    p.add_argument("--attn-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2, help="timed steps after the measured one")
    p.add_argument("--bf16", action="store_true", help="autocast to bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "mtp_memory.png")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    rows = []
    passthrough = sys.argv[1:]
    for n in [int(x) for x in args.heads.split(",")]:
        for mode in ("naive", "sequential"):
            cmd = [sys.executable, __file__, *passthrough, "--child", "--n", str(n), "--mode", mode]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                raise SystemExit(f"n={n} {mode} failed")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            peak, speed = r["peak"] / 2**30, r["tokens_per_s"]
            print(f"  n={n} {mode}: peak {peak:.2f} GiB, {speed:.0f} tokens/s", file=sys.stderr)

    gib = lambda b: b / 2**30  # noqa: E731
    base = {m: next(r for r in rows if r["n"] == rows[0]["n"] and r["mode"] == m) for m in ("naive", "sequential")}
    what = "max_memory_allocated" if args.device.startswith("cuda") else "peak RSS"
    print(
        f"\nOne training step (forward + backward), batch {args.batch} x {args.seq_len} tokens, vocab {args.vocab}, "
        f"hidden {args.hidden}, trunk {args.trunk_layers} layers, {'bf16 autocast' if args.bf16 else 'fp32'}, "
        f"{args.device} ({what})\n"
    )
    print("| heads | mode | params | peak (GiB) | vs n=1 | step above weights (GiB) | vs n=1 | tokens/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b = base[r["mode"]]
        step, b_step = r["peak"] - r["before"], b["peak"] - b["before"]
        print(
            f"| {r['n']} | {r['mode']} | {r['params'] / 1e6:.1f}M | {gib(r['peak']):.2f} | "
            f"{r['peak'] / b['peak']:.2f}x | {gib(step):.2f} | {step / b_step:.2f}x | {r['tokens_per_s']:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, marker in (("naive", "o"), ("sequential", "s")):
        pts = [r for r in rows if r["mode"] == mode]
        ax.plot([r["n"] for r in pts], [gib(r["peak"]) for r in pts], marker=marker, label=mode)
    ax.set_xlabel("heads n")
    ax.set_ylabel(f"peak memory of one step (GiB, {what})")
    ax.set_xticks([r["n"] for r in rows if r["mode"] == "naive"])
    ax.set_title(f"MTP training step, vocab {args.vocab}, {args.batch}x{args.seq_len} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
