"""Pretrain a model with multi-token-prediction heads (Gloeckle et al. 2024), or attach heads to a
pretrained one, then validate MTP self-speculation on specdec_runtime and export.

    python -m recipes.mtp output_dir=runs/mtp                              # from scratch on the stdlib corpus
    python -m recipes.mtp experiment=mtp_quickstart output_dir=runs/mtp-quick
    python -m recipes.mtp mtp.init=pretrained mtp.trainable=new_heads output_dir=runs/mtp-smollm2
    python -m recipes.mtp data.corpus='data/*.jsonl' data.column=text mtp.num_heads=8
    accelerate launch --config_file conf/accelerate/multi_gpu.yaml -m recipes.mtp

Setup (config checks, tokenizer, packed corpus, model), loop (sequential per-head backward, or
naive for comparison; per-head loss and accuracy logged), evaluate (per-head held-out loss),
validate (greedy MTP self-speculation vs autoregressive on held-out prompts: tau, speedup,
losslessness), export (trunk + head 0 as a transformers causal LM; heads 1.. in
mtp_heads.safetensors with mtp_config.json; a model card).
"""

import copy
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from recipes.checks import check_shard, check_trainer, refuse, run_or_exit, target_hub_id
from recipes.plan import dry_run, mtp_plan
from recipes.run import (
    Run,
    finish,
    make_batches,
    make_horizon,
    make_optimizer_from,
    make_progress,
    make_tracker,
    resume,
    start,
    validation_due,
)
from specdec_runtime.drafters.mtp import MTP_WEIGHTS, MTPDrafter, MTPHeads
from specdec_runtime.errors import SpecdecError
from specdec_runtime.hardware import resolve_dtype
from specdec_runtime.loading import load_hf_model
from specdec_runtime.paths import cache_root
from train.checkpoint import save_checkpoint
from train.corpus import corpus_documents, packed_corpus, train_tokenizer
from train.export import Card, export_mtp
from train.launch import check_launch, unwrap
from train.loop import every, optimizer_step
from train.mtp import TRAINABLE, MTPModel, PackedSequence, average_gradients, evaluate, heads_state_dict, mtp_step
from train.validate import runtime_decoder, validate

INITS = ("scratch", "pretrained")
BACKWARDS = ("sequential", "naive")


def loss_weights(cfg: DictConfig) -> list[float]:
    weights = cfg.mtp.loss_weights
    return [1.0] * cfg.mtp.num_heads if weights is None else [float(x) for x in weights]


def check_config(cfg: DictConfig) -> None:
    """Refuse bad values before anything is loaded."""
    mtp, trainer = cfg.mtp, cfg.trainer
    problems = check_trainer(cfg)
    problems += check_shard(cfg, "mtp")
    if not isinstance(mtp.num_heads, int) or mtp.num_heads < 1:
        problems.append(f"mtp.num_heads={mtp.num_heads} must be a positive integer (1 = plain next-token training)")
    else:
        weights = loss_weights(cfg)
        if len(weights) != mtp.num_heads or min(weights) < 0 or sum(weights) <= 0:
            problems.append(f"mtp.loss_weights={list(weights)}: give {mtp.num_heads} non-negative weights, not all 0")
        if trainer.max_seq_len <= mtp.num_heads:
            problems.append(f"trainer.max_seq_len={trainer.max_seq_len} must exceed mtp.num_heads={mtp.num_heads}")
    if cfg.data.train_tokenizer and (mtp.init != "scratch" or cfg.data.train_tokenizer < 256):
        problems.append("data.train_tokenizer: a vocabulary size >= 256, with mtp.init=scratch only (0 = model's)")
    if mtp.init not in INITS:
        problems.append(f"mtp.init='{mtp.init}': use scratch (new model from mtp.architecture) or pretrained")
    if mtp.trainable not in TRAINABLE:
        problems.append(f"mtp.trainable='{mtp.trainable}': use one of {', '.join(TRAINABLE)}")
    if mtp.backward not in BACKWARDS:
        problems.append(f"mtp.backward='{mtp.backward}': use sequential (memory of one head) or naive")
    if mtp.init == "scratch":
        architecture = mtp.architecture
        if (
            architecture.trunk_layers < 1
            or architecture.hidden_size % architecture.num_attention_heads
            or architecture.num_attention_heads % architecture.num_key_value_heads
        ):
            problems.append(
                "mtp.architecture: need trunk_layers >= 1, hidden_size divisible by num_attention_heads, "
                "num_attention_heads divisible by num_key_value_heads"
            )
        if trainer.max_seq_len > architecture.max_position_embeddings:
            problems.append(
                f"trainer.max_seq_len={trainer.max_seq_len} exceeds mtp.architecture.max_position_embeddings"
            )
        if cfg.validate.prompt_tokens + cfg.validate.max_new_tokens > architecture.max_position_embeddings:
            problems.append("validate.prompt_tokens + validate.max_new_tokens exceed the model's context")
    if cfg.validate.prompt_tokens < 1 or cfg.validate.prompt_tokens >= trainer.max_seq_len:
        problems.append(f"validate.prompt_tokens={cfg.validate.prompt_tokens} must be in 1..trainer.max_seq_len - 1")
    refuse(problems)


