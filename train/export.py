"""Exporting every drafter type in the formats serving stacks load, with a model card, and pushing
it to the Hub. One module for all four recipes:

    card = Card(target="HuggingFaceTB/SmolLM2-135M-Instruct", recipe="distill", data="builtin", setup={...},
                metrics=validation)
    export_standalone(model, tokenizer, out / "export", card, vocab_ids=ids, generation_config=gen_cfg, gamma=4)
    export_medusa(heads, out / "export", card, base=target_name, lm_head=w, tree=calibration)
    export_mtp(model.lm, heads_sd, meta, tokenizer, out / "export", card, generation_config=gen_cfg)
    export_skipset(skipset, out / "export", card)
    export_eagle3(model, out / "export", card, verifier=target_name, verifier_path=path, drafting={"gamma": 5, ...})
    push_to_hub(out / "export", "me/smollm2-drafter", private=True, revision="v1")   # token: $HF_TOKEN

Formats: a stand-alone drafter is a plain transformers folder (config, model.safetensors, tokenizer,
generation config): AutoModelForCausalLM loads it and transformers' assisted generation takes it as
assistant_model. With a draft vocabulary, lm_head is saved full-size with zero rows outside it
(transformers sees ordinary logits there, 0) and the vocabulary ids go to draft_vocab.safetensors,
from which the runtime builds the small head. Medusa heads are written in the FasterDecoding layout
(folder root) and vLLM's (vllm/); MTP as the causal LM (trunk + head 0) plus mtp_heads.safetensors;
a layer-skip set as skipset.json; an EAGLE-3 drafter in the speculators format (config.json with
speculators_config, model.safetensors). Every folder gets a README.md model card (target, recipe, data,
measured tau and speedup, usage with specdec, transformers and vLLM where they apply) and
specdec_metrics.json, and is written to NAME.tmp and renamed, so a reader never sees half of one.
"""

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec_runtime.drafter_spec import LOOKUP
from specdec_runtime.loading import DRAFT_VOCAB_FILE
from specdec_runtime.phrases import PhraseTable
from train.draft_model import full_state_dict

KINDS = ("standalone", "medusa", "mtp", "layerskip", "eagle3")


