"""From a recipe's Hydra config to the plain arguments of train/'s pieces, the same way for every recipe.

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
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, gather_object
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specdec_runtime.errors import SpecdecError
from specdec_runtime.hardware import cpu_threads, fast_bf16, resolve_device, resolve_dtype
from specdec_runtime.hub import check_push, push_command, push_folder
from specdec_runtime.loading import load_hf_model, stop_token_ids
from specdec_runtime.paths import cache_root, hub_id_of, resolve_model
from train import checkpoint
from train.data import (
    Batches,
    Conversation,
    Example,
    encode_conversation,
    load_conversations,
    pre_query_ids,
    prompt_ids,
    self_written,
    spread,
    with_responses,
)
from train.launch import MIXED_PRECISION, make_accelerator, whole
from train.loop import (
    Horizon,
    Progress,
    hyperparameters,
    make_optimizer,
    minutes_problem,
    restore_hyperparameters,
    until_problem,
)
from train.responses import DONE as RESPONSES_DONE
from train.responses import cache_key, generate_responses
from train.run_folder import RunLock, config_changes, describe_changes, truncate_log, write_config
from train.tracking import KINDS as TRACKING_KINDS
from train.tracking import Tracker
from train.validate import runtime_decoder

# ---------------------------------------------------------------- config checks


def check_trainer(cfg: DictConfig) -> list[str]:
    """Problems with the keys every training recipe has (trainer, tracking, validate, device)."""
    problems = check_tracking(cfg)
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
    if cfg.device not in ("auto", "cpu"):
        problems.append(f"device='{cfg.device}': use auto (the launcher's GPUs, else CPU) or cpu")
    if cfg.trainer.max_grad_norm is not None and not cfg.trainer.max_grad_norm > 0:
        problems.append(f"trainer.max_grad_norm={cfg.trainer.max_grad_norm} must be positive (or null: no clipping)")
    return problems + check_optim(cfg.optim)


def check_optim(o: DictConfig) -> list[str]:
    """Problems with cfg.optim (the learning rate and its schedule, AdamW's settings)."""
    problems = []
    if not o.lr > 0:
        problems.append(f"optim.lr={o.lr} must be positive")
    if o.weight_decay < 0 or o.warmup_steps < 0:
        problems.append(f"optim.weight_decay={o.weight_decay} and optim.warmup_steps={o.warmup_steps} must be >= 0")
    if o.schedule not in ("cosine", "linear", "constant"):
        problems.append(f"optim.schedule='{o.schedule}': use cosine, linear or constant")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        problems.append(f"optim.betas={list(o.betas)}: two numbers in [0, 1)")
    if not 0 <= o.min_lr_ratio <= 1:
        problems.append(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    return problems


def check_tracking(cfg: DictConfig) -> list[str]:
    if cfg.tracking.kind not in TRACKING_KINDS:
        return [f"tracking.kind='{cfg.tracking.kind}': use tracking=none or tracking=wandb"]
    return []


ENGINES = ("auto", "runtime", "transformers")  # responses.engine (response_engine)


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


# ---------------------------------------------------------------- the run


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

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def checkpoints(self) -> Path:
        return self.out / "checkpoints"

    def say(self, *args: Any) -> None:
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
    return Run(accelerator, out, *load_tokenizer(cfg.model.name), changes=outcome[0]["changes"], threads=threads)


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
    refused = config_changes(before, now, allowed=RESUMABLE)
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


@dataclass(frozen=True)
class Conversations:
    """The conversation recipes' data: training conversations, and validation prompts."""

    train: list[Conversation]
    val: list[Conversation]  # validate.num_prompts of data.val, spread over its categories
    val_prompts: list[list[int]]  # their token ids (chat template applied)
    rest_val: list[Conversation]  # the validation conversations not used for validation (calibration)

    @property
    def val_categories(self) -> list[str | None]:
        return [c.category for c in self.val]


def conversations(cfg: DictConfig, run: Run) -> Conversations:
    d = cfg.data
    train = spread(load_conversations(d.train, split=d.split, column=d.column), d.max_samples or 0)
    all_val = load_conversations(d.val, split=d.split, column=d.column)
    val = spread(list(all_val), cfg.validate.num_prompts)
    chosen = {id(c) for c in val}
    rest = [c for c in all_val if id(c) not in chosen]
    return Conversations(train, val, [prompt_ids(run.tokenizer, c) for c in val], rest)


def load_target(cfg: DictConfig, run: Run, dtype: torch.dtype | None = None) -> Any:
    """The HF target on the run's device, frozen, in `dtype` (default: model.dtype)."""
    if dtype is None and cfg.model.dtype == "fast":
        run.say(f"model.dtype=fast: {fast_bf16(run.device)}")
    dtype = dtype or resolve_dtype(cfg.model.dtype, run.device)
    run.say(f"target {cfg.model.name} ({run.target_path}) on {run.device} in {dtype}")
    with whole(run.accelerator):
        model = load_hf_model(cfg.model.name, dtype=dtype)
    return model.to(run.device).eval().requires_grad_(False)


# ---------------------------------------------------------------- responses and examples


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


def target_responses(
    cfg: DictConfig, run: Run, target: Any, prompts: list[list[int]], sampling: dict[str, Any] | None = None
) -> list[list[int]]:
    """The target's responses to prompts, cached on disk by target + prompts + settings; sampling
    (max_new_tokens, temperature, top_p, what) overrides cfg.responses' for another kind of text."""
    r, sampling = cfg.responses, sampling or {}
    settings = {k: r[k] for k in ("max_new_tokens", "temperature", "top_p")} | sampling
    settings |= {"seed": cfg.seed, "dtype": str(target.dtype)}
    engine = response_engine(cfg, run)
    if engine == "runtime":  # (transformers' responses keep the cache keys they had before engines)
        settings["engine"] = engine
    elif settings["temperature"] > 0:  # transformers' sampled responses drew from its top 50 before top_k=0: not those
        settings["top_k"] = 0
    root = Path(r.cache_dir).expanduser() if r.cache_dir else cache_root() / "responses"
    cache = root / cache_key(run.target_path, prompts, settings)
    run.say(f"{sampling.get('what', 'self-distillation responses')} ({engine}): {cache}")
    model = target
    if engine == "runtime" and not (cache / RESPONSES_DONE).is_file():
        model = runtime_decoder(target, None, run.device, fast_path=False)
    kwargs = generation_kwargs(cfg, run) | {k: v for k, v in sampling.items() if k != "what"}
    return generate_responses(model, prompts, seed=cfg.seed, cache_dir=cache, **kwargs)


# Magpie's sampling of user messages (temperature 1); 96 tokens hold most questions, and a message
# the limit cuts off is dropped.
SELF_PROMPTS = {"what": "self-written prompts", "max_new_tokens": 96, "temperature": 1.0, "top_p": 0.95}


def self_prompts(cfg: DictConfig, run: Run, target: Any) -> list[list[int]]:
    """responses.self_prompts user messages the target writes itself (Magpie: its chat template up
    to a user's turn, sampled), as prompt ids: the finished, distinct ones. More distinct prompts
    are what a drafter trained on a few thousand lacks: the GPU-trained EAGLE-3 drafter of the
    bundled target reaches a higher tau on the built-in set's training prompts than on held-out ones
    (docs/log/eagle3.md)."""
    n = cfg.responses.get("self_prompts", 0)
    if not n:
        return []
    written = target_responses(cfg, run, target, [pre_query_ids(run.tokenizer)] * n, SELF_PROMPTS)
    convs = self_written(run.tokenizer, written, run.stop_ids)
    run.say(f"self-written prompts: {len(convs)} of {n} finished and distinct")
    return [prompt_ids(run.tokenizer, c) for c in convs]


def response_engine(cfg: DictConfig, run: Run) -> str:
    """What generates the target's responses: responses.engine, where auto is the runtime's batched
    decoding on a CPU (the same tokens, faster than transformers' generate: docs/log/drafters.md)
    and transformers' generate on GPUs (the runtime's batches run eagerly there; not measured)."""
    engine = cfg.responses.get("engine", "auto")
    if engine == "auto":
        return "runtime" if run.device.type == "cpu" else "transformers"
    return engine


def training_examples(
    cfg: DictConfig, run: Run, target: Any, data: Conversations
) -> tuple[list[Example], list[list[int]]]:
    """Training examples (responses from the dataset or the target; none yet for on-policy data)
    and the prompts they were made from (prompts too long for trainer.max_seq_len are skipped)."""
    max_len = cfg.trainer.max_seq_len
    if cfg.responses.source == "dataset" and not any(c.has_response for c in data.train):
        raise SpecdecError(f"{cfg.data.train} has no assistant responses: use responses.source=target")
    prompts = [prompt_ids(run.tokenizer, c) for c in data.train]
    keep = [i for i, p in enumerate(prompts) if len(p) < max_len - 8]
    if len(keep) < len(prompts):
        run.say(f"skipping {len(prompts) - len(keep)} prompts longer than trainer.max_seq_len={max_len}")
    prompts = [prompts[i] for i in keep]
    if cfg.responses.source == "target" and cfg.responses.samples_per_prompt > 1:  # independent samples each
        prompts = [p for p in prompts for _ in range(cfg.responses.samples_per_prompt)]
    if cfg.responses.source == "dataset":
        examples = [encode_conversation(run.tokenizer, data.train[i], max_len) for i in keep]
        return [e for e in examples if e.n_targets], prompts
    own = [p for p in self_prompts(cfg, run, target) if len(p) < max_len - 8]  # one response each
    if cfg.responses.source == "target":
        examples = with_responses(prompts, target_responses(cfg, run, target, prompts), max_len)
        if own:  # their own cache: the data's responses are kept when only self_prompts changes
            examples += with_responses(own, target_responses(cfg, run, target, own), max_len)
        return examples, prompts + own
    return [], prompts + own


# ---------------------------------------------------------------- the loop's pieces


def make_horizon(cfg: DictConfig, run: Run) -> Horizon:
    """The steps the run trains: trainer.max_steps, cut once at the end of the warm-up (at least 10
    steps in) to what fits trainer.max_minutes and trainer.train_until, every process taking rank
    0's decision."""
    agree = lambda n: broadcast_object_list([n])[0]  # noqa: E731
    decide_at = max(cfg.optim.warmup_steps, 10)
    say = lambda line: run.main and tqdm.write(line)  # noqa: E731  (on its own line, above the progress bar)
    T = cfg.trainer
    return Horizon(T.max_steps, T.get("max_minutes"), decide_at, until=T.get("train_until"), agree=agree, say=say)


def make_optimizer_from(cfg: DictConfig, params: Any, horizon: Horizon) -> tuple[Any, Any]:
    """AdamW and its schedule from cfg.optim over the horizon's steps (params: parameters or
    groups, see train.loop.make_optimizer)."""
    o = cfg.optim
    return make_optimizer(
        params,
        lr=o.lr,
        weight_decay=o.weight_decay,
        warmup_steps=o.warmup_steps,
        max_steps=horizon,
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
    T, acc = cfg.trainer, run.accelerator
    return Batches(
        examples,
        micro_batch=T.micro_batch,
        grad_accum=T.grad_accum,
        world=acc.num_processes,
        rank=acc.process_index,
        seed=cfg.seed,
        group_by_length=T.get("group_by_length", False),
    )


def make_progress(
    cfg: DictConfig, run: Run, tracker: Tracker, start_step: int, horizon: Horizon, desc: str, postfix: tuple[str, ...]
) -> Progress:
    """The progress bar and train/* log of steps start_step..the horizon (says what it trains)."""
    T, acc = cfg.trainer, run.accelerator
    if start_step < horizon.steps:
        limit = f", at most {horizon.max_minutes:g} min (trainer.max_minutes)" if horizon.max_minutes else ""
        if T.get("train_until") is not None:
            limit += f", ending by {time.strftime('%H:%M:%S', time.localtime(T.train_until))} (trainer.train_until)"
        run.say(
            f"training steps {start_step}..{horizon.steps} ({acc.num_processes} processes, "
            f"global batch {T.micro_batch * T.grad_accum * acc.num_processes}{limit})"
        )
    return Progress(
        tracker, start=start_step, total=horizon, log_every=T.log_every, desc=desc, postfix=postfix, show=run.main
    )


def validation_due(cfg: DictConfig, done: int, last: int) -> bool:
    """A validation during training after `done` of `last` steps (the final one runs after the loop)."""
    return bool(cfg.validate.every) and done % cfg.validate.every == 0 and done < last


# ---------------------------------------------------------------- the end


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
    if m:
        parts = []  # the two rates the ratio comes from, and the drafter
        if m.get("ar_tokens_per_s"):
            parts.append(f"{m['tokens_per_s']:.1f} against {m['ar_tokens_per_s']:.1f} tok/s")
        if m.get("drafter"):
            parts.append(f"drafter {m['drafter']}")
        run.say(
            f"\ntau {m['tau']:.2f}, speedup {m['speedup']:.2f}x over autoregressive"
            + (f" ({', '.join(parts)})" if parts else "")
            + f", lossless {m['lossless']:.0%} ({m['prompts']} validation prompts)"
        )
    run.say(f"exported to {export}\ngenerate with it:\n  {generate_cmd}")


def push(cfg: DictConfig, run: Run, result: dict[str, Any], export: Path) -> None:
    """Push the export to hub.repo_id: the commit URL in result["hub"], or what failed in
    result["hub_error"] and the command that retries it in result["hub_retry"]."""
    h = cfg.hub
    try:
        result["hub"] = push_folder(export, h.repo_id, private=h.private, revision=h.revision)
        run.say(f"pushed to {result['hub']}")
    except Exception as e:  # no network, a refused token, a failed check: the run's results stay
        result["hub_error"] = str(e) if isinstance(e, SpecdecError) else f"{type(e).__name__}: {e}"
        result["hub_retry"] = push_command(export, h.repo_id, private=h.private, revision=h.revision)
