"""The GPU fast path, measured: a Llama-3.2-1B- or Llama-3.1-8B-shaped target built on the spot (no download).

    python scripts/bench_gpu.py --shape 1b                       # on a CUDA GPU: bf16, the fast path (CUDA graphs)
    python scripts/bench_gpu.py --shape 8b --k 4 --output-dir runs/bench_gpu_8b
    python scripts/bench_gpu.py --shape tiny --device cpu --compile off   # a seconds-long smoke run on a CPU
    python scripts/bench_gpu.py --shape 8b --drafter eagle3 --accept-rate 0.83 --no-hf --profile runs/prof
    python scripts/bench_gpu.py --shape 8b --no-hf --layout out-in    # our weights stored [out, in], as nn.Linear's
    python scripts/bench_gpu.py --shape 8b --drafter eagle3 --accept-rate 0.83 --no-hf --compile-drafter

All in one process, interleaved per prompt (batch 1, random prompts):
1. our autoregressive decode against the memory-bandwidth limit: the bytes every token must read
   (all weights but the embedding rows, plus the KV cache) / HBM bandwidth;
2. ours against transformers' generate (dynamic cache) and its best (static cache, compiled);
3. our speculative decoding (truncate:K: the target's first K layers, final norm and lm_head)
   against transformers' assisted generation with the same drafter and gamma;
4. the cost bound of that drafter, tau x (AR step) / (gamma x draft step + verify step), each step
   timed alone on the device, and our speculative speedup as a fraction of it: the runtime's own
   efficiency, whatever the drafter;
5. honesty: bf16 speculative output against bf16 autoregressive output, every first divergence
   checked to be a near-tie against an fp32 copy (measure.divergences), and with --fp32-check the
   same decoding in fp32, which must be identical.

The target has random weights, so to give its drafter a realistic acceptance the layers after K
only add a small residual (their output projections are scaled by --residual-scale): the first K
layers then predict most of the target's tokens. What is compared is the runtime's cost per round
at equal tau, which is what a trained drafter of that size would see.

--drafter eagle3: an EAGLE-3 drafter with random weights for the shape (one layer as wide as the
target, a draft vocabulary of 32k), drafting trees of --tree-budget nodes at most --gamma deep on
the device. Random weights accept nothing, so --accept-rate P forces acceptance: each drafted token
is accepted with probability P whatever its value (SGLang's simulated acceptance; generate's
accept_rate), which sets tau without a trained 8B drafter. The output is then not the target's, so
the honesty checks are left out. The cost bound is tau x decode / (catch-up + tree + verify), each
step timed alone, and the host syncs per round are counted (torch.cuda.set_sync_debug_mode).
--profile DIR writes a torch.profiler trace of a few speculative rounds there (and its table).
"""

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from specdec_runtime import graphs
from specdec_runtime.config import DecoderConfig
from specdec_runtime.drafters.eagle3 import CATCH_UP_ROWS, Eagle3Drafter
from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.generate import generate
from specdec_runtime.layers import Linear
from specdec_runtime.measure import divergences, warm_up
from specdec_runtime.model import Decoder
from specdec_runtime.reference import assisted_kwargs, hf_generate
from specdec_runtime.sampling import Sampler

LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True,
)  # fmt: skip
LLAMA_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False,
)  # fmt: skip
TINY = dict(LLAMA_1B, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=4)  # fmt: skip
SMOLLM2 = dict(  # the bundled target's shape (SmolLM2-135M), for the runtime's mechanics at its size
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B, "smollm2": SMOLLM2, "tiny": TINY}
# Peak HBM bandwidth (GB/s) by device name, for the limit when --bandwidth-gbs is not given.
BANDWIDTH = {"H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100 NVL": 3900, "H200": 4800,
             "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100-SXM4-40GB": 1555, "L4": 300}  # fmt: skip


