"""Config checks: a recipe's bad values stop the run here, with a message, before anything loads;
run_or_exit turns what a run refuses later into the same kind of message and an exit code."""

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from specdec_runtime.errors import SpecdecError
from specdec_runtime.hub import check_push, push_command
from specdec_runtime.paths import hub_id_of
from train.launch import MIXED_PRECISION
from train.loop import (
    minutes_problem,
    until_problem,
)
from train.tracking import KINDS as TRACKING_KINDS


def check_trainer(cfg: DictConfig) -> list[str]:
    """Problems with the keys every training recipe has (trainer, tracking, validate, device)."""
    problems = check_run_settings(cfg)
    if cfg.trainer.mixed_precision not in ("auto", "fast", *MIXED_PRECISION):
        problems.append(f"trainer.mixed_precision='{cfg.trainer.mixed_precision}': use auto, fast, no, bf16 or fp16")
    for key in ("max_steps", "micro_batch", "grad_accum", "max_seq_len", "log_every", "checkpoint_every"):
        if not isinstance(cfg.trainer[key], int) or cfg.trainer[key] < 1:
            problems.append(f"trainer.{key}={cfg.trainer[key]} must be a positive integer")
    if problem := minutes_problem(cfg.trainer.get("max_minutes")):
        problems.append(problem)
    if problem := until_problem(cfg.trainer.get("train_until")):
        problems.append(problem)
    if cfg.validate.max_new_tokens < 1:
        problems.append("validate.max_new_tokens must be >= 1")
    sizes = list(cfg.validate.get("batch_sizes") or [1])
    if not all(isinstance(b, int) and b >= 1 for b in sizes):
        problems.append(f"validate.batch_sizes={sizes}: positive integers, e.g. [1, 4, 16]")
    if cfg.device not in ("auto", "cpu"):
        problems.append(f"device='{cfg.device}': use auto (the launcher's GPUs, else CPU) or cpu")
    if cfg.trainer.max_grad_norm is not None and not cfg.trainer.max_grad_norm > 0:
        problems.append(f"trainer.max_grad_norm={cfg.trainer.max_grad_norm} must be positive (or null: no clipping)")
    return problems + check_optim(cfg.optim)


def check_optim(optim: DictConfig) -> list[str]:
    """Problems with cfg.optim (the learning rate and its schedule, AdamW's settings)."""
    problems = []
    if not optim.lr > 0:
        problems.append(f"optim.lr={optim.lr} must be positive")
    if optim.weight_decay < 0 or optim.warmup_steps < 0:
        problems.append(
            f"optim.weight_decay={optim.weight_decay} and optim.warmup_steps={optim.warmup_steps} must be >= 0"
        )
    if optim.schedule not in ("cosine", "linear", "constant"):
        problems.append(f"optim.schedule='{optim.schedule}': use cosine, linear or constant")
    if len(optim.betas) != 2 or not all(0 <= b < 1 for b in optim.betas):
        problems.append(f"optim.betas={list(optim.betas)}: two numbers in [0, 1)")
    if not 0 <= optim.min_lr_ratio <= 1:
        problems.append(f"optim.min_lr_ratio={optim.min_lr_ratio} must be in [0, 1]")
    return problems


def check_run_settings(cfg: DictConfig) -> list[str]:
    """Every recipe's own settings: tracking, and how long a rank waits for the others."""
    problems = []
    if cfg.tracking.kind not in TRACKING_KINDS:
        problems.append(f"tracking.kind='{cfg.tracking.kind}': use tracking=none or tracking=wandb")
    return problems + check_collective_timeout(cfg)


def check_collective_timeout(cfg: DictConfig) -> list[str]:
    """collective_timeout_minutes: how long a rank waits for the others, a positive number."""
    timeout = cfg.collective_timeout_minutes
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        return [f"collective_timeout_minutes={timeout}: a positive number of minutes"]
    return []


ENGINES = ("auto", "runtime", "transformers")  # responses.engine (response_engine)


def check_data(cfg: DictConfig) -> list[str]:
    """Problems with data.max_unusable and data.mix."""
    problems, data = [], cfg.data
    if not 0 <= data.get("max_unusable", 0) <= 1:
        problems.append(f"data.max_unusable={data.max_unusable}: a share of the records, in [0, 1]")
    keys = {"train", "split", "column", "weight"}
    for i, m in enumerate(data.get("mix") or []):
        if not isinstance(m, Mapping) or not m.get("train") or not float(m.get("weight", 1.0)) > 0:
            problems.append(f"data.mix[{i}]={m}: give {{train: SOURCE, weight: > 0}} (split and column optional)")
        elif set(m) - keys:
            problems.append(f"data.mix[{i}] has unknown keys {sorted(set(m) - keys)}")
    return problems


