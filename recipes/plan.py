"""dry_run=true: what a run will need, per GPU, from the target's config.json alone (no weights,
no data, nothing written), printed before anything loads.

    python -m recipes.eagle3 experiment=eagle3_llama3_8b dry_run=true
    accelerate launch --config_file conf/accelerate/multi_gpu.yaml -m recipes.eagle3 ... dry_run=true

Memory is counted per rank: the frozen target (whole on every rank), the drafter's weights,
gradients and AdamW state (fp32 master weights under bf16 autocast: 16 bytes a parameter), the
activations the training-time test keeps for its backward at trainer.micro_batch x
trainer.max_seq_len, and the target's pass that computes the states it reads. The activations are
counted tensor by tensor from train/eagle3.py's forward (tests/train/test_plan.py holds the count
to the bytes autograd saves on a small configuration). Disk: the hidden-state store, at most
max_seq_len tokens an example.
"""

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

KEEP = "(raise trainer.grad_accum to keep the batch)"
DEFAULT_GPU_GIB = 80.0  # the budget where this machine has no GPU to ask (an H100's)
GIB = 2**30


@dataclass
class Plan:
    """A run's needs per rank: (what, bytes, how it was counted), the store's disk, the steps."""

    memory: list[tuple[str, float, str]] = field(default_factory=list)
    disk_bytes: float = 0.0
    steps: int = 0
    budget_gib: float = DEFAULT_GPU_GIB
    budget_from: str = ""
    advice: list[str] = field(default_factory=list)

    @property
    def peak_gib(self) -> float:
        return sum(b for _, b, _ in self.memory) / GIB

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.budget_gib

    def render(self) -> str:
        width = max(len(w) for w, _, _ in self.memory)
        lines = [f"{what:<{width}}  {b / GIB:8.2f} GiB  {how}" for what, b, how in self.memory]
        budget = f"of {self.budget_gib:.0f} ({self.budget_from})"
        lines.append(f"{'peak per GPU':<{width}}  {self.peak_gib:8.2f} GiB  {budget}")
        lines.append(f"{'state store (disk)':<{width}}  {self.disk_bytes / 1e9:8.1f} GB   at most, all ranks together")
        lines.append(f"{'optimizer steps':<{width}}  {self.steps:8d}")
        lines.append("fits" if self.fits else "does NOT fit: " + "; ".join(self.advice))
        return "\n".join(lines)


def gpu_budget(cfg: DictConfig) -> tuple[float, str]:
    """GiB a rank may use: plan.gpu_memory_gib, else this machine's GPU, else DEFAULT_GPU_GIB."""
    if cfg.plan.gpu_memory_gib:
        return float(cfg.plan.gpu_memory_gib), "plan.gpu_memory_gib"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GIB, props.name
    return DEFAULT_GPU_GIB, f"no GPU here: {DEFAULT_GPU_GIB:.0f} GiB assumed, plan.gpu_memory_gib=N to change it"


def autocast_half(trainer: DictConfig) -> bool:
    """Whether trainer.mixed_precision runs the products in half precision (on a GPU: auto does)."""
    return trainer.mixed_precision in ("bf16", "fp16", "auto", "fast")


def dtype_bytes(name: str) -> int:
    """Bytes of an element of model.dtype: auto runs a GPU's target in bf16."""
    return 4 if name in ("float32", "fp32") else 2


def attention_shape(hf: Any) -> tuple[int, int, int, int]:
    """(hidden size, query heads, key/value heads, head dim) of a transformers config."""
    H, heads = hf.hidden_size, hf.num_attention_heads
    return H, heads, getattr(hf, "num_key_value_heads", None) or heads, getattr(hf, "head_dim", None) or H // heads


def decoder_layer_params(hf: Any) -> int:
    """Parameters of one decoder layer of a Llama-family model (Qwen3's q/k norms included)."""
    H, heads, kv, D = attention_shape(hf)
    norms = 2 * D if getattr(hf, "model_type", "") == "qwen3" else 0
    return H * (heads + 2 * kv) * D + heads * D * H + 3 * H * hf.intermediate_size + 2 * H + norms


