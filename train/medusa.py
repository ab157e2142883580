"""Training Medusa heads: the joint module (target + heads), hidden-state caching, calibration.

    model = MedusaTraining(target, heads, decay=0.8)                          # Medusa-1: target frozen
    model = MedusaTraining(peft_target, heads, decay=0.8, target_weight=1.0)  # Medusa-2: + self-distillation
    loss, n, metrics = model(input_ids, attention_mask, target_mask)          # sums over response tokens
    loss, n, metrics = model(input_ids, attention_mask, target_mask, hidden=h)  # Medusa-1 on cached states
    examples = cache_states(target, examples, folder, states=final_hidden, pad_id=2)  # train.hidden_cache
    acc = head_accuracies(model, examples, pad_id=2, top_k=10)                # [heads, 10] -> Tree.from_accuracies

Positions: target_mask[b, t] says ids[b, t + 1] is a response token (the target predicts it at t).
Head k (0-based) at position t predicts ids[t + 2 + k], so it trains where target_mask[b, t + 1 + k].
Loss = heads_weight * sum_k decay^k CE_k + target_weight * KL(original target || adapted target),
every term summed over tokens; the loop divides by the step's response-token count.

Medusa-2's self-distillation teacher is the original target: with LoRA the same model with its
adapters disabled (no second copy), with full fine-tuning a frozen copy kept outside the module's
parameters (so checkpoints and DDP do not carry it).
"""

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec_runtime.drafters.medusa import MedusaHeads
from train.data import Example, collate


def causal_lm(model: Any) -> Any:
    """The transformers causal LM inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class MedusaTraining(nn.Module):
    """The target and its heads as one module whose forward returns the loss, so that DDP, FSDP and
    DeepSpeed see every trained parameter through a single forward call."""

    def __init__(
        self,
        target: Any,
        heads: MedusaHeads,
        *,
        decay: float = 0.8,
        heads_weight: float = 1.0,
        target_weight: float = 0.0,
        full_finetune: bool = False,
    ):
        super().__init__()
        self.heads = heads
        self.decay, self.heads_weight, self.target_weight = decay, heads_weight, target_weight
        self.joint = target_weight > 0  # Medusa-2: gradients flow into the target
        # A frozen target stays outside the module's parameters: checkpoints hold the heads only.
        if self.joint:
            self.target = target
        else:
            self._frozen = [target]
        # Full fine-tuning needs the original target as the teacher; LoRA disables its adapters instead.
        self._original = [copy.deepcopy(causal_lm(target)).eval().requires_grad_(False)] if full_finetune else []

    @property
    def base(self) -> Any:
        """The target (a peft model under Medusa-2 with LoRA)."""
        return self.target if self.joint else self._frozen[0]

    def lm_head(self, x: Tensor) -> Tensor:
        head = causal_lm(self.base).lm_head
        return head(x.to(head.weight.dtype))  # a frozen half-precision head under fp32 heads

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The target's final-norm hidden states [B, T, H] (what the heads read at run time)."""
        with torch.set_grad_enabled(self.joint and torch.is_grad_enabled()):
            return causal_lm(self.base).model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    @torch.no_grad()
    def original_logits(self, input_ids: Tensor, attention_mask: Tensor, rows: Tensor) -> Tensor:
        """The unadapted target's logits [N, V] at flat positions rows [N]."""
        if self._original:
            lm = self._original[0]
            h = lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return lm.lm_head(h.flatten(0, 1)[rows])
        with self.base.disable_adapter():
            h = causal_lm(self.base).model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return self.lm_head(h.flatten(0, 1)[rows])

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, target_mask: Tensor, hidden: Tensor | None = None
    ) -> tuple[Tensor, int, dict[str, Tensor]]:
        """(loss summed over tokens, response tokens, {metric: sum}) for a batch; see the module docstring."""
        if hidden is None:
            hidden = self.hidden_states(input_ids, attention_mask)  # [B, T, H]
        if not self.joint:  # a frozen (possibly half-precision) target feeds fp32 heads
            hidden = hidden.float()
        B, T, H = hidden.shape
        flat = hidden.flatten(0, 1)  # [B*T, H]
        labels = input_ids.flatten()
        mask = F.pad(target_mask, (0, 1))  # [B, T]: mask[b, t] <=> ids[b, t+1] is a response token
        loss = flat.new_zeros((), dtype=torch.float32)
        metrics: dict[str, Tensor] = {}
        for k in range(self.heads.num_heads):
            valid = F.pad(mask[:, 1 + k :], (0, 1 + k))  # [B, T]: ids[b, t+2+k] is a response token
            rows = valid.flatten().nonzero().squeeze(1)  # [N_k]
            if not rows.numel():
                continue
            logits = self.heads.head_logits(k, flat[rows], self.lm_head).float()  # [N_k, V]
            y = labels[rows + 2 + k]
            ce = F.cross_entropy(logits, y, reduction="sum")
            loss = loss + self.heads_weight * self.decay**k * ce
            with torch.no_grad():
                top5 = logits.topk(5, dim=-1).indices  # [N_k, 5]
                hit = top5 == y[:, None]
                metrics |= {
                    f"head{k + 1}/ce": ce.detach(),
                    f"head{k + 1}/top1": hit[:, 0].float().sum(),
                    f"head{k + 1}/top5": hit.any(-1).float().sum(),
                    f"head{k + 1}/count": torch.tensor(float(rows.numel()), device=y.device),
                }
        rows = mask.flatten().nonzero().squeeze(1)  # positions predicting a response token
        if self.joint and rows.numel():
            student = self.lm_head(flat[rows]).float()  # [N, V]
            teacher = self.original_logits(input_ids, attention_mask, rows).float()
            p_log = teacher.log_softmax(-1)
            kl = (p_log.exp() * (p_log - student.log_softmax(-1))).sum()  # KL(original || adapted), summed
            loss = loss + self.target_weight * kl
            metrics["target/kl"] = kl.detach()
            metrics["target/agree"] = (student.argmax(-1) == teacher.argmax(-1)).float().sum()
        return loss, int(rows.numel()), metrics


