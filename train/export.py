"""Exporting every drafter type in the formats serving stacks load, with a model card, checked
against each engine's loader. One module for all recipes:

    card = Card(target="smollm2-135m-instruct", target_hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
                target_config=config, recipe="distill", data="builtin", setup={...}, metrics=validation)
    export_standalone(model, tokenizer, out / "export", card, vocab_ids=ids, generation_config=gen_cfg, gamma=4)
    export_medusa(heads, out / "export", card, lm_head=w, tree=calibration)
    export_mtp(model.lm, heads_sd, meta, tokenizer, out / "export", card, generation_config=gen_cfg)
    export_skipset(skipset, out / "export", card)
    export_eagle3(model, out / "export", card, drafting={"gamma": 5, ...})
    push_folder(out / "export", "me/smollm2-drafter", private=True, revision="v1")   # specdec_runtime.hub

Formats: a stand-alone drafter is a plain transformers folder (config, model.safetensors, tokenizer,
generation config): AutoModelForCausalLM loads it, transformers' assisted generation takes it as
assistant_model and vLLM as a draft model. With a draft vocabulary, lm_head is saved full-size, its
rows outside the vocabulary the mean of those inside (no argmax picks them), the generation config
suppresses those tokens (transformers then never drafts them), and the ids go to
specdec/draft_vocab.safetensors, from which the runtime builds the small head. Medusa heads are
written in the FasterDecoding layout (folder root, where FasterDecoding can load them right) and
vLLM's (vllm/); MTP as the causal LM (trunk + head 0) plus specdec/mtp_heads.safetensors; a
layer-skip set as skipset.json; an EAGLE-3 drafter in the speculators format (config.json with
speculators_config, model.safetensors) and SGLang's (sglang/). Files only specdec reads go to
specdec/, where no engine's weight glob finds them. Every folder gets specdec_export.json (the
engines it is for: specdec_runtime.export_check), a README.md model card (target, recipe, data,
measured tau and speedup, what `specdec check-export` said of each engine, usage per engine) and
specdec_metrics.json, and is written to NAME.tmp and renamed, so a reader never sees half of one.
The exported configs name the target by its Hub id (Card.target_id), never by a path on this
machine or specdec's short name.
"""

import copy
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec_runtime.drafters.phrases import PhraseTable
from specdec_runtime.drafters.spec import LOOKUP
from specdec_runtime.export_check import Claim, Report, check_export, target_facts, write_manifest
from specdec_runtime.paths import DRAFT_VOCAB_FILE, is_hub_id
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
    if vocab_ids is not None:
        from transformers import GenerationConfig

        # transformers' assisted generation fills what the target's generation config leaves unset
        # from the assistant's own: suppressed here, the tokens outside the vocabulary are never drafted.
        generation_config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
        outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
        outside[vocab_ids.cpu()] = False
        suppressed = set(generation_config.suppress_tokens or []) | set(outside.nonzero().flatten().tolist())
        generation_config.suppress_tokens = sorted(suppressed)
        (folder / DRAFT_VOCAB_FILE).parent.mkdir(exist_ok=True)
        save_file({"ids": vocab_ids.to("cpu", torch.long).contiguous()}, str(folder / DRAFT_VOCAB_FILE))
    if generation_config is not None:
        generation_config.save_pretrained(folder)
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
    hub_id: str | None = None  # where it will be pushed: usage then downloads it from there
    target_hub_id: str | None = None  # the target's Hub id where `target` is not one (recipes: model.hub_id)
    target_config: dict[str, Any] | None = None  # its config.json: what the engines' checks need of it

    @property
    def target_id(self) -> str | None:
        """How the target is named outside this machine (engines, configs, the card): its Hub id, or None."""
        if self.target_hub_id:
            return self.target_hub_id
        return self.target if is_hub_id(self.target) else None

    @property
    def facts(self) -> dict[str, Any] | None:
        """What the engines' checks need of the target (specdec_export.json), from its config."""
        return target_facts(self.target_config, self.target_id) if self.target_config else None

    @property
    def served(self) -> str:
        """The target in an engine's command line."""
        return self.target_id or "TARGET_HUB_ID"


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


