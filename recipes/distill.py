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

from recipes.common import (
    check_common,
    check_launch,
    finish,
    gathered_state_dict,
    generation_kwargs,
    load_target,
    make_optimizer_from,
    make_tracker,
    refuse,
    resume,
    run_or_exit,
    sharded,
    start,
    train_loop,
    training_examples,
    whole,
    with_responses,
)
from specdec_runtime.drafters import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.loading import resolve_dtype
from specdec_runtime.model import Decoder
from train import losses
from train.checkpoint import save_checkpoint
from train.data import Example, collate
from train.draft_model import (
    SelectedLogits,
    draft_vocab,
    drafter_from_config,
    drafter_from_pretrained,
    drafter_from_target_layers,
    use_draft_vocab,
)
from train.export import Card, export_standalone
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
    problems = check_common(cfg, SOURCES)
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


def build_drafter(cfg: DictConfig, target: Any, tokenizer: Any) -> Any:
    d = cfg.drafter
    if d.source == "target_layers":
        model = drafter_from_target_layers(target, d.num_layers)
    elif d.source == "config":
        model = drafter_from_config(
            target,
            hidden_size=d.hidden_size,
            num_layers=d.num_layers,
            intermediate_size=d.intermediate_size,
            num_heads=d.num_heads,
            num_kv_heads=d.num_kv_heads,
            init_embeddings=d.init_embeddings,
            seed=cfg.seed,
        )
    else:
        model = drafter_from_pretrained(d.name, tokenizer)
    return model.float()  # master weights in fp32; accelerate's autocast handles bf16/fp16


