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

from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

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


def dtype_bytes(name: str) -> int:
    """Bytes of an element of model.dtype: auto runs a GPU's target in bf16."""
    return 4 if name in ("float32", "fp32") else 2


def attention_shape(hf: Any) -> tuple[int, int, int, int]:
    """(hidden size, query heads, key/value heads, head dim) of a transformers config."""
    H, heads = hf.hidden_size, hf.num_attention_heads
    return H, heads, getattr(hf, "num_key_value_heads", None) or heads, getattr(hf, "head_dim", None) or H // heads


def decoder_params(hf: Any) -> int:
    """Parameters of a Llama-family decoder from its transformers config."""
    H, heads, kv, D = attention_shape(hf)
    L, V = hf.num_hidden_layers, hf.vocab_size
    layer = H * (heads + 2 * kv) * D + heads * D * H + 3 * H * hf.intermediate_size + 2 * H
    return V * H * (1 if getattr(hf, "tie_word_embeddings", False) else 2) + L * layer + H


def eagle3_drafter_params(hf: Any, draft_vocab: int) -> int:
    """The EAGLE-3 drafter's trained parameters: fc (3H -> H), one layer reading 2H, the final
    norm, the lm_head over the draft vocabulary (the embedding is the target's, frozen)."""
    H, heads, kv, D = attention_shape(hf)
    layer = 2 * H * (heads + 2 * kv) * D + heads * D * H + 3 * H * hf.intermediate_size + 3 * H
    return 3 * H * H + layer + H + H * draft_vocab


def ttt_activation_bytes(hf: Any, B: int, T: int, steps: int, draft_vocab: int, half: bool) -> dict[str, float]:
    """Bytes the training-time test keeps for its backward (train/eagle3.Eagle3Training.forward),
    every position counted as a response token in the draft vocabulary (the most there can be).
    half: under bf16 autocast (products in bf16, softmax and log-probabilities in fp32)."""
    H, heads, _, D = attention_shape(hf)
    I = hf.intermediate_size  # noqa: E741
    p = 2 if half else 4  # a product's output
    attention = 0.0
    rows = 0.0
    for k in range(steps):
        keys = T + k  # step k's row sees T causal keys and one more per earlier step
        attention += B * heads * T * keys * (4 + (2 if half else 0))  # the softmax's fp32 output (+ its bf16 cast)
        # per row, fp32: the norms' inputs and outputs (the embedding's, the feature's, after
        # attention, the final one); in the products' dtype: the 2H input, q, keys and values
        # repeated to every head, the attention's output, the MLP's input, gate, up, their
        # activation and product, the head's input
        rows += B * T * (4 * 7 * H + p * (4 * H + 4 * heads * D + 4 * I))
        rows += B * T * p * 2 * heads * D * k  # the earlier steps' own key and value, repeated to every head
    logits = steps * B * T * draft_vocab * (2 * 4)  # the drafter's log-probabilities, exp(the target's)
    fc = B * T * 3 * H * p  # the taps fc reads
    # (the target's log-probabilities [B*T, N] are held through the forward, not saved for the backward)
    return {"attention": attention, "rows": rows + fc, "logits": logits, "target_logp": B * T * draft_vocab * 4.0}


def eagle3_plan(cfg: DictConfig, hf: Any) -> Plan:
    """The plan of recipes/eagle3.py's run under cfg (see the module docstring)."""
    trainer, eagle3 = cfg.trainer, cfg.eagle3
    B, T, steps, N = trainer.micro_batch, trainer.max_seq_len, eagle3.ttt_steps, eagle3.draft_vocab_size
    t_bytes = dtype_bytes(cfg.model.dtype)
    half = trainer.mixed_precision in ("bf16", "fp16", "auto", "fast")
    budget, source = gpu_budget(cfg)
    plan = Plan(budget_gib=budget, budget_from=source, steps=int(trainer.max_steps))
    params = decoder_params(hf)
    plan.memory.append(("target (frozen, whole)", params * t_bytes, f"{params / 1e9:.2f} B parameters x {t_bytes} B"))
    P = eagle3_drafter_params(hf, N)
    how = f"{P / 1e6:.0f} M parameters x 16 B (fp32 master, grad, 2 moments)"
    plan.memory.append(("drafter + grads + AdamW", 16 * P, how))
    act = ttt_activation_bytes(hf, B, T, steps, N, half)
    how = f"micro_batch {B} x max_seq_len {T}, {steps} unrolled steps"
    plan.memory.append(("activations: attention", act["attention"], how + " (grows with max_seq_len^2)"))
    plan.memory.append(("activations: logits", act["logits"] + act["target_logp"], f"draft vocabulary {N}"))
    plan.memory.append(("activations: layer rows", act["rows"], "norms, projections, MLP"))
    states = (hf.num_hidden_layers + 1) * B * T * hf.hidden_size * t_bytes
    where = "once per example into the store" if eagle3.cache_hidden else "every step"
    how = f"every layer's output at once (output_hidden_states), {where}"
    plan.memory.append(("target's states pass", states, how))
    examples = (cfg.data.max_samples or 0) * max(1, cfg.responses.samples_per_prompt)
    if eagle3.cache_hidden:
        plan.disk_bytes = examples * T * (len(eagle3.aux_layers or (0, 0, 0)) + 1) * hf.hidden_size * t_bytes
    if not plan.fits:
        largest = max(plan.memory, key=lambda m: m[1])[0]
        keep = "(raise trainer.grad_accum to keep the batch)"
        advice = {
            "target (frozen, whole)": "the target does not fit one GPU: a larger GPU, or model.dtype=bfloat16",
            "activations: attention": f"lower trainer.max_seq_len or trainer.micro_batch {keep}",
            "activations: logits": f"lower trainer.micro_batch {keep} or eagle3.draft_vocab_size",
        }
        plan.advice.append(advice.get(largest, f"lower trainer.micro_batch {keep}"))
    if eagle3.cache_hidden and not examples:
        plan.advice.append("the store's disk is counted from data.max_samples: set it to see the figure")
    return plan
