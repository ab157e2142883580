"""Peak resident memory of the hidden-state store while it computes states, for N and 4N examples.

    python scripts/bench_state_store.py                      # N = 100 examples of 512 tokens, H = 1024
    python scripts/bench_state_store.py --n 200 --hidden 2048

Each row runs in a fresh process: a stand-in target whose states are random bf16 taps + final
state ([T, 4H] a token, as EAGLE-3 stores them), train.hidden_cache.cache_states into a temporary
folder, then the process's peak resident memory (ru_maxrss) less its memory before the store ran.
"streamed" writes shards of --shard-mb; "one shard" holds a rank's whole share until the end (the
store's behaviour before it streamed). The ratio 4N / N says whether memory grows with the data.
The children run with MALLOC_MMAP_THRESHOLD_=131072, so that glibc returns a freed batch's memory
at once and the peak is what the store holds (its default threshold grows after large frees and
keeps some of them in the heap: the streamed peak then drifts by tens of MiB from run to run);
--default-malloc leaves glibc's default.
"""

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from train.data import Example
    from train.hidden_cache import cache_states

    class Target(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.anchor = torch.nn.Linear(1, 1)

    def states(_target, ids, _mask):
        B, T = ids.shape
        x = torch.randn(B, T, 4 * args.hidden, dtype=torch.bfloat16)
        return {"taps": x[..., : 3 * args.hidden], "final": x[..., 3 * args.hidden :]}

    examples = [Example([1] * args.tokens, [1] * args.tokens, {}) for _ in range(args.n)]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        cache_states(Target(), examples, Path(folder), states=states, pad_id=0, token_bytes=4 * args.hidden * 2,
                     batch_size=8, shard_bytes=args.shard_bytes)  # fmt: skip
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - before) / 1024)  # MiB (ru_maxrss is in KiB on Linux)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100, help="examples in the small run (the large one: 4x)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens an example")
    parser.add_argument("--hidden", type=int, default=1024, help="the target's hidden size H")
    parser.add_argument("--shard-mb", type=int, default=64, help="the streamed store's shard size")
    parser.add_argument("--folder", default=None, help="where the temporary stores go (default: the system's)")
    parser.add_argument("--default-malloc", action="store_true", help="glibc's default mmap threshold in the children")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    per_example = args.tokens * 4 * args.hidden * 2
    print(f"{args.tokens} tokens an example, H = {args.hidden}: {per_example / 2**20:.0f} MiB of states an example")
    print(f"{'store':<12} {'examples':>8} {'states GiB':>10} {'peak MiB':>9}   4N / N")
    for label, shard_bytes in (("streamed", args.shard_mb << 20), ("one shard", 1 << 62)):
        peaks = []
        for n in (args.n, 4 * args.n):
            cmd = [sys.executable, __file__, "--child", "--n", str(n), "--tokens", str(args.tokens),
                   "--hidden", str(args.hidden), "--shard-bytes", str(shard_bytes)]  # fmt: skip
            cmd += ["--folder", args.folder] if args.folder else []
            env = os.environ | ({} if args.default_malloc else {"MALLOC_MMAP_THRESHOLD_": "131072"})
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            peaks.append(float(out.strip().splitlines()[-1]))
            ratio = f"{peaks[1] / peaks[0]:.2f}" if len(peaks) == 2 else ""
            print(f"{label:<12} {n:>8} {n * per_example / 2**30:>10.2f} {peaks[-1]:>9.0f}   {ratio}", flush=True)


if __name__ == "__main__":
    main()
