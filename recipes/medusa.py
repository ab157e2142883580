"""Train Medusa heads (Medusa-1: target frozen; Medusa-2: jointly with the target), calibrate their
token tree, validate tree decoding on specdec_runtime, export in the FasterDecoding and vLLM layouts.

    python -m recipes.medusa output_dir=runs/medusa                       # Medusa-1, 4 heads
    python -m recipes.medusa experiment=medusa_quickstart output_dir=runs/medusa-quick
    python -m recipes.medusa medusa.mode=medusa2 medusa2.target=lora output_dir=runs/medusa2
    accelerate launch --config_file conf/accelerate/multi_gpu.yaml -m recipes.medusa model=qwen2.5-0.5b-instruct

Setup (config checks, target, self-distilled responses, heads, LoRA), loop (sum_k decay^k CE_k on
response tokens, + KL to the original target for Medusa-2), calibrate (per-head top-k accuracy on
held-out prompts -> the tree with the best expected acceptance for tree.budget nodes), validate
(tau, speedup, losslessness with tree decoding), export (both layouts, the tree, a model card;
Medusa-2 adds the adapted target and its LoRA adapter).
"""

import copy
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from recipes.common import (
    check_common,
    check_launch,
    finish,
    load_target,
    make_optimizer_from,
    make_tracker,
    refuse,
    resume,
    run_or_exit,
    start,
    target_responses,
    train_loop,
    training_examples,
    with_responses,
)
from specdec_runtime.errors import SpecdecError
from specdec_runtime.loading import cache_root, resolve_dtype
from specdec_runtime.measure import measure
from specdec_runtime.medusa import MedusaDrafter, MedusaHeads
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree
from train.checkpoint import save_checkpoint
from train.data import Example, collate, prompt_ids
from train.export import Card, export_medusa
from train.medusa import (
    MedusaTraining,
    cache_hidden_states,
    causal_lm,
    head_accuracies,
    hidden_cache_key,
    padded_hidden,
    per_head_rates,
)
from train.validate import runtime_decoder, validate

MODES = ("medusa1", "medusa2")
TARGET_TRAINING = ("lora", "full")


def check_config(cfg: DictConfig) -> None:
    """Refuse bad values before anything is loaded."""
    m, m2, t = cfg.medusa, cfg.medusa2, cfg.tree
    problems = check_common(cfg, ("target", "dataset"))
    if m.mode not in MODES:
        problems.append(f"medusa.mode='{m.mode}': use medusa1 (target frozen) or medusa2 (joint)")
    if m.num_heads < 1 or m.num_layers < 0:
        problems.append(f"medusa.num_heads={m.num_heads} must be >= 1 and medusa.num_layers={m.num_layers} >= 0")
    if not 0 < m.decay <= 1:
        problems.append(f"medusa.decay={m.decay} must be in (0, 1]")
    if m.cache_hidden and m.mode == "medusa2":
        problems.append("medusa.cache_hidden applies to medusa1 only (Medusa-2 changes the target's hidden states)")
    if m.mode == "medusa2":
        if m2.target not in TARGET_TRAINING:
            problems.append(f"medusa2.target='{m2.target}': use lora or full")
        if not 0 < m2.target_lr_ratio <= 1:
            problems.append(f"medusa2.target_lr_ratio={m2.target_lr_ratio}: in (0, 1], heads learn faster")
        if m2.target_weight <= 0 or m2.heads_weight <= 0:
            problems.append("medusa2.target_weight and medusa2.heads_weight must be positive")
        if m2.warmup_steps < 0:
            problems.append(f"medusa2.warmup_steps={m2.warmup_steps} must be >= 0")
    if t.budget < 1 or t.top_k < 1:
        problems.append(f"tree.budget={t.budget} and tree.top_k={t.top_k} must be >= 1")
    if t.paths is not None:
        try:
            tree = Tree.from_paths(t.paths)
        except SpecdecError as e:
            problems.append(f"tree.paths: {e}")
        else:
            if tree.depth > m.num_heads:
                problems.append(f"tree.paths is {tree.depth} deep but medusa.num_heads={m.num_heads}")
    refuse(problems)


