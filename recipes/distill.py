"""Distill a stand-alone drafter from the target (DistillSpec), validate it on specdec_runtime, export it.

    python -m recipes.distill output_dir=runs/drafter trainer.max_steps=300
    python -m recipes.distill experiment=quickstart output_dir=runs/quickstart
    accelerate launch --config_file conf/accelerate/multi_gpu.yaml -m recipes.distill model=qwen2.5-0.5b-instruct

Setup (config checks, target, data, responses, drafter), loop (token-normalized divergence between
the drafter's and the target's next-token distributions on response tokens), validate (tau,
speedup, losslessness on the runtime), export (HF folder + model card, optional Hub push).
"""

import json
import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from accelerate.utils import gather_object
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specdec_runtime.drafters import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.loading import cache_root, load_hf_model, resolve_dtype, resolve_model, stop_token_ids
from specdec_runtime.model import Decoder
from train import losses
from train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from train.data import Batches, Conversation, Example, collate, encode_conversation, load_conversations, prompt_ids
from train.draft_model import (
    SelectedLogits,
    draft_vocab,
    drafter_from_config,
    drafter_from_pretrained,
    drafter_from_target_layers,
    use_draft_vocab,
)
from train.export import export_hf_drafter, model_card, push_to_hub, write_model_card
from train.loop import MIXED_PRECISION, make_accelerator, make_optimizer, optimizer_step
from train.responses import cache_key, generate_responses
from train.tracking import KINDS as TRACKING_KINDS
from train.tracking import Tracker
from train.validate import runtime_decoder, validate

SOURCES = ("target", "dataset", "drafter")
DRAFTERS = ("target_layers", "config", "pretrained")


def check_config(cfg: DictConfig) -> None:
    """Refuse bad values before anything is loaded."""
    try:
        losses.check_loss(cfg.loss.kind, cfg.loss.beta, cfg.loss.top_k > 0)
    except ValueError as e:
        raise SpecdecError(f"loss: {e}") from e
    problems = []
    if cfg.responses.source not in SOURCES:
        problems.append(f"responses.source='{cfg.responses.source}': use one of {', '.join(SOURCES)}")
    if cfg.drafter.source not in DRAFTERS:
        problems.append(f"drafter.source='{cfg.drafter.source}': use drafter=target_layers|small_llama|pretrained")
    if cfg.tracking.kind not in TRACKING_KINDS:
        problems.append(f"tracking.kind='{cfg.tracking.kind}': use tracking=none or tracking=wandb")
    if cfg.trainer.mixed_precision not in MIXED_PRECISION:
        problems.append(f"trainer.mixed_precision='{cfg.trainer.mixed_precision}': use no, bf16 or fp16")
    for key in ("max_steps", "micro_batch", "grad_accum", "max_seq_len", "log_every", "checkpoint_every"):
        if not isinstance(cfg.trainer[key], int) or cfg.trainer[key] < 1:
            problems.append(f"trainer.{key}={cfg.trainer[key]} must be a positive integer")
    for key, low in (("max_new_tokens", 1), ("batch_size", 1), ("refresh_every", 1)):
        if cfg.responses[key] < low:
            problems.append(f"responses.{key}={cfg.responses[key]} must be >= {low}")
    if cfg.loss.temperature <= 0:
        problems.append(f"loss.temperature={cfg.loss.temperature} must be positive")
    if cfg.validate.gamma < 1 or cfg.validate.max_new_tokens < 1:
        problems.append("validate.gamma and validate.max_new_tokens must be >= 1")
    if cfg.drafter.draft_vocab_size < 0:
        problems.append(f"drafter.draft_vocab_size={cfg.drafter.draft_vocab_size} must be >= 0 (0 = full vocabulary)")
    if problems:
        raise SpecdecError("invalid config:\n  " + "\n  ".join(problems))


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


def with_responses(prompts: list[list[int]], responses: list[list[int]], max_len: int) -> list[Example]:
    out = []
    for p, r in zip(prompts, responses):
        if r:
            ex = Example((p + r)[:max_len], ([False] * len(p) + [True] * len(r))[:max_len])
            if ex.n_targets:
                out.append(ex)
    return out


