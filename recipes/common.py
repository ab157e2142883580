"""What every recipe does the same way, from its Hydra config: run folder, target and data, the
self-distilled responses, the tracker, the training loop, and the end of a run.

    run = start(cfg, "medusa")                  # accelerator, run folder, tokenizer, stop ids, prompts
    target = load_target(cfg, run)              # the HF target, frozen, in model.dtype
    examples, prompts, gen_kw = training_examples(cfg, run, target)
    tracker = make_tracker(cfg, run, "medusa")
    stats, history = train_loop(cfg, run, tracker, model=..., optimizer=..., scheduler=..., loss_fn=..., ...)
    finish(cfg, run, result, export, cmd, tracker, "medusa")  # metrics.json, Hub push, W&B artifact, closing lines

Recipe files keep what is particular to them (models, losses, validation, export); configs stop
here: the train/ modules below receive plain arguments.
"""

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specdec_runtime.errors import SpecdecError
from specdec_runtime.loading import cache_root, load_hf_model, resolve_dtype, resolve_model, stop_token_ids
from train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from train.data import Batches, Conversation, Example, encode_conversation, load_conversations, prompt_ids
from train.export import push_to_hub
from train.loop import (
    MIXED_PRECISION,
    BackwardFn,
    LossFn,
    launcher,
    make_accelerator,
    make_optimizer,
    optimizer_step,
)
from train.responses import cache_key, generate_responses
from train.tracking import KINDS as TRACKING_KINDS
from train.tracking import Tracker


def check_common(cfg: DictConfig, sources: tuple[str, ...]) -> list[str]:
    """Problems with the config keys the conversation recipes share (trainer, responses, tracking, validate)."""
    problems = check_trainer(cfg)
    if cfg.responses.source not in sources:
        problems.append(f"responses.source='{cfg.responses.source}': use one of {', '.join(sources)}")
    for key in ("max_new_tokens", "batch_size"):
        if cfg.responses[key] < 1:
            problems.append(f"responses.{key}={cfg.responses[key]} must be >= 1")
    return problems


def check_trainer(cfg: DictConfig) -> list[str]:
    """Problems with the keys every recipe has (trainer, tracking, validate)."""
    problems = []
    if cfg.tracking.kind not in TRACKING_KINDS:
        problems.append(f"tracking.kind='{cfg.tracking.kind}': use tracking=none or tracking=wandb")
    if cfg.trainer.mixed_precision not in ("auto", *MIXED_PRECISION):
        problems.append(f"trainer.mixed_precision='{cfg.trainer.mixed_precision}': use auto, no, bf16 or fp16")
    for key in ("max_steps", "micro_batch", "grad_accum", "max_seq_len", "log_every", "checkpoint_every"):
        if not isinstance(cfg.trainer[key], int) or cfg.trainer[key] < 1:
            problems.append(f"trainer.{key}={cfg.trainer[key]} must be a positive integer")
    if cfg.validate.max_new_tokens < 1:
        problems.append("validate.max_new_tokens must be >= 1")
    if cfg.device not in ("auto", "cpu"):
        problems.append(f"device='{cfg.device}': use auto (the launcher's GPUs, else CPU) or cpu")
    return problems


def refuse(problems: list[str]) -> None:
    if problems:
        raise SpecdecError("invalid config:\n  " + "\n  ".join(problems))


def run_or_exit(run_fn: Callable[[DictConfig], Any], cfg: DictConfig) -> None:
    """A recipe's entry point: a user's mistake (SpecdecError) prints its message and exits 2."""
    try:
        run_fn(cfg)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def spread(convs: list[Conversation], n: int) -> list[Conversation]:
    """The first n conversations taken round-robin over categories (all when n is 0)."""
    if not n or n >= len(convs):
        return convs
    by_cat: dict[Any, list[Conversation]] = {}
    for c in convs:
        by_cat.setdefault(c.category, []).append(c)
    picked, queues = [], list(by_cat.values())
    while len(picked) < n:
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    return picked


def with_responses(prompts: list[list[int]], responses: list[list[int]], max_len: int) -> list[Example]:
    """Examples prompt + response with loss on the response tokens (empty responses dropped)."""
    out = []
    for p, r in zip(prompts, responses):
        if r:
            ex = Example((p + r)[:max_len], ([False] * len(p) + [True] * len(r))[:max_len])
            if ex.n_targets:
                out.append(ex)
    return out


@dataclass
class Run:
    """The objects a recipe's setup produces before any weights are loaded."""

    accelerator: Any
    out: Path
    target_path: Path
    tokenizer: Any
    pad_id: int
    gen_cfg: Any
    stop_ids: frozenset[int]
    # The conversation recipes' data (a pretraining recipe has a corpus instead).
    train_convs: list[Conversation] = field(default_factory=list)
    val_convs: list[Conversation] = field(default_factory=list)
    val_prompts: list[list[int]] = field(default_factory=list)
    rest_val_convs: list[Conversation] = field(default_factory=list)  # not used for validation (calibration)

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def say(self, *args: Any) -> None:
        self.accelerator.print(*args)


