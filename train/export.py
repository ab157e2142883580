"""Exporting drafters in the formats serving stacks load, with a model card, and pushing them to the Hub.

    export_hf_drafter(model, tokenizer, out / "export", vocab_ids=ids, generation_config=target_gen_cfg)
    write_model_card(out / "export", model_card(title=..., target=..., recipe="distill", setup={...}, metrics={...}))
    push_to_hub(out / "export", "me/smollm2-drafter", private=True)      # token from HF_TOKEN

A stand-alone drafter is a plain transformers folder (config, model.safetensors, tokenizer,
generation config): AutoModelForCausalLM loads it and transformers' assisted generation takes it as
assistant_model. With a draft vocabulary, lm_head is saved full-size with zero rows outside it
(transformers sees ordinary logits there, 0) and the vocabulary ids go to draft_vocab.safetensors,
from which the runtime builds the small head. Folders are written to NAME.tmp and renamed.
"""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdec_runtime.loading import DRAFT_VOCAB_FILE
from train.draft_model import full_state_dict


def export_hf_drafter(
    model: Any,
    tokenizer: Any,
    out: Path,
    *,
    vocab_ids: torch.Tensor | None,
    generation_config: Any | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write the drafter as a transformers model folder at `out` (atomically); extra(folder) adds
    files of its own (MTP heads) before the folder takes its name."""
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    sd = {k: v.to("cpu").contiguous() for k, v in full_state_dict(model, vocab_ids).items()}
    # A draft vocabulary has untied the config already (use_draft_vocab); a tied head is stored once.
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    model.config.save_pretrained(tmp)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    if generation_config is not None:
        generation_config.save_pretrained(tmp)
    if vocab_ids is not None:
        save_file({"ids": vocab_ids.to("cpu", torch.long).contiguous()}, str(tmp / DRAFT_VOCAB_FILE))
    if extra is not None:
        extra(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list | tuple):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def model_card(
    *,
    title: str,
    target: str,
    recipe: str,
    setup: dict[str, Any],
    metrics: dict[str, Any] | None,
    usage: str,
    tags: list[str] | None = None,
    base_model: str | None = None,
    summary: str | None = None,
) -> str:
    """A README.md with YAML front matter, the training setup and the measured numbers."""
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    if base_model:
        front.append(f"base_model: {base_model}")
    front += ["tags:"] + [f"- {t}" for t in ["speculative-decoding", "specdec", *(tags or [])]] + ["---", ""]
    lines = [
        *front,
        f"# {title}",
        "",
        summary
        or f"A drafter for speculative decoding of **{target}**, trained with specdec's "
        f"`{recipe}` recipe. Speculative decoding with it produces exactly the target's output.",
        "",
    ]
    if metrics:
        lines += ["## Measured on specdec_runtime", "", "| metric | value |", "|---|---|"]
        names = {
            "tau": "tau (tokens per target forward)",
            "speedup": "speedup over autoregressive",
            "lossless": "greedy outputs identical to the target's",
            "tokens_per_s": "tokens/s (speculative)",
            "ar_tokens_per_s": "tokens/s (autoregressive)",
            "acceptance_per_position": "acceptance per draft position",
            "gamma": "gamma (draft length)",
            "max_new_tokens": "max new tokens",
            "prompts": "validation prompts",
            "device": "device",
        }
        lines += [f"| {label} | {_fmt(metrics[k])} |" for k, label in names.items() if metrics.get(k) is not None]
        if metrics.get("per_category"):
            lines += ["", "| category | tau | speedup |", "|---|---|---|"]
            lines += [f"| {c} | {_fmt(m['tau'])} | {_fmt(m['speedup'])} |" for c, m in metrics["per_category"].items()]
        lines.append("")
    lines += ["## Training setup", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in setup.items()]
    lines += ["", "## Usage", "", usage.strip(), ""]
    return "\n".join(lines)


def write_model_card(folder: Path, card: str, metrics: dict[str, Any] | None = None) -> None:
    (folder / "README.md").write_text(card)
    if metrics is not None:
        (folder / "specdec_metrics.json").write_text(json.dumps(metrics, indent=2))


def push_to_hub(
    folder: Path,
    repo_id: str,
    *,
    private: bool = True,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str = "Upload drafter trained with specdec",
) -> str:
    """Create the repo if needed and upload the folder; returns the commit URL. Token: argument or $HF_TOKEN."""
    from huggingface_hub import HfApi

    api = HfApi(token=token or os.environ.get("HF_TOKEN"))
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision, commit_message=commit_message)
    return str(getattr(info, "commit_url", info))
