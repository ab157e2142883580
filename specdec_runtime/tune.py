"""`specdec tune`: which drafting settings pay at which batch size and temperature, for this target
and drafter, measured on the runtime, and the same settings as vLLM and SGLang take them.

    specdec tune --drafter runs/eagle3/export --batch-sizes 1,4,16 --temperatures 0,0.7 --gammas 1,2,3,4,5

Per batch size and temperature: autoregressive decoding at that batch size once, then each
candidate on the same prompts: chains of each gamma (Medusa and MTP heads: no longer than their
heads); an EAGLE-3 export's own tree (in batches, a tree a row); for model drafters, prompt lookup
first (SPEC+lookup, with the export's phrase table where it has one) before its own drafting (in
batches, a lookup's chain in its row's tree), and in batches before the chain that measured fastest
too. The best (tokens/s) is written to tune.json with the speedup it measured, beside every
candidate's figures and the engines' settings for it (`serving`); where the best is the runtime's
own (lookup first), the best an engine serves too (best_served). The engines count differently:
vLLM's num_speculative_tokens is the draft length (a chain; vLLM drafts greedily at any
temperature), SGLang's num_draft_tokens counts the verified root too (a chain of gamma: gamma + 1;
a tree of n nodes: n + 1) and its eagle-topk is 1 for chains.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec_runtime.drafters.batched import RowEagle3, RowLookup, RowMedusa, RowModel, batch_drafter
from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.lookup import LookupFirst, NgramDrafter
from specdec_runtime.drafters.medusa import MedusaDrafter
from specdec_runtime.drafters.mtp import MTPDrafter
from specdec_runtime.drafters.spec import LOOKUP, as_chains, build_drafter, phrase_table
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.engines.sglang import eagle_draft_tokens
from specdec_runtime.loading import LoadedModel
from specdec_runtime.measure import measure
from specdec_runtime.sampling import Sampler


def candidates(spec: str, target: LoadedModel, batch: int, gammas: Sequence[int], dtype: str) -> list[dict]:
    """The drafting settings tried at a batch size: {"name", "drafter", "gamma", "tree_budget", "top_k",
    "lookup"} each (a drafter that decodes a prompt at a time has none above batch 1)."""
    own = build_drafter(spec, target, dtype=dtype)
    chain = as_chains(own, spec, target, dtype=dtype)
    heads = own.heads.num_heads - isinstance(own, MTPDrafter) if isinstance(own, MedusaDrafter | MTPDrafter) else 0
    gammas = sorted({min(g, heads) for g in gammas}) if heads else gammas  # (heads draft at most one token each)
    runs = chain if batch == 1 else batch_drafter(chain)
    if runs is None:
        return []
    out = [dict(name=f"chain:{g}", drafter=runs, gamma=g, tree_budget=0, top_k=1, lookup=False) for g in gammas]
    budget, g = getattr(own, "tree_budget", 0), own.gamma or max(gammas)
    table = None if isinstance(own, NgramDrafter) else phrase_table(spec, target)  # (an export's, as SPEC+lookup)
    if budget:  # its own tree, at its own depth (batched: a tree a row)
        top_k = getattr(own, "top_k", 0)
        out.append(dict(name=f"tree:{budget}:{g}", drafter=own if batch == 1 else batch_drafter(own), gamma=g,
                        tree_budget=budget, top_k=top_k, lookup=False))  # fmt: skip
    if isinstance(own, NgramDrafter):
        return out
    if batch > 1:  # lookup first before the chain that measured fastest (gamma None: tune sets it)
        first = batch_drafter(LookupFirst(chain, table=table))
        out.append(dict(name=LOOKUP, drafter=first, gamma=None, tree_budget=0, top_k=1, lookup=True))
    if batch == 1 or budget:  # prompt lookup first, then its own drafting (batched: a lookup's chain in its tree)
        first = LookupFirst(own, table=table)
        name = ("tree" if budget else f"chain:{g}") + LOOKUP
        out.append(dict(name=name, drafter=first if batch == 1 else batch_drafter(first), gamma=g,
                        tree_budget=budget, top_k=getattr(own, "top_k", 1), lookup=True))  # fmt: skip
    return out


def serving(spec: str, drafter: Any, c: dict) -> dict[str, Any]:
    """The engines' settings for candidate c of drafter `spec` (None where an engine has no such drafting)."""
    g, budget, top_k = c["gamma"], c["tree_budget"], c["top_k"]
    if c["lookup"]:
        return {"vllm": None, "sglang": None, "note": "prompt lookup first is the runtime's own"}
    if isinstance(drafter, Eagle3Drafter | RowEagle3):
        topk, tokens = eagle_draft_tokens(g, budget, top_k)
        sglang = (f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {spec}/sglang "
                  f"--speculative-num-steps {g} --speculative-eagle-topk {topk} "
                  f"--speculative-num-draft-tokens {tokens}")  # fmt: skip
        return {"vllm": {"method": "eagle3", "model": spec, "num_speculative_tokens": g}, "sglang": sglang}
    if isinstance(drafter, NgramDrafter | RowLookup):
        vllm = {"method": "ngram", "num_speculative_tokens": g, "prompt_lookup_max": drafter.max_ngram,
                "prompt_lookup_min": 1}  # fmt: skip
        return {"vllm": vllm, "sglang": None}
    if isinstance(drafter, MedusaDrafter | RowMedusa):  # (vLLM's Medusa drafts each head's top token: chains)
        folder = Path(spec) / "vllm" if (Path(spec) / "vllm").is_dir() else Path(spec)  # (an export's vllm/)
        vllm = {"method": "medusa", "model": str(folder), "num_speculative_tokens": g}
        config = folder / "config.json"
        if not config.is_file() or json.loads(config.read_text()).get("model_type") != "medusa":
            return {"vllm": None, "sglang": None, "note": f"{folder} is not vLLM's Medusa layout"}
        return {"vllm": vllm, "sglang": None, "note": "vLLM up to 0.32 (0.33 removed Medusa); SGLang has no Medusa"}
    if isinstance(drafter, RowModel) or (isinstance(drafter, ModelDrafter) and not drafter.shares_target_cache):
        sglang = (f"--speculative-algorithm STANDALONE --speculative-draft-model-path {spec} "
                  f"--speculative-num-steps {g} --speculative-eagle-topk 1 "
                  f"--speculative-num-draft-tokens {g + 1}")  # fmt: skip
        return {"vllm": {"method": "draft_model", "model": spec, "num_speculative_tokens": g}, "sglang": sglang}
    return {"vllm": None, "sglang": None, "note": "no engine serves this kind of drafter as specdec runs it"}


