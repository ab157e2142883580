"""The CPU cost model of speculative decoding on a target: what each piece costs in decode steps.

    python scripts/bench_cost.py                      # fp32, and bf16 where this CPU has the kernel or fast bf16
    python scripts/bench_cost.py --dtypes float32,bfloat16 --nodes 4,8,16

For each dtype: one decode step (ms) against the memory-bandwidth bound (the bytes a step reads,
weights + KV cache, over the read bandwidth measured by streaming a 512 MiB tensor right before
each decode step: the machine's speed drifts, and the two drift together), so the table says how
close autoregressive decoding runs to the machine's limit; one verify forward of a chain
of T tokens and of a tree of 1 + N tokens, in decode steps; and one draft step of each drafter
kind (an EAGLE-3 layer + draft-vocabulary head, 4 Medusa heads, the target's first 2 layers), in
decode steps (each the median ratio to a decode step run right before it, call by call).
Speedup ~= tau / (verify(T) + gamma x draft step) tells which drafts can pay. With the CPU kernel,
a table of products of 1 to 512 rows (--rows) against MKL's GEMM: where a step's rows stop
costing what one row costs, and where MKL takes over (cpu_kernel.max_rows()). Random drafter
weights of the shapes the recipes train (the cost does not depend on the values).

--argmax-only times the steps as greedy decoding runs them: where the CPU kernel runs an fp32
head, it reads the lm_head's bf16 screen and only the fp32 panels that can hold the argmax
(cpu.DecoderKernel.screen), ~57 MB less a step than the bound counts on the bundled target.
"""

import argparse
import contextlib
import time

import torch

from specdec_runtime.cpu import kernel as cpu_kernel
from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model
from specdec_runtime.drafters.medusa import MedusaHeads
from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.hardware import fast_bf16, resolve_dtype, using_threads
from specdec_runtime.layers import Linear, linear
from specdec_runtime.loading import load_model
from specdec_runtime.model import Decoder
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree

PREFIX = 200  # tokens in the cache while timing