def build(args, device: torch.device, dtype: torch.dtype):
    """(HF target, our Decoder) with the same random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[args.shape])
    torch.manual_seed(0)
    with torch.device(device):
        hf = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for layer in hf.model.layers[args.k :]:
            layer.self_attn.o_proj.weight.mul_(args.residual_scale)
            layer.mlp.down_proj.weight.mul_(args.residual_scale)
    hf.generation_config.pad_token_id = 0
    ours = Decoder.from_hf_state_dict(DecoderConfig.from_hf(config), hf.state_dict(), device, dtype)
    if getattr(args, "layout", "in-out") == "out-in":
        store_out_in(ours)
    return hf, ours


def store_out_in(model: Decoder) -> None:
    """Every Linear's weight stored as nn.Linear stores it, [out, in], and read through its [in, out]
    view, so that x @ W is F.linear's product (cuBLAS's other operand layout; --layout out-in, beside
    scripts/bench_gpu_products.py's products alone)."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.weight = torch.nn.Parameter(m.weight.detach().t().contiguous().t(), requires_grad=False)


def device_bandwidth(device: torch.device, given: float | None = None) -> tuple[str, float | None]:
    """(the device's name, its HBM bandwidth in GB/s: `given`, else BANDWIDTH's entry for the name, else None)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return name, given or next((v for k, v in BANDWIDTH.items() if k in name), None)


def weight_bytes(model: Decoder) -> int:
    """Bytes a decode step reads: every parameter but the (untied) embedding table."""
    skip = {id(model.embed.weight)} if model.embed is not None else set()
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_ms(fn, device: torch.device, reps: int) -> float:
    """Milliseconds one fn() takes on the device, after 3 warm-up calls (on the fast path a replayed
    graph), averaged over reps calls."""
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps * 1000


def timed(fn, ids: list[int], device: torch.device):
    sync(device)
    t0 = time.perf_counter()
    out = fn(ids)
    sync(device)
    return out, time.perf_counter() - t0


@torch.inference_mode()
def step_costs(model: Decoder, k: int, gamma: int, context: int, reps: int = 50) -> dict[str, float]:
    """Device milliseconds of each step the speculative round is made of, each timed alone (after
    a warm-up, so on the fast path every step is a replayed graph): a decode step (what an
    autoregressive token costs), a truncate:K draft step, and verification (the handoff of the last
    draft's first K layers + the target resuming at layer K over gamma + 1 tokens)."""
    dev, H = model.device, model.config.hidden_size
    model.setup_cache(1, context + gamma + 2)
    model.prefill(torch.randint(0, model.config.vocab_size, (1, context), device=dev))
    one = torch.randint(0, model.config.vocab_size, (1, 1), device=dev)
    residual = torch.randn(1, gamma + 1, H, device=dev, dtype=model.dtype)
    steps = {
        "decode": lambda: model(one, context),
        "draft": lambda: model(one, context, exit_layer=k, taps=(k,), logits_to_keep=1),
        "handoff": lambda: model(one, context, exit_layer=k, taps=(k,), head=False),
        "resume": lambda: model(residual, context, first_layer=k),
    }
    return {name: device_ms(fn, dev, reps) for name, fn in steps.items()}


def eagle3_drafter(target: Decoder, args) -> Eagle3Drafter:
    """A random EAGLE-3 drafter for the target (see the module docstring). Its head is scaled so that
    each row's distribution is peaked: the best path of a tree then runs as deep as the tree may,
    where forced acceptance walks (each depth's first child)."""
    cfg = Eagle3Config.for_target(target.config, aux_layers=None, draft_vocab_size=min(32000, target.config.vocab_size))
    torch.manual_seed(2)
    with torch.device(target.device):
        model = Eagle3Model(cfg)
        for name, p in model.named_parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.5 if name == "lm_head.weight" else 0.02)
        model.set_draft_vocab(torch.arange(cfg.draft_vocab_size))
    model = model.to(target.dtype)
    # on the device wherever the target's steps are captured (on a CPU, emulated: the smoke run)
    return Eagle3Drafter(model, target, tree_budget=args.tree_budget, top_k=args.top_k, on_device=target.compiled,
                         compile_steps=getattr(args, "compile_drafter", False))  # fmt: skip


