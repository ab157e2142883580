"""Validating a trained drafter on specdec_runtime: tau, speedup over autoregressive, losslessness.

    decoder = runtime_decoder(hf_drafter, vocab_ids, device=target_decoder.device)
    metrics = validate(target_decoder, ModelDrafter(decoder, vocab_size=V), prompts, categories,
                       stop_ids=stop_ids, gamma=4, max_new_tokens=128)
    metrics["tau"], metrics["speedup"], metrics["lossless"]

Greedy decoding: each prompt is decoded autoregressively and speculatively side by side (measure()), so the
speedup is a side-by-side ratio and losslessness is exact output equality.
"""

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec_runtime.config import DecoderConfig
from specdec_runtime.drafters.batched import batch_drafter
from specdec_runtime.drafters.protocol import Drafter
from specdec_runtime.hardware import resolve_dtype, using_threads
from specdec_runtime.measure import measure
from specdec_runtime.model import Decoder
from specdec_runtime.sampling import Sampler
from train.draft_model import full_state_dict


def runtime_decoder(
    model: Any,
    vocab_ids: torch.Tensor | None,
    device: torch.device,
    dtype: torch.dtype | None = None,
    fast_path: bool = True,
) -> Decoder:
    """The runtime Decoder of a transformers model in memory: the target (vocab_ids None) or a
    drafter, exactly as its export loads (use_draft_vocab has already untied its config), in
    `dtype` (default: the device's, fp32 on a CPU, where a model whose weights are bf16 then runs
    as its bf16 weights with fp32 activations: Decoder.from_hf_state_dict). On CUDA it runs the
    fast path (CUDA graphs), as `specdec generate` does by default there, unless fast_path=False
    (batched generation: generate_batch runs eagerly)."""
    cfg = DecoderConfig.from_hf(model.config)
    dtype = dtype or resolve_dtype("auto", torch.device(device))
    decoder = Decoder.from_hf_state_dict(cfg, full_state_dict(model, vocab_ids), device, dtype, vocab_ids=vocab_ids)
    if decoder.device.type == "cuda" and fast_path and decoder.can_compile:
        decoder.compile()
    return decoder


def validate(
    target: Decoder,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    categories: Sequence[str | None],
    *,
    stop_ids: frozenset[int],
    gamma: int,
    max_new_tokens: int,
    progress: bool = True,
    threads: int | None = None,
    batch_sizes: Sequence[int] = (1,),
) -> dict[str, Any]:
    """Greedy speculative vs autoregressive decoding of every prompt; the numbers a model card reports.
    threads: the CPU threads to decode on (a run's choice for decoding, Run.threads), restored after.
    batch_sizes: beside batch 1, the prompts decoded that many at a time too (batched.generate_many,
    the autoregressive baseline at the same size; the drafter batched: its trees a row each, lookups
    no longer than gamma beside chains, a lookup's chain in its row's tree beside trees), each
    size's figures as tau_batch{B}, speedup_batch{B}, ...: what the drafter buys where serving
    batches requests."""
    bar = (lambda it: tqdm(it, desc="validate", unit="prompt")) if progress else None
    with using_threads(threads) as decoding_threads:
        report = measure(
            target,
            drafter,
            [torch.as_tensor(p, device=target.device) for p in prompts],
            sampler=Sampler,
            baseline=True,
            progress=bar,
            max_new_tokens=max_new_tokens,
            gamma=gamma,
            stop_ids=stop_ids,
        )
    spec, ar = report.total(), report.total("baseline")
    out: dict[str, Any] = {
        "tau": spec.tau,
        "speedup": report.speedup(),
        "lossless": report.lossless_rate(),
        "tokens_per_s": spec.tokens_per_s,
        "ar_tokens_per_s": ar.tokens_per_s,
        "acceptance_rate": spec.acceptance_rate,
        "acceptance_per_position": spec.acceptance_per_position,
        **({"lookups": spec.lookups} if spec.lookups else {}),
        "new_tokens": spec.new_tokens,
        "prompts": len(prompts),
        "gamma": gamma,
        "max_new_tokens": max_new_tokens,
        **({"threads": decoding_threads} if target.device.type == "cpu" else {}),
    }
    per_category = {}
    for cat in sorted({c for c in categories if c}):
        idx = [i for i, c in enumerate(categories) if c == cat]
        per_category[cat] = {"tau": report.total("spec", idx).tau, "speedup": report.speedup(idx)}
    if per_category:
        out["per_category"] = per_category
    for B in sorted({b for b in batch_sizes if b > 1}):  # flat keys: trackers log numbers, cards list them
        rows = batch_drafter(drafter)  # (lookup first too: RowLookupFirst)
        if rows is None:
            out[f"batch{B}"] = f"{drafter.name} decodes one prompt at a time"
            continue
        with using_threads(threads):
            batched = measure(target, rows, prompts, sampler=Sampler, baseline=True, batch_size=B, gamma=gamma,
                              max_new_tokens=max_new_tokens, stop_ids=stop_ids, progress=bar)  # fmt: skip
        spec, ar = batched.total(), batched.total("baseline")
        out |= {f"tau_batch{B}": spec.tau, f"speedup_batch{B}": batched.speedup(),
                f"lossless_batch{B}": batched.lossless_rate(), f"tokens_per_s_batch{B}": spec.tokens_per_s,
                f"ar_tokens_per_s_batch{B}": ar.tokens_per_s}  # fmt: skip
    return out