def write_hf_model(
    model: Any, tokenizer: Any, folder: Path, *, vocab_ids: torch.Tensor | None, generation_config: Any | None
) -> Path:
    """Write a causal LM as a transformers model folder (the export functions make it atomic)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.to("cpu").contiguous() for k, v in full_state_dict(model, vocab_ids).items()}
    # A draft vocabulary has untied the config already (use_draft_vocab); a tied head is stored once.
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    model.config.save_pretrained(folder)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    if vocab_ids is not None:
        save_file({"ids": vocab_ids.to("cpu", torch.long).contiguous()}, str(folder / DRAFT_VOCAB_FILE))
    return folder


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list | tuple):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


@dataclass
class Card:
    """What a model card says about a drafter besides its format: the target it drafts for, how it
    was trained, and what specdec_runtime measured (validation: tau, speedup, lossless, ...)."""

    target: str
    recipe: str
    data: str
    setup: dict[str, Any]
    metrics: dict[str, Any] | None = None
    title: str | None = None
    summary: str | None = None
    tags: list[str] = field(default_factory=list)
    base_model: str | None = None
    hub_id: str | None = None  # where it will be pushed: usage then downloads it from there


METRIC_NAMES = {
    "tau": "tau (tokens per target forward)",
    "speedup": "speedup over autoregressive",
    "lossless": "greedy outputs identical to the target's",
    "tokens_per_s": "tokens/s (speculative)",
    "ar_tokens_per_s": "tokens/s (autoregressive)",
    "acceptance_per_position": "acceptance per draft position",
    "lookups": "prompt-lookup rounds (counted apart from the positions above)",
    "gamma": "gamma (draft length)",
    "nodes": "tree nodes",
    "max_new_tokens": "max new tokens",
    "prompts": "validation prompts",
    "device": "device",
    "threads": "CPU threads (decoding)",
    "drafter": "drafting (specdec_runtime)",
    "measured_against": "speedup measured against",
    "target_agreement": "adapted target: teacher-forced top-1 agreement with the original",
    "target_kl": "adapted target: KL(original || adapted) per token",
    "identical_to_original": "adapted target: greedy outputs identical to the original's",
}

LOSSLESS = "Speculative decoding with it produces exactly the target's output."
SUMMARIES = {  # {target}, {recipe}: a card's opening paragraph unless it brings its own
    "standalone": "A stand-alone drafter (a small causal LM) for speculative decoding of **{target}**, trained "
    "with specdec's `{recipe}` recipe. " + LOSSLESS,
    "medusa": "Medusa heads for speculative decoding of **{target}** (tree decoding), trained with specdec's "
    "`{recipe}` recipe. " + LOSSLESS,
    "mtp": "A model with multi-token-prediction heads that drafts for itself (blockwise parallel decoding), "
    "trained with specdec's `{recipe}` recipe. " + LOSSLESS,
    "eagle3": "An EAGLE-3 drafter (one decoder layer reading the target's low, middle and high hidden states) for "
    "speculative decoding of **{target}**, trained with specdec's `{recipe}` recipe, in the speculators format "
    "vLLM and SGLang load. " + LOSSLESS,
    "layerskip": "A layer-skip set for self-speculative decoding of **{target}** (Draft & Verify), found by "
    "specdec's `{recipe}` recipe: the target drafts for itself with the listed sublayers skipped and "
    "verifies with all of them, so the output is exactly the target's.",
}


def model_card(kind: str, card: Card, usage: str) -> str:
    """A README.md with YAML front matter, the measured numbers, the training setup and the usage."""
    if kind not in KINDS:
        raise ValueError(f"drafter kind '{kind}': use one of {', '.join(KINDS)}")
    front = ["---", "library_name: transformers" if kind in ("standalone", "mtp") else "library_name: specdec"]
    if card.base_model:
        front.append(f"base_model: {card.base_model}")
    tags = ["speculative-decoding", "specdec", f"specdec-{kind}", *card.tags]
    front += ["tags:"] + [f"- {t}" for t in tags] + ["---", ""]
    summary = card.summary or SUMMARIES[kind].format(target=card.target, recipe=card.recipe)
    title = card.title or f"{card.recipe} drafter for {card.target}"
    lines = [*front, f"# {title}", "", summary, ""]
    m = card.metrics
    if m:
        lines += ["## Measured on specdec_runtime", "", "| metric | value |", "|---|---|"]
        lines += [f"| {label} | {_fmt(m[k])} |" for k, label in METRIC_NAMES.items() if m.get(k) is not None]
        if m.get("per_category"):
            lines += ["", "| category | tau | speedup |", "|---|---|---|"]
            lines += [f"| {c} | {_fmt(v['tau'])} | {_fmt(v['speedup'])} |" for c, v in m["per_category"].items()]
        lines.append("")
    setup = {"target": card.target, "recipe": card.recipe, "data": card.data, **card.setup}
    lines += ["## Training setup", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in setup.items()]
    lines += ["", "## Usage", "", usage.strip(), ""]
    return "\n".join(lines)


def write_card(folder: Path, kind: str, card: Card, usage: str) -> None:
    (folder / "README.md").write_text(model_card(kind, card, usage))
    if card.metrics is not None:
        (folder / "specdec_metrics.json").write_text(json.dumps(card.metrics, indent=2))


def _fetch(card: Card, local: Path) -> tuple[str, str]:
    """(shell lines that fetch the drafter, the folder to use): the Hub repo when it is pushed there."""
    if not card.hub_id:
        return "", str(local)
    name = card.hub_id.split("/")[-1]
    return f"hf download {card.hub_id} --local-dir {name}\n", name


def _atomic(out: Path, write: Callable[[Path], None]) -> Path:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def export_standalone(
    model: Any,
    tokenizer: Any,
    out: Path,
    card: Card,
    *,
    vocab_ids: torch.Tensor | None,
    generation_config: Any | None,
    gamma: int,
) -> Path:
    """A distilled drafter: a transformers folder + card (specdec, transformers assisted generation, vLLM)."""
    get, folder = _fetch(card, out)
    usage = f"""With specdec's runtime (lossless speculative decoding):