TITLES = {
    "standalone": "Distilled drafter for {target}",
    "medusa": "Medusa heads for {target}",
    "mtp": "Multi-token prediction model ({target})",
    "eagle3": "EAGLE-3 drafter for {target}",
    "layerskip": "Layer-skip set for {target}",
}


def model_card(kind: str, card: Card, usage: str, engines: Report | None = None) -> str:
    """A README.md with YAML front matter, the measured numbers, the training setup, what each
    serving engine was checked to do with it, and the usage."""
    if kind not in KINDS:
        raise ValueError(f"drafter kind '{kind}': use one of {', '.join(KINDS)}")
    front = ["---", "library_name: transformers" if kind in ("standalone", "mtp") else "library_name: specdec"]
    if card.target_id:
        front.append(f"base_model: {card.target_id}")
    tags = ["speculative-decoding", "specdec", f"specdec-{kind}", *card.tags]
    front += ["tags:"] + [f"- {t}" for t in tags] + ["---", ""]
    summary = card.summary or SUMMARIES[kind].format(target=card.target_id or card.target, recipe=card.recipe)
    title = card.title or TITLES[kind].format(target=card.target_id or card.target)
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
    if engines is not None and (engines.verdicts or engines.unclaimed):
        lines += ["", "## Serving engines", "", engines.card().strip()]
    if "TARGET_HUB_ID" in usage:
        usage += (
            f"\n\nTARGET_HUB_ID: {card.target} has no Hub id here; train with `model.hub_id=ORG/NAME` (or edit "
            "the exported configs) so that engines find it."
        )
    lines += ["", "## Usage", "", usage.strip(), ""]
    return "\n".join(lines)


def _fetch(card: Card, local: Path) -> tuple[str, str]:
    """(shell lines that fetch the drafter, the folder to use): the Hub repo when it is pushed there."""
    if not card.hub_id:
        return "", str(local)
    name = card.hub_id.split("/")[-1]
    return f"hf download {card.hub_id} --local-dir {name}\n", name


def _atomic(
    out: Path,
    kind: str,
    card: Card,
    usage: str,
    write: Callable[[Path], dict[str, str] | None],
    claims: list[Claim],
) -> Path:
    """Write an export to out.tmp (write returns {engine: why} for the claims it gives up), record
    its claims, check them (`specdec check-export`: said here, and in the card), then rename."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    unclaimed = write(tmp) or {}
    claims = [c for c in claims if c.engine not in unclaimed]
    write_manifest(tmp, kind, card.facts, claims, unclaimed)
    report = check_export(tmp)
    (tmp / "README.md").write_text(model_card(kind, card, usage, report))
    if card.metrics is not None:
        (tmp / "specdec_metrics.json").write_text(json.dumps(card.metrics, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(report.text(out))
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
target = AutoModelForCausalLM.from_pretrained("{card.served}")
drafter = AutoModelForCausalLM.from_pretrained("{folder}")
tok = AutoTokenizer.from_pretrained("{folder}")
ids = tok.apply_chat_template([{{"role": "user", "content": "Hi!"}}], add_generation_prompt=True, return_tensors="pt")
out = target.generate(ids, assistant_model=drafter, max_new_tokens=128, do_sample=False)
```

With vLLM (draft-model speculation):

```python
from vllm import LLM
spec = {{"method": "draft_model", "model": "{folder}", "num_speculative_tokens": {gamma}}}
llm = LLM(model="{card.served}", speculative_config=spec)
```"""

    def write(tmp: Path) -> None:
        write_hf_model(model, tokenizer, tmp, vocab_ids=vocab_ids, generation_config=generation_config)

    claims = [Claim("transformers", ".", "draft_model"), Claim("vllm", ".", "draft_model")]
    return _atomic(out, "standalone", card, usage, write, claims)