def decoder_params(hf: Any) -> int:
    """Parameters of a Llama-family decoder from its transformers config."""
    H, V = hf.hidden_size, hf.vocab_size
    embeddings = V * H * (1 if getattr(hf, "tie_word_embeddings", False) else 2)
    return embeddings + hf.num_hidden_layers * decoder_layer_params(hf) + H


def eagle3_drafter_params(hf: Any, draft_vocab: int) -> int:
    """The EAGLE-3 drafter's trained parameters: fc (3H -> H), one layer reading 2H, the final
    norm, the lm_head over the draft vocabulary (the embedding is the target's, frozen)."""
    H, heads, kv, D = attention_shape(hf)
    layer = 2 * H * (heads + 2 * kv) * D + heads * D * H + 3 * H * hf.intermediate_size + 3 * H
    return 3 * H * H + layer + H + H * draft_vocab


def ttt_activation_bytes(
    hf: Any,
    B: int,
    T: int,
    steps: int,
    draft_vocab: int,
    half: bool,
    pack_tokens: int = 0,
    checkpoint_steps: bool = False,
) -> dict[str, float]:
    """Bytes the training-time test keeps for its backward (train/eagle3.Eagle3Training.forward),
    every position counted as a response token in the draft vocabulary (the most there can be).
    half: under bf16 autocast (products in bf16, norms and log-probabilities in fp32); pack_tokens:
    the B x T tokens packed into rows of that many (the attention runs a document per row, at most
    B x T of them: no more than unpadded, counted as that); checkpoint_steps: each
    step's layer keeps only its inputs and keys and is recomputed, one at a time, in the backward."""
    H, heads, kv, D = attention_shape(hf)
    I = hf.intermediate_size  # noqa: E741
    p = 2 if half else 4  # a product's output
    rows = B * T
    # the additive mask, made once, shared by the batch; packed, one a group of documents whose
    # longest shrink by 2/3 or more from group to group: at most 1 / (1 - 4/9) = 1.8 times as much
    mask = T * steps * T * p * (1.8 if pack_tokens else 1)
    # inside a step's layer: q, the keys and values of steps 0..k repeated to every head, a
    # log-sum-exp per head; the MLP's gate, up, activation and product, the norms' inputs and
    # outputs, the residual sums and the attention's output
    attention = [rows * heads * (D * p * (1 + 2 * (k + 1)) + 4) for k in range(steps)]
    if half:
        layer = rows * (7 * I * 2 + 2 * H * 4 + 5 * H * 2 + heads * D * 2)
        head = rows * (H * 4 + 2 * H * 2)  # the head's input, normalized, at the rows with a loss
    else:
        layer = rows * (5 * I * 4 + 6 * H * 4 + heads * D * 4)
        head = rows * 3 * H * 4
    if checkpoint_steps:  # the inputs (embeddings, feature) and the keys and values each step keeps
        kept_attention, kept_layers = 0, steps * rows * (2 * H * p + 2 * kv * D * p)
        recomputed = max(a + layer for a in attention)
    else:
        kept_attention, kept_layers, recomputed = sum(attention), steps * layer, 0
    # autocast's bf16 copies of the products' weights, once (a checkpointed layer's are made again)
    cast = 3 * H * H + H * draft_vocab if checkpoint_steps else eagle3_drafter_params(hf, draft_vocab)
    weights = 2 * cast if half else 0
    # (the target's log-probabilities [B*T, N] are held through the forward, not saved for the backward)
    return {
        "attention": mask + kept_attention,
        "rows": kept_layers + steps * head + rows * 3 * H * p + weights,  # + the taps fc reads
        "recomputed": recomputed,  # one step's layer at a time, in the backward
        "logits": steps * rows * draft_vocab * (2 * 4),  # the drafter's log-probabilities, exp(the target's)
        "target_logp": rows * draft_vocab * 4.0,
    }


