"""The pieces of a training loop every recipe shares (accelerate does devices and processes).

    accelerator = make_accelerator(mixed_precision="no", grad_accum=2, seed=0, log_with=None, project_dir=out)
    optimizer, scheduler = make_optimizer(params, lr=3e-4, weight_decay=0.0, warmup_steps=10, max_steps=100)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    stats = optimizer_step(accelerator, model, optimizer, scheduler, micro_batches, loss_fn, max_grad_norm=1.0)

loss_fn(micro_batch) returns (loss summed over its tokens, token count, {metric: sum over tokens}).
A recipe that runs its own backward (MTP's sequential per-head backward) passes
backward_fn(micro_batch, scale) instead: it backpropagates loss * scale and returns
(loss, {metric: sum over tokens}), detached.
optimizer_step scales every micro-batch so the gradient is that of the mean over all tokens of the
optimizer step, across gradient-accumulation steps and processes (accelerate divides by the
accumulation steps and DDP averages over processes; both are undone here).
"""

import logging
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

MIXED_PRECISION = ("no", "bf16", "fp16")
LossFn = Callable[[Any], tuple[Tensor, int, dict[str, Tensor]]]
BackwardFn = Callable[[Any, float], tuple[Tensor, dict[str, Tensor]]]


def launcher() -> str:
    """What `accelerate launch` asked for: "deepspeed", "fsdp", or "" (DDP or a plain process)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "deepspeed"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp"
    return ""


def make_accelerator(
    *,
    mixed_precision: str,
    grad_accum: int,
    seed: int,
    log_with: str | None,
    project_dir: str,
    micro_batch: int = 1,
    max_grad_norm: float | None = None,
    cpu: bool | None = None,
) -> Any:
    """An Accelerator for one run; the scheduler is stepped by hand, once per optimizer step.

    cpu=None: CPU when there is no GPU. Then torchrun-style launches (WORLD_SIZE > 1, e.g.
    conf/accelerate/multi_cpu.yaml) form a gloo process group instead of silently running alone,
    and a DeepSpeed launch runs DeepSpeed on its CPU accelerator (gloo). DeepSpeed's own batch
    settings are taken from the trainer's (micro_batch, grad_accum, max_grad_norm), so a launcher
    config can never disagree with the recipe's.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file "saved ..." lines
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"trainer.mixed_precision='{mixed_precision}': use no, bf16 or fp16")
    handlers = []
    if cpu is None:
        cpu = not torch.cuda.is_available()
    if cpu and launcher() == "deepspeed":
        # accelerate's cpu=True would silently turn a DeepSpeed launch into plain DDP: run
        # DeepSpeed on its CPU accelerator over gloo instead.
        cpu = False
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    if launcher() == "deepspeed":
        # accelerate launch exports the config file's values, which the Accelerator prefers to its
        # arguments: the recipe's trainer settings win instead.
        os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(grad_accum)
        os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(float(max_grad_norm or 0.0))
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=grad_accum,
        step_scheduler_with_optimizer=False,
        log_with=log_with,
        project_dir=project_dir,
        cpu=cpu,
        kwargs_handlers=handlers,
    )
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch  # no dataloader is prepared
        if plugin.zero_stage == 3:  # validation and export read whole weights (accelerator.get_state_dict)
            plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    set_seed(seed, device_specific=False)
    return accelerator


def make_optimizer(
    params: Iterable[Any],
    *,
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    max_steps: int,
    schedule: str = "cosine",
    betas: tuple[float, float] = (0.9, 0.95),
    min_lr_ratio: float = 0.1,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warm-up, then cosine (down to min_lr_ratio * lr), linear or constant.

    params: parameters, or groups {"params": [...], "lr": x, "frozen_steps": n}: a group's own
    peak learning rate, and n first steps at learning rate 0 (its parameters stay unchanged).
    """
    if schedule not in ("cosine", "linear", "constant"):
        raise ValueError(f"optim.schedule='{schedule}': use cosine, linear or constant")
    if lr <= 0:
        raise ValueError(f"optim.lr={lr} must be positive")
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)
    frozen = [g.get("frozen_steps", 0) for g in optimizer.param_groups]

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        t = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * t)) if schedule == "cosine" else 1 - t
        return min_lr_ratio + (1 - min_lr_ratio) * shape

    lambdas = [lambda step, n=n: 0.0 if step < n else factor(step) for n in frozen]
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


def optimizer_step(
    accelerator: Any,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    micro_batches: list[Any],
    loss_fn: LossFn | None,
    max_grad_norm: float | None,
    n_tokens: Callable[[Any], int],
    backward_fn: BackwardFn | None = None,
) -> dict[str, float]:
    """One optimizer step over this process's micro-batches; returns token-weighted global means."""
    local = sum(n_tokens(mb) for mb in micro_batches)
    total = accelerator.reduce(torch.tensor(float(local), device=accelerator.device), "sum").item()
    if total == 0:
        raise RuntimeError("this step's batches have no loss tokens: check the data's loss masks")
    # accelerate divides by grad_accum and DDP averages over processes: undo both.
    scale = accelerator.num_processes * accelerator.gradient_accumulation_steps / total
    sums: dict[str, Tensor] = {}
    grad_norm = None
    for mb in micro_batches:
        with accelerator.accumulate(model):
            if backward_fn is not None:
                loss, metrics = backward_fn(mb, scale)
            else:
                loss, _, metrics = loss_fn(mb)
                accelerator.backward(loss * scale)
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0) + v.detach().float()
            if accelerator.sync_gradients and max_grad_norm:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    keys = sorted(sums)
    reduced = accelerator.reduce(torch.stack([sums[k] for k in keys]), "sum") / total
    out = {k: v.item() for k, v in zip(keys, reduced)}  # one host sync for all metrics
    out["tokens"] = total
    out["lr"] = scheduler.get_last_lr()[0]
    if grad_norm is not None:
        out["grad_norm"] = float(grad_norm)
    return out