def open_run(cfg: DictConfig) -> tuple[Any, Path]:
    """The accelerator and the run folder, with the resolved config.yaml (rank 0 writes it).
    A recipe without a `trainer` section (no training: layerskip) runs in full precision."""
    out = Path(cfg.output_dir)
    trainer = cfg.get("trainer")
    accelerator = make_accelerator(
        mixed_precision=mixed_precision(trainer.mixed_precision) if trainer is not None else "no",
        grad_accum=trainer.grad_accum if trainer is not None else 1,
        micro_batch=trainer.micro_batch if trainer is not None else 1,
        max_grad_norm=trainer.max_grad_norm if trainer is not None else None,
        seed=cfg.seed,
        log_with="wandb" if cfg.tracking.kind == "wandb" else None,
        project_dir=str(out),
        cpu=True if cfg.get("device") == "cpu" else None,
    )
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    accelerator.wait_for_everyone()
    return accelerator, out


def mixed_precision(setting: str) -> str:
    """trainer.mixed_precision: auto takes the accelerate config's (`accelerate launch`), else no."""
    if setting == "auto":
        return os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    return setting


def launch_kind(accelerator: Any) -> str:
    """How the run was launched: "single", "ddp", "zero1"/"zero2"/"zero3" (DeepSpeed) or "fsdp"."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if kind == DistributedType.FSDP:
        return "fsdp"
    return "single" if accelerator.num_processes == 1 else "ddp"


def check_launch(accelerator: Any, recipe: str, fits: tuple[str, ...], why: str = "") -> str:
    """Refuse, before any model loads, a launcher config the recipe does not fit; returns the kind.
    fits: the kinds of launch_kind() the recipe runs under ("single" and "ddp" always fit)."""
    asked, kind = launcher(), launch_kind(accelerator)
    if asked == "fsdp" and kind != "fsdp":
        raise SpecdecError(
            "the accelerate config asks for FSDP, which accelerate runs on GPUs only: on this machine use "
            "conf/accelerate/multi_cpu.yaml (DDP over gloo) or a DeepSpeed config"
        )
    if kind not in ("single", "ddp", *fits):
        ok = ", ".join(["DDP (conf/accelerate/multi_gpu.yaml)", *(FITS_NAMES[f] for f in fits)])
        raise SpecdecError(
            f"recipes.{recipe} does not run under {FITS_NAMES[kind]}{': ' + why if why else ''}. Use {ok}"
        )
    return kind


FITS_NAMES = {
    "single": "one process",
    "ddp": "DDP",
    "zero0": "DeepSpeed ZeRO-0",
    "zero1": "DeepSpeed ZeRO-1",
    "zero2": "DeepSpeed ZeRO-2 (conf/accelerate/deepspeed_zero2.yaml)",
    "zero3": "DeepSpeed ZeRO-3 (conf/accelerate/deepspeed_zero3*.yaml)",
    "fsdp": "FSDP (conf/accelerate/fsdp.yaml)",
}


def sharded(accelerator: Any) -> bool:
    """Parameters are split across processes (ZeRO-3, FSDP): reading the weights needs a gather."""
    return launch_kind(accelerator) in ("zero3", "fsdp")


@contextmanager
def whole(accelerator: Any) -> Iterator[None]:
    """Models created inside stay whole on every process. Under ZeRO-3, transformers would otherwise
    partition every model at creation (zero.Init); a frozen target must stay whole, and the trained
    model is partitioned when accelerator.prepare() wraps it."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def gathered_state_dict(accelerator: Any, wrapped: Any) -> dict[str, torch.Tensor] | None:
    """The prepared model's whole state dict on rank 0 (None elsewhere). Every process must call it:
    under ZeRO-3 and FSDP it gathers the shards."""
    sd = accelerator.get_state_dict(wrapped)
    return {k: v.detach() for k, v in sd.items()} if accelerator.is_main_process else None


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


def start(cfg: DictConfig) -> Run:
    """Accelerator, run folder (config.yaml), tokenizer, stop ids, train and validation conversations."""
    accelerator, out = open_run(cfg)
    target_path, tokenizer, pad_id, gen_cfg, stop_ids = load_tokenizer(cfg.model.name)
    d = cfg.data
    train_convs = load_conversations(d.train, split=d.split, column=d.column, max_samples=d.max_samples)
    all_val = load_conversations(d.val, split=d.split, column=d.column)
    val_convs = spread(list(all_val), cfg.validate.num_prompts)
    chosen = {id(c) for c in val_convs}
    return Run(
        accelerator,
        out,
        target_path,
        tokenizer,
        pad_id,
        gen_cfg,
        stop_ids,
        train_convs,
        val_convs,
        [prompt_ids(tokenizer, c) for c in val_convs],
        [c for c in all_val if id(c) not in chosen],
    )