def add_lora(target: Any, cfg: DictConfig) -> Any:
    from peft import LoraConfig, get_peft_model

    lora = cfg.medusa2.lora
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(target, config)


def adapted_target(model: MedusaTraining) -> Any:
    """The trained target as a plain transformers model (LoRA merged into a copy)."""
    target = model.base
    if hasattr(target, "merge_and_unload"):
        return copy.deepcopy(target).merge_and_unload()
    return target


def run(cfg: DictConfig) -> dict[str, Any]:
    # ---------------------------------------------------------------- setup
    check_config(cfg)
    run = start(cfg)
    accelerator, device, say = run.accelerator, run.device, run.say
    m, m2 = cfg.medusa, cfg.medusa2
    joint = m.mode == "medusa2"
    check_launch(
        accelerator,
        "medusa",
        ("zero1", "zero2"),
        "the heads are small and the frozen target is not sharded (Medusa-1); the jointly trained target "
        "(Medusa-2) is not gathered for validation and export yet",
    )
    dtype = resolve_dtype(cfg.model.dtype, device)
    if joint and dtype != torch.float32:  # trained weights stay fp32; trainer.mixed_precision runs bf16 math
        say(f"medusa2 trains the target: loading it in float32 (not {dtype}); autocast does the rest")
        dtype = torch.float32
    target = load_target(cfg, run, dtype)
    examples, _ = training_examples(cfg, run, target)
    calib = calibration_examples(cfg, run, target, examples)  # the original target's responses

    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(hidden, vocab, m.num_heads, m.num_layers, share_lm_head=m.share_lm_head)
    heads.init_lm_heads(target.get_output_embeddings().weight.float())
    groups = [{"params": list(heads.parameters()), "lr": cfg.optim.lr}]
    if joint:
        if m2.target == "lora":
            target = add_lora(target, cfg)
        else:
            target.requires_grad_(True)
        target.train()
        trained = [p for p in target.parameters() if p.requires_grad]
        groups.append({"params": trained, "lr": cfg.optim.lr * m2.target_lr_ratio, "frozen_steps": m2.warmup_steps})
        say(f"medusa2: {sum(p.numel() for p in trained):,} target parameters train ({m2.target}), "
            f"frozen for the first {m2.warmup_steps} steps")  # fmt: skip
    model = MedusaTraining(
        target,
        heads,
        decay=m.decay,
        heads_weight=m2.heads_weight if joint else 1.0,
        target_weight=m2.target_weight if joint else 0.0,
        full_finetune=joint and m2.target == "full",
    )
    say(f"{m.num_heads} Medusa heads, {m.num_layers} block(s) each, "
        f"{sum(p.numel() for p in heads.parameters()):,} parameters"
        f"{' (sharing the target lm_head)' if m.share_lm_head else ''}")  # fmt: skip

    if m.cache_hidden:  # Medusa-1: the frozen target runs once per example, not once per epoch
        key = hidden_cache_key(run.target_path, examples, target.dtype)
        root = Path(cfg.responses.cache_dir).expanduser() if cfg.responses.cache_dir else cache_root()
        folder = root / "hidden" / key
        say(f"hidden-state cache: {folder}")
        examples = cache_hidden_states(
            target,
            examples,
            folder,
            pad_id=run.pad_id,
            batch_size=cfg.trainer.micro_batch,
            rank=accelerator.process_index,
            world=accelerator.num_processes,
            barrier=accelerator.wait_for_everyone,
            progress=lambda n: tqdm(total=n, desc="hidden states", unit="example", disable=not run.main),
        )

    optimizer, scheduler = make_optimizer_from(cfg, groups)
    wrapped, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    tracker = make_tracker(cfg, run, "medusa")
    start_step, _ = resume(cfg, run)

    # ---------------------------------------------------------------- loop
    def loss_fn(mb: list[Example]) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        batch = {k: v.to(device) for k, v in collate(mb, run.pad_id).items()}
        cached = padded_hidden(mb, device) if m.cache_hidden else None
        with accelerator.autocast():
            return wrapped(batch["input_ids"], batch["attention_mask"], batch["target_mask"], cached)

    stats, history = train_loop(
        cfg,
        run,
        tracker,
        model=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_fn=loss_fn,
        examples=examples,
        start_step=start_step,
        desc=m.mode,
        save=save_checkpoint,
        postprocess=lambda s: per_head_rates(s, m.num_heads),
        postfix=("loss", "head1/top1", f"head{m.num_heads}/top1"),
    )

    # ---------------------------------------------------------------- calibrate + validate
    trained_model = accelerator.unwrap_model(wrapped)
    trained_model.eval()
    result: dict[str, Any] = {"train": stats, "history": history, "step": cfg.trainer.max_steps}
    metrics: dict[str, Any] = {}
    tree, served = None, None
    if run.main:
        served = adapted_target(trained_model) if joint else target  # what tree decoding runs on (merged once)
        with accelerator.autocast():
            acc = head_accuracies(trained_model, calib, pad_id=run.pad_id, top_k=cfg.tree.top_k)
        tree = (
            Tree.from_paths(cfg.tree.paths)
            if cfg.tree.paths is not None
            else Tree.from_accuracies(acc, cfg.tree.budget)
        )
        calibration = {
            "accuracy": acc.tolist(),
            "paths": [list(p) for p in tree.paths],
            "nodes": len(tree),
            "expected_tau": Tree.expected_tau(tree.paths, acc),
            "examples": len(calib),
        }
        result["calibration"] = calibration
        say("per-head accuracy (top-1 / top-5) on held-out responses: " + ", ".join(
            f"head {k + 1} {acc[k, 0]:.2f}/{acc[k, :5].sum():.2f}" for k in range(m.num_heads)))  # fmt: skip
        say(f"tree: {len(tree)} nodes, depth {tree.depth}, expected tau {calibration['expected_tau']:.2f}")
        if cfg.validate.enabled:
            metrics = validate_medusa(cfg, run, trained_model, tree, served)
            metrics.update(nodes=len(tree), head_top1=acc[:, 0].tolist(), head_top5=acc[:, :5].sum(1).tolist())
            tracker.log(
                {f"val/{k}": v for k, v in metrics.items() if isinstance(v, int | float)}, cfg.trainer.max_steps
            )
        result["validation"] = metrics
    accelerator.wait_for_everyone()

    # ---------------------------------------------------------------- export
    if run.main:
        export = write_export(cfg, run, trained_model, tree, served, result)
        cmd = f"specdec generate --target {result.get('export_target', cfg.model.name)} --drafter {export} --baseline"
        finish(cfg, run, result, export, cmd, tracker, "medusa")
    tracker.finish()
    accelerator.wait_for_everyone()
    return result