def export_medusa(
    heads: Any,
    out: Path,
    card: Card,
    *,
    lm_head: torch.Tensor,
    tree: dict[str, Any] | None,
    target_model: Any | None = None,
    tokenizer: Any | None = None,
    generation_config: Any | None = None,
    lora: Any | None = None,
) -> Path:
    """Medusa heads: the FasterDecoding layout at the root (medusa_lm_head.pt where FasterDecoding
    loads them right, else medusa_lm_head.safetensors, which it does not read), vLLM's in vllm/, the
    calibrated tree; Medusa-2 adds target/ (the adapted target, merged) and lora/ (the adapter alone)."""
    from specdec_runtime.drafters.medusa import (
        FASTER_DECODING_PT,
        FASTER_DECODING_WEIGHTS,
        TREE_FILE,
        to_layout,
        write_layout,
    )
    from specdec_runtime.engines import Folder, faster_decoding

    get, folder = _fetch(card, out)
    joint = target_model is not None
    target = f"{folder}/target" if joint else card.target
    served = f"{folder}/target" if joint else card.served
    base = None if joint else card.target_id  # Medusa-2's base is target/, which no Hub id names
    usage = f"""With specdec's runtime (tree decoding; greedy output identical to the target's):

```bash
{get}specdec generate --target {target} --drafter {folder} --prompt "Write a haiku about the sea." --baseline
```

With FasterDecoding's Medusa, where `specdec check-export` says it loads them (the root:
`medusa_lm_head.pt`, `config.json` with `medusa_num_heads`):

```bash
python -m medusa.inference.cli --model {folder}
```

With vLLM up to 0.32 (Medusa was removed in 0.33), from its layout in `{folder}/vllm`:

```python
from vllm import LLM
spec = {{"method": "medusa", "model": "{folder}/vllm", "num_speculative_tokens": {heads.num_heads}}}
llm = LLM(model="{served}", speculative_config=spec)
```

transformers has no Medusa decoding. `{TREE_FILE}` holds the calibrated tree (`medusa_choices`) and
the measured per-head top-k accuracies."""

    def write(tmp: Path) -> dict[str, str]:
        if joint:
            write_hf_model(target_model, tokenizer, tmp / "target", vocab_ids=None, generation_config=generation_config)
            if lora is not None:
                lora.save_pretrained(tmp / "lora")
        write_layout(heads, tmp, "faster_decoding", base, lm_head_weight=lm_head)
        write_layout(heads, tmp / "vllm", "vllm", base, lm_head_weight=lm_head)
        if tree is not None:
            (tmp / TREE_FILE).write_text(json.dumps(tree))
        if joint:
            problems = [
                "Medusa-2: FasterDecoding loads the base from one Hub id or path, and the adapted target is target/ "
                "here: push target/ as a repo of its own, set base_model_name_or_path to it and save the tensors of "
                f"{FASTER_DECODING_WEIGHTS} as {FASTER_DECODING_PT} (torch.save)"
            ]
        else:
            problems = faster_decoding.medusa(Folder(tmp), card.facts).problems
        if not problems:
            return {}
        # It would load them wrong (or not at all): the heads go where it does not look, so it fails instead.
        from safetensors.torch import save_file

        (tmp / FASTER_DECODING_PT).unlink()
        tensors = to_layout(heads, "faster_decoding", lm_head)
        save_file(tensors, str(tmp / FASTER_DECODING_WEIGHTS), metadata={"format": "pt"})
        return {"faster_decoding": "; ".join(problems)}

    claims = [Claim("faster_decoding", ".", "medusa"), Claim("vllm", "vllm", "medusa")]
    if joint:
        claims += [Claim("transformers", "target", "model"), Claim("vllm", "target", "model")]
    return _atomic(out, "medusa", card, usage, write, claims)


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
    """An MTP model: the causal LM (trunk + head 0) that transformers and vLLM load, plus the extra
    heads (specdec/mtp_heads.safetensors, described by specdec/mtp_config.json)."""
    from safetensors.torch import save_file

    from specdec_runtime.drafters.mtp import MTP_CONFIG, MTP_WEIGHTS

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