def tune(
    target: LoadedModel,
    spec: str,
    encoded: Sequence[list[int]],
    sizes: Sequence[int],
    temperatures: Sequence[float],
    gammas: Sequence[int],
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    max_new_tokens: int = 64,
    dtype: str = "auto",
    progress=None,
) -> dict[str, Any]:
    """tune.json's content (module docstring)."""
    settings = []
    for B in sizes:
        for t in temperatures:
            sampler = lambda t=t: Sampler(t, top_k, top_p, seed=seed)  # noqa: E731
            kw = dict(sampler=sampler, batch_size=B, max_new_tokens=max_new_tokens, stop_ids=target.stop_ids)
            ar = measure(target.model, None, encoded, **kw).total().tokens_per_s
            rows = []
            for c in candidates(spec, target, B, gammas, dtype):
                if c["gamma"] is None:  # lookup first before the fastest chain so far
                    chains = (r for r in rows if not r["lookup"] and not r["tree_budget"])
                    g = max(chains, key=lambda r: r["tok_s"])["gamma"]
                    c = c | dict(gamma=g, name=f"chain:{g}{LOOKUP}")
                report = measure(target.model, c["drafter"], encoded, gamma=c["gamma"], **kw)
                s = report.total()
                row = {k: v for k, v in c.items() if k != "drafter"}
                rows.append(row | {"tok_s": s.tokens_per_s, "tau": s.tau, "speedup": s.tokens_per_s / ar}
                            | serving(spec, c["drafter"], c))  # fmt: skip
                if progress is not None:
                    progress(B, t, rows[-1])
            entry = {"batch_size": B, "temperature": t, "autoregressive_tok_s": ar, "candidates": rows}
            if rows:
                best = max(rows, key=lambda r: r["tok_s"])
                entry["best"] = best | {"pays": best["speedup"] > 1.0}
                served = [r for r in rows if r.get("vllm") or r.get("sglang")]
                if served and best not in served:  # the runtime's own best (lookup first) is no engine's
                    b = max(served, key=lambda r: r["tok_s"])
                    entry["best_served"] = b | {"pays": b["speedup"] > 1.0}
            else:
                entry["note"] = "this drafter decodes one prompt at a time: batch 1 only"
            settings.append(entry)
    return {
        "drafter": spec,
        "device": target.model.device.type,
        "prompts": len(encoded),
        "max_new_tokens": max_new_tokens,
        "settings": settings,
        "notes": [
            "vLLM drafts greedily whatever the temperature: its acceptance at T > 0 can be below the runtime's",
            "SGLang's num_draft_tokens counts the verified root: a chain of g is g + 1, a tree of n nodes n + 1",
        ],
    }


def table(result: dict[str, Any]) -> str:
    """A markdown table of the best setting per batch size and temperature."""
    lines = ["| batch | temperature | AR tok/s | best | tok/s | tau | speedup | best an engine serves | speedup | "
             "vLLM num_speculative_tokens |", "|---:|---:|---:|---|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    for s in result["settings"]:
        b = s.get("best")
        if b is None:
            lines.append(f"| {s['batch_size']} | {s['temperature']} | {s['autoregressive_tok_s']:.1f} | {s['note']} |"
                         " | | | | | |")  # fmt: skip
            continue
        e = s.get("best_served", b)
        vllm = e["vllm"]["num_speculative_tokens"] if e.get("vllm") else "-"
        lines.append(f"| {s['batch_size']} | {s['temperature']} | {s['autoregressive_tok_s']:.1f} | {b['name']} | "
                     f"{b['tok_s']:.1f} | {b['tau']:.2f} | {b['speedup']:.2f}x | {e['name']} | {e['speedup']:.2f}x "
                     f"| {vllm} |")  # fmt: skip
    return "\n".join(lines) + "\n"