def eagle3_plan(cfg: DictConfig, hf: Any) -> Plan:
    """The plan of recipes/eagle3.py's run under cfg (see the module docstring)."""
    trainer, eagle3 = cfg.trainer, cfg.eagle3
    B, T, steps, N = trainer.micro_batch, trainer.max_seq_len, eagle3.ttt_steps, eagle3.draft_vocab_size
    t_bytes = dtype_bytes(cfg.model.dtype)
    half = autocast_half(trainer)
    plan = _start(cfg, hf, whole_target=not cfg.model.get("shard"))
    if cfg.model.get("shard"):
        params, layer = decoder_params(hf), decoder_layer_params(hf)
        world = int(cfg.plan.get("processes") or os.environ.get("WORLD_SIZE", 1))
        whole = params - hf.num_hidden_layers * layer  # embeddings, final norm, lm_head
        kept = whole + hf.num_hidden_layers * layer / world + layer  # + the layer gathered in the forward
        how = f"{params / 1e9:.2f} B parameters x {t_bytes} B, layers split across {world} processes (model.shard)"
        plan.memory.append(("target (frozen, layers split)", kept * t_bytes, how))
    _trained(plan, "drafter + grads + AdamW", eagle3_drafter_params(hf, N))
    pack, ckpt = eagle3.pack_tokens, eagle3.checkpoint_steps
    act = ttt_activation_bytes(hf, B, T, steps, N, half, pack_tokens=pack, checkpoint_steps=ckpt)
    how = f"micro_batch {B} x max_seq_len {T}, {steps} unrolled steps"
    rows = f"packed in rows of {pack}, a mask per group of lengths" if pack else "one mask (max_seq_len^2 x steps)"
    plan.memory.append(("activations: attention", act["attention"], f"{how}; {rows}"))
    plan.memory.append(("activations: logits", act["logits"] + act["target_logp"], f"draft vocabulary {N}"))
    kept = "each step's inputs and keys (eagle3.checkpoint_steps)" if ckpt else "norms, projections, MLP"
    plan.memory.append(("activations: layer rows", act["rows"], kept))
    if ckpt:
        plan.memory.append(("a step recomputed", act["recomputed"], "in the backward, one step's layer at a time"))
    states = (hf.num_hidden_layers + 1) * B * T * hf.hidden_size * t_bytes
    where = "once per example into the store" if eagle3.cache_hidden else "every step"
    how = f"every layer's output at once (output_hidden_states), {where}"
    plan.memory.append(("target's states pass", states, how))
    examples = (cfg.data.max_samples or 0) * max(1, cfg.responses.samples_per_prompt)
    if eagle3.cache_hidden:
        plan.disk_bytes = examples * T * (len(eagle3.aux_layers or (0, 0, 0)) + 1) * hf.hidden_size * t_bytes
    advice = {
        "target (frozen, whole)": "the target does not fit one GPU: model.shard=true (its layers split "
        "across the processes), or model.dtype=bfloat16",
        "activations: attention": f"lower trainer.max_seq_len or trainer.micro_batch {KEEP}",
        "activations: layer rows": "eagle3.checkpoint_steps=true, or lower trainer.micro_batch " + KEEP,
        "activations: logits": f"lower trainer.micro_batch {KEEP} or eagle3.draft_vocab_size",
    }
    _advise(plan, advice, otherwise=f"lower trainer.micro_batch {KEEP}")
    if eagle3.cache_hidden and not examples:
        plan.advice.append("the store's disk is counted from data.max_samples: set it to see the figure")
    return plan


def decoder_activation_bytes(hf: Any, rows: int, half: bool, layers: int | None = None) -> float:
    """Bytes a transformers Llama-family decoder's layers keep for the backward over `rows` tokens
    when gradients flow through them (SDPA's fused kernels keep a log-sum-exp per head, no [T, T]
    matrix; sequences counted unpadded): per layer and row, the MLP's gate, up, activation and
    product, the norms' inputs and outputs, the residual sums, q, k, v and the attention's output;
    under bf16 autocast also the products' bf16 weight copies (tests/train/test_plan.py holds it to
    what autograd saves)."""
    H, heads, kv, D = attention_shape(hf)
    I = hf.intermediate_size  # noqa: E741
    L = hf.num_hidden_layers if layers is None else layers
    if half:
        per_row = (4 * I + 4 * H + 2 * kv * D + heads * D) * 2 + 5 * H * 4 + (heads + 2) * 4
        return L * (rows * per_row + 2 * (decoder_layer_params(hf) - 2 * H))
    return L * rows * ((4 * I + 7 * H + 2 * kv * D + heads * D) * 4 + (heads + 2) * 4)


