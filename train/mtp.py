"""Multi-token prediction (Gloeckle et al. 2024): a shared trunk, n heads of one transformer layer
each, one final norm and vocabulary projection shared by all heads.

    model = MTPModel.from_config(llama_config, num_heads=4)     # from scratch: trunk = layers - 1
    model = MTPModel.attach(pretrained_lm, num_heads=4)         # heads 1.. start as copies of its last layer
    loss, metrics = mtp_step(model, ids, weights=[1, 1, 1, 1], scale=s, backward=accelerator.backward)
    model.lm.save_pretrained(...)      # trunk + head 0 is a plain transformers causal LM
    model.heads                        # heads 1..n-1: the same decoder layer type

Positions: a packed sequence of S tokens trains every head on positions t = 0..S-n-1, where head i
predicts ids[t + 1 + i], so each head sees the same S - n positions and per-head means compare.

Sequential backward (Gloeckle et al., section 2): the trunk runs once, its output z is detached
into a leaf that requires grad, and each head in turn runs forward, loss and backward (adding
into the leaf's gradient) and frees its logits; one last backward takes the accumulated gradient
through the trunk. Peak memory holds one head's [B, S, V] logits instead of n. The gradients are
those of the summed loss (tests/train/test_mtp.py).

Processes: the step never runs through DDP's forward, so DDP's reducer never fires (it would
fire once per head); `average_gradients` reduces every gradient once when the step is complete.
"""

import copy
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TRAINABLE = ("all", "heads", "new_heads")