def build_model(cfg: DictConfig, tokenizer: Any) -> MTPModel:
    mtp = cfg.mtp
    if mtp.init == "pretrained":
        lm = load_hf_model(cfg.model.name, dtype=torch.float32)
        if cfg.trainer.max_seq_len > lm.config.max_position_embeddings:
            raise SpecdecError(
                f"trainer.max_seq_len exceeds {cfg.model.name}'s context of {lm.config.max_position_embeddings}"
            )
        model = MTPModel.attach(lm, mtp.num_heads)
    else:
        from transformers import LlamaConfig

        architecture = mtp.architecture
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=architecture.hidden_size,
            intermediate_size=architecture.intermediate_size,
            num_hidden_layers=architecture.trunk_layers + 1,  # the exported model: trunk + head 0
            num_attention_heads=architecture.num_attention_heads,
            num_key_value_heads=architecture.num_key_value_heads,
            max_position_embeddings=architecture.max_position_embeddings,
            rope_theta=architecture.rope_theta,
            tie_word_embeddings=architecture.tie_word_embeddings,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(cfg.seed)
        model = MTPModel.from_config(config, mtp.num_heads)
    model.lm.config.architectures = [type(model.lm).__name__]
    model.set_trainable(mtp.trainable)
    return model


def no_sync(model: Any) -> Any:
    """DDP's no_sync (the step reduces gradients itself), or nothing for a plain module."""
    return model.no_sync() if hasattr(model, "no_sync") else nullcontext()


def own_tokenizer(cfg: DictConfig, out: Path) -> Any:
    """The run's BPE tokenizer (data.train_tokenizer tokens) trained on the training documents."""
    from transformers import AutoTokenizer

    folder = out / "tokenizer"
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    data = cfg.data
    train, _ = corpus_documents(
        data.corpus,
        split=data.split,
        column=data.column,
        val_fraction=data.val_fraction,
        max_documents=data.max_documents,
    )
    return train_tokenizer(train, data.train_tokenizer, folder)