def load_target(cfg: DictConfig, run: Run, dtype: torch.dtype | None = None) -> Any:
    """The HF target on the run's device, frozen, in `dtype` (default: model.dtype)."""
    dtype = dtype or resolve_dtype(cfg.model.dtype, run.device)
    run.say(f"target {cfg.model.name} ({run.target_path}) on {run.device} in {dtype}")
    with whole(run.accelerator):
        model = load_hf_model(cfg.model.name, dtype=dtype)
    return model.to(run.device).eval().requires_grad_(False)


def generation_kwargs(cfg: DictConfig, run: Run) -> dict[str, Any]:
    """generate_responses() settings: sampling from cfg.responses, the process group from the run."""
    r, acc = cfg.responses, run.accelerator

    def progress(todo: int, total: int) -> Any:
        done = total - todo * acc.num_processes
        return tqdm(total=todo, desc=f"responses ({done} cached)", unit="prompt", disable=not run.main)

    return dict(
        pad_id=run.pad_id,
        stop_ids=run.stop_ids,
        max_new_tokens=r.max_new_tokens,
        batch_size=r.batch_size,
        temperature=r.temperature,
        top_p=r.top_p,
        rank=acc.process_index,
        world=acc.num_processes,
        barrier=acc.wait_for_everyone,
        gather=lambda d: gather_object([d]),  # every process gets every share
        progress=progress,
    )


def target_responses(cfg: DictConfig, run: Run, target: Any, prompts: list[list[int]]) -> list[list[int]]:
    """The target's responses to prompts, cached on disk by target + prompts + settings."""
    r = cfg.responses
    settings = {k: r[k] for k in ("max_new_tokens", "temperature", "top_p")} | {
        "seed": cfg.seed,
        "dtype": str(target.dtype),
    }
    root = Path(r.cache_dir).expanduser() if r.cache_dir else cache_root() / "responses"
    cache = root / cache_key(run.target_path, prompts, settings)
    run.say(f"self-distillation responses: {cache}")
    return generate_responses(target, prompts, seed=cfg.seed, cache_dir=cache, **generation_kwargs(cfg, run))


def training_examples(cfg: DictConfig, run: Run, target: Any) -> tuple[list[Example], list[list[int]]]:
    """Training examples (responses from the dataset or the target; none yet for on-policy data)
    and the prompts they were made from (prompts too long for trainer.max_seq_len are skipped)."""
    max_len = cfg.trainer.max_seq_len
    if cfg.responses.source == "dataset" and not any(c.has_response for c in run.train_convs):
        raise SpecdecError(f"{cfg.data.train} has no assistant responses: use responses.source=target")
    prompts = [prompt_ids(run.tokenizer, c) for c in run.train_convs]
    keep = [i for i, p in enumerate(prompts) if len(p) < max_len - 8]
    if len(keep) < len(prompts):
        run.say(f"skipping {len(prompts) - len(keep)} prompts longer than trainer.max_seq_len={max_len}")
    prompts = [prompts[i] for i in keep]
    if cfg.responses.source == "dataset":
        examples = [encode_conversation(run.tokenizer, run.train_convs[i], max_len) for i in keep]
        return [e for e in examples if e.n_targets], prompts
    if cfg.responses.source == "target":
        return with_responses(prompts, target_responses(cfg, run, target, prompts), max_len), prompts
    return [], prompts


def make_optimizer_from(cfg: DictConfig, params: Any) -> tuple[Any, Any]:
    """AdamW and its schedule from cfg.optim over cfg.trainer.max_steps (params: parameters or
    groups, see train.loop.make_optimizer)."""
    o = cfg.optim
    return make_optimizer(
        params,
        lr=o.lr,
        weight_decay=o.weight_decay,
        warmup_steps=o.warmup_steps,
        max_steps=cfg.trainer.max_steps,
        schedule=o.schedule,
        betas=tuple(o.betas),
        min_lr_ratio=o.min_lr_ratio,
    )


def make_tracker(cfg: DictConfig, run: Run, recipe: str) -> Tracker:
    t = cfg.tracking
    return Tracker(
        run.accelerator,
        run.out,
        kind=t.kind,
        project=t.get("project", "specdec"),
        run_name=t.get("run_name") or f"{recipe}-{run.out.name}",
        config=OmegaConf.to_container(cfg, resolve=True),
        entity=t.get("entity"),
        tags=list(t.get("tags") or []),
    )


