"""A recipe's run, from its Hydra config to the plain arguments of train/'s pieces, the same way for every
recipe: its start, the pieces of its loop, its end (recipes.checks: the config checks; recipes.data: prompts,
the target's responses and the training examples).

    refuse(check_trainer(cfg) + [...])            # bad values stop here, before anything loads
    run = start(cfg)                              # accelerator, run folder (config.yaml), tokenizer, stop ids
    data = conversations(cfg, run)                # the conversation recipes' train / validation prompts
    target = load_target(cfg, run)                # the HF target, frozen, in model.dtype
    examples, prompts = training_examples(cfg, run, target, data)
    horizon = make_horizon(cfg, run)             # trainer.max_steps, or what fits max_minutes / train_until
    optimizer, scheduler = make_optimizer_from(cfg, params, horizon)
    tracker = make_tracker(cfg, run, "medusa")
    resumed = resume(cfg, run, optimizer, scheduler, horizon)   # + config.yaml, what runs from here on
    progress = make_progress(cfg, run, tracker, resumed.step, horizon, "medusa", postfix=("loss",))
    batches = make_batches(cfg, run, examples)
    for step in horizon.steps_from(resumed.step):
        ... the recipe's own loop (optimizer_step, progress.update, save_checkpoint, validation_due) ...
    finish(cfg, run, result, export, cmd, tracker, "medusa")  # metrics.json, Hub push, W&B artifact, closing lines

Recipe files keep what is particular to them (models, losses, validation, export) and write their
loop out; configs stop here: the train/ modules receive plain arguments.
"""

import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from recipes.checks import check_hub, check_target_id, target_hub_id
from specdec_runtime.config import DecoderConfig
from specdec_runtime.errors import SpecdecError
from specdec_runtime.hardware import cpu_threads, fast_bf16, resolve_device, resolve_dtype
from specdec_runtime.hub import push_command, push_folder
from specdec_runtime.loading import load_hf_config, load_hf_model, stop_token_ids
from specdec_runtime.paths import resolve_model
from train import checkpoint
from train.data import (
    Batches,
)
from train.launch import load_layer_sharded, make_accelerator, unpartitioned
from train.loop import (
    Horizon,
    Progress,
    hyperparameters,
    make_optimizer,
    restore_hyperparameters,
)
from train.run_folder import RunLock, config_changes, describe_changes, flatten, truncate_log, write_config
from train.tracking import Tracker


@dataclass(frozen=True)
class Run:
    """What every recipe's setup produces before any weights are loaded."""

    accelerator: Any
    out: Path
    target_path: Path
    tokenizer: Any
    pad_id: int
    gen_cfg: Any  # the model's generation config, or None
    stop_ids: frozenset[int]
    changes: dict[str, tuple] = field(default_factory=dict)  # settings changed since the run folder's config.yaml
    # The CPU threads each kind of work runs on ("train", "decode": cpu_threads), where this run
    # chose them (one process on a CPU); empty otherwise (torch's or accelerate's setting stands).
    threads: dict[str, int] = field(default_factory=dict)
    # Why specdec_runtime cannot decode with the target (its family, or its layers split across the
    # processes), or None: a recipe that trains on it anyway generates with transformers and
    # validates with what it can without it
    runtime_refusal: str | None = None

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    def print_once(self, *args: Any) -> None:
        """print() on the main process only (accelerate's print: once per machine), not on every rank."""
        self.accelerator.print(*args)

    def with_tokenizer(self, tokenizer: Any) -> "Run":
        """The same run with another tokenizer (a model trained with its own), its pad and end ids."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return replace(self, tokenizer=tokenizer, pad_id=pad, stop_ids=frozenset({tokenizer.eos_token_id}))


# Settings a resumed run may change without trainer.allow_changes (they do not change what is trained).
RESUMABLE = (
    "output_dir",
    "trainer.max_steps",
    "trainer.max_minutes",
    "trainer.train_until",
    "trainer.log_every",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.allow_changes",
    "validate",
    "tracking",
    "hub",
    "responses.cache_dir",
    "data.cache_dir",
)


def start(cfg: DictConfig) -> Run:
    """The accelerator; with hub.repo_id, whether the push can work (check_hub); the run folder,
    locked for this run, and checked against the settings it was resumed with (a resumable run
    refuses other settings unless trainer.allow_changes); the tokenizer, generation config and stop
    ids of cfg.model.name (no weights yet). Nothing in the folder is written but the lock: resume()
    records config.yaml when the run goes on. A recipe without a `trainer` section (no training:
    layerskip) runs in full precision."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise SpecdecError(f"output_dir={out} is a file: give a folder for the run (it is created if missing)")
    trainer = cfg.get("trainer")
    accelerator = make_accelerator(
        mixed_precision=mixed_precision(trainer.mixed_precision, cfg.get("device", "auto"))
        if trainer is not None
        else "no",
        grad_accum=trainer.grad_accum if trainer is not None else 1,
        micro_batch=trainer.micro_batch if trainer is not None else 1,
        max_grad_norm=trainer.max_grad_norm if trainer is not None else None,
        seed=cfg.seed,
        log_with="wandb" if cfg.tracking.kind == "wandb" else None,
        project_dir=str(out),
        cpu=True if cfg.get("device") == "cpu" else None,
        collective_timeout_minutes=cfg.collective_timeout_minutes,
    )
    outcome: list[Any] = [None]  # rank 0 locks, compares and asks the Hub; every process learns the outcome
    if accelerator.is_main_process:
        try:
            check_target_id(cfg)
            check_hub(cfg)
            RunLock(out)
            outcome[0] = {"changes": resumed_changes(cfg, out)}
        except SpecdecError as e:
            outcome[0] = {"error": str(e)}
    broadcast_object_list(outcome)
    if "error" in outcome[0]:
        raise SpecdecError(outcome[0]["error"])
    threads = choose_threads(accelerator, training=trainer is not None)
    path, *tokenizer = load_tokenizer(cfg.model.name)
    return Run(accelerator, out, path, *tokenizer, outcome[0]["changes"], threads, runtime_refusal(cfg, path))