def make_backward_fn(accelerator: Any, wrapped: Any, weights: list[float], sequential: bool) -> Any:
    """The loop's backward_fn: one micro-batch's MTP forward + backward, and on the last micro-batch
    of an optimizer step the gradient average over processes (once; DDP itself never reduces)."""
    model = unwrap(accelerator, wrapped)
    trainable = [p for p in model.parameters() if p.requires_grad]

    def backward_fn(mb: list[PackedSequence], scale: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ids = torch.stack([s.ids for s in mb]).to(accelerator.device)
        with no_sync(wrapped):
            loss, metrics = mtp_step(
                model,
                ids,
                weights=weights,
                scale=scale,
                backward=accelerator.backward,
                sequential=sequential,
                autocast=accelerator.autocast,
            )
        if accelerator.sync_gradients and accelerator.num_processes > 1:
            average_gradients(trainable, accelerator.num_processes)
        return loss, metrics

    return backward_fn


def validation_prompts(val: torch.Tensor, n: int, prompt_tokens: int) -> list[list[int]]:
    """The first prompt_tokens tokens of n held-out sequences spread over the held-out split."""
    idx = torch.linspace(0, val.shape[0] - 1, min(n, val.shape[0])).long().unique()
    return [val[i, :prompt_tokens].tolist() for i in idx]


def run(cfg: DictConfig) -> dict[str, Any]:
    # ---------------------------------------------------------------- setup
    check_config(cfg)
    if cfg.dry_run:  # the plan from config.json alone: nothing loads, nothing is written
        return dry_run(cfg, "mtp", lambda hf: mtp_plan(cfg, hf))
    run = start(cfg)
    accelerator, trainer, mtp = run.accelerator, cfg.trainer, cfg.mtp
    check_launch(
        accelerator,
        "mtp",
        (),
        "it runs its own per-head backward and gradient reduction, which DeepSpeed and FSDP would bypass",
    )
    if cfg.data.train_tokenizer:
        with accelerator.main_process_first():  # rank 0 trains it (or finds it from an earlier start)
            run = run.with_tokenizer(own_tokenizer(cfg, run.out))
    train_seqs, val_seqs, info = corpus(cfg, run)
    n, weights, sequential = mtp.num_heads, loss_weights(cfg), mtp.backward == "sequential"
    examples = [PackedSequence(s, trainer.max_seq_len - n) for s in train_seqs]
    model = build_model(cfg, run.tokenizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    run.print_once(
        f"model: {model.trunk_layers}-layer trunk + {n} heads, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        f"({sum(p.numel() for p in trainable) / 1e6:.1f}M trained: {mtp.trainable}), {mtp.backward} backward"
    )
    horizon = make_horizon(cfg, run)  # trainer.max_steps, or what fits max_minutes / train_until
    optimizer, scheduler = make_optimizer_from(cfg, trainable, horizon)
    wrapped, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    model = unwrap(accelerator, wrapped)
    tracker = make_tracker(cfg, run, "mtp")
    backward = make_backward_fn(accelerator, wrapped, weights, sequential)
    held_out = HeldOut(model, val_seqs[: cfg.validate.eval_sequences], trainer.micro_batch, accelerator, tracker)
    resumed = resume(cfg, run, optimizer, scheduler, horizon)  # + config.yaml: what runs from here on

    # ---------------------------------------------------------------- loop
    progress = make_progress(
        cfg, run, tracker, resumed.step, horizon, "mtp", postfix=("loss", "loss_0", f"acc_{n - 1}")
    )
    batches, stats, history = make_batches(cfg, run, examples), resumed.stats, resumed.history
    for step in horizon.steps_from(resumed.step):
        micro = batches.step(step)
        stats = optimizer_step(accelerator, wrapped, optimizer, scheduler, micro, None, trainer.max_grad_norm,
                               backward_fn=backward)  # fmt: skip
        done = step + 1
        progress.update(done, stats, epoch=batches.epoch(done))
        if every(trainer.checkpoint_every, done, horizon.steps):
            state = {"stats": stats, "history": history, "horizon": horizon.state()}
            save_checkpoint(accelerator, run.checkpoints, step=done, state=state, keep=trainer.keep_checkpoints)
        if validation_due(cfg, done, horizon.steps):
            history.append({"step": done, **held_out(done)})
    progress.close()

    # ---------------------------------------------------------------- evaluate + validate
    model.eval()
    heldout = held_out(horizon.steps)
    run.print_once(
        "held-out per head: "
        + ", ".join(f"{i}: loss {heldout[f'loss_{i}']:.3f} acc {heldout[f'acc_{i}']:.2f}" for i in range(n))
    )
    result: dict[str, Any] = {"train": stats, "history": history, "heldout": heldout, "step": horizon.steps}
    if run.main and cfg.validate.enabled and n > 1:
        result["validation"] = validate_mtp(cfg, run, model, val_seqs)

    # ---------------------------------------------------------------- export (rank 0)
    if run.main:
        export = write_export(cfg, run, model, info, result)
        cmd = f"specdec generate --target {export} --drafter mtp --no-chat-template"
        finish(cfg, run, result, export, cmd, tracker, "mtp")
    tracker.finish()
    return result


def corpus(cfg: DictConfig, run: Run) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(training sequences, held-out sequences, counts) of data.corpus, packed to trainer.max_seq_len
    (rank 0 tokenizes into the cache, the others read it)."""
    data, trainer = cfg.data, cfg.trainer
    cache = Path(data.cache_dir).expanduser() if data.cache_dir else cache_root() / "corpus"
    with run.accelerator.main_process_first():
        train_seqs, val_seqs, info = packed_corpus(
            run.tokenizer,
            data.corpus,
            seq_len=trainer.max_seq_len,
            cache_dir=cache,
            split=data.split,
            column=data.column,
            val_fraction=data.val_fraction,
            max_documents=data.max_documents,
            progress=run.main,
        )
    run.print_once(
        f"corpus {data.corpus}: {train_seqs.numel():,} training tokens ({info['train_documents']} documents), "
        f"{val_seqs.numel():,} held-out ({info['val_documents']} documents), sequences of {trainer.max_seq_len}"
    )
    return train_seqs, val_seqs, info


class HeldOut:
    """Per-head loss and top-1 accuracy on held-out sequences, logged as val/*."""

    def __init__(self, model: MTPModel, seqs: torch.Tensor, batch: int, accelerator: Any, tracker: Any):
        self.model, self.seqs, self.batch, self.accelerator, self.tracker = model, seqs, batch, accelerator, tracker

    def __call__(self, step: int) -> dict[str, Any]:
        metrics = evaluate(self.model, self.seqs, self.batch, self.accelerator.autocast)
        self.tracker.log({f"val/{k}": v for k, v in metrics.items()}, step)
        return metrics


def runtime_drafter(model: MTPModel, device: torch.device, dtype: torch.dtype) -> tuple[Any, MTPDrafter]:
    """The trained model on specdec_runtime (trunk + head 0) and its MTP drafter, as the export loads them."""
    target = runtime_decoder(model.lm, None, device, dtype)
    heads = MTPHeads.from_hf_state_dict(
        target.config, heads_state_dict(model), model.num_heads, model.trunk_layers, device, dtype
    )
    return target, MTPDrafter(heads, target)


def validate_mtp(cfg: DictConfig, run: Run, model: MTPModel, val_seqs: torch.Tensor) -> dict[str, Any]:
    device = run.device
    target, drafter = runtime_drafter(model, device, resolve_dtype(cfg.model.dtype, device))
    prompts = validation_prompts(val_seqs, cfg.validate.num_prompts, cfg.validate.prompt_tokens)
    gamma = cfg.validate.gamma or model.num_heads - 1
    metrics = validate(
        target,
        drafter,
        prompts,
        [None] * len(prompts),
        stop_ids=frozenset({run.tokenizer.eos_token_id}),
        gamma=gamma,
        max_new_tokens=cfg.validate.max_new_tokens,
        threads=run.threads.get("decode"),
    )
    metrics["device"] = str(device)
    return metrics


def write_export(cfg: DictConfig, run: Run, model: MTPModel, info: dict[str, Any], result: dict[str, Any]) -> Path:
    """export/: the causal LM (trunk + head 0), mtp_heads.safetensors + mtp_config.json, a model card."""
    from transformers import GenerationConfig

    mtp, n = cfg.mtp, model.num_heads
    tokenizer = run.tokenizer
    gen_cfg = run.gen_cfg
    if mtp.init == "scratch":  # a base model: no chat template, plain end-of-text (gen_cfg was model.name's)
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = None
        gen_cfg = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=run.pad_id
        )
    meta = {
        "format": "specdec-mtp",
        "num_heads": n,
        "trunk_layers": model.trunk_layers,
        "head_layer": type(model.head_layer(0)).__name__,
        "weights": MTP_WEIGHTS,
        "loss_weights": loss_weights(cfg),
        "keys": "heads.{i}.<decoder layer keys>, i = 1..num_heads-1; head 0 is the model's last layer",
    }
    heldout = result["heldout"]
    card = Card(
        target="itself",
        recipe="mtp",
        data=f"{cfg.data.corpus} ({info['train_documents']} documents)",
        setup={
            "init": mtp.init if mtp.init == "scratch" else f"pretrained {cfg.model.name}",
            "heads": n,
            "trunk layers": model.trunk_layers,
            "trainable": mtp.trainable,
            "loss weights": loss_weights(cfg),
            "steps": result["step"],
            "sequence length": cfg.trainer.max_seq_len,
            "held-out loss per head": [heldout[f"loss_{i}"] for i in range(n)],
            "held-out top-1 per head": [heldout[f"acc_{i}"] for i in range(n)],
        },
        metrics=result.get("validation"),
        title=f"{run.out.name}: {n}-head multi-token prediction",
        summary=(
            f"A causal LM trained with multi-token prediction ({n} heads, Gloeckle et al. 2024) by specdec's "
            "`mtp` recipe. The model folder is an ordinary transformers model (trunk + next-token head); "
            f"heads 1..{n - 1} are in `{MTP_WEIGHTS}` and let specdec_runtime decode it self-speculatively, "
            "with exactly its own output."
        ),
        tags=["multi-token-prediction"],
        target_hub_id=None if mtp.init == "scratch" else target_hub_id(cfg),
        hub_id=cfg.hub.repo_id,
    )
    return export_mtp(
        model.lm, heads_state_dict(model), meta, tokenizer, run.out / "export", card, generation_config=gen_cfg
    )


@hydra.main(config_path="../conf", config_name="mtp", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
