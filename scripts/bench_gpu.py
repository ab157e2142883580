"""The GPU fast path, measured: a Llama-3.2-1B-shaped target built on the spot (no download).

    python scripts/bench_gpu.py                                   # on a CUDA GPU: bf16, compiled (CUDA graphs)
    python scripts/bench_gpu.py --bandwidth-gbs 3350 --gamma 4 --output-dir runs/bench_gpu
    python scripts/bench_gpu.py --tiny --device cpu --compile off # a seconds-long smoke run on a CPU

Three comparisons, all in one process, interleaved per prompt (batch 1):
1. our autoregressive decode tokens/s against the memory-bandwidth limit: the bytes every token
   must read (all weights but the embedding rows, plus the KV cache) / HBM bandwidth;
2. our autoregressive decode against transformers' generate;
3. our speculative decoding against transformers' assisted generation with the same drafter
   (the target's first K layers, its final norm and lm_head) and the same gamma.

The target has random weights, so to give its drafter a realistic acceptance the layers after K
only add a small residual (their output projections are scaled by --residual-scale): the first K
layers then predict most of the target's tokens. What is compared is the runtime's cost per
round at equal tau, which is what a trained drafter of that size would see.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from specdec_runtime.config import DecoderConfig
from specdec_runtime.drafters import ModelDrafter
from specdec_runtime.generate import generate
from specdec_runtime.model import Decoder
from specdec_runtime.reference import assisted_kwargs, hf_generate

LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True,
)  # fmt: skip
TINY = dict(LLAMA_1B, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=4)  # fmt: skip
# Peak HBM bandwidth (GB/s) by device name, for the limit when --bandwidth-gbs is not given.
BANDWIDTH = {"H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100 NVL": 3900, "H200": 4800,
             "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100-SXM4-40GB": 1555, "L4": 300}  # fmt: skip


def build(args, device: torch.device, dtype: torch.dtype):
    """(HF target, our Decoder) with the same random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(TINY if args.tiny else LLAMA_1B))
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


def timed(fn, ids: list[int], device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 model (smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="auto: on CUDA")
    ap.add_argument("--k", type=int, default=2, help="the drafter: the target's first K layers")
    ap.add_argument("--residual-scale", type=float, default=0.05, help="output scale of the layers after K")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="HBM bandwidth (default: from the GPU's name)")
    ap.add_argument("--output-dir", type=Path, default=Path("runs/bench_gpu"))
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    hf, ours = build(args, device, dtype)
    if args.compile == "on" or (args.compile == "auto" and device.type == "cuda"):
        ours.compile()
    drafter = ModelDrafter(ours, exit_layer=args.k, shares_target_cache=True)
    assist, _ = assisted_kwargs(hf, drafter, gamma=args.gamma)
    g = torch.Generator().manual_seed(1)
    vocab = ours.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    N = args.max_new_tokens
    methods = {
        "ours autoregressive": lambda ids: generate(ours, ids, max_new_tokens=N).tokens,
        "transformers generate": lambda ids: hf_generate(hf, ids, max_new_tokens=N, stop_ids=frozenset()),
        f"ours speculative (truncate:{args.k}, gamma {args.gamma})": lambda ids: (
            generate(ours, ids, drafter, max_new_tokens=N, gamma=args.gamma).tokens
        ),
        f"transformers assisted (truncate:{args.k}, gamma {args.gamma})": lambda ids: hf_generate(
            hf, ids, max_new_tokens=N, stop_ids=frozenset(), **assist
        ),
    }
    for fn in methods.values():  # warm-up: compilation and CUDA graph capture for every shape
        fn(prompts[0])
        fn(prompts[0])
    totals = {m: [0, 0.0] for m in methods}
    outputs = {m: [] for m in methods}
    for ids in prompts:
        for m, fn in methods.items():
            toks, secs = timed(fn, ids, device)
            totals[m][0] += len(toks)
            totals[m][1] += secs
            outputs[m].append(toks)
    tok_s = {m: n / s for m, (n, s) in totals.items()}
    names = list(methods)
    tau = generate(ours, prompts[0], drafter, max_new_tokens=N, gamma=args.gamma).stats.tau

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = args.bandwidth_gbs or next((v for k, v in BANDWIDTH.items() if k in name), None)
    kv_bytes = 2 * ours.config.num_layers * ours.config.num_kv_heads * ours.config.head_dim * dtype.itemsize
    per_token = weight_bytes(ours) + kv_bytes * (args.prompt_len + N // 2)  # mean context
    limit = bandwidth * 1e9 / per_token if bandwidth else None
    lines = [
        f"{name}, {args.dtype}, compile {ours.compiled != {}}, {args.prompts} random prompts of {args.prompt_len} "
        f"tokens, {N} new tokens, batch 1; {weight_bytes(ours) / 1e9:.2f} GB of weights read per token; "
        f"speculative tau {tau:.2f}",
        "",
        "| method | tok/s | identical to ours autoregressive |",
        "|---|---:|---:|",
    ]
    for m in names:
        same = sum(a == b for a, b in zip(outputs[m], outputs[names[0]])) / len(prompts)
        lines.append(f"| {m} | {tok_s[m]:.1f} | {same:.0%} |")
    ratios = {
        "ours AR / bandwidth limit": tok_s[names[0]] / limit if limit else None,
        "ours AR / transformers generate": tok_s[names[0]] / tok_s[names[1]],
        "ours speculative / transformers assisted (same drafter, same gamma)": tok_s[names[2]] / tok_s[names[3]],
        "ours speculative / ours AR": tok_s[names[2]] / tok_s[names[0]],
    }
    if limit:
        lines.insert(2, f"bandwidth limit: {bandwidth:.0f} GB/s / {per_token / 1e9:.2f} GB = {limit:.1f} tok/s\n")
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {'-' if v is None else f'{v:.2f}'} |" for k, v in ratios.items()]
    table = "\n".join(lines)
    print(table)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "results.md").write_text(table + "\n")
    (args.output_dir / "results.json").write_text(
        json.dumps({"device": name, "tok_s": tok_s, "ratios": ratios, "tau": tau, "limit_tok_s": limit}, indent=1)
    )


if __name__ == "__main__":
    main()