def runtime_refusal(cfg: DictConfig, path: Path) -> str | None:
    """Why specdec_runtime cannot decode with the run's target (Run.runtime_refusal), or None."""
    if cfg.model.get("shard"):
        return (
            "the target's layers are split across the processes (model.shard=true) and the runtime decodes "
            "with a whole target on one"
        )
    try:
        DecoderConfig.from_hf(load_hf_config(path))
    except SpecdecError as e:
        return str(e)
    return None


def target_card(cfg: DictConfig, run: "Run") -> dict[str, Any]:
    """train.export.Card's fields naming the target: specdec's name, its Hub id (model.hub_id for a
    local folder; what engines and exported configs name it by), its config.json."""
    config = json.loads((run.target_path / "config.json").read_text())
    return {"target": cfg.model.name, "target_hub_id": target_hub_id(cfg), "target_config": config}


def choose_threads(accelerator: Any, training: bool) -> dict[str, int]:
    """On a CPU, in one process: the threads training (where the recipe trains) and decoding run
    fastest on (cpu_threads, timed where there is a choice), said; the process takes training's
    (decoding's in a recipe that does not train), and validate() decoding's. Several processes
    keep accelerate's setting."""
    if accelerator.device.type != "cpu" or accelerator.num_processes > 1:
        return {}
    choices = {work: cpu_threads(work) for work in (("train", "decode") if training else ("decode",))}
    if len(choices) == 2 and not any(c.timed for c in choices.values()):  # nothing was chosen between: one line
        print(f"threads: {choices['decode'].describe('training and decoding')}", file=sys.stderr)
    else:
        print("\n".join(f"threads: {choice}" for choice in choices.values()), file=sys.stderr)
    torch.set_num_threads(next(iter(choices.values())).threads)  # training's where it trains
    return {work: choice.threads for work, choice in choices.items()}


def resumed_changes(cfg: DictConfig, out: Path) -> dict[str, tuple]:
    """Settings that differ from those of the run this one resumes (config.yaml, when there is a
    checkpoint to resume from): the changes RESUMABLE allows, said; the others refused unless
    trainer.allow_changes. {} for a fresh run."""
    trainer = cfg.get("trainer")
    saved = out / "config.yaml"
    if trainer is None or not trainer.resume or not saved.is_file() or not any(out.glob("checkpoints/step-*")):
        return {}
    before = OmegaConf.to_container(OmegaConf.load(saved), resolve=True)
    now = OmegaConf.to_container(cfg, resolve=True)
    changes = config_changes(before, now, allowed=("output_dir",))  # a moved folder is the same run
    # Settings the run's specdec did not have yet (a newer version's keys) cannot differ from what
    # it trained under: said, not refused.
    had = flatten(before)
    refused = {k: v for k, v in config_changes(before, now, allowed=RESUMABLE).items() if k in had}
    if refused and not trainer.allow_changes:
        raise SpecdecError(
            f"{out} holds a run with other settings ({describe_changes(refused)}). To resume it, run with its "
            f"settings (see {saved}); to start over, give another output_dir; to go on with the new settings "
            "from its last checkpoint, add trainer.allow_changes=true (recorded in config_history.jsonl)"
        )
    if changes:
        print(f"resuming {out} with changed settings: {describe_changes(changes)}", file=sys.stderr)
    return changes


