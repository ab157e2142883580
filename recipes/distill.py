"""Distill a stand-alone drafter from the target (DistillSpec), validate it on specdec_runtime, export it.

    python -m recipes.distill output_dir=runs/drafter trainer.max_steps=300
    python -m recipes.distill experiment=quickstart output_dir=runs/quickstart
    accelerate launch --config_file conf/accelerate/multi_gpu.yaml -m recipes.distill model=qwen2.5-0.5b-instruct

Setup (config checks, target, data, responses, drafter), loop (token-normalized divergence between
the drafter's and the target's next-token distributions on response tokens), validate (tau,
speedup, losslessness on the runtime), export (HF folder + model card, optional Hub push).
"""

from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from recipes.checks import check_conversations, check_shard, refuse, run_or_exit
from recipes.data import Conversations, conversations, generation_kwargs, training_examples
from recipes.plan import distill_plan, drafter_config, dry_run
from recipes.run import (
    Run,
    finish,
    load_target,
    make_batches,
    make_horizon,
    make_optimizer_from,
    make_progress,
    make_tracker,
    resume,
    start,
    target_card,
    validation_due,
)
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.model import Decoder
from train import losses
from train.checkpoint import save_checkpoint
from train.data import Example, collate, with_responses
from train.draft_model import (
    SelectedLogits,
    draft_vocab,
    drafter_from_config,
    drafter_from_pretrained,
    drafter_from_target_layers,
    use_draft_vocab,
)
from train.export import Card, export_standalone
from train.launch import check_launch, gathered_state_dict, sharded, unpartitioned, unwrap
from train.loop import every, optimizer_step
from train.responses import generate_responses
from train.validate import runtime_decoder, validate

SOURCES = ("target", "dataset", "drafter")
DRAFTERS = ("target_layers", "config", "pretrained")


def check_config(cfg: DictConfig) -> None:
    """Refuse bad values before anything is loaded."""
    try:
        losses.check_loss(cfg.loss.kind, cfg.loss.beta, cfg.loss.top_k > 0)
    except ValueError as e:
        raise SpecdecError(f"loss: {e}") from e
    problems = check_conversations(cfg, SOURCES)
    problems += check_shard(cfg, "distill")
    if cfg.drafter.source not in DRAFTERS:
        problems.append(f"drafter.source='{cfg.drafter.source}': use drafter=target_layers|small_llama|pretrained")
    if cfg.responses.refresh_every < 1:
        problems.append(f"responses.refresh_every={cfg.responses.refresh_every} must be >= 1")
    if cfg.loss.temperature <= 0:
        problems.append(f"loss.temperature={cfg.loss.temperature} must be positive")
    if cfg.validate.gamma < 1:
        problems.append("validate.gamma must be >= 1")
    if cfg.drafter.draft_vocab_size < 0:
        problems.append(f"drafter.draft_vocab_size={cfg.drafter.draft_vocab_size} must be >= 0 (0 = full vocabulary)")
    refuse(problems)