```bash
{get}specdec generate --target {card.target} --drafter {folder} --gamma {gamma} --prompt "Write a haiku about the sea."
```

With transformers' assisted generation:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
target = AutoModelForCausalLM.from_pretrained("{card.target}")
drafter = AutoModelForCausalLM.from_pretrained("{folder}")
tok = AutoTokenizer.from_pretrained("{folder}")
ids = tok.apply_chat_template([{{"role": "user", "content": "Hi!"}}], add_generation_prompt=True, return_tensors="pt")
out = target.generate(ids, assistant_model=drafter, max_new_tokens=128, do_sample=False)
```

With vLLM (draft-model speculation; not run by specdec's tests):

```python
from vllm import LLM
llm = LLM(model="{card.target}", speculative_config={{"model": "{folder}", "num_speculative_tokens": {gamma}}})
```"""

    def write(tmp: Path) -> None:
        write_hf_model(model, tokenizer, tmp, vocab_ids=vocab_ids, generation_config=generation_config)
        write_card(tmp, "standalone", card, usage)

    return _atomic(out, write)


def export_medusa(
    heads: Any,
    out: Path,
    card: Card,
    *,
    base: str,
    lm_head: torch.Tensor,
    tree: dict[str, Any] | None,
    target_model: Any | None = None,
    tokenizer: Any | None = None,
    generation_config: Any | None = None,
    lora: Any | None = None,
) -> Path:
    """Medusa heads: the FasterDecoding layout at the root, vLLM's in vllm/, the calibrated tree;
    Medusa-2 adds target/ (the adapted target, merged) and lora/ (the adapter alone)."""
    from specdec_runtime.medusa import TREE_FILE, write_layout

    get, folder = _fetch(card, out)
    target = f"{folder}/target" if target_model is not None else card.target
    usage = f"""With specdec's runtime (tree decoding; greedy output identical to the target's):

```bash
{get}specdec generate --target {target} --drafter {folder} --prompt "Write a haiku about the sea." --baseline
```

`{folder}` is the FasterDecoding layout (`medusa_lm_head.safetensors`, `config.json` with
`medusa_num_heads`); `{folder}/vllm` is vLLM's Medusa layout (`model_type: medusa`; not run by
specdec's tests):

```python
from vllm import LLM
spec = {{"method": "medusa", "model": "{folder}/vllm", "num_speculative_tokens": {heads.num_heads}}}
llm = LLM(model="{target}", speculative_config=spec)
```

transformers has no Medusa decoding. `{TREE_FILE}` holds the calibrated tree (`medusa_choices`) and
the measured per-head top-k accuracies."""

    def write(tmp: Path) -> None:
        if target_model is not None:
            write_hf_model(target_model, tokenizer, tmp / "target", vocab_ids=None, generation_config=generation_config)
            if lora is not None:
                lora.save_pretrained(tmp / "lora")
        write_layout(heads, tmp, "faster_decoding", base, lm_head_weight=lm_head)
        write_layout(heads, tmp / "vllm", "vllm", base, lm_head_weight=lm_head)
        if tree is not None:
            (tmp / TREE_FILE).write_text(json.dumps(tree))
        write_card(tmp, "medusa", card, usage)

    return _atomic(out, write)


def export_mtp(
    lm: Any,
    heads_sd: dict[str, torch.Tensor],
    meta: dict[str, Any],
    tokenizer: Any,
    out: Path,
    card: Card,
    *,
    generation_config: Any | None,
) -> Path:
    """An MTP model: the causal LM (trunk + head 0) that transformers loads, plus the extra heads
    (mtp_heads.safetensors, described by mtp_config.json)."""
    from safetensors.torch import save_file

    from specdec_runtime.mtp import MTP_CONFIG, MTP_WEIGHTS

    get, folder = _fetch(card, out)
    n = meta["num_heads"]
    usage = f"""{get}```python