def run(cfg: DictConfig) -> dict[str, Any]:
    # ---------------------------------------------------------------- setup
    check_config(cfg)
    run = start(cfg)
    accelerator, device, say = run.accelerator, run.device, run.say
    if cfg.responses.source != "drafter":
        launch = check_launch(accelerator, "distill", ("zero1", "zero2", "zero3", "fsdp"))
    else:
        why = "on-policy responses (responses.source=drafter) generate with the drafter, which ZeRO-3 and FSDP split"
        launch = check_launch(accelerator, "distill", ("zero1", "zero2"), why)
    target = load_target(cfg, run)
    with whole(accelerator):
        drafter = build_drafter(cfg, target, run.tokenizer)
    if drafter.config.vocab_size != target.config.vocab_size:
        raise SpecdecError(
            f"the drafter's vocabulary ({drafter.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}): they must share the tokenizer"
        )
    # Responses: the data's own, the target's (cached on disk), or the drafter's (refreshed in the loop).
    r = cfg.responses
    examples, prompts = training_examples(cfg, run, target)

    vocab_ids = None
    if cfg.drafter.draft_vocab_size:
        counted = [e.ids for e in examples] if examples else prompts
        vocab_ids = draft_vocab(counted, cfg.drafter.draft_vocab_size, target.config.vocab_size, always=run.stop_ids)
        use_draft_vocab(drafter, vocab_ids)
        say(f"draft vocabulary: {len(vocab_ids)} of {target.config.vocab_size} tokens")
        response_tokens = torch.tensor([t for e in examples for t, m in zip(e.ids, e.loss_mask) if m])
        if len(response_tokens):
            say(f"  covering {torch.isin(response_tokens, vocab_ids).float().mean().item():.1%} of the response tokens")
    if cfg.drafter.freeze_embeddings:
        drafter.get_input_embeddings().requires_grad_(False)
    vocab_dev = vocab_ids.to(device) if vocab_ids is not None else None

    optimizer, scheduler = make_optimizer_from(cfg, [p for p in drafter.parameters() if p.requires_grad])
    student, optimizer, scheduler = accelerator.prepare(SelectedLogits(drafter), optimizer, scheduler)
    teacher = SelectedLogits(target)
    tracker = make_tracker(cfg, run, "distill")
    start_step, extra = resume(cfg, run)
    if r.source == "drafter" and "ids" in extra:
        examples = _unpack(extra)

    def refresh_on_policy(step: int) -> list[Example] | None:
        if r.source != "drafter" or (step % r.refresh_every and examples):
            return None
        model = accelerator.unwrap_model(student).model
        model.eval()
        with accelerator.autocast():
            responses = generate_responses(model, prompts, seed=cfg.seed + step, **generation_kwargs(cfg, run))
        model.train()
        examples[:] = with_responses(prompts, responses, cfg.trainer.max_seq_len)
        return examples

    # ---------------------------------------------------------------- loop
    L = cfg.loss

    def loss_fn(mb: list[Example]) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        batch = {k: v.to(device) for k, v in collate(mb, run.pad_id).items()}
        ids, attn, tmask = batch["input_ids"], batch["attention_mask"], batch["target_mask"]
        select = torch.nn.functional.pad(tmask, (0, 1)).flatten().nonzero().squeeze(1)  # [N] positions predicting
        with torch.no_grad(), accelerator.autocast():
            t_logits = teacher(ids, attn, select).float()  # [N, V]
        s_logits = student(ids, attn, select).float()  # [N, V'] (V' = draft vocabulary)
        t_draft = t_logits if vocab_dev is None else t_logits[:, vocab_dev]
        teach = losses.Teacher.top_k(t_draft, L.top_k) if L.top_k else losses.Teacher.dense(t_draft)
        per_token = losses.divergence(L.kind, s_logits, teach, beta=L.beta, temperature=L.temperature)  # [N]
        with torch.no_grad():  # acceptance estimates against the full, untempered teacher
            q = s_logits.softmax(-1)
            if vocab_dev is not None:
                q = torch.zeros_like(t_logits).index_copy_(1, vocab_dev, q)
            tvd = 0.5 * (t_logits.softmax(-1) - q).abs().sum(-1)
            top1 = (q.argmax(-1) == t_logits.argmax(-1)).float()
        return per_token.sum(), len(select), {"tvd": tvd.sum(), "top1_agree": top1.sum()}

    runtime: list[Decoder] = []  # the target as a runtime Decoder, built at the first validation

    def trained() -> Any:
        """The drafter, whole, on rank 0 (None elsewhere). Under ZeRO-3 and FSDP every process
        takes part in gathering it into a fresh copy."""
        model = accelerator.unwrap_model(student).model
        if not sharded(accelerator):
            return model
        sd = gathered_state_dict(accelerator, student)
        if not run.main:
            return None
        with whole(accelerator):
            copy = type(model)(model.config)
        if vocab_ids is not None:
            use_draft_vocab(copy, vocab_ids)
        copy.load_state_dict({k.removeprefix("model."): v for k, v in sd.items()}, strict=False)
        copy.tie_weights()
        return copy.float().to(device).eval()

    def validate_now(step: int) -> dict[str, Any]:
        """Validation on the runtime (rank 0; the other processes wait)."""
        metrics: dict[str, Any] = {}
        model = trained() if cfg.validate.enabled else None
        if cfg.validate.enabled and run.main:
            dtype = resolve_dtype("auto", device)
            runtime[:] = runtime or [runtime_decoder(target, None, device, dtype)]
            decoder = runtime_decoder(model, vocab_ids, device, dtype)
            metrics = validate(
                runtime[0],
                ModelDrafter(decoder, vocab_size=target.config.vocab_size, name="distilled"),
                run.val_prompts,
                [c.category for c in run.val_convs],
                stop_ids=run.stop_ids,
                gamma=cfg.validate.gamma,
                max_new_tokens=cfg.validate.max_new_tokens,
            )
            metrics["device"] = str(device)
            tracker.log({f"val/{k}": v for k, v in metrics.items() if isinstance(v, int | float)}, step)
        accelerator.wait_for_everyone()
        return metrics

    stats, history = train_loop(
        cfg,
        run,
        tracker,
        model=student,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_fn=loss_fn,
        examples=examples,
        start_step=start_step,
        desc="distill",
        save=save_checkpoint,
        refresh=refresh_on_policy,
        extra_state=lambda: _pack(examples) if r.source == "drafter" else None,
        postprocess=lambda s: s.update(acceptance_est=1 - s["tvd"]),
        postfix=("loss", "acceptance_est"),
        validate=validate_now,
    )

    # ---------------------------------------------------------------- validate
    final = cfg.trainer.max_steps
    metrics = validate_now(final)
    result = {"validation": metrics, "train": stats, "history": history, "step": final}

    # ---------------------------------------------------------------- export
    model = trained()
    if run.main:
        d = model.config
        card = Card(
            target=cfg.model.name,
            recipe="distill",
            data=cfg.data.train,
            setup={
                "drafter": f"{cfg.drafter.source}: {d.num_hidden_layers} layers, hidden {d.hidden_size}",
                "draft vocabulary": len(vocab_ids) if vocab_ids is not None else "full",
                "loss": _loss_name(L),
                "responses": r.source,
                "examples": len(examples),
                "steps": final,
                "global batch": cfg.trainer.micro_batch * cfg.trainer.grad_accum * accelerator.num_processes,
                "learning rate": f"{cfg.optim.lr} ({cfg.optim.schedule})",
                "processes": f"{accelerator.num_processes} ({launch})",
            },
            metrics=metrics,
            title=f"Distilled drafter for {cfg.model.name}",
            tags=["distillspec", "draft-model"],
            base_model=cfg.model.name if "/" in cfg.model.name else None,
            hub_id=cfg.hub.repo_id,
        )
        export = export_standalone(
            model,
            run.tokenizer,
            run.out / "export",
            card,
            vocab_ids=vocab_ids,
            generation_config=run.gen_cfg,
            gamma=cfg.validate.gamma,
        )
        cmd = f"specdec generate --target {cfg.model.name} --drafter {export} --gamma {cfg.validate.gamma} --baseline"
        finish(cfg, run, result, export, cmd, tracker, "distill")
    tracker.finish()
    accelerator.wait_for_everyone()
    return result


def _pack(examples: list[Example]) -> dict[str, torch.Tensor]:
    return {
        "ids": torch.tensor([t for e in examples for t in e.ids]),
        "mask": torch.tensor([m for e in examples for m in e.loss_mask]),
        "lengths": torch.tensor([len(e.ids) for e in examples]),
    }


def _unpack(t: dict[str, torch.Tensor]) -> list[Example]:
    ids, mask = t["ids"].split(t["lengths"].tolist()), t["mask"].split(t["lengths"].tolist())
    return [Example(i.tolist(), m.tolist()) for i, m in zip(ids, mask)]


def _loss_name(L: DictConfig) -> str:
    name = {"fkl": "forward KL", "rkl": "reverse KL", "jsd": f"JSD(beta={L.beta})", "tvd": "TVD"}[L.kind]
    return (
        name + (f", T={L.temperature}" if L.temperature != 1 else "") + (f", teacher top-{L.top_k}" if L.top_k else "")
    )


@hydra.main(config_path="../conf", config_name="distill", version_base=None)
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