def calibration_examples(cfg: DictConfig, run: Any, target: Any, train_examples: list[Example]) -> list[Example]:
    """Held-out examples for the tree: the target's responses to validation prompts not used for
    validation (tree.calibration_prompts of them); the training examples when there are none."""
    convs = run.rest_val_convs[: cfg.tree.calibration_prompts]
    if not convs:
        run.say("no held-out prompts left for calibration: measuring head accuracy on the training examples")
        return train_examples[: max(cfg.tree.calibration_prompts, 1)]
    prompts = [prompt_ids(run.tokenizer, c) for c in convs]
    return with_responses(prompts, target_responses(cfg, run, target, prompts), cfg.trainer.max_seq_len)


def validate_medusa(cfg: DictConfig, run: Any, model: MedusaTraining, tree: Tree, served: Any) -> dict[str, Any]:
    """Tree decoding on the runtime against autoregressive decoding of `served`: the target, or
    under Medusa-2 the adapted target.

    Medusa-2 also measures how far the adapted target moved: greedy outputs identical to the
    original target's, and teacher-forced top-1 agreement (logged during training as target/agree).
    """
    device = run.device
    dtype = resolve_dtype("auto", device)
    decoder = runtime_decoder(served, None, device, dtype)
    drafter = MedusaDrafter(copy.deepcopy(model.heads).float(), decoder, tree, name="medusa")
    metrics = validate(
        decoder,
        drafter,
        run.val_prompts,
        [c.category for c in run.val_convs],
        stop_ids=run.stop_ids,
        gamma=tree.depth,
        max_new_tokens=cfg.validate.max_new_tokens,
    )
    metrics["device"] = str(device)
    if model.joint:  # Medusa-2: the original target's greedy outputs vs the adapted one's
        original = runtime_decoder(original_target(model), None, device, dtype)
        kw = dict(sampler=Sampler, max_new_tokens=cfg.validate.max_new_tokens, stop_ids=run.stop_ids, warmup=False)
        prompts = [torch.as_tensor(p, device=device) for p in run.val_prompts]
        a = measure(original, None, prompts, **kw).spec
        b = measure(decoder, None, prompts, **kw).spec
        metrics["identical_to_original"] = sum(x.tokens == y.tokens for x, y in zip(a, b)) / len(a)
        agree = [sum(u == v for u, v in zip(x.tokens, y.tokens)) / max(len(x.tokens), 1) for x, y in zip(a, b)]
        metrics["position_agreement_with_original"] = sum(agree) / len(agree)
    return metrics