def run(cfg: DictConfig) -> dict[str, Any]:
    # ---------------------------------------------------------------- setup
    check_config(cfg)
    out = Path(cfg.output_dir)
    accelerator = make_accelerator(
        mixed_precision=cfg.trainer.mixed_precision,
        grad_accum=cfg.trainer.grad_accum,
        seed=cfg.seed,
        log_with="wandb" if cfg.tracking.kind == "wandb" else None,
        project_dir=str(out),
    )
    main, device = accelerator.is_main_process, accelerator.device
    say = accelerator.print
    if main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    accelerator.wait_for_everyone()

    from transformers import AutoTokenizer, GenerationConfig

    target_path = resolve_model(cfg.model.name)  # clear error for unknown names, before any weights
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        gen_cfg = GenerationConfig.from_pretrained(target_path)
    except OSError:
        gen_cfg = None
    stop_ids = stop_token_ids(tokenizer, gen_cfg.eos_token_id if gen_cfg else None)
    train_convs = load_conversations(
        cfg.data.train, split=cfg.data.split, column=cfg.data.column, max_samples=cfg.data.max_samples
    )
    val_convs = spread(
        load_conversations(cfg.data.val, split=cfg.data.split, column=cfg.data.column), cfg.validate.num_prompts
    )
    val_prompts = [prompt_ids(tokenizer, c) for c in val_convs]
    if cfg.responses.source == "dataset" and not any(c.has_response for c in train_convs):
        raise SpecdecError(f"{cfg.data.train} has no assistant responses: use responses.source=target")

    dtype = resolve_dtype(cfg.model.dtype, device)
    say(f"target {cfg.model.name} ({target_path}) on {device} in {dtype}")
    target = load_hf_model(cfg.model.name, dtype=dtype).to(device).eval().requires_grad_(False)
    drafter = build_drafter(cfg, target, tokenizer)
    if drafter.config.vocab_size != target.config.vocab_size:
        raise SpecdecError(
            f"the drafter's vocabulary ({drafter.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}): they must share the tokenizer"
        )

    # Responses: the data's own, the target's (cached on disk), or the drafter's (refreshed in the loop).
    max_len = cfg.trainer.max_seq_len
    prompts = [prompt_ids(tokenizer, c) for c in train_convs]
    keep = [i for i, p in enumerate(prompts) if len(p) < max_len - 8]
    if len(keep) < len(prompts):
        say(f"skipping {len(prompts) - len(keep)} prompts longer than trainer.max_seq_len={max_len}")
    prompts = [prompts[i] for i in keep]
    r = cfg.responses
    gen_kw = dict(
        pad_id=pad_id,
        stop_ids=stop_ids,
        max_new_tokens=r.max_new_tokens,
        batch_size=r.batch_size,
        temperature=r.temperature,
        top_p=r.top_p,
        rank=accelerator.process_index,
        world=accelerator.num_processes,
        barrier=accelerator.wait_for_everyone,
        gather=lambda d: gather_object([d]),  # every process gets every share
    )

    def progress(todo: int, total: int) -> Any:
        return tqdm(
            total=todo,
            desc=f"responses ({total - todo * accelerator.num_processes} cached)",
            unit="prompt",
            disable=not main,
        )

    if r.source == "dataset":
        examples = [encode_conversation(tokenizer, train_convs[i], max_len) for i in keep]
        examples = [e for e in examples if e.n_targets]
    elif r.source == "target":
        settings = {k: r[k] for k in ("max_new_tokens", "temperature", "top_p")} | {
            "seed": cfg.seed,
            "dtype": str(dtype),
        }
        root = Path(r.cache_dir).expanduser() if r.cache_dir else cache_root() / "responses"
        cache = root / cache_key(target_path, prompts, settings)
        say(f"self-distillation responses: {cache}")
        responses = generate_responses(target, prompts, seed=cfg.seed, cache_dir=cache, progress=progress, **gen_kw)
        examples = with_responses(prompts, responses, max_len)
    else:
        examples = []  # generated by the drafter at step 0 (or restored from the checkpoint)

    vocab_ids = None
    if cfg.drafter.draft_vocab_size:
        counted = [e.ids for e in examples] if examples else prompts
        vocab_ids = draft_vocab(counted, cfg.drafter.draft_vocab_size, target.config.vocab_size, always=stop_ids)
        use_draft_vocab(drafter, vocab_ids)
        say(f"draft vocabulary: {len(vocab_ids)} of {target.config.vocab_size} tokens")
        response_tokens = torch.tensor([t for e in examples for t, m in zip(e.ids, e.loss_mask) if m])
        if len(response_tokens):
            say(f"  covering {torch.isin(response_tokens, vocab_ids).float().mean().item():.1%} of the response tokens")
    if cfg.drafter.freeze_embeddings:
        drafter.get_input_embeddings().requires_grad_(False)
    vocab_dev = vocab_ids.to(device) if vocab_ids is not None else None

    o = cfg.optim
    optimizer, scheduler = make_optimizer(
        [p for p in drafter.parameters() if p.requires_grad],
        lr=o.lr,
        weight_decay=o.weight_decay,
        warmup_steps=o.warmup_steps,
        max_steps=cfg.trainer.max_steps,
        schedule=o.schedule,
        betas=tuple(o.betas),
        min_lr_ratio=o.min_lr_ratio,
    )
    student, optimizer, scheduler = accelerator.prepare(SelectedLogits(drafter), optimizer, scheduler)
    teacher = SelectedLogits(target)
    tracker = Tracker(
        accelerator,
        out,
        kind=cfg.tracking.kind,
        project=cfg.tracking.get("project", "specdec"),
        run_name=cfg.tracking.get("run_name") or f"distill-{out.name}",
        config=OmegaConf.to_container(cfg, resolve=True),
        entity=cfg.tracking.get("entity"),
        tags=list(cfg.tracking.get("tags") or []),
    )

    start = 0
    ckpt = latest_checkpoint(out / "checkpoints") if cfg.trainer.resume else None
    if ckpt is not None:
        state, extra = load_checkpoint(accelerator, ckpt)
        start = state["step"]
        if r.source == "drafter" and "ids" in extra:
            examples = _unpack(extra)
        say(f"resumed from {ckpt} at step {start}")

    def refresh_on_policy(step: int) -> list[Example]:
        model = accelerator.unwrap_model(student).model
        model.eval()
        with accelerator.autocast():
            responses = generate_responses(model, prompts, seed=cfg.seed + step, progress=progress, **gen_kw)
        model.train()
        return with_responses(prompts, responses, max_len)

    # ---------------------------------------------------------------- loop
    L = cfg.loss

    def loss_fn(mb: list[Example]) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        batch = {k: v.to(device) for k, v in collate(mb, pad_id).items()}
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

    def validate_now(step: int) -> dict[str, Any]:
        """Validation on the runtime (rank 0; the other processes wait)."""
        metrics: dict[str, Any] = {}
        if cfg.validate.enabled and main:
            dtype = resolve_dtype("auto", device)
            runtime[:] = runtime or [runtime_decoder(target, None, device, dtype)]
            decoder = runtime_decoder(accelerator.unwrap_model(student).model, vocab_ids, device, dtype)
            metrics = validate(
                runtime[0],
                ModelDrafter(decoder, vocab_size=target.config.vocab_size, name="distilled"),
                val_prompts,
                [c.category for c in val_convs],
                stop_ids=stop_ids,
                gamma=cfg.validate.gamma,
                max_new_tokens=cfg.validate.max_new_tokens,
            )
            metrics["device"] = str(device)
            tracker.log({f"val/{k}": v for k, v in metrics.items() if isinstance(v, int | float)}, step)
        accelerator.wait_for_everyone()
        return metrics

    batches = None
    history: list[dict[str, Any]] = []
    if start < cfg.trainer.max_steps:
        say(
            f"training steps {start}..{cfg.trainer.max_steps} ({accelerator.num_processes} processes, "
            f"global batch {cfg.trainer.micro_batch * cfg.trainer.grad_accum * accelerator.num_processes})"
        )
    bar = tqdm(
        range(start, cfg.trainer.max_steps),
        initial=start,
        total=cfg.trainer.max_steps,
        desc="distill",
        unit="step",
        disable=not main,
    )
    stats: dict[str, float] = {}
    for step in bar:
        if r.source == "drafter" and (step % r.refresh_every == 0 or not examples):
            examples, batches = refresh_on_policy(step), None
        if batches is None:
            batches = Batches(
                examples,
                micro_batch=cfg.trainer.micro_batch,
                grad_accum=cfg.trainer.grad_accum,
                world=accelerator.num_processes,
                rank=accelerator.process_index,
                seed=cfg.seed,
            )
        stats = optimizer_step(
            accelerator,
            student,
            optimizer,
            scheduler,
            batches.step(step),
            loss_fn,
            cfg.trainer.max_grad_norm,
            n_tokens=lambda mb: sum(e.n_targets for e in mb),
        )
        stats["acceptance_est"] = 1 - stats["tvd"]
        bar.set_postfix(loss=f"{stats['loss']:.4f}", accept=f"{stats['acceptance_est']:.3f}")
        done = step + 1
        if done % cfg.trainer.log_every == 0 or done == cfg.trainer.max_steps:
            tracker.log({f"train/{k}": v for k, v in stats.items()} | {"train/epoch": batches.epoch(done)}, done)
        if done % cfg.trainer.checkpoint_every == 0 or done == cfg.trainer.max_steps:
            extra = _pack(examples) if r.source == "drafter" else None
            save_checkpoint(
                accelerator,
                out / "checkpoints",
                step=done,
                state={"loss": stats["loss"]},
                tensors=extra,
                keep=cfg.trainer.keep_checkpoints,
            )
        if cfg.validate.every and done % cfg.validate.every == 0 and done < cfg.trainer.max_steps:
            history.append({"step": done, **validate_now(done)})
    bar.close()

    # ---------------------------------------------------------------- validate
    final = cfg.trainer.max_steps
    metrics = validate_now(final)
    result = {"validation": metrics, "train": stats, "history": history, "step": final}

    # ---------------------------------------------------------------- export
    if main:
        export = export_hf_drafter(
            accelerator.unwrap_model(student).model,
            tokenizer,
            out / "export",
            vocab_ids=vocab_ids,
            generation_config=gen_cfg,
        )
        d = accelerator.unwrap_model(student).model.config
        setup = {
            "target": cfg.model.name,
            "drafter": f"{cfg.drafter.source}: {d.num_hidden_layers} layers, hidden {d.hidden_size}",
            "draft vocabulary": len(vocab_ids) if vocab_ids is not None else "full",
            "loss": _loss_name(L),
            "responses": r.source,
            "data": cfg.data.train,
            "examples": len(examples),
            "steps": final,
            "global batch": cfg.trainer.micro_batch * cfg.trainer.grad_accum * accelerator.num_processes,
            "learning rate": f"{cfg.optim.lr} ({cfg.optim.schedule})",
            "processes": accelerator.num_processes,
        }
        card = model_card(
            title=f"Distilled drafter for {cfg.model.name}",
            target=cfg.model.name,
            recipe="distill",
            setup=setup,
            metrics=metrics,
            usage=_usage(cfg.model.name, export, cfg.validate.gamma),
            base_model=cfg.model.name if "/" in cfg.model.name else None,
            tags=["distillspec", "draft-model"],
        )
        write_model_card(export, card, metrics)
        result["export"] = str(export)
        if cfg.hub.repo_id:
            result["hub"] = push_to_hub(export, cfg.hub.repo_id, private=cfg.hub.private, revision=cfg.hub.revision)
            say(f"pushed to {result['hub']}")
        (out / "metrics.json").write_text(json.dumps(result, indent=2))
        if metrics:
            say(
                f"\ntau {metrics['tau']:.2f} at gamma {metrics['gamma']}, speedup {metrics['speedup']:.2f}x over "
                f"autoregressive, lossless {metrics['lossless']:.0%} ({metrics['prompts']} validation prompts)"
            )
        say(
            f"exported to {export}\ngenerate with it:\n  specdec generate --target {cfg.model.name} "
            f"--drafter {export} --gamma {cfg.validate.gamma} --baseline"
        )
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


def _usage(target: str, export: Path, gamma: int) -> str:
    return f"""With specdec's runtime (lossless speculative decoding):

```bash
specdec generate --target {target} --drafter {export} --gamma {gamma} --prompt "Write a haiku about the sea."
```

With transformers' assisted generation:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
target = AutoModelForCausalLM.from_pretrained("{target}")
drafter = AutoModelForCausalLM.from_pretrained("{export}")
tok = AutoTokenizer.from_pretrained("{export}")
ids = tok.apply_chat_template([{{"role": "user", "content": "Hi!"}}], add_generation_prompt=True, return_tensors="pt")
out = target.generate(ids, assistant_model=drafter, max_new_tokens=128, do_sample=False)
```"""


@hydra.main(config_path="../conf", config_name="distill", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
