"""The pieces a recipe's training loop calls (the loop itself is written out in each recipe).

    horizon = Horizon(100, max_minutes=5.0, decide_at=10)  # 100 steps, or what fits 5 minutes
    horizon = Horizon(100, until=time.time() + 600)         # or what ends within 10 minutes from now
    optimizer, scheduler = make_optimizer(params, lr=3e-4, weight_decay=0.0, warmup_steps=10, max_steps=horizon)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    horizon.restore(checkpoint_state.get("horizon"))       # a resumed run keeps its cut
    progress = Progress(tracker, start=0, total=horizon, log_every=10, desc="distill", postfix=("loss",), show=True)
    for step in horizon.steps_from(start):
        stats = optimizer_step(accelerator, model, optimizer, scheduler, batches.step(step), loss_fn, max_grad_norm=1.0)
        progress.update(step + 1, stats)                   # the bar, and train/* in the log every log_every steps
        if every(checkpoint_every, step + 1, horizon.steps): save_checkpoint(..., state={"horizon": horizon.state()})
    progress.close()

loss_fn(micro_batch) returns (loss summed over its tokens, token count, {metric: sum over tokens}).
A recipe that runs its own backward (MTP's sequential per-head backward) passes
backward_fn(micro_batch, scale) instead: it backpropagates loss * scale and returns
(loss, {metric: sum over tokens}), detached.
optimizer_step scales every micro-batch so the gradient is that of the mean over all tokens of the
optimizer step, across gradient-accumulation steps and processes (accelerate divides by the
accumulation steps and DDP averages over processes; both are undone here).
"""

import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

LossFn = Callable[[Any], tuple[Tensor, int, dict[str, Tensor]]]
BackwardFn = Callable[[Any, float], tuple[Tensor, dict[str, Tensor]]]


def _neither_none_nor_positive(value: Any) -> bool:
    """A time limit's setting that is wrong: not None and not a positive int or float (a bool is not one)."""
    return value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0)


def minutes_problem(max_minutes: Any) -> str | None:
    """What is wrong with a trainer.max_minutes (a positive number of minutes, or None: no limit)."""
    if _neither_none_nor_positive(max_minutes):
        return f"trainer.max_minutes={max_minutes}: give a positive number of minutes, or null for none"
    return None


def until_problem(until: Any) -> str | None:
    """What is wrong with a trainer.train_until (a Unix time in seconds, or None: no deadline)."""
    if _neither_none_nor_positive(until):
        return f"trainer.train_until={until}: give a Unix time in seconds (e.g. $(( $(date +%s) + 600 ))), or null"
    return None


class Horizon:
    """How many steps a run trains: max_steps, or fewer where a time limit is given and the run's
    first steps say they would not fit it: max_minutes of training (counted from the loop's start)
    and `until`, a Unix time training must end by (a whole job's deadline: the quickstart's). The
    cut is made once, when decide_at - 1 steps are done (the warm-up's: no step already taken had a
    schedule over another horizon), at the rate of the steps since the first (which pays for
    warm-up work), to what fits the nearer limit; it never cuts below decide_at. A checkpoint
    records it (state()), so a resumed run keeps the same steps and schedule. agree(n) -> n: every
    process takes rank 0's decision (a broadcast); print_line: where the decision is told; wall: the Unix
    clock `until` is read against, once."""

    def __init__(
        self,
        max_steps: int,
        max_minutes: float | None = None,
        decide_at: int = 10,
        *,
        until: float | None = None,
        agree: Callable[[int], int] = lambda n: n,
        print_line: Callable[[str], None] = print,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
    ):
        if problem := minutes_problem(max_minutes) or until_problem(until):
            raise ValueError(problem)
        self.configured = self.steps = max_steps
        self.max_minutes, self.decide_at = max_minutes, max(decide_at, 3)
        self.deadline = None if until is None else clock() + (until - wall())  # `until` on self.clock
        self.agree, self.print_line, self.clock = agree, print_line, clock

    def state(self) -> dict[str, Any]:
        """What a checkpoint records: the configured steps and the steps this run takes."""
        return {"max_steps": self.configured, "steps": self.steps}

    def restore(self, saved: dict[str, Any] | None) -> None:
        """A checkpoint's state(): its cut holds while max_steps is the one it was made for (a
        resumed run given another trainer.max_steps takes that, uncut). The decision precedes the
        body of step decide_at - 1, so every checkpoint after it has its cut; one before it holds
        max_steps, and a run resumed from it decides again where it has steps to time first."""
        if saved and saved.get("max_steps") == self.configured:
            self.steps = saved["steps"]

    def steps_from(self, start: int) -> Iterator[int]:
        """The step indices start, start + 1, ... up to the horizon. The cut is decided before step
        decide_at - 1 runs, so that the loop body of every step, the last one included, sees the
        final horizon (its checkpoint, its log line)."""
        limited = self.max_minutes is not None or self.deadline is not None
        timed = limited and start + 2 < self.decide_at  # a decision ahead, steps to time
        step, began, first = start, self.clock() if timed else 0.0, 0.0
        while step < self.steps:
            if timed and step == start + 1:
                first = self.clock()
            if timed and step == self.decide_at - 1:
                now = self.clock()
                self._decide(step, now - began, (now - first) / (step - start - 1))
            yield step
            step += 1

    def _decide(self, done: int, elapsed: float, per_step: float) -> None:
        """After `done` steps that took `elapsed` seconds, the later ones `per_step` each."""
        limits = []  # (seconds left for the steps still to run, the limit in words)
        if self.max_minutes is not None:
            limits.append((60 * self.max_minutes - elapsed, f"trainer.max_minutes={self.max_minutes:g}"))
        if self.deadline is not None:
            left = self.deadline - self.clock()
            limits.append((left, f"trainer.train_until ({max(left, 0) / 60:.1f} min left)"))
        left, limit = min(limits)
        fit = done + int(max(left, 0) / per_step)
        steps = self.agree(min(self.steps, max(fit, done + 1)))
        need = elapsed + (self.steps - done) * per_step
        if steps < self.steps:
            self.print_line(
                f"{limit}: {self.steps} steps would take ~{need / 60:.1f} min "
                f"at {per_step:.2f} s a step here; training {steps} steps (the schedule ends there)"
            )
        else:
            self.print_line(f"{limit}: {self.steps} steps fit (~{need / 60:.1f} min)")
        self.steps = steps