def original_target(model: MedusaTraining) -> Any:
    """The target before Medusa-2 training (LoRA: the base weights; full: the frozen copy)."""
    if model._original:
        return model._original[0]
    return copy.deepcopy(model.base).unload()  # peft: the base model without adapters


def write_export(
    cfg: DictConfig, run: Any, model: MedusaTraining, tree: Tree | None, served: Any, result: dict
) -> Path:
    """export/ = FasterDecoding layout (+ tree, card), export/vllm/ = vLLM layout; Medusa-2 adds
    export/target/ (`served`: the adapted target, merged) and export/lora/ (the adapter alone)."""
    out = run.out / "export"
    joint = cfg.medusa.mode == "medusa2"
    if joint:
        result["export_target"] = str(out / "target")
    m = cfg.medusa
    card = Card(
        target=cfg.model.name,
        recipe="medusa",
        data=cfg.data.train,
        setup={
            "mode": "Medusa-2 (" + cfg.medusa2.target + "), adapted target in target/" if joint else "Medusa-1",
            "heads": f"{m.num_heads} x {m.num_layers} residual block(s)" + (", shared lm_head" * m.share_lm_head),
            "tree": f"{len(tree)} nodes, depth {tree.depth}" if tree is not None else "-",
            "responses": cfg.responses.source,
            "steps": cfg.trainer.max_steps,
            "learning rate": f"{cfg.optim.lr} ({cfg.optim.schedule})",
        },
        metrics=result.get("validation") or None,
        title=f"Medusa heads for {cfg.model.name}",
        tags=["medusa"],
        base_model=cfg.model.name if "/" in cfg.model.name else None,
        hub_id=cfg.hub.repo_id,
    )
    calibration = result.get("calibration")
    return export_medusa(
        copy.deepcopy(model.heads).float(),
        out,
        card,
        base=result.get("export_target", cfg.model.name),
        lm_head=causal_lm(model.base).get_output_embeddings().weight.float(),
        tree=calibration or ({"paths": [list(p) for p in tree.paths]} if tree is not None else None),
        target_model=served if joint else None,
        tokenizer=run.tokenizer,
        generation_config=run.gen_cfg,
        lora=model.base if joint and hasattr(model.base, "peft_config") else None,
    )


@hydra.main(config_path="../conf", config_name="medusa", version_base=None)
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