def run(cfg: DictConfig) -> dict[str, Any]:
    # ---------------------------------------------------------------- setup
    check_config(cfg)
    if cfg.dry_run:  # the plan from config.json alone: nothing loads, nothing is written
        return dry_run(cfg, "distill", lambda hf: distill_plan(cfg, hf, drafter_config(cfg, hf)))
    run = start(cfg)
    data = conversations(cfg, run)
    accelerator, trainer, responses = run.accelerator, cfg.trainer, cfg.responses
    on_policy = responses.source == "drafter"
    launch = check_distill_launch(run, on_policy)
    target = load_target(cfg, run)
    drafter = build_drafter(cfg, run, target)
    examples, prompts = training_examples(cfg, run, target, data)  # on-policy: none yet (the loop makes them)
    vocab_ids = draft_vocabulary(cfg, run, drafter, target, examples, prompts)
    horizon = make_horizon(cfg, run)  # trainer.max_steps, or what fits max_minutes / train_until
    optimizer, scheduler = make_optimizer_from(cfg, [p for p in drafter.parameters() if p.requires_grad], horizon)
    student, optimizer, scheduler = accelerator.prepare(SelectedLogits(drafter), optimizer, scheduler)
    loss = Distillation(SelectedLogits(target), student, vocab_ids, cfg.loss, run)
    tracker = make_tracker(cfg, run, "distill")
    resumed = resume(cfg, run, optimizer, scheduler, horizon)  # + config.yaml: what runs from here on
    if on_policy and "ids" in resumed.extra:
        examples = examples_from_tensors(resumed.extra)
    validation = Validation(cfg, run, data, target, student, vocab_ids, tracker)

    # ---------------------------------------------------------------- loop
    progress = make_progress(cfg, run, tracker, resumed.step, horizon, "distill", postfix=("loss", "acceptance_est"))
    batches, stats, history = None, resumed.stats, resumed.history
    for step in horizon.steps_from(resumed.step):
        if on_policy and (step % responses.refresh_every == 0 or not examples):  # the drafter's own samples
            examples, batches = drafter_responses(cfg, run, student, prompts, step), None
        batches = batches or make_batches(cfg, run, examples)
        stats = optimizer_step(
            accelerator, student, optimizer, scheduler, batches.step(step), loss, trainer.max_grad_norm
        )
        stats["acceptance_est"] = 1 - stats["tvd"]
        done = step + 1
        progress.update(done, stats, epoch=batches.epoch(done))
        if every(trainer.checkpoint_every, done, horizon.steps):
            tensors = examples_to_tensors(examples) if on_policy else None
            state = {"stats": stats, "history": history, "horizon": horizon.state()}
            save_checkpoint(
                accelerator, run.checkpoints, step=done, state=state, tensors=tensors, keep=trainer.keep_checkpoints
            )
        if validation_due(cfg, done, horizon.steps):
            history.append({"step": done, **validation(done)})
    progress.close()

    # ---------------------------------------------------------------- validate
    metrics = validation(horizon.steps)
    result = {"validation": metrics, "train": stats, "history": history, "step": horizon.steps}

    # ---------------------------------------------------------------- export
    model = validation.trained()
    if run.main:
        # The export's engine checks build models (on the meta device) on rank 0 alone: under ZeRO-3,
        # transformers would partition them with a broadcast the other rank never joins (a hang)
        with unpartitioned(run.accelerator):
            export = write_export(cfg, run, model, vocab_ids, metrics, len(examples), launch, horizon.steps)
        cmd = f"specdec generate --target {cfg.model.name} --drafter {export} --gamma {cfg.validate.gamma} --baseline"
        finish(cfg, run, result, export, cmd, tracker, "distill")
    tracker.finish()
    return result


def check_distill_launch(run: Run, on_policy: bool) -> str:
    """The launcher kind, refused (before any model loads) where distillation does not fit it."""
    if not on_policy:
        return check_launch(run.accelerator, "distill", ("zero1", "zero2", "zero3", "fsdp"))
    why = "on-policy responses (responses.source=drafter) generate with the drafter, which ZeRO-3 and FSDP split"
    return check_launch(run.accelerator, "distill", ("zero1", "zero2"), why)


def build_drafter(cfg: DictConfig, run: Run, target: Any) -> Any:
    """The drafter to train (drafter.source), in fp32 master weights (autocast does bf16/fp16)."""
    drafter = cfg.drafter
    with unpartitioned(run.accelerator):
        if drafter.source == "target_layers":
            model = drafter_from_target_layers(target, drafter.num_layers)
        elif drafter.source == "config":
            model = drafter_from_config(
                target,
                hidden_size=drafter.hidden_size,
                num_layers=drafter.num_layers,
                intermediate_size=drafter.intermediate_size,
                num_heads=drafter.num_heads,
                num_kv_heads=drafter.num_kv_heads,
                init_embeddings=drafter.init_embeddings,
                seed=cfg.seed,
            )
        else:
            model = drafter_from_pretrained(drafter.name, run.tokenizer)
    if model.config.vocab_size != target.config.vocab_size:
        raise SpecdecError(
            f"the drafter's vocabulary ({model.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}): they must share the tokenizer"
        )
    if drafter.freeze_embeddings:
        model.get_input_embeddings().requires_grad_(False)
    return model.float()