@torch.inference_mode()
def eagle3_costs(target: Decoder, drafter: Eagle3Drafter, gamma: int, tau: float, reps: int = 50) -> dict[str, float]:
    """Device milliseconds of an EAGLE-3 round's steps, each replayed alone (the captured steps the
    timed runs used): the target's decode step, the drafter's catch-up over round(tau) rows, its
    tree, and the target's verification of the tree (with the drafter's taps)."""
    dev = target.device
    rows = next(r for r in CATCH_UP_ROWS if r >= max(1, round(tau)))
    context = target.cache.size // 2
    one = torch.zeros(1, 1, dtype=torch.long, device=dev)
    budget = min(drafter.tree_budget, drafter.top_k + (gamma - 1) * drafter.top_k**2)
    tree = drafter.steps.get(("tree", gamma, budget))
    catch = drafter.steps.get(("catch-up", rows))
    steps = {"decode": lambda: target(one, context)}
    if tree is not None and catch is not None:
        t = tree.outputs[2]
        nodes = torch.zeros(1, budget + 1, dtype=torch.long, device=dev)
        steps |= {
            "catch-up": lambda: catch(),
            "tree": lambda: tree(),
            "verify": lambda: target(nodes, context, tree=(t["depth"], t["ancestor"]), taps=drafter.hidden_layers),
        }
    return {name: device_ms(fn, dev, reps) for name, fn in steps.items()}


LIVE_VARIANTS = {  # results.json's key: (the table's column, the attention, live_spans)
    "sdpa_whole": ("SDPA, whole cache", "sdpa", False),
    "sdpa_span": ("SDPA, the span that holds them", "sdpa", True),
    "flex": ("flex, the live blocks", "flex", False),
}


@torch.inference_mode()
def live_length_costs(model: Decoder, lengths: list[int], capacity: int, reps: int = 50) -> dict[int, dict]:
    """Device milliseconds of a decode step at each live length in a cache of `capacity` slots, in
    each of LIVE_VARIANTS: torch's SDPA over the whole cache (live_spans False, the fast path before
    spans) and over the span that holds the live slots, and flex attention over the whole cache's
    blocks up to the newest slot (compile(attention="flex")). {length: {variant: ms}}. Leaves the
    model with its own attention and that cache, and its captured steps dropped."""
    dev, kept = model.device, model.attention_kernel
    one = torch.zeros(1, 1, dtype=torch.long, device=dev)
    out = {n: {} for n in lengths}
    for name, (_, attention, spans) in sorted(LIVE_VARIANTS.items(), key=lambda v: v[1][1] != kept):  # its own first
        if attention != model.attention_kernel:
            model.compile(model.compile_backend, attention=attention)
        model.live_spans = spans
        model.steps.clear()
        model.setup_cache(1, capacity)
        model.cache.kv.normal_()  # (stale slots are masked: any values do, but not zeros)
        for n in lengths:
            out[n][name] = device_ms(lambda n=n: model(one, n), dev, reps)
    model.live_spans = True
    if model.attention_kernel != kept:
        model.compile(model.compile_backend, attention=kept)
    return out


def syncs_per_round(fn, device: torch.device) -> float | None:
    """Host syncs per target forward of fn() -> GenerationStats (CUDA's sync debug mode; None off CUDA,
    where fn still runs: a smoke run on a CPU goes through the path the GPU's run takes)."""
    if device.type != "cuda":
        fn()
        return None
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught) / stats.target_forwards


def write_report(output_dir: Path, lines: list[str], data: dict, started: float) -> None:
    """Print the report's lines (and the bench's wall time), and write them to output_dir/results.md
    beside data as results.json (the GPU benches' shared ending)."""
    table = "\n".join(lines + [f"\n(bench wall time {time.perf_counter() - started:.0f} s)"])
    print(table)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.md").write_text(table + "\n")
    (output_dir / "results.json").write_text(json.dumps(data, indent=1))


