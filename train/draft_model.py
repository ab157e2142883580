"""The drafter to distill, as a transformers model, and its optional draft vocabulary.

    draft = drafter_from_target_layers(target_hf, num_layers=2)          # target's first K layers
    draft = drafter_from_config(target_hf, hidden_size=256, num_layers=2, init_embeddings=True)
    draft = drafter_from_pretrained("HuggingFaceTB/SmolLM2-135M", target_tokenizer)
    ids = draft_vocab(responses, size=8192, vocab_size=V, always=stop_ids)   # most frequent tokens
    use_draft_vocab(draft, ids)               # lm_head keeps only those rows (untied from the embeddings)
    logits = SelectedLogits(draft)(input_ids, attention_mask, select)  # [N, V'] at chosen positions
    sd = full_state_dict(draft, ids)          # HF layout with a full-size lm_head (rows elsewhere: their mean)

Cost model: a drafter pays only when one of its forwards costs a small fraction of the target's;
for small targets the vocabulary projection (hidden x vocab) is a large share of that cost, which
is what the draft vocabulary cuts. Tokens outside it are never proposed, which keeps verification
lossless (they get draft probability 0) and only costs acceptance when the target wants them.
"""

from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from specdec_runtime.errors import SpecdecError


def _same_special_ids(cfg: Any, target_cfg: Any) -> None:
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(cfg, name, getattr(target_cfg, name, None))


def drafter_from_target_layers(target: Any, num_layers: int) -> Any:
    """The target's embeddings, first num_layers layers, final norm and lm_head, as a new model."""
    from transformers import AutoModelForCausalLM

    n = target.config.num_hidden_layers
    if not 1 <= num_layers < n:
        raise SpecdecError(f"drafter.num_layers={num_layers}: the target has {n} layers, choose 1..{n - 1}")
    cfg = target.config.__class__.from_dict(target.config.to_dict())
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:num_layers]
    model = AutoModelForCausalLM.from_config(cfg, dtype=target.dtype)
    sd = {
        k: v
        for k, v in target.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers
    }
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"copying target layers: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


def pca_embeddings(embed: Tensor, dim: int) -> Tensor:
    """The target's embeddings [V, H] projected on their top `dim` principal directions [V, dim],
    rescaled to the original per-coordinate spread (an initialization for a narrower drafter)."""
    e = embed.float()
    centered = e - e.mean(0)
    _, _, v = torch.pca_lowrank(centered, q=dim, center=False, niter=4)  # v [H, dim]
    out = centered @ v
    return out * (e.std() / out.std())


def drafter_from_config(
    target: Any,
    *,
    hidden_size: int,
    num_layers: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    init_embeddings: bool = True,
    seed: int = 0,
) -> Any:
    """A small random Llama with the target's vocabulary, context and rope; embeddings optionally from
    the target's (copied when the widths match, else their principal components)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise SpecdecError(
            f"drafter: hidden_size {hidden_size} must be a multiple of num_heads {num_heads}, "
            f"and num_heads a multiple of num_kv_heads {num_kv_heads}"
        )
    target_config = target.config
    cfg = LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=target_config.rms_norm_eps,
        rope_parameters=dict(
            getattr(target_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        ),
        tie_word_embeddings=True,
    )
    _same_special_ids(cfg, target_config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=target.dtype)
    if init_embeddings:
        embed = target.get_input_embeddings().weight.detach()
        with torch.no_grad():
            new = embed if embed.shape[1] == hidden_size else pca_embeddings(embed, hidden_size)
            model.get_input_embeddings().weight.copy_(new)
    model.tie_weights()
    return model


def drafter_from_pretrained(name: str, target_tokenizer: Any, dtype: torch.dtype = torch.float32) -> Any:
    """An existing small model; refused unless its tokenizer maps every token to the target's id."""
    from transformers import AutoTokenizer

    from specdec_runtime.loading import load_hf_model
    from specdec_runtime.paths import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(name))
    if tok.get_vocab() != target_tokenizer.get_vocab():
        raise SpecdecError(
            f"drafter '{name}' does not share the target's tokenizer ({len(tok)} vs {len(target_tokenizer)} tokens): "
            "speculative decoding needs identical token ids; use drafter=target_layers or drafter=small_llama"
        )
    return load_hf_model(name, dtype=dtype)


def draft_vocab(sequences: Iterable[Iterable[int]], size: int, vocab_size: int, always: Iterable[int] = ()) -> Tensor:
    """The `size` most frequent token ids in the sequences, with `always` (stop tokens) included; sorted [size].

    Ties and unseen slots are filled in id order, so the result is deterministic.
    """
    if not 0 < size <= vocab_size:
        raise SpecdecError(f"drafter.draft_vocab_size={size} must be in 1..{vocab_size} (0 turns it off)")
    counts = Counter(t for seq in sequences for t in seq)
    chosen = list(dict.fromkeys(list(always) + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]))
    chosen = chosen[:size]
    if len(chosen) < size:
        have = set(chosen)
        chosen += [t for t in range(vocab_size) if t not in have][: size - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def use_draft_vocab(model: Any, ids: Tensor) -> None:
    """Replace the lm_head by one over `ids` only (rows copied from the current head); untie it."""
    old = model.get_output_embeddings().weight.detach()  # [V, H]
    head = nn.Linear(old.shape[1], len(ids), bias=False, dtype=old.dtype, device=old.device)
    with torch.no_grad():
        head.weight.copy_(old[ids.to(old.device)])
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    model.set_output_embeddings(head)


class SelectedLogits(nn.Module):
    """A causal LM that returns logits only at selected positions, so no [B, T, V] tensor exists.

    Wrapping the model (instead of calling its parts) keeps DDP/FSDP/DeepSpeed hooks on the call path.
    """

    def __init__(self, model: Any):
        super().__init__()
        self.model = model
        # FSDP's transformer auto-wrap reads the layer classes from the module it wraps (this one).
        self._no_split_modules = list(getattr(model, "_no_split_modules", None) or [])

    def forward(self, input_ids: Tensor, attention_mask: Tensor, select: Tensor) -> Tensor:
        """Logits [N, V'] at flat positions select [N] of the [B, T] batch."""
        hidden = self.model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
        return self.model.lm_head(hidden.flatten(0, 1)[select])


def full_state_dict(model: Any, vocab_ids: Tensor | None) -> dict[str, Tensor]:
    """The model's HF state dict; with a draft vocabulary, lm_head.weight as a full [V, H] matrix
    (what transformers, vLLM and the runtime load) whose rows outside the vocabulary are the mean of
    the rows inside: their logit is the mean of the vocabulary's, never above its maximum, so no
    loader's argmax drafts outside it (a zero row's 0 would, wherever every logit inside is negative)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if vocab_ids is None:
        return sd
    head = sd["lm_head.weight"]  # [N, H]
    full = head.mean(0, keepdim=True).expand(model.config.vocab_size, -1).clone()  # [V, H]
    full[vocab_ids.to(head.device)] = head
    sd["lm_head.weight"] = full
    return sd