def draft_vocabulary(
    cfg: DictConfig, run: Run, drafter: Any, target: Any, examples: list[Example], prompts: list[list[int]]
) -> torch.Tensor | None:
    """drafter.draft_vocab_size > 0: the most frequent tokens of the data (responses, else prompts),
    and the drafter's lm_head cut to them; None for the full vocabulary."""
    size = cfg.drafter.draft_vocab_size
    if not size:
        return None
    counted = [e.ids for e in examples] if examples else prompts
    vocab_ids = draft_vocab(counted, size, target.config.vocab_size, always=run.stop_ids)
    use_draft_vocab(drafter, vocab_ids)
    run.print_once(f"draft vocabulary: {len(vocab_ids)} of {target.config.vocab_size} tokens")
    response_tokens = torch.tensor([t for e in examples for t, m in zip(e.ids, e.loss_mask) if m])
    if len(response_tokens):
        run.print_once(
            f"  covering {torch.isin(response_tokens, vocab_ids).float().mean().item():.1%} of the response tokens"
        )
    return vocab_ids


class Distillation:
    """The loop's loss_fn: the divergence between the drafter's and the target's next-token
    distributions at the response positions of a micro-batch (train.losses), with the acceptance
    estimates 1 - TVD and top-1 agreement against the full, untempered teacher."""

    def __init__(
        self, teacher: SelectedLogits, student: Any, vocab_ids: torch.Tensor | None, loss: DictConfig, run: Run
    ):
        self.teacher, self.student, self.loss, self.run = teacher, student, loss, run
        self.vocab = vocab_ids.to(run.device) if vocab_ids is not None else None

    def __call__(self, mb: list[Example]) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        loss, accelerator = self.loss, self.run.accelerator
        batch = {k: v.to(self.run.device) for k, v in collate(mb, self.run.pad_id).items()}
        ids, attn, tmask = batch["input_ids"], batch["attention_mask"], batch["target_mask"]
        select = torch.nn.functional.pad(tmask, (0, 1)).flatten().nonzero().squeeze(1)  # [N] positions predicting
        with torch.no_grad(), accelerator.autocast():
            t_logits = self.teacher(ids, attn, select).float()  # [N, V]
        s_logits = self.student(ids, attn, select).float()  # [N, V'] (V' = draft vocabulary)
        t_draft = t_logits if self.vocab is None else t_logits[:, self.vocab]
        teach = losses.Teacher.top_k(t_draft, loss.top_k) if loss.top_k else losses.Teacher.dense(t_draft)
        per_token = losses.divergence(loss.kind, s_logits, teach, beta=loss.beta, temperature=loss.temperature)  # [N]
        with torch.no_grad():  # acceptance estimates against the full, untempered teacher
            q = s_logits.softmax(-1)
            if self.vocab is not None:
                q = torch.zeros_like(t_logits).index_copy_(1, self.vocab, q)
            tvd = 0.5 * (t_logits.softmax(-1) - q).abs().sum(-1)
            top1 = (q.argmax(-1) == t_logits.argmax(-1)).float()
        return per_token.sum(), len(select), {"tvd": tvd.sum(), "top1_agree": top1.sum()}


def drafter_responses(cfg: DictConfig, run: Run, student: Any, prompts: list[list[int]], step: int) -> list[Example]:
    """On-policy data (DistillSpec): the drafter's own samples for the prompts, scored by the target."""
    accelerator = run.accelerator
    model = unwrap(accelerator, student).model
    model.eval()
    with accelerator.autocast():
        responses = generate_responses(model, prompts, seed=cfg.seed + step, **generation_kwargs(cfg, run))
    model.train()
    return with_responses(prompts, responses, cfg.trainer.max_seq_len)