def check_conversations(cfg: DictConfig, sources: tuple[str, ...]) -> list[str]:
    """Problems with the keys of the recipes that train on conversations (+ check_trainer's)."""
    problems = check_trainer(cfg)
    if cfg.responses.source not in sources:
        problems.append(f"responses.source='{cfg.responses.source}': use one of {', '.join(sources)}")
    if cfg.responses.get("engine", "auto") not in ENGINES:
        problems.append(f"responses.engine='{cfg.responses.engine}': use one of {', '.join(ENGINES)}")
    for key in ("max_new_tokens", "batch_size", "samples_per_prompt"):
        if cfg.responses[key] < 1:
            problems.append(f"responses.{key}={cfg.responses[key]} must be >= 1")
    if cfg.responses.source != "dataset" and cfg.responses.max_new_tokens >= cfg.trainer.max_seq_len:
        problems.append(
            f"responses.max_new_tokens={cfg.responses.max_new_tokens} leaves no room for a prompt in "
            f"trainer.max_seq_len={cfg.trainer.max_seq_len}: raise max_seq_len (dry_run=true plans its memory) "
            "or lower max_new_tokens"
        )
    problems += check_data(cfg)
    own = cfg.responses.get("self_prompts", 0)
    if not isinstance(own, int) or own < 0:
        problems.append(f"responses.self_prompts={own} must be a count >= 0")
    elif own and cfg.responses.source == "dataset":
        problems.append(
            f"responses.self_prompts={own} adds prompts the target writes, which have no dataset responses: "
            "use responses.source=target, or self_prompts=0"
        )
    if cfg.responses.samples_per_prompt > 1 and (cfg.responses.temperature <= 0 or cfg.responses.source != "target"):
        problems.append(
            f"responses.samples_per_prompt={cfg.responses.samples_per_prompt} samples the target several times "
            "per prompt: it needs responses.source=target and responses.temperature > 0 (greedy repeats itself)"
        )
    return problems


def check_shard(cfg: DictConfig, recipe: str) -> list[str]:
    """model.shard=true (the frozen target's decoder layers split across the processes): what the
    recipe must do without a whole target on any process."""
    if not cfg.model.get("shard"):
        return []
    if recipe != "eagle3":
        return [f"model.shard=true: recipes.{recipe} keeps a whole target on every process; recipes.eagle3 shards it"]
    if cfg.responses.get("engine", "auto") == "runtime":
        return ["model.shard=true: the runtime decodes with a whole target; use responses.engine=transformers"]
    return []


def refuse(problems: list[str]) -> None:
    if problems:
        raise SpecdecError("invalid config:\n  " + "\n  ".join(problems))


def run_or_exit(run_fn: Callable[[DictConfig], Any], cfg: DictConfig) -> None:
    """A recipe's entry point: a user's mistake (SpecdecError) prints its message and exits 2; so
    does a Hub push that failed after the run (said here, last: what failed and how to retry it)."""
    try:
        result = run_fn(cfg)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if isinstance(result, dict) and result.get("hub_error"):  # said last, after W&B's summary
        print(f"\nerror: the push to {cfg.hub.repo_id} failed: {result['hub_error']}\nThe export and the run's "
              f"results are kept in {Path(result['export']).parent}; push it with:\n  {result['hub_retry']}",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)


def target_hub_id(cfg: DictConfig) -> str | None:
    """The Hub id the exports name the target by (hub_id_of): model.hub_id for a local folder."""
    return hub_id_of(cfg.model.name, cfg.model.get("hub_id"))


def check_target_id(cfg: DictConfig) -> None:
    """model.hub_id, if given, must be a Hub id; a local folder without one is said now, not found
    missing in the export."""
    if target_hub_id(cfg) is None:
        print(f"note: model.name={cfg.model.name} has no Hub id, so the export cannot name its target for vLLM "
              "(`vllm serve DIR`) or FasterDecoding: add model.hub_id=ORG/NAME", file=sys.stderr)  # fmt: skip


def check_hub(cfg: DictConfig) -> None:
    """With hub.repo_id: refuse, before any weights load, a push that cannot work (no token, a
    read-only one, a namespace not the user's); where the Hub cannot be reached, stop unless
    hub.offline_ok (then say that the push is tried at the end, and how to retry it)."""
    hub = cfg.get("hub")
    if not hub or not hub.repo_id:
        return
    check = check_push(hub.repo_id)
    if check.problems:
        raise SpecdecError(f"hub.repo_id={hub.repo_id}: " + "; ".join(check.problems))
    if check.unreachable:
        later = push_command(Path(cfg.output_dir) / "export", hub.repo_id, private=hub.private, revision=hub.revision)
        if not hub.get("offline_ok", False):
            raise SpecdecError(
                f"hub.repo_id={hub.repo_id}: the Hub cannot be reached ({check.unreachable}). Connect, or add "
                f"hub.offline_ok=true to train and export now (the push is tried at the end; `{later}` retries it)"
            )
        print(f"hub: cannot reach the Hub now ({check.unreachable}); training anyway (hub.offline_ok): the push is "
              f"tried at the end, `{later}` retries it", file=sys.stderr)  # fmt: skip