class MTPModel(nn.Module):
    """A transformers causal LM whose last layer is head 0 (`lm`), plus heads 1..n-1 (`heads`)."""

    def __init__(self, lm: Any, heads: Iterable[nn.Module]):
        super().__init__()
        self.lm = lm
        self.heads = nn.ModuleList(heads)

    @property
    def num_heads(self) -> int:
        return 1 + len(self.heads)

    @property
    def trunk_layers(self) -> int:
        return len(self.lm.model.layers) - 1

    @classmethod
    def from_config(cls, config: Any, num_heads: int) -> "MTPModel":
        """Random init from a transformers config whose num_hidden_layers counts trunk + head 0.

        The model is built with trunk + n layers (transformers' own init for all of them) and the
        last n - 1 become the extra heads."""
        from transformers import AutoModelForCausalLM

        layers = config.num_hidden_layers
        cfg = config.__class__.from_dict(config.to_dict())
        cfg.num_hidden_layers = layers + num_heads - 1
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = [cfg.layer_types[0]] * cfg.num_hidden_layers
        lm = AutoModelForCausalLM.from_config(cfg)
        extra = list(lm.model.layers[layers:])
        lm.model.layers = lm.model.layers[:layers]
        lm.config.num_hidden_layers = layers
        if getattr(lm.config, "layer_types", None):
            lm.config.layer_types = lm.config.layer_types[:layers]
        return cls(lm, extra)

    @classmethod
    def attach(cls, lm: Any, num_heads: int) -> "MTPModel":
        """Heads on a pretrained causal LM: its last layer is head 0, heads 1.. start as copies of it."""
        last = lm.model.layers[-1]
        return cls(lm, [copy.deepcopy(last) for _ in range(num_heads - 1)])

    def set_trainable(self, which: str) -> None:
        """all | heads (the n head layers; trunk, embeddings, norm and vocabulary projection frozen)
        | new_heads (heads 1..n-1 only: the pretrained model itself stays exactly as it was)."""
        if which not in TRAINABLE:
            raise ValueError(f"trainable='{which}': use one of {', '.join(TRAINABLE)}")
        self.requires_grad_(which == "all")
        self.heads.requires_grad_(True)
        if which == "heads":
            self.lm.model.layers[-1].requires_grad_(True)

    def head_layer(self, i: int) -> nn.Module:
        return self.lm.model.layers[-1] if i == 0 else self.heads[i - 1]

    def trunk(self, input_ids: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """The trunk's output z [B, S, H] and what every head layer needs besides it (rope, mask)."""
        from transformers.masking_utils import create_causal_mask

        m = self.lm.model
        x = m.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        mask = create_causal_mask(
            config=self.lm.config, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=pos
        )
        ctx = {"attention_mask": mask, "position_ids": pos, "position_embeddings": m.rotary_emb(x, position_ids=pos)}
        for layer in m.layers[:-1]:
            x = layer(x, **ctx)
        return x, ctx

    def head_logits(self, i: int, z: Tensor, ctx: dict[str, Any], keep: int) -> Tensor:
        """Head i's logits [B, keep, V] at the first `keep` positions."""
        h = self.head_layer(i)(z, **ctx)
        return self.lm.lm_head(self.lm.model.norm(h[:, :keep]))

    def forward(self, input_ids: Tensor) -> list[Tensor]:
        """Every head's logits [B, S - n, V] (the naive way: all of them alive at once)."""
        z, ctx = self.trunk(input_ids)
        keep = input_ids.shape[1] - self.num_heads
        return [self.head_logits(i, z, ctx, keep) for i in range(self.num_heads)]


def head_loss(logits: Tensor, input_ids: Tensor, i: int) -> tuple[Tensor, Tensor]:
    """(summed cross-entropy, correct top-1 count) of head i's logits [B, K, V] against ids[t + 1 + i]."""
    K = logits.shape[1]
    labels = input_ids[:, 1 + i : 1 + i + K]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    correct = (logits.detach().argmax(-1) == labels).sum()
    return loss, correct


def _record(metrics: dict[str, Tensor], i: int, loss: Tensor, correct: Tensor) -> None:
    metrics[f"loss_{i}"] = loss.detach().float()
    metrics[f"acc_{i}"] = correct.float()


def mtp_step(
    model: MTPModel,
    input_ids: Tensor,
    *,
    weights: list[float],
    scale: float,
    backward: Callable[[Tensor], None],
    sequential: bool = True,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Forward and backward of sum_i weights[i] * CE_i (summed over tokens) times `scale`.

    backward(loss) is accelerator.backward (gradient accumulation, fp16 loss scaling) or
    Tensor.backward. Returns the weighted loss and per-head loss_i / acc_i sums, detached.
    """
    n = model.num_heads
    keep = input_ids.shape[1] - n
    if keep < 1:
        raise ValueError(f"sequences of {input_ids.shape[1]} tokens are too short for {n} heads")
    metrics: dict[str, Tensor] = {}
    if not sequential:
        with autocast():
            all_logits = model(input_ids)
            total = 0
            for i, logits in enumerate(all_logits):
                loss, correct = head_loss(logits, input_ids, i)
                total = total + weights[i] * loss
                _record(metrics, i, loss, correct)
        if total.requires_grad:
            backward(total * scale)
        return total.detach(), metrics

    with autocast():
        z, ctx = model.trunk(input_ids)
    leaf = z.detach().requires_grad_(z.requires_grad)
    total = torch.zeros((), device=input_ids.device)
    for i in range(n):
        with autocast():
            logits = model.head_logits(i, leaf, ctx, keep)
            loss, correct = head_loss(logits, input_ids, i)
        if loss.requires_grad:  # a frozen head 0 (trainable=new_heads) only reports its loss
            backward(weights[i] * loss * scale)
        del logits  # this head's logits and their graph go before the next head's
        total += weights[i] * loss.detach().float()
        _record(metrics, i, loss, correct)
    if z.requires_grad and leaf.grad is not None:
        z.backward(leaf.grad)  # the trunk, once, with every head's gradient
    return total, metrics


@torch.no_grad()
def average_gradients(params: Iterable[nn.Parameter], world: int, bucket_numel: int = 2**24) -> None:
    """All-reduce (mean over processes) every gradient once, in flat buckets (what DDP would do)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[Tensor] = []

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([g.flatten() for g in bucket])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket.clear()

    for g in sorted(grads, key=lambda g: g.dtype.itemsize):  # one dtype per bucket
        if bucket and (bucket[0].dtype != g.dtype or sum(b.numel() for b in bucket) + g.numel() > bucket_numel):
            flush()
        bucket.append(g)
    flush()


class PackedSequence(NamedTuple):
    """One packed training sequence, as the loop's Batches see it."""

    ids: Tensor  # [S]
    n_targets: int  # positions every head is trained on: S - n


def heads_state_dict(model: MTPModel) -> dict[str, Tensor]:
    """Heads 1..n-1 in the exported layout: heads.{i}.<the decoder layer's own keys>."""
    return {
        f"heads.{i}.{k}": v.detach() for i, layer in enumerate(model.heads, 1) for k, v in layer.state_dict().items()
    }


@torch.no_grad()
def evaluate(
    model: MTPModel, seqs: Tensor, micro_batch: int, autocast: Callable[[], AbstractContextManager] = nullcontext
) -> dict[str, float]:
    """Per-head mean cross-entropy and top-1 accuracy on held-out sequences [N, S] (one head's
    logits alive at a time)."""
    n, device = model.num_heads, next(model.parameters()).device
    sums = torch.zeros(2, n, dtype=torch.float64)
    count = 0
    was_training = model.training
    model.eval()
    for b in range(0, seqs.shape[0], micro_batch):
        ids = seqs[b : b + micro_batch].to(device)
        keep = ids.shape[1] - n
        with autocast():
            z, ctx = model.trunk(ids)
            for i in range(n):
                loss, correct = head_loss(model.head_logits(i, z, ctx, keep), ids, i)
                sums[0, i] += loss.item()
                sums[1, i] += correct.item()
        count += ids.shape[0] * keep
    model.train(was_training)
    means = sums / max(count, 1)
    return {f"{k}_{i}": means[j, i].item() for j, k in enumerate(("loss", "acc")) for i in range(n)}