class Validation:
    """The drafter on specdec_runtime against the target (rank 0; the other processes wait):
    tau, speedup, losslessness, logged as val/*."""

    def __init__(
        self,
        cfg: DictConfig,
        run: Run,
        data: Conversations,
        target: Any,
        student: Any,
        vocab_ids: torch.Tensor | None,
        tracker: Any,
    ):
        self.cfg, self.run, self.data, self.target, self.student = cfg, run, data, target, student
        self.vocab_ids, self.tracker = vocab_ids, tracker
        self.runtime: Decoder | None = None  # the target as a runtime Decoder, built at the first validation

    def trained(self) -> Any:
        """The drafter, whole, on rank 0 (None elsewhere). Under ZeRO-3 and FSDP every process
        takes part in gathering it into a fresh copy."""
        accelerator, run = self.run.accelerator, self.run
        model = unwrap(accelerator, self.student).model
        if not sharded(accelerator):
            return model
        sd = gathered_state_dict(accelerator, self.student)
        if not run.main:
            return None
        with unpartitioned(accelerator):
            copy = type(model)(model.config)
        if self.vocab_ids is not None:
            use_draft_vocab(copy, self.vocab_ids)
        copy.load_state_dict({k.removeprefix("model."): v for k, v in sd.items()}, strict=False)
        copy.tie_weights()
        return copy.float().to(run.device).eval()

    def __call__(self, step: int) -> dict[str, Any]:
        cfg, run = self.cfg, self.run
        metrics: dict[str, Any] = {}
        model = self.trained() if cfg.validate.enabled else None
        if cfg.validate.enabled and run.main:
            self.runtime = self.runtime or runtime_decoder(self.target, None, run.device)
            decoder = runtime_decoder(model, self.vocab_ids, run.device)
            metrics = validate(
                self.runtime,
                ModelDrafter(decoder, vocab_size=self.target.config.vocab_size, name="distilled"),
                self.data.val_prompts,
                self.data.val_categories,
                stop_ids=run.stop_ids,
                gamma=cfg.validate.gamma,
                max_new_tokens=cfg.validate.max_new_tokens,
                threads=run.threads.get("decode"),
                batch_sizes=list(cfg.validate.batch_sizes),
            )
            metrics["device"] = str(run.device)
            self.tracker.log({f"val/{k}": v for k, v in metrics.items() if isinstance(v, int | float)}, step)
        run.accelerator.wait_for_everyone()
        return metrics


def write_export(
    cfg: DictConfig,
    run: Run,
    model: Any,
    vocab_ids: torch.Tensor | None,
    metrics: dict[str, Any],
    n_examples: int,
    launch: str,
    steps: int,
) -> Any:
    """export/: a plain HF folder (+ specdec/draft_vocab.safetensors) with a model card."""
    config, accelerator = model.config, run.accelerator
    card = Card(
        **target_card(cfg, run),
        recipe="distill",
        data=cfg.data.train,
        setup={
            "drafter": f"{cfg.drafter.source}: {config.num_hidden_layers} layers, hidden {config.hidden_size}",
            "draft vocabulary": len(vocab_ids) if vocab_ids is not None else "full",
            "loss": _loss_name(cfg.loss),
            "responses": cfg.responses.source,
            "examples": n_examples,
            "steps": steps,
            "global batch": cfg.trainer.micro_batch * cfg.trainer.grad_accum * accelerator.num_processes,
            "learning rate": f"{cfg.optim.lr} ({cfg.optim.schedule})",
            "processes": f"{accelerator.num_processes} ({launch})",
        },
        metrics=metrics,
        tags=["distillspec", "draft-model"],
        hub_id=cfg.hub.repo_id,
    )
    return export_standalone(
        model,
        run.tokenizer,
        run.out / "export",
        card,
        vocab_ids=vocab_ids,
        generation_config=run.gen_cfg,
        gamma=cfg.validate.gamma,
    )


def examples_to_tensors(examples: list[Example]) -> dict[str, torch.Tensor]:
    """On-policy examples as checkpoint tensors (the data a resumed run continues with)."""
    return {
        "ids": torch.tensor([t for e in examples for t in e.ids]),
        "mask": torch.tensor([m for e in examples for m in e.loss_mask]),
        "lengths": torch.tensor([len(e.ids) for e in examples]),
    }


def examples_from_tensors(tensors: dict[str, torch.Tensor]) -> list[Example]:
    """examples_to_tensors() undone (a resumed run's on-policy examples)."""
    lengths = tensors["lengths"].tolist()
    ids, mask = tensors["ids"].split(lengths), tensors["mask"].split(lengths)
    return [Example(i.tolist(), m.tolist()) for i, m in zip(ids, mask)]


def _loss_name(loss: DictConfig) -> str:
    name = {"fkl": "forward KL", "rkl": "reverse KL", "jsd": f"JSD(beta={loss.beta})", "tvd": "TVD"}[loss.kind]
    return (
        name
        + (f", T={loss.temperature}" if loss.temperature != 1 else "")
        + (f", teacher top-{loss.top_k}" if loss.top_k else "")
    )


@hydra.main(config_path="../conf", config_name="distill", version_base=None)
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
