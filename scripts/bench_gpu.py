"""The GPU fast path, measured: a Llama-3.2-1B- or Llama-3.1-8B-shaped target built on the spot (no download).

    python scripts/bench_gpu.py --shape 1b                       # on a CUDA GPU: bf16, the fast path (CUDA graphs)
    python scripts/bench_gpu.py --shape 8b --k 4 --output-dir runs/bench_gpu_8b
    python scripts/bench_gpu.py --shape tiny --device cpu --compile off   # a seconds-long smoke run on a CPU

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
"""

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from specdec_runtime import graphs
from specdec_runtime.config import DecoderConfig
from specdec_runtime.drafters import ModelDrafter
from specdec_runtime.generate import generate, warm_up
from specdec_runtime.measure import divergences
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
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B, "tiny": TINY}
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
    return hf, ours


def weight_bytes(model: Decoder) -> int:
    """Bytes a decode step reads: every parameter but the (untied) embedding table."""
    skip = {id(model.embed.weight)} if model.embed is not None else set()
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


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
    out = {}
    for name, fn in steps.items():
        for _ in range(3):
            fn()
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(dev)
        out[name] = (time.perf_counter() - t0) / reps * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="auto: on CUDA")
    ap.add_argument("--k", type=int, default=2, help="the drafter: the target's first K layers")
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
    t_start = time.perf_counter()
    hf, ours = build(args, device, dtype)
    weights = weight_bytes(ours)
    if fast:
        ours.compile(**({} if device.type == "cuda" else {"backend": "aot_eager"}))
    drafter = ModelDrafter(ours, exit_layer=args.k, shares_target_cache=True)
    assist, _ = assisted_kwargs(hf, drafter, gamma=args.gamma)
    g = torch.Generator().manual_seed(1)
    vocab = ours.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    N, cap = args.max_new_tokens, args.prompt_len + args.max_new_tokens
    spec_name = f"ours speculative (truncate:{args.k}, gamma {args.gamma})"
    methods = {
        "ours autoregressive": lambda ids: generate(ours, ids, max_new_tokens=N, capacity=cap).tokens,
        "transformers generate": lambda ids: hf_generate(hf, ids, max_new_tokens=N, stop_ids=frozenset()),
        spec_name: lambda ids: generate(ours, ids, drafter, max_new_tokens=N, gamma=args.gamma, capacity=cap).tokens,
        f"transformers assisted (truncate:{args.k}, gamma {args.gamma})": lambda ids: hf_generate(
            hf, ids, max_new_tokens=N, stop_ids=frozenset(), **assist
        ),
    }
    if device.type == "cuda" and not args.no_hf_static:
        methods["transformers generate (static cache, compiled)"] = lambda ids: hf_generate(
            hf, ids, max_new_tokens=N, stop_ids=frozenset(), cache_implementation="static"
        )
    for fn in methods.values():  # warm-up: compilation, graph capture, lazy initialization
        fn(prompts[0])
        fn(prompts[0])
    # Every draft length too, as specdec bench and the recipes warm up: a chain cut short by the
    # token budget (the last rounds of a prompt) verifies fewer rows, a step shape the prompt above
    # may not have reached, which would otherwise be compiled and captured inside a timed prompt.
    warm_up(ours, drafter, prompts[0], Sampler, max_new_tokens=N, gamma=args.gamma, capacity=cap)
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
    tau_runs = [generate(ours, p, drafter, max_new_tokens=N, gamma=args.gamma, capacity=cap).stats for p in prompts]
    tau = sum(s.new_tokens for s in tau_runs) / sum(s.target_forwards for s in tau_runs)

    cost = step_costs(ours, args.k, args.gamma, args.prompt_len + N // 2)  # at the mean context
    verify_ms = cost["handoff"] + cost["resume"]
    bound = tau * cost["decode"] / (args.gamma * cost["draft"] + verify_ms)
    speedup = tok_s[spec_name] / tok_s[names[0]]

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = args.bandwidth_gbs or next((v for k, v in BANDWIDTH.items() if k in name), None)
    kv_bytes = 2 * ours.config.num_layers * ours.config.num_kv_heads * ours.config.head_dim * dtype.itemsize
    per_token = weights + kv_bytes * (args.prompt_len + N // 2)  # mean context
    limit = bandwidth * 1e9 / per_token if bandwidth else None
    best_hf = max(v for m, v in tok_s.items() if m.startswith("transformers generate"))

    # Honesty: bf16 divergences must be near-ties (an fp32 copy of the same weights decides).
    reference = Decoder.from_hf_state_dict(DecoderConfig.from_hf(hf.config), hf.state_dict(), device, torch.float32)
    hf = assist = methods = None  # free the transformers model (the lambdas above share these cells)
    gc.collect()
    runs = list(zip(prompts, outputs[names[0]], outputs[spec_name]))
    report = divergences(ours, reference, runs) if dtype != torch.float32 else []
    identical = sum(a == b for _, a, b in runs) / len(runs)
    fp32_identical = None
    if args.fp32_check:
        ours = drafter = None
        gc.collect()
        if fast:
            reference.compile(**({} if device.type == "cuda" else {"backend": "aot_eager"}))
        d32 = ModelDrafter(reference, exit_layer=args.k, shares_target_cache=True)
        same = [
            generate(reference, p, None, max_new_tokens=N, capacity=cap).tokens
            == generate(reference, p, d32, max_new_tokens=N, gamma=args.gamma, capacity=cap).tokens
            for p in prompts
        ]
        fp32_identical = sum(same) / len(same)

    lines = [
        f"{name}, {args.shape} shape, {args.dtype}, fast path {fast}, {args.prompts} random prompts of "
        f"{args.prompt_len} tokens, {N} new tokens, batch 1; {weights / 1e9:.2f} GB of weights read per "
        f"token; speculative tau {tau:.2f}",
        "",
        "| method | tok/s | identical to ours autoregressive |",
        "|---|---:|---:|",
    ]
    for m in names:
        same = sum(a == b for a, b in zip(outputs[m], outputs[names[0]])) / len(prompts)
        lines.append(f"| {m} | {tok_s[m]:.1f} | {same:.0%} |")
    if limit:
        lines.insert(2, f"bandwidth limit: {bandwidth:.0f} GB/s / {per_token / 1e9:.2f} GB = {limit:.1f} tok/s\n")
    lines += [
        "",
        f"step costs (ms, each alone on the device): decode {cost['decode']:.3f}, draft {cost['draft']:.3f}, "
        f"verify {verify_ms:.3f} (handoff {cost['handoff']:.3f} + resume at layer {args.k} {cost['resume']:.3f}); "
        f"cost bound = tau x decode / (gamma x draft + verify) = {bound:.2f}x",
        f"inside the timed runs (after the warm-up): {timed_compiles[0]} graphs compiled, "
        f"{timed_compiles[1]} steps captured (both must be 0)",
    ]
    ratios = {
        "ours AR / bandwidth limit": tok_s[names[0]] / limit if limit else None,
        "ours AR / transformers generate": tok_s[names[0]] / tok_s[names[1]],
        "ours AR / transformers' best generate": tok_s[names[0]] / best_hf,
        "ours speculative / transformers assisted (same drafter, same gamma)": tok_s[spec_name] / tok_s[names[3]],
        "ours speculative / ours AR": speedup,
        "cost bound (tau x decode / (gamma x draft + verify))": bound,
        "ours speculative / ours AR as a fraction of the bound (efficiency)": speedup / bound,
    }
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {'-' if v is None else f'{v:.2f}'} |" for k, v in ratios.items()]
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
    lines.append(f"\n(bench wall time {time.perf_counter() - t_start:.0f} s)")
    table = "\n".join(lines)
    print(table)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "results.md").write_text(table + "\n")
    (args.output_dir / "results.json").write_text(
        json.dumps(
            {
                "device": name,
                "shape": args.shape,
                "tok_s": tok_s,
                "ratios": ratios,
                "tau": tau,
                "limit_tok_s": limit,
                "step_ms": cost,
                "timed_compiles_captures": timed_compiles,
                "identical": identical,
                "divergences": report,
                "fp32_identical": fp32_identical,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