def profile(fns: dict, directory: Path, device: torch.device) -> str:
    """A torch.profiler trace of each fn() under directory (Chrome trace JSON) and the table of the
    speculative one's top kernels by device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    directory.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    table = ""
    for name, fn in fns.items():
        with torch_profile(activities=activities) as prof:
            fn()
            sync(device)
        prof.export_chrome_trace(str(directory / f"trace_{name}.json.gz"))  # (chrome://tracing, Perfetto)
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=25)
        (directory / f"table_{name}.txt").write_text(table)
    return table


def round_costs(ours: Decoder, drafter, args, tau: float) -> tuple[dict[str, float], float, str]:
    """(each step's device ms, the cost bound, a line saying both) of the drafter's round at this tau:
    eagle3_costs' steps for EAGLE-3, step_costs' at the mean context for truncate:K."""
    if args.drafter == "eagle3":
        cost = eagle3_costs(ours, drafter, args.gamma, tau)
        round_ms = sum(cost.get(k, float("nan")) for k in ("catch-up", "tree", "verify"))
        bound = tau * cost["decode"] / round_ms
        line = (
            f"step costs (ms, each alone on the device): decode {cost['decode']:.3f}; a round: catch-up "
            f"{cost.get('catch-up', float('nan')):.3f} + tree {cost.get('tree', float('nan')):.3f} + verify "
            f"{cost.get('verify', float('nan')):.3f} = {round_ms:.3f}; cost bound = tau x decode / round = {bound:.2f}x"
        )
        return cost, bound, line
    cost = step_costs(ours, args.k, args.gamma, args.prompt_len + args.max_new_tokens // 2)  # at the mean context
    verify_ms = cost["handoff"] + cost["resume"]
    bound = tau * cost["decode"] / (args.gamma * cost["draft"] + verify_ms)
    line = (
        f"step costs (ms, each alone on the device): decode {cost['decode']:.3f}, draft {cost['draft']:.3f}, "
        f"verify {verify_ms:.3f} (handoff {cost['handoff']:.3f} + resume at layer {args.k} {cost['resume']:.3f}); "
        f"cost bound = tau x decode / (gamma x draft + verify) = {bound:.2f}x"
    )
    return cost, bound, line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="auto: on CUDA")
    ap.add_argument("--drafter", choices=["truncate", "eagle3"], default="truncate")
    ap.add_argument("--k", type=int, default=2, help="truncate: the target's first K layers")
    ap.add_argument("--tree-budget", type=int, default=8, help="eagle3: nodes a tree drafts")
    ap.add_argument("--top-k", type=int, default=4, help="eagle3: the frontier a tree level expands")
    ap.add_argument("--accept-rate", type=float, default=None, help="forced acceptance (not the target's output)")
    ap.add_argument("--no-hf", action="store_true", help="skip every transformers method (large shapes)")
    ap.add_argument("--layout", choices=["in-out", "out-in"], default="in-out",
                    help="our weights: the runtime's [in, out], or nn.Linear's [out, in] through a view")  # fmt: skip
    ap.add_argument("--attention", choices=["sdpa", "flex"], default="sdpa",
                    help="the fast path's attention: SDPA over spans, or flex over the live blocks (Decoder.compile)")
    ap.add_argument("--compile-drafter", action="store_true", help="eagle3: its captured steps compiled too")
    ap.add_argument("--costs-only", action="store_true", help="the round's step costs alone (A/B runs)")
    ap.add_argument("--profile", type=Path, default=None, help="write a profiler trace of a few rounds here")
    ap.add_argument("--live-lengths", default="", help="e.g. 256,1024,4000: decode step time by live length")
    ap.add_argument("--residual-scale", type=float, default=0.05, help="output scale of the layers after K")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--no-hf-static", action="store_true", help="skip transformers' static-cache compiled generate")
    ap.add_argument("--fp32-check", action="store_true", help="also decode in fp32: speculative must equal AR")
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="HBM bandwidth (default: from the GPU's name)")
    ap.add_argument("--output-dir", type=Path, default=Path("runs/bench_gpu"))
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    fast = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    eagle3, forced = args.drafter == "eagle3", args.accept_rate is not None
    t_start = time.perf_counter()
    hf, ours = build(args, device, dtype)
    weights = weight_bytes(ours)
    backend = "inductor" if device.type == "cuda" else "aot_eager"  # (CPU smoke runs: traced, not compiled)
    if fast:
        ours.compile(backend, attention=args.attention)
    if eagle3:
        drafter = eagle3_drafter(ours, args)
        spec_name = f"ours speculative (eagle3 trees of {args.tree_budget}, top-{args.top_k}, depth {args.gamma})"
    else:
        drafter = ModelDrafter(ours, exit_layer=args.k, shares_target_cache=True)
        spec_name = f"ours speculative (truncate:{args.k}, gamma {args.gamma})"
    steps_compiled = getattr(drafter, "step_backend", None)  # (--compile-drafter on a compiled target)
    if forced:
        spec_name += f", forced acceptance {args.accept_rate}"
    g = torch.Generator().manual_seed(1)
    vocab = ours.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    N, cap = args.max_new_tokens, args.prompt_len + args.max_new_tokens
    spec_kw = dict(max_new_tokens=N, gamma=args.gamma, capacity=cap, accept_rate=args.accept_rate)
    spec_stats = []
    name, bandwidth = device_bandwidth(device, args.bandwidth_gbs)
    if args.costs_only:  # the round's steps alone, after one prompt has captured them
        warm_up(ours, drafter, prompts[0], Sampler, **spec_kw)
        tau = generate(ours, prompts[0], drafter, Sampler(seed=0), **spec_kw).stats.tau
        cost, bound, cost_line = round_costs(ours, drafter, args, tau)
        cdt = torch._inductor.config.coordinate_descent_tuning  # (TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1)
        lines = [
            f"{name}, {args.shape} shape, {args.dtype}, weights {args.layout}, attention {args.attention}, drafter "
            f"steps compiled {steps_compiled or 'no'}, inductor's coordinate descent {cdt}: {spec_name}, tau {tau:.2f} "
            "on one prompt",
            "",
            cost_line,
        ]
        if bandwidth:
            lines.append(
                f"decode step: its weights at {weights / (bandwidth * 1e6) / cost['decode']:.0%} of {bandwidth} GB/s"
            )
        data = {"device": name, "shape": args.shape, "layout": args.layout, "attention": args.attention,
                "drafter_steps_compiled": steps_compiled, "coordinate_descent_tuning": cdt, "tau": tau,
                "step_ms": cost, "bound": bound}  # fmt: skip
        return write_report(args.output_dir, lines, data, t_start)

    def speculative(ids, keep=True):
        out = generate(ours, ids, drafter, Sampler(seed=len(spec_stats)), **spec_kw)
        if keep:
            spec_stats.append(out.stats)
        return out.tokens

    methods = {"ours autoregressive": lambda ids: generate(ours, ids, max_new_tokens=N, capacity=cap).tokens}
    if not args.no_hf:
        methods["transformers generate"] = lambda ids: hf_generate(hf, ids, max_new_tokens=N, stop_ids=frozenset())
    methods[spec_name] = speculative
    if not args.no_hf and not eagle3:
        assist, _ = assisted_kwargs(hf, drafter, gamma=args.gamma)
        methods[f"transformers assisted (truncate:{args.k}, gamma {args.gamma})"] = lambda ids: hf_generate(
            hf, ids, max_new_tokens=N, stop_ids=frozenset(), **assist
        )
    if device.type == "cuda" and not args.no_hf and not args.no_hf_static:
        methods["transformers generate (static cache, compiled)"] = lambda ids: hf_generate(
            hf, ids, max_new_tokens=N, stop_ids=frozenset(), cache_implementation="static"
        )
    for fn in methods.values():  # warm-up: compilation, graph capture, lazy initialization
        fn(prompts[0])
        fn(prompts[0])
    # Every draft length too, as specdec bench and the recipes warm up: a chain cut short by the
    # token budget (the last rounds of a prompt) verifies fewer rows, a step shape the prompt above
    # may not have reached, which would otherwise be compiled and captured inside a timed prompt.
    warm_up(ours, drafter, prompts[0], Sampler, **spec_kw)
    spec_stats.clear()
    totals = {m: [0, 0.0] for m in methods}
    outputs = {m: [] for m in methods}
    warm = graphs.compile_counts()  # transformers' static-cache generate compiles too: it counts
    for ids in prompts:
        for m, fn in methods.items():
            toks, secs = timed(fn, ids, device)
            totals[m][0] += len(toks)
            totals[m][1] += secs
            outputs[m].append(toks)
    tok_s = {m: n / s for m, (n, s) in totals.items()}
    timed_compiles = [b - a for a, b in zip(warm, graphs.compile_counts())]  # anything here inflates the timed runs
    names = list(methods)
    tau = sum(s.new_tokens for s in spec_stats) / sum(s.target_forwards for s in spec_stats)
    syncs = syncs_per_round(lambda: generate(ours, prompts[0], drafter, Sampler(seed=0), **spec_kw).stats, device)
    ar_syncs = syncs_per_round(lambda: generate(ours, prompts[0], max_new_tokens=N, capacity=cap).stats, device)

    speedup = tok_s[spec_name] / tok_s[names[0]]
    cost, bound, cost_line = round_costs(ours, drafter, args, tau)
    table = None
    if args.profile is not None:
        short = dict(spec_kw, max_new_tokens=min(N, 24))  # a few rounds
        table = profile({
            "autoregressive": lambda: generate(ours, prompts[0], max_new_tokens=min(N, 24), capacity=cap),
            "speculative": lambda: generate(ours, prompts[0], drafter, Sampler(seed=0), **short),
        }, args.profile, device)  # fmt: skip

    live = {}
    if args.live_lengths and fast:
        lengths = [int(n) for n in args.live_lengths.split(",")]
        live = live_length_costs(ours, lengths, ours.config.max_position_embeddings)

    kv_bytes = 2 * ours.config.num_layers * ours.config.num_kv_heads * ours.config.head_dim * dtype.itemsize
    per_token = weights + kv_bytes * (args.prompt_len + N // 2)  # mean context
    limit = bandwidth * 1e9 / per_token if bandwidth else None
    hf_names = [m for m in tok_s if m.startswith("transformers generate")]
    best_hf = max(tok_s[m] for m in hf_names) if hf_names else None

    report, identical, fp32_identical = [], None, None
    if not forced:  # honesty: bf16 divergences must be near-ties (an fp32 copy of the same weights decides)
        reference = Decoder.from_hf_state_dict(DecoderConfig.from_hf(hf.config), hf.state_dict(), device, torch.float32)
        hf = assist = methods = None  # free the transformers model (the lambdas above share these cells)
        gc.collect()
        runs = list(zip(prompts, outputs[names[0]], outputs[spec_name]))
        report = divergences(ours, reference, runs) if dtype != torch.float32 else []
        identical = sum(a == b for _, a, b in runs) / len(runs)
        if args.fp32_check and not eagle3:
            ours = drafter = None
            gc.collect()
            if fast:
                reference.compile(backend, attention=args.attention)
            d32 = ModelDrafter(reference, exit_layer=args.k, shares_target_cache=True)
            same = [
                generate(reference, p, None, max_new_tokens=N, capacity=cap).tokens
                == generate(reference, p, d32, max_new_tokens=N, gamma=args.gamma, capacity=cap).tokens
                for p in prompts
            ]
            fp32_identical = sum(same) / len(same)

    lines = [
        f"{name}, {args.shape} shape, {args.dtype}, fast path {fast}, weights {args.layout}, attention "
        f"{args.attention}, drafter steps compiled {steps_compiled or 'no'}, {args.prompts} random prompts of "
        f"{args.prompt_len} tokens, {N} new tokens, batch 1; {weights / 1e9:.2f} GB of weights read per "
        f"token; speculative tau {tau:.2f}",
        "",
        "| method | tok/s | identical to ours autoregressive |",
        "|---|---:|---:|",
    ]
    for m in names:
        same = sum(a == b for a, b in zip(outputs[m], outputs[names[0]])) / len(prompts)
        lines.append(f"| {m} | {tok_s[m]:.1f} | {'- (forced)' if forced and m == spec_name else f'{same:.0%}'} |")
    if limit:
        lines.insert(2, f"bandwidth limit: {bandwidth:.0f} GB/s / {per_token / 1e9:.2f} GB = {limit:.1f} tok/s\n")
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines += [
        "",
        cost_line,
        f"inside the timed runs (after the warm-up): {timed_compiles[0]} graphs compiled, "
        f"{timed_compiles[1]} steps captured (both must be 0)",
        f"host syncs per target forward: speculative {fmt(syncs)}, autoregressive {fmt(ar_syncs)}",
    ]
    ratios = {
        "ours AR / bandwidth limit": tok_s[names[0]] / limit if limit else None,
        "ours AR / transformers generate": tok_s[names[0]] / tok_s[hf_names[0]] if hf_names else None,
        "ours AR / transformers' best generate": tok_s[names[0]] / best_hf if best_hf else None,
    }
    assisted = [m for m in names if m.startswith("transformers assisted")]
    if assisted:
        ratios["ours speculative / transformers assisted (same drafter, same gamma)"] = (
            tok_s[spec_name] / tok_s[assisted[0]]
        )
    ratios |= {
        "ours speculative / ours AR": speedup,
        "cost bound (tau x decode / round)": bound,
        "ours speculative / ours AR as a fraction of the bound (efficiency)": speedup / bound,
    }
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {fmt(v)} |" for k, v in ratios.items()]
    if identical is not None:
        lines += [
            "",
            f"{args.dtype} speculative output identical to autoregressive: {identical:.0%}; first divergences: "
            f"{len(report)}, near-ties (fp32 gap of the two tokens <= 2 x the {args.dtype} logit error there): "
            f"{sum(r['near_tie'] for r in report)}",
        ]
    lines += [
        f"  prompt {r['prompt']} at token {r['position']}: top-2 gap {r['top2_gap']:.4f}, fp32 gap "
        f"{r['fp32_gap']:.4f}, {args.dtype} error {r['error']:.4f} -> {'near-tie' if r['near_tie'] else 'NOT A TIE'}"
        for r in report
    ]
    if fp32_identical is not None:
        lines.append(f"float32 speculative output identical to autoregressive: {fp32_identical:.0%}")
    if live:
        size = ours.config.max_position_embeddings
        header = f"| live slots | {' | '.join(column for column, _, _ in LIVE_VARIANTS.values())} |"
        lines += ["", f"decode step by live length, cache of {size} slots (ms, alone on the device):", "",
                  header, "|---:" * (len(LIVE_VARIANTS) + 1) + "|"]  # fmt: skip
        lines += [f"| {n} | " + " | ".join(f"{v[k]:.3f}" for k in LIVE_VARIANTS) + " |" for n, v in live.items()]
    if table is not None:
        lines.append(f"\nprofile of {min(N, 24)} speculative tokens ({args.profile}):\n{table}")
    write_report(
        args.output_dir,
        lines,
        {
            "device": name,
            "shape": args.shape,
            "layout": args.layout,
            "attention": args.attention,
            "drafter_steps_compiled": steps_compiled,
            "drafter": args.drafter,
            "accept_rate": args.accept_rate,
            "tok_s": tok_s,
            "ratios": ratios,
            "tau": tau,
            "limit_tok_s": limit,
            "step_ms": cost,
            "timed_compiles_captures": timed_compiles,
            "syncs_per_forward": {"speculative": syncs, "autoregressive": ar_syncs},
            "decode_ms_by_live_length": live,
            "identical": identical,
            "divergences": report,
            "fp32_identical": fp32_identical,
        },
        t_start,
    )


if __name__ == "__main__":
    main()