def _start(cfg: DictConfig, hf: Any, whole_target: bool = True) -> Plan:
    """A plan with its budget and steps, and the frozen target whole on every GPU."""
    budget, source = gpu_budget(cfg)
    trainer = cfg.get("trainer")
    plan = Plan(budget_gib=budget, budget_from=source, steps=int(trainer.max_steps) if trainer else 0)
    if whole_target:
        params, t_bytes = decoder_params(hf), dtype_bytes(cfg.model.dtype)
        plan.memory.append(
            ("target (frozen, whole)", params * t_bytes, f"{params / 1e9:.2f} B parameters x {t_bytes} B")
        )
    return plan


def _trained(plan: Plan, what: str, params: float) -> None:
    plan.memory.append((what, 16 * params, f"{params / 1e6:.0f} M parameters x 16 B (fp32 master, grad, 2 moments)"))


def _advise(plan: Plan, advice: dict[str, str] | None = None, otherwise: str | None = None) -> Plan:
    """Where the plan does not fit, the setting to change for its largest line: `advice` by the
    line's name (and `otherwise`) where the recipe gives them, else what fits every recipe."""
    if plan.fits:
        return plan
    largest = max(plan.memory, key=lambda m: m[1])[0]
    if advice is not None:
        plan.advice.append(advice.get(largest, otherwise))
    elif largest.startswith("target"):
        plan.advice.append("the target does not fit one GPU: a larger GPU, or model.dtype=bfloat16")
    elif largest.startswith("heads + grads"):
        plan.advice.append("medusa.share_lm_head=true (the heads read the target's lm_head) or fewer heads")
    else:
        plan.advice.append(f"lower trainer.micro_batch or trainer.max_seq_len {KEEP}")
    return plan


def distill_plan(cfg: DictConfig, hf: Any, drafter_hf: Any) -> Plan:
    """recipes.distill: the frozen target, the stand-alone drafter (drafter_hf: its config) trained
    whole, its activations at micro_batch x max_seq_len, and the logits of both at every position
    (the most response tokens there can be) in fp32, with the divergence's [tokens, vocabulary]
    intermediates."""
    trainer, half = cfg.trainer, autocast_half(cfg.trainer)
    rows, V = trainer.micro_batch * trainer.max_seq_len, drafter_hf.vocab_size
    N = cfg.drafter.draft_vocab_size or V
    plan = _start(cfg, hf)
    H = drafter_hf.hidden_size
    head = H * N + (0 if getattr(drafter_hf, "tie_word_embeddings", False) and N == V else H * V)
    _trained(
        plan, "drafter + grads + AdamW", drafter_hf.num_hidden_layers * decoder_layer_params(drafter_hf) + head + H
    )
    act = decoder_activation_bytes(drafter_hf, rows, half)
    plan.memory.append(("activations: drafter layers", act, f"micro_batch x max_seq_len = {rows} tokens"))
    logits = rows * (DISTILL_LOGITS * N + V) * 4
    plan.memory.append(("activations: logits", logits, f"both models' over {N} / {V} tokens, fp32"))
    return _advise(plan)


# [tokens, N] fp32 tensors the divergence keeps for its backward (the student's logits, log-q,
# q, log-m and the teacher's terms), held to autograd by tests/train/test_plan.py
DISTILL_LOGITS = 5


def medusa_plan(cfg: DictConfig, hf: Any) -> Plan:
    """recipes.medusa: the target (frozen, or LoRA-adapted under Medusa-2 with its activations),
    the heads (a residual block each, and a vocabulary projection unless share_lm_head), and each
    head's fp32 logits at every position."""
    trainer, medusa = cfg.trainer, cfg.medusa
    half = autocast_half(trainer)
    rows, H, V = trainer.micro_batch * trainer.max_seq_len, hf.hidden_size, hf.vocab_size
    plan = _start(cfg, hf)
    per_head = medusa.num_layers * (H * H + H) + (0 if medusa.share_lm_head else H * V)
    _trained(plan, "heads + grads + AdamW", medusa.num_heads * per_head)
    heads = medusa.num_heads * rows * (3 * medusa.num_layers * H + V) * 4  # a block's rows, then the logits
    plan.memory.append(("activations: heads", heads, f"{medusa.num_heads} heads x {rows} tokens, logits in fp32"))
    if medusa.mode == "medusa2":
        if cfg.medusa2.target == "lora":
            r, mods = cfg.medusa2.lora.r, len(cfg.medusa2.lora.target_modules)
            _trained(plan, "LoRA + grads + AdamW", hf.num_hidden_layers * mods * r * 2 * H)
        else:
            _trained(plan, "target + grads + AdamW", decoder_params(hf))
        act = decoder_activation_bytes(hf, rows, half)
        plan.memory.append(("activations: target layers", act, "Medusa-2 trains through the target"))
        plan.memory.append(("activations: KL", rows * 3 * V * 4.0, "the original and adapted logits, fp32"))
    return _advise(plan)