vLLM serves it as an ordinary model; its `mtp` speculation loads the MTP modules of
DeepSeek-V3-style checkpoints, not these heads (in `{MTP_WEIGHTS}`, where no weight glob reads them)."""

    def write(tmp: Path) -> None:
        write_hf_model(lm, tokenizer, tmp, vocab_ids=None, generation_config=generation_config)
        (tmp / MTP_WEIGHTS).parent.mkdir(exist_ok=True)
        sd = {k: v.to("cpu").contiguous() for k, v in heads_sd.items()}
        save_file(sd, str(tmp / MTP_WEIGHTS), metadata={"format": "pt"})
        (tmp / MTP_CONFIG).write_text(json.dumps(meta, indent=2))

    return _atomic(out, "mtp", card, usage, write, [Claim("transformers", ".", "model"), Claim("vllm", ".", "model")])


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

    return _atomic(out, "layerskip", card, usage, write, [])


def export_eagle3(
    model: Any,
    out: Path,
    card: Card,
    *,
    drafting: dict[str, int],
    phrases: PhraseTable | None = None,
) -> Path:
    """An EAGLE-3 drafter in the speculators format (specdec_runtime.drafters.eagle3_format) and SGLang's
    flat layout (sglang/), with its card and, given one, the phrase table (specdec_runtime.drafters.phrases:
    specdec's runtime drafts from it with DIR+lookup; in specdec_phrases/, which serving engines do not
    read). The verifier is the card's target_id; card.target_config gives its architectures and the
    dtype SGLang runs the drafter in (the target's, else bf16: SGLang runs an fp32 drafter in fp16)."""
    from specdec_runtime.drafters.eagle3_format import save_speculators
    from specdec_runtime.engines.sglang import eagle_draft_tokens

    target_config = card.target_config or {}
    dtype = target_config.get("torch_dtype") or target_config.get("dtype")
    get, folder = _fetch(card, out)
    k, tree = drafting["gamma"], drafting["tree_budget"]
    topk, draft_tokens = eagle_draft_tokens(k, tree, drafting["top_k"])
    drafts = f"a tree of {tree} nodes up to {k} deep" if tree else f"chains of {k} tokens"
    lookup, first = (LOOKUP, ", prompt lookup and the phrase table first") if phrases is not None else ("", "")
    serve_dir = (
        f"""

or, as the folder names its target (`speculators_config.verifier`):

```bash
vllm serve {folder}
```"""
        if card.target_id
        else ""
    )
    usage = f"""With specdec's runtime ({drafts}{first}; greedy output identical to the target's):

```bash
{get}specdec generate --target {card.target} --drafter {folder}{lookup} --baseline --prompt "A haiku about the sea."
```

With vLLM, which reads the speculators format:

```bash
vllm serve {card.served} \\
    --speculative-config '{{"model": "{folder}", "num_speculative_tokens": {k}, "method": "eagle3"}}'
```{serve_dir}

With SGLang, from its flat layout in `{folder}/sglang`:

```bash
python -m sglang.launch_server --model-path {card.served} --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path {folder}/sglang --speculative-num-steps {k} \\
    --speculative-eagle-topk {topk} --speculative-num-draft-tokens {draft_tokens}
```"""

    def write(tmp: Path) -> None:
        architectures = target_config.get("architectures") or []
        sglang_dtype = dtype if dtype in ("bfloat16", "float16") else "bfloat16"
        save_speculators(model, tmp, verifier=card.target_id, verifier_architectures=architectures, drafting=drafting,
                         sglang_dtype=sglang_dtype)  # fmt: skip
        if phrases is not None:
            phrases.save(tmp / phrases.FILE)

    claims = [Claim("vllm", ".", "eagle3"), Claim("sglang", "sglang", "eagle3")]
    return _atomic(out, "eagle3", card, usage, write, claims)