def timed(fn, reps: int) -> float:
    """Median ms of fn over reps calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1000


def paired(fn, step, reps: int) -> tuple[float, float]:
    """(median ms of fn(), median of fn's time over the time of a decode step()), the two alternated
    call by call: a shared host's speed drifts (2x within minutes on a 2-core cloud machine), and a
    ratio of neighbouring calls holds where one of separately timed medians does not."""
    for _ in range(3):
        fn(), step()
    ms, ratios = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        ms.append((t2 - t1) * 1000)
        ratios.append((t2 - t1) / (t1 - t0))
    return sorted(ms)[reps // 2], sorted(ratios)[reps // 2]


def step_and_bandwidth(step, reps: int) -> tuple[float, float]:
    """(median ms of step(), median read bandwidth in GB/s), the two alternated call by call: the
    bandwidth is the faster of two reads of a 512 MiB fp32 tensor (past any cache), torch's sum and
    the CPU kernel's plain stream (cpu_kernel.stream_sum, where it is built; torch's sum read up to
    a third slower on a 2-core Zen 4), right beside each step, so the bound a step is held to moves
    with the machine's speed as the step does. On huge pages where the model's packed weights are
    (cpu_kernel.on_huge_pages: a plain stream reads faster from them too, so the bound is the faster one)."""
    (x,) = cpu_kernel.on_huge_pages([torch.ones(128 * 2**20)])
    reads = [x.sum] + ([lambda: cpu_kernel.stream_sum(x)] if cpu_kernel.library() is not None else [])
    for _ in range(3):
        step(), [read() for read in reads]
    ms, gbs = [], []
    for _ in range(reps):
        best = float("inf")
        for read in reads:
            t0 = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - t0)
        t1 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t1) * 1000)
        gbs.append(x.numel() * 4 / best / 1e9)
    return sorted(ms)[reps // 2], sorted(gbs)[reps // 2]


def products_table(m: Decoder, rows: list[int], reps: int) -> None:
    """Products of M rows by every weight matrix of the target (a step's products without the rest):
    the CPU kernel against MKL's x @ W (what a step of more than max_rows() rows runs), in ms and
    GFLOP/s, each row count's two timed back to back."""
    weights = [mod.params for mod in m.modules() if isinstance(mod, Linear)]
    flops = 2 * sum(w.w.numel() for w in weights)
    print("\n| rows | kernel ms | kernel GFLOP/s | MKL ms | MKL GFLOP/s | kernel / MKL time |")
    print("|---:|---:|---:|---:|---:|---:|")
    for M in rows:
        xs = [torch.randn(M, w.w.shape[0], dtype=w.w.dtype) for w in weights]
        with torch.inference_mode():
            kernel = timed(lambda xs=xs: [cpu_kernel.matmul(x, w) for x, w in zip(xs, weights)], reps)
            mkl = timed(lambda xs=xs: [x @ w.w for x, w in zip(xs, weights)], reps)
        print(f"| {M} | {kernel:.1f} | {flops * M / kernel / 1e6:.0f} | {mkl:.1f} | {flops * M / mkl / 1e6:.0f} | "
              f"{kernel / mkl:.2f} |")  # fmt: skip


def gemv_gbs(m: Decoder, threads: int) -> float:
    """Bandwidth (GB/s) of the 1-row products of a decode step alone: linear() on every weight
    matrix of the target, run back to back with `threads` threads, each called from Python (~5-8 us
    a call on a 2-core EPYC: the small products read slower this way than inside a step, where the
    kernel runs a layer's products in one call and they stream at a plain read's rate)."""
    weights = [mod.params for mod in m.modules() if isinstance(mod, Linear)]
    xs = [torch.randn(1, w[0].shape[0], dtype=w[0].dtype) for w in weights]

    def products():
        for x, w in zip(xs, weights):
            linear(x, w)

    with torch.inference_mode(), using_threads(threads):
        ms = timed(products, 5)
    return sum(w[0].numel() * m.weight_dtype.itemsize for w in weights) / (ms / 1000) / 1e9


def step_bytes(m: Decoder, prefix: int) -> int:
    """Bytes one decode step reads: every weight matrix once, in its weights' dtype (the embedding
    row aside) + the K/V of prefix tokens."""
    c = m.config
    seen, total = set(), 0
    for name, p in m.named_parameters():
        if "embed" in name and not c.tie_word_embeddings or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * (m.weight_dtype.itemsize if p.dim() == 2 else p.element_size())
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * prefix * m.dtype.itemsize
    return total + kv


def counts(spec: str) -> list[int]:
    """'1,3,5' -> [1, 3, 5]; '' -> []."""
    return [int(n) for n in spec.split(",") if n.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument(
        "--dtypes", default="auto", help="auto: float32, plus bfloat16 where the kernel or the CPU does it fast"
    )
    p.add_argument("--chains", default="1,2,3,4,5,6,8", help="chain lengths verified ('' for none)")
    p.add_argument("--nodes", default="4,8,12,16,32", help="tree sizes verified ('' for none)")
    p.add_argument("--rows", default="1,8,16,32,64,128,256,512", help="the products table's row counts ('' for none)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--argmax-only",
        action="store_true",
        help="time greedy steps, which read only the argmax (the CPU kernel finds it from the lm_head's bf16 screen)",
    )
    args = p.parse_args()
    greedy = dict(argmax_only=args.argmax_only)
    cpu = torch.device("cpu")
    dtypes = (
        ["float32"] + (["bfloat16"] if fast_bf16(cpu).fast or cpu_kernel.reads_bf16_weights(cpu) else [])
        if args.dtypes == "auto"
        else args.dtypes.split(",")
    )
    print(f"{fast_bf16(cpu)}; {torch.get_num_threads()} threads")
    for dtype in dtypes:
        dt = resolve_dtype(dtype, cpu)
        # Each path in turn: torch's ops (MKL's products on x86), and the compiled kernels where they
        # are built (cpu/kernel.py: a decode or verify step of up to max_rows() rows runs its layers in
        # layers.c, the lm_head in skinny.c; a bf16 model as its bf16 weights, fp32 activations).
        paths = {"torch": cpu_kernel.disabled}
        if cpu_kernel.library() is not None and dt in (torch.float32, torch.bfloat16):
            paths["kernel"] = contextlib.nullcontext
        rows = {}
        threads = torch.get_num_threads()
        for path, within in paths.items():
            with within():  # loaded inside: what this path's products read (W^T for MKL, or packed)
                loaded = load_model(args.target, device="cpu", dtype=dt)
                m = loaded.model
                V, H = m.config.vocab_size, m.config.hidden_size
                m.setup_cache(1, PREFIX + 512)
                m.prefill(torch.randint(0, V, (1, PREFIX)))
                read = step_bytes(m, PREFIX)
                x = torch.randint(0, V, (1, 1))
                one, bw = step_and_bandwidth(lambda m=m, x=x: m(x, PREFIX, **greedy), args.reps)
                bound = read / (bw * 1e9) * 1000
                gemv = {n: gemv_gbs(m, n) for n in sorted({1, threads})}
                what = f"{dtype} weights, fp32 activations" if m.bf16_weights else dtype
                screen = m.native().screen() if args.argmax_only and path == "kernel" else None
                if screen is not None:  # it reads the screen instead of the fp32 head (and 1-2 panels a row)
                    fewer = read - m.lm_head.weight.numel() * 4 + screen.packed.numel() * 2
                    what += (
                        " (greedy steps: the lm_head screened in bf16, fp32 panels read where the argmax can be: "
                        f"~{fewer / 1e6:.0f} MB a step, {fewer / (bw * 1e9) * 1000 / one:.0%} of their own bound)"
                    )
                print(
                    f"\n## {what}, {path} path: decode step {one:.1f} ms = {1000 / one:.1f} tok/s; read "
                    f"bandwidth beside it {bw:.1f} GB/s, so the bound is {bound:.1f} ms ({read / 1e6:.0f} MB a "
                    f"step): {bound / one:.0%} of the limit. Its "
                    "1-row products alone (each called from Python): "
                    + ", ".join(f"{gb:.1f} GB/s with {n} thread{'s' * (n > 1)}" for n, gb in gemv.items())
                    + f", so a step's weights take {read / (gemv[threads] * 1e9) * 1000:.1f} ms"
                )
                if path == "kernel" and args.rows:
                    products_table(m, counts(args.rows), max(3, args.reps // 4))
                step = lambda m=m, x=x: m(x, PREFIX, **greedy)  # noqa: E731  (every cost below: paired with it)
                for T in counts(args.chains):
                    xs = torch.randint(0, V, (1, T))
                    chain = lambda m=m, x=xs: m(x, PREFIX, **greedy)  # noqa: E731
                    rows.setdefault(f"chain of {T}", []).append(paired(chain, step, args.reps))
                profile = torch.tensor([[0.6, 0.2, 0.1, 0.05]] * 4)
                for n in counts(args.nodes):
                    t = Tree.from_accuracies(profile, n).tensors
                    xs = torch.randint(0, V, (1, n + 1))
                    verify = lambda m=m, x=xs, t=t: m(x, PREFIX, tree=(t["depth"], t["ancestor"]), **greedy)  # noqa: E731
                    rows.setdefault(f"tree of 1 + {n}", []).append(paired(verify, step, args.reps))
        print("\n| verified | " + " | ".join(f"{p} ms | {p}: decode steps" for p in paths) + " |")
        print("|---|" + "---:|---:|" * len(paths))
        for name, costs in rows.items():
            print(f"| {name} | " + " | ".join(f"{ms:.1f} | {ratio:.2f}" for ms, ratio in costs) + " |")
        print(f"(decode steps: the median ratio to a decode step run right before each call; draft steps below: on "
              f"the {list(paths)[-1]} path)")  # fmt: skip
        print("\n| draft step | ms | decode steps |\n|---|---:|---:|")
        for gamma in (1, 3):
            model = Eagle3Model(Eagle3Config.for_target(m.config, aux_layers=None, draft_vocab_size=8192))
            model.set_draft_vocab(torch.arange(8192))  # before the drafter reads it
            e3 = Eagle3Drafter(model, m)
            ids, feature = torch.randint(0, V, (PREFIX + 1,)), torch.randn(1, 3 * H, dtype=m.dtype)
            e3.start(ids, PREFIX + 64)

            def eagle3(e3=e3, ids=ids, gamma=gamma, feature=feature):
                e3.observe(feature)
                e3.draft(ids, gamma, Sampler())

            ms, ratio = paired(eagle3, step, args.reps)
            print(f"| EAGLE-3 (8192-token head), chain of {gamma}: per step | {ms / gamma:.2f} | {ratio / gamma:.3f} |")
        for share in (True, False):
            heads = MedusaHeads(H, V, 4, 1, share_lm_head=share).to(m.dtype)
            h = torch.randn(1, H, dtype=m.dtype)
            with torch.inference_mode():
                ms, ratio = paired(lambda heads=heads, h=h, m=m: heads(h, m.lm_head).topk(8, dim=-1), step, args.reps)
            print(f"| 4 Medusa heads, {'shared' if share else 'own'} lm_head: a round | {ms:.2f} | {ratio:.3f} |")
        for gamma in (1, 3):
            early = build_drafter("truncate:2", loaded)  # the target's first 2 layers + its lm_head
            ids = torch.randint(0, V, (PREFIX + 1,))
            early.start(ids, PREFIX + 64)
            ms, ratio = paired(lambda d=early, ids=ids, gamma=gamma: d.draft(ids, gamma, Sampler()), step, args.reps)
            print(
                f"| truncate:2 (2 layers + the full lm_head), chain of {gamma}: per step | {ms / gamma:.2f} | "
                f"{ratio / gamma:.3f} |"
            )


if __name__ == "__main__":
    main()