def resume(cfg: DictConfig, run: Run) -> tuple[int, dict[str, torch.Tensor]]:
    """(first step, extra tensors) from the latest checkpoint, or (0, {}) for a fresh run."""
    ckpt = latest_checkpoint(run.out / "checkpoints") if cfg.trainer.resume else None
    if ckpt is None:
        return 0, {}
    state, extra = load_checkpoint(run.accelerator, ckpt)
    run.say(f"resumed from {ckpt} at step {state['step']}")
    return state["step"], extra


def train_loop(
    cfg: DictConfig,
    run: Run,
    tracker: Tracker,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    loss_fn: LossFn | None,
    examples: list[Example],
    start_step: int,
    desc: str,
    save: Callable[..., Any] = save_checkpoint,
    refresh: Callable[[int], list[Example] | None] | None = None,
    extra_state: Callable[[], dict[str, torch.Tensor] | None] = lambda: None,
    postprocess: Callable[[dict[str, float]], None] = lambda stats: None,
    postfix: tuple[str, ...] = ("loss",),
    validate: Callable[[int], dict[str, Any]] | None = None,
    backward_fn: BackwardFn | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Steps start_step..max_steps: deterministic batches, token-normalized optimizer steps, logging,
    atomic checkpoints, optional periodic validation. Returns the last step's stats and the history.

    refresh(step) may return new examples (on-policy data) before a step; postprocess edits the
    step's stats in place (derived metrics) before they are shown and logged. backward_fn replaces
    loss_fn for recipes that run their own backward (see train/loop.py). Examples need only
    `n_targets` here (the Batches they go through only index them).
    """
    acc, T = run.accelerator, cfg.trainer
    if start_step < T.max_steps:
        run.say(
            f"training steps {start_step}..{T.max_steps} ({acc.num_processes} processes, "
            f"global batch {T.micro_batch * T.grad_accum * acc.num_processes})"
        )
    steps = range(start_step, T.max_steps)
    bar = tqdm(steps, initial=start_step, total=T.max_steps, desc=desc, unit="step", disable=not run.main)
    batches, stats, history = None, {}, []
    for step in bar:
        t0 = time.perf_counter()
        fresh = refresh(step) if refresh is not None else None
        if fresh is not None:
            examples, batches = fresh, None
        if batches is None:
            batches = Batches(
                examples,
                micro_batch=T.micro_batch,
                grad_accum=T.grad_accum,
                world=acc.num_processes,
                rank=acc.process_index,
                seed=cfg.seed,
            )
        stats = optimizer_step(
            acc,
            model,
            optimizer,
            scheduler,
            batches.step(step),
            loss_fn,
            T.max_grad_norm,
            n_tokens=lambda mb: sum(e.n_targets for e in mb),
            backward_fn=backward_fn,
        )
        stats["tokens_per_s"] = stats["tokens"] / (time.perf_counter() - t0)  # loss tokens, all processes
        postprocess(stats)
        bar.set_postfix({k: f"{stats[k]:.4f}" for k in postfix if k in stats})
        done = step + 1
        if done % T.log_every == 0 or done == T.max_steps:
            tracker.log({f"train/{k}": v for k, v in stats.items()} | {"train/epoch": batches.epoch(done)}, done)
        if done % T.checkpoint_every == 0 or done == T.max_steps:
            save(
                acc,
                run.out / "checkpoints",
                step=done,
                state={"loss": stats["loss"]},
                tensors=extra_state(),
                keep=T.keep_checkpoints,
            )
        if validate is not None and cfg.validate.every and done % cfg.validate.every == 0 and done < T.max_steps:
            history.append({"step": done, **validate(done)})
    bar.close()
    return stats, history


def finish(
    cfg: DictConfig, run: Run, result: dict[str, Any], export: Path, generate_cmd: str, tracker: Tracker, recipe: str
) -> None:
    """Rank 0: optional Hub push, metrics.json, the export as a W&B artifact, and the closing lines
    (tau, speedup, how to use it)."""
    result["export"] = str(export)
    if cfg.hub.repo_id:
        result["hub"] = push_to_hub(export, cfg.hub.repo_id, private=cfg.hub.private, revision=cfg.hub.revision)
        run.say(f"pushed to {result['hub']}")
    (run.out / "metrics.json").write_text(json.dumps(result, indent=2))
    m = result.get("validation") or {}
    summary = {"recipe": recipe, "target": cfg.model.name} | {k: m[k] for k in ("tau", "speedup", "lossless") if k in m}
    tracker.log_artifact(export, f"{recipe}-{run.out.name}", metadata=summary)
    if m:
        run.say(
            f"\ntau {m['tau']:.2f}, speedup {m['speedup']:.2f}x over autoregressive, "
            f"lossless {m['lossless']:.0%} ({m['prompts']} validation prompts)"
        )
    run.say(f"exported to {export}\ngenerate with it:\n  {generate_cmd}")