def _batches(examples: list[Example], size: int) -> list[list[Example]]:
    return [examples[i : i + size] for i in range(0, len(examples), size)]


def final_hidden(target: Any, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
    """The frozen target's final-norm hidden states [B, T, H], what the heads read (train.hidden_cache)."""
    return {"hidden": causal_lm(target).model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state}


@torch.no_grad()
def head_accuracies(
    model: MedusaTraining, examples: list[Example], *, pad_id: int, top_k: int = 10, batch_size: int = 8
) -> Tensor:
    """acc [heads, top_k]: how often head k's rank-r candidate is the right token, over the
    examples' response positions (teacher forcing on the target's own responses)."""
    device = next(model.heads.parameters()).device
    hits = torch.zeros(model.heads.num_heads, top_k, dtype=torch.float64)
    counts = torch.zeros(model.heads.num_heads, dtype=torch.float64)
    for mb in _batches(examples, batch_size):
        batch = {k: v.to(device) for k, v in collate(mb, pad_id).items()}
        hidden = model.hidden_states(batch["input_ids"], batch["attention_mask"]).float()
        mask = F.pad(batch["target_mask"], (0, 1))
        flat, labels = hidden.flatten(0, 1), batch["input_ids"].flatten()
        for k in range(model.heads.num_heads):
            rows = F.pad(mask[:, 1 + k :], (0, 1 + k)).flatten().nonzero().squeeze(1)
            if not rows.numel():
                continue
            cand = model.heads.head_logits(k, flat[rows], model.lm_head).topk(top_k, dim=-1).indices  # [N, top_k]
            hits[k] += (cand == labels[rows + 2 + k][:, None]).double().sum(0).cpu()
            counts[k] += rows.numel()
    return hits / counts.clamp(min=1)[:, None]


@torch.no_grad()
def target_drift(original: Any, adapted: Any, sequences: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """How far Medusa-2 moved the target: on sequences (prompt ids, response ids), teacher-forced,
    the top-1 agreement of the adapted target with the original and the mean KL(original ||
    adapted) per response token (both causal LMs, on the same device)."""
    device = next(adapted.parameters()).device
    agree = kl = tokens = 0.0
    for prompt, response in sequences:
        if not response:
            continue
        ids = torch.tensor([list(prompt) + list(response)], device=device)
        rows = slice(len(prompt) - 1, ids.shape[1] - 1)  # the positions that predict the response
        p = causal_lm(original)(input_ids=ids).logits[0, rows].float().log_softmax(-1)
        q = causal_lm(adapted)(input_ids=ids).logits[0, rows].float().log_softmax(-1)
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        kl += (p.exp() * (p - q)).sum().item()
        tokens += len(response)
    return {"agreement": agree / max(tokens, 1), "kl": kl / max(tokens, 1), "tokens": int(tokens)}