from transformers import AutoModelForCausalLM     # trunk + head 0: an ordinary causal LM
model = AutoModelForCausalLM.from_pretrained("{folder}")
```

MTP self-speculation (heads 1..{n - 1} draft, the model verifies; output identical to its own):

```bash
specdec generate --target {folder} --drafter mtp --no-chat-template --prompt "def parse_args("
```

vLLM's `mtp` speculation loads the MTP modules of DeepSeek-V3-style checkpoints, not this layout."""

    def write(tmp: Path) -> None:
        write_hf_model(lm, tokenizer, tmp, vocab_ids=None, generation_config=generation_config)
        sd = {k: v.to("cpu").contiguous() for k, v in heads_sd.items()}
        save_file(sd, str(tmp / MTP_WEIGHTS), metadata={"format": "pt"})
        (tmp / MTP_CONFIG).write_text(json.dumps(meta, indent=2))
        write_card(tmp, "mtp", card, usage)

    return _atomic(out, write)


def export_skipset(skipset: Any, out: Path, card: Card) -> Path:
    """A layer-skip set: skipset.json (what the runtime loads) and its card."""
    get, folder = _fetch(card, out)
    usage = f"""```bash
{get}specdec generate --target {card.target} --drafter {folder}/skipset.json --baseline
```

The set is a list of sublayers of {card.target}; transformers and vLLM have no layer-skip
self-speculation that reads it."""

    def write(tmp: Path) -> None:
        skipset.save(tmp / "skipset.json")
        write_card(tmp, "layerskip", card, usage)

    return _atomic(out, write)


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


def export_eagle3(
    model: Any,
    out: Path,
    card: Card,
    *,
    verifier: str,
    verifier_path: Path,
    drafting: dict[str, int],
    phrases: PhraseTable | None = None,
) -> Path:
    """An EAGLE-3 drafter in the speculators format (specdec_runtime.eagle3_format) and SGLang's
    flat layout (sglang/), with its card and, given one, the phrase table (specdec_runtime.phrases:
    specdec's runtime drafts from it with DIR+lookup; in specdec_phrases/, which serving engines do not read)."""
    from specdec_runtime.eagle3_format import save_speculators

    target_config = json.loads((Path(verifier_path) / "config.json").read_text())
    architectures = target_config.get("architectures") or []
    get, folder = _fetch(card, out)
    k, tree = drafting["gamma"], drafting["tree_budget"]
    topk, draft_tokens = (drafting["top_k"], tree + 1) if tree else (1, k + 1)  # SGLang: a chain is top-k 1
    drafts = f"a tree of {tree} nodes up to {k} deep" if tree else f"chains of {k} tokens"
    lookup, first = (LOOKUP, ", prompt lookup and the phrase table first") if phrases is not None else ("", "")
    usage = f"""With specdec's runtime ({drafts}{first}; greedy output identical to the target's):

```bash
{get}specdec generate --target {card.target} --drafter {folder}{lookup} --baseline --prompt "A haiku about the sea."
```

With vLLM, which reads the speculators format (not run by specdec's tests):

```bash
vllm serve {card.target} \\
    --speculative-config '{{"model": "{folder}", "num_speculative_tokens": {k}, "method": "eagle3"}}'
```

With SGLang, from its flat layout in `{folder}/sglang` (not run by specdec's tests):

```bash
python -m sglang.launch_server --model-path {card.target} --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path {folder}/sglang --speculative-num-steps {k} \\
    --speculative-eagle-topk {topk} --speculative-num-draft-tokens {draft_tokens}
```"""

    def write(tmp: Path) -> None:
        layers = target_config.get("num_hidden_layers")
        save_speculators(model, tmp, verifier=verifier, verifier_architectures=architectures, drafting=drafting,
                         num_target_layers=layers)  # fmt: skip
        if phrases is not None:
            phrases.save(tmp / phrases.FILE)
        write_card(tmp, "eagle3", card, usage)

    return _atomic(out, write)