def mixed_precision(setting: str, device: str) -> str:
    """trainer.mixed_precision: auto takes the accelerate config's (`accelerate launch`), else no;
    fast is bf16 where this machine multiplies bf16 measurably faster than fp32 (said), else no."""
    if setting == "auto":
        return os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if setting == "fast":
        speed = fast_bf16(resolve_device(device))
        print(f"trainer.mixed_precision=fast: {speed}", file=sys.stderr)
        return "bf16" if speed.fast else "no"
    return setting


def load_tokenizer(name: str) -> tuple[Path, Any, int, Any, frozenset[int]]:
    """(path, tokenizer, pad id, generation config or None, stop ids) of a model, before any weights."""
    from transformers import AutoTokenizer, GenerationConfig

    path = resolve_model(name)  # clear error for unknown names
    tokenizer = AutoTokenizer.from_pretrained(path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        gen_cfg = GenerationConfig.from_pretrained(path)
    except OSError:
        gen_cfg = None
    return path, tokenizer, pad_id, gen_cfg, stop_token_ids(tokenizer, gen_cfg.eos_token_id if gen_cfg else None)


def load_target(cfg: DictConfig, run: Run, dtype: torch.dtype | None = None) -> Any:
    """The HF target on the run's device, frozen, in `dtype` (default: model.dtype)."""
    if dtype is None and cfg.model.dtype == "fast":
        run.print_once(f"model.dtype=fast: {fast_bf16(run.device)}")
    dtype = dtype or resolve_dtype(cfg.model.dtype, run.device)
    run.print_once(f"target {cfg.model.name} ({run.target_path}) on {run.device} in {dtype}")
    if cfg.model.get("shard"):
        world = run.accelerator.num_processes
        run.print_once(f"  its decoder layers split across the {world} processes (model.shard=true)")
        return load_layer_sharded(run.target_path, dtype, run.device)
    with unpartitioned(run.accelerator):
        model = load_hf_model(cfg.model.name, dtype=dtype)
    return model.to(run.device).eval().requires_grad_(False)


def make_horizon(cfg: DictConfig, run: Run) -> Horizon:
    """The steps the run trains: trainer.max_steps, cut once at the end of the warm-up (at least 10
    steps in) to what fits trainer.max_minutes and trainer.train_until, every process taking rank
    0's decision."""
    agree = lambda n: broadcast_object_list([n])[0]  # noqa: E731
    decide_at = max(cfg.optim.warmup_steps, 10)
    print_line = lambda line: run.main and tqdm.write(line)  # noqa: E731  (on its own line, above the progress bar)
    trainer = cfg.trainer
    return Horizon(
        trainer.max_steps,
        trainer.get("max_minutes"),
        decide_at,
        until=trainer.get("train_until"),
        agree=agree,
        print_line=print_line,
    )


def make_optimizer_from(cfg: DictConfig, params: Any, horizon: Horizon) -> tuple[Any, Any]:
    """AdamW and its schedule from cfg.optim over the horizon's steps (params: parameters or
    groups, see train.loop.make_optimizer)."""
    optim = cfg.optim
    return make_optimizer(
        params,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        warmup_steps=optim.warmup_steps,
        max_steps=horizon,
        schedule=optim.schedule,
        betas=tuple(optim.betas),
        min_lr_ratio=optim.min_lr_ratio,
    )


def make_tracker(cfg: DictConfig, run: Run, recipe: str) -> Tracker:
    tracking = cfg.tracking
    return Tracker(
        run.accelerator,
        run.out,
        kind=tracking.kind,
        project=tracking.get("project", "specdec"),
        run_name=tracking.get("run_name") or f"{recipe}-{run.out.name}",
        config=OmegaConf.to_container(cfg, resolve=True),
        entity=tracking.get("entity"),
        tags=list(tracking.get("tags") or []),
    )


@dataclass(frozen=True)
class Resumed:
    """Where a run goes on: its first step, and what its checkpoint recorded."""

    step: int = 0
    stats: dict[str, float] = field(default_factory=dict)  # the last step's (a finished run keeps them)
    history: list[dict[str, Any]] = field(default_factory=list)  # validations during training so far
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # a recipe's own tensors


def resume(cfg: DictConfig, run: Run, optimizer: Any, scheduler: Any, horizon: Horizon) -> Resumed:
    """Restore the newest intact checkpoint (trainer.resume) into the prepared objects and the
    horizon (its cut), with the configured optimizer settings; then record what runs from here on:
    config.yaml (the changed settings in config_history.jsonl) and log.jsonl cut back to the
    checkpoint's step. Checkpoints record the horizon as state["horizon"]."""
    configured = hyperparameters(optimizer)
    step, state, extra = checkpoint.resume(run.accelerator, run.checkpoints) if cfg.trainer.resume else (0, {}, {})
    horizon.restore(state.get("horizon"))  # before the schedule's learning rate is recomputed
    restore_hyperparameters(optimizer, scheduler, configured)
    if run.main:
        write_config(run.out, OmegaConf.to_yaml(cfg, resolve=True), run.changes, step)
        truncate_log(run.out / "log.jsonl", step)
    run.accelerator.wait_for_everyone()
    return Resumed(step, state.get("stats", {}), state.get("history", []), extra)


def record_config(cfg: DictConfig, run: Run) -> None:
    """config.yaml for a run that does not train (layerskip: its study records the rest)."""
    if run.main:
        write_config(run.out, OmegaConf.to_yaml(cfg, resolve=True), {}, 0)


def make_batches(cfg: DictConfig, run: Run, examples: list[Any]) -> Batches:
    """This process's share of deterministic global batches (see train.data.Batches)."""
    trainer, accelerator = cfg.trainer, run.accelerator
    return Batches(
        examples,
        micro_batch=trainer.micro_batch,
        grad_accum=trainer.grad_accum,
        world=accelerator.num_processes,
        rank=accelerator.process_index,
        seed=cfg.seed,
        group_by_length=trainer.get("group_by_length", False),
    )


def make_progress(
    cfg: DictConfig, run: Run, tracker: Tracker, start_step: int, horizon: Horizon, desc: str, postfix: tuple[str, ...]
) -> Progress:
    """The progress bar and train/* log of steps start_step..the horizon (says what it trains)."""
    trainer, accelerator = cfg.trainer, run.accelerator
    if start_step < horizon.steps:
        limit = f", at most {horizon.max_minutes:g} min (trainer.max_minutes)" if horizon.max_minutes else ""
        if trainer.get("train_until") is not None:
            limit += (
                f", ending by {time.strftime('%H:%M:%S', time.localtime(trainer.train_until))} (trainer.train_until)"
            )
        run.print_once(
            f"training steps {start_step}..{horizon.steps} ({accelerator.num_processes} processes, "
            f"global batch {trainer.micro_batch * trainer.grad_accum * accelerator.num_processes}{limit})"
        )
    return Progress(
        tracker, start=start_step, total=horizon, log_every=trainer.log_every, desc=desc, postfix=postfix, show=run.main
    )


def validation_due(cfg: DictConfig, done: int, last: int) -> bool:
    """A validation during training after `done` of `last` steps (the final one runs after the loop)."""
    return bool(cfg.validate.every) and done % cfg.validate.every == 0 and done < last


def finish(
    cfg: DictConfig, run: Run, result: dict[str, Any], export: Path, generate_cmd: str, tracker: Tracker, recipe: str
) -> None:
    """Rank 0: metrics.json, the optional Hub push (a failed one is said last by run_or_exit, with
    the command that retries it, and exits 2), the export as a W&B artifact, and the closing lines."""
    result["export"] = str(export)
    RunLock(run.out).release()  # the folder is free once its results are written
    (run.out / "metrics.json").write_text(json.dumps(result, indent=2))  # kept whatever the push does
    if cfg.hub.repo_id:
        push(cfg, run, result, export)
        (run.out / "metrics.json").write_text(json.dumps(result, indent=2))
    m = result.get("validation") or {}
    summary = {"recipe": recipe, "target": cfg.model.name} | {k: m[k] for k in ("tau", "speedup", "lossless") if k in m}
    tracker.log_artifact(export, f"{recipe}-{run.out.name}", metadata=summary)
    if m.get("tau") is not None:  # (a split target's validation has the training-time estimate only)
        parts = []  # the two rates the ratio comes from, and the drafter
        if m.get("ar_tokens_per_s"):
            parts.append(f"{m['tokens_per_s']:.1f} against {m['ar_tokens_per_s']:.1f} tok/s")
        if m.get("drafter"):
            parts.append(f"drafter {m['drafter']}")
        run.print_once(
            f"\ntau {m['tau']:.2f}, speedup {m['speedup']:.2f}x over autoregressive"
            + (f" ({', '.join(parts)})" if parts else "")
            + f", lossless {m['lossless']:.0%} ({m['prompts']} validation prompts)"
        )
    run.print_once(f"exported to {export}\ngenerate with it:\n  {generate_cmd}")


def push(cfg: DictConfig, run: Run, result: dict[str, Any], export: Path) -> None:
    """Push the export to hub.repo_id: the commit URL in result["hub"], or what failed in
    result["hub_error"] and the command that retries it in result["hub_retry"]."""
    hub = cfg.hub
    try:
        result["hub"] = push_folder(export, hub.repo_id, private=hub.private, revision=hub.revision)
        run.print_once(f"pushed to {result['hub']}")
    except Exception as e:  # no network, a refused token, a failed check: the run's results stay
        result["hub_error"] = str(e) if isinstance(e, SpecdecError) else f"{type(e).__name__}: {e}"
        result["hub_retry"] = push_command(export, hub.repo_id, private=hub.private, revision=hub.revision)