def steps_of(horizon: "int | Horizon") -> int:
    """The steps a run takes now: a count, or a Horizon's (which its cut may lower)."""
    return horizon.steps if isinstance(horizon, Horizon) else horizon


def make_optimizer(
    params: Iterable[Any],
    *,
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    max_steps: "int | Horizon",
    schedule: str = "cosine",
    betas: tuple[float, float] = (0.9, 0.95),
    min_lr_ratio: float = 0.1,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warm-up, then cosine (down to min_lr_ratio * lr), linear or constant.

    params: parameters, or groups {"params": [...], "lr": x, "frozen_steps": n}: a group's own
    peak learning rate, and n first steps at learning rate 0 (its parameters stay unchanged).
    max_steps: the schedule's horizon, or a Horizon (read at every step: it may be cut).
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
        t = min(1.0, (step - warmup_steps) / max(1, steps_of(max_steps) - warmup_steps))
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
    *,
    backward_fn: BackwardFn | None = None,
) -> dict[str, float]:
    """One optimizer step over this process's micro-batches (lists of items with `n_targets`);
    returns token-weighted global means, the token count and tokens/s over all processes."""
    t0 = time.perf_counter()
    local = sum(e.n_targets for mb in micro_batches for e in mb)
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
    out["tokens_per_s"] = total / (time.perf_counter() - t0)  # loss tokens, all processes
    return out


def per_group_rates(stats: dict[str, float], groups: list[str]) -> None:
    """Turn a step's token-normalized sums of per-group metrics ("head1/top1", with the group's
    own "head1/count" of tokens) into means over the group's tokens, in place."""
    for g in groups:
        count = stats.pop(f"{g}/count", 0.0)
        if count:
            for key in [k for k in stats if k.startswith(g + "/")]:
                stats[key] /= count


def every(n: int, done: int, last: int) -> bool:
    """Whether something done every n steps (and at the last) is due after `done` steps."""
    return done % n == 0 or done == last


class Progress:
    """The training progress bar (shown on rank 0) and the metric log: each step's `postfix` stats
    on the bar; all stats (+ `extra`) logged as train/<name> every log_every steps and at the last
    (total: the steps, or a Horizon whose cut the bar follows)."""

    def __init__(
        self,
        tracker: Any,
        *,
        start: int,
        total: "int | Horizon",
        log_every: int,
        desc: str,
        postfix: tuple[str, ...],
        show: bool,
    ):
        self.tracker, self.horizon, self.log_every, self.postfix = tracker, total, log_every, postfix
        self.bar = tqdm(initial=start, total=self.total, desc=desc, unit="step", disable=not show)

    @property
    def total(self) -> int:
        return steps_of(self.horizon)

    def update(self, done: int, stats: dict[str, float], **extra: float) -> None:
        if self.bar.total != self.total:
            self.bar.total = self.total
        self.bar.update(1)
        self.bar.set_postfix({k: f"{stats[k]:.4f}" for k in self.postfix if k in stats})
        if every(self.log_every, done, self.total):
            self.tracker.log({f"train/{k}": v for k, v in (stats | extra).items()}, done)

    def close(self) -> None:
        self.bar.close()


def hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    """Each parameter group's configured settings, which loading a checkpoint would overwrite with
    the old ones: capture them before resuming and put them back with restore_hyperparameters."""
    return [{k: g[k] for k in ("initial_lr", "betas", "weight_decay") if k in g} for g in optimizer.param_groups]


def restore_hyperparameters(optimizer: Any, scheduler: Any, saved: list[dict[str, Any]]) -> None:
    """After a checkpoint restored the optimizer and its schedule: the configured learning rate,
    betas and weight decay again, and the current learning rate that of the (configured) schedule
    at the restored step. With an unchanged config this reproduces the restored values exactly."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate wraps the LambdaLR
    groups = optimizer.param_groups
    if not hasattr(inner, "lr_lambdas") or len(saved) != len(groups) or any("initial_lr" not in s for s in saved):
        return
    for g, s in zip(groups, saved):
        g.update(s)
    inner.base_lrs = [g["initial_lr"] for g in groups]
    for g, base, factor in zip(groups, inner.base_lrs, inner.lr_lambdas):
        g["lr"] = base * factor(inner.last_epoch)
    inner._last_lr = [g["lr"] for g in groups]