def mtp_plan(cfg: DictConfig, hf: Any) -> Plan:
    """recipes.mtp: the model (pretrained from scratch in the shape mtp.architecture gives, or
    model.name with heads) trained whole, the trunk's activations and one head's at a time
    (mtp.backward=sequential; naive keeps every head's)."""
    trainer, mtp = cfg.trainer, cfg.mtp
    half = autocast_half(trainer)
    if mtp.init == "scratch":  # the model's last layer is head 0; heads 1.. are layers beside it
        a = mtp.architecture
        shape = dict(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                     num_attention_heads=a.num_attention_heads, num_key_value_heads=a.num_key_value_heads,
                     num_hidden_layers=a.trunk_layers + 1, vocab_size=hf.vocab_size,
                     tie_word_embeddings=a.tie_word_embeddings)  # fmt: skip
        model = type(hf)(**shape)
    else:
        model = hf
    trunk, rows = model.num_hidden_layers - 1, trainer.micro_batch * trainer.max_seq_len
    plan = _start(cfg, hf, whole_target=False)
    params = decoder_params(model) + (mtp.num_heads - 1) * decoder_layer_params(model)
    _trained(plan, "model + heads + grads + AdamW", params)
    plan.memory.append(("activations: trunk", decoder_activation_bytes(model, rows, half, trunk), f"{trunk} layers"))
    heads = 1 if mtp.backward == "sequential" else mtp.num_heads
    per_head = decoder_activation_bytes(model, rows, half, 1) + rows * 2 * model.vocab_size * 4
    plan.memory.append(("activations: heads", heads * per_head, f"{heads} head(s) at a time, logits in fp32"))
    return _advise(plan)


def layerskip_plan(cfg: DictConfig, hf: Any) -> Plan:
    """recipes.layerskip: nothing trains; the target whole and the KV cache of its calibration and
    validation decoding."""
    plan = _start(cfg, hf)
    _, _, kv, D = attention_shape(hf)
    tokens = 4096  # calibration and validation decode a prompt and a few hundred tokens at most
    cache = 2 * hf.num_hidden_layers * kv * D * tokens * dtype_bytes(cfg.model.dtype)
    plan.memory.append(("KV cache", cache, f"{tokens} positions"))
    return _advise(plan)


def dry_run(cfg: DictConfig, recipe: str, make: Any) -> dict[str, Plan]:
    """A recipe's dry run: make(config.json) -> its Plan, printed; nothing loads."""
    from specdec_runtime.loading import load_hf_config
    from specdec_runtime.paths import config_folder

    plan = make(load_hf_config(config_folder(cfg.model.name)))
    print(f"dry run: recipes.{recipe} on {cfg.model.name}, per GPU\n{plan.render()}")
    return {"plan": plan}


def drafter_config(cfg: DictConfig, hf: Any) -> Any:
    """The config of recipes.distill's drafter (drafter.source): the target's first layers, a small
    Llama of the given shape, or a pretrained model's config.json."""
    from transformers import LlamaConfig

    from specdec_runtime.loading import load_hf_config
    from specdec_runtime.paths import config_folder

    d = cfg.drafter
    if d.source == "target_layers":
        return type(hf)(**{**hf.to_dict(), "num_hidden_layers": d.num_layers})
    if d.source == "config":
        return LlamaConfig(vocab_size=hf.vocab_size, hidden_size=d.hidden_size, num_hidden_layers=d.num_layers,
                           intermediate_size=d.intermediate_size, num_attention_heads=d.num_heads,
                           num_key_value_heads=d.num_kv_heads, tie_word_embeddings=True)  # fmt: skip
    return load_hf_config(config_folder(d.name))
