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

from recipes.checks import check_conversations, check_shard, refuse, run_or_exit
from recipes.data import Conversations, conversations, target_responses, training_examples
from recipes.plan import dry_run, medusa_plan
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
)
from specdec_runtime.drafters.medusa import MedusaDrafter, MedusaHeads
from specdec_runtime.errors import SpecdecError
from specdec_runtime.hardware import resolve_dtype
from specdec_runtime.measure import measure
from specdec_runtime.paths import cache_root
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree
from train.checkpoint import save_checkpoint
from train.data import Example, collate, prompt_ids, with_responses
from train.export import Card, export_medusa
from train.hidden_cache import cache_key, cache_states, padded
from train.launch import check_launch, unwrap
from train.loop import every, optimizer_step, per_group_rates
from train.medusa import MedusaTraining, causal_lm, final_hidden, head_accuracies, target_drift
from train.validate import runtime_decoder, validate

MODES = ("medusa1", "medusa2")
TARGET_TRAINING = ("lora", "full")


def check_config(cfg: DictConfig) -> None:
    """Refuse bad values before anything is loaded."""
    medusa, medusa2 = cfg.medusa, cfg.medusa2
    problems = check_conversations(cfg, ("target", "dataset"))
    problems += check_shard(cfg, "medusa")
    if medusa.mode not in MODES:
        problems.append(f"medusa.mode='{medusa.mode}': use medusa1 (target frozen) or medusa2 (joint)")
    if medusa.num_heads < 1 or medusa.num_layers < 0:
        problems.append(
            f"medusa.num_heads={medusa.num_heads} must be >= 1 and medusa.num_layers={medusa.num_layers} >= 0"
        )
    if not 0 < medusa.decay <= 1:
        problems.append(f"medusa.decay={medusa.decay} must be in (0, 1]")
    if medusa.cache_hidden and medusa.mode == "medusa2":
        problems.append("medusa.cache_hidden applies to medusa1 only (Medusa-2 changes the target's hidden states)")
    if medusa.mode == "medusa2":
        if medusa2.target not in TARGET_TRAINING:
            problems.append(f"medusa2.target='{medusa2.target}': use lora or full")
        if not 0 < medusa2.target_lr_ratio <= 1:
            problems.append(f"medusa2.target_lr_ratio={medusa2.target_lr_ratio}: in (0, 1], heads learn faster")
        if medusa2.target_weight <= 0 or medusa2.heads_weight <= 0:
            problems.append("medusa2.target_weight and medusa2.heads_weight must be positive")
        if medusa2.warmup_steps < 0:
            problems.append(f"medusa2.warmup_steps={medusa2.warmup_steps} must be >= 0")
        if not 0 <= medusa2.min_agreement <= 1:
            problems.append(f"medusa2.min_agreement={medusa2.min_agreement} must be in [0, 1]")
    if cfg.tree.budget < 1 or cfg.tree.top_k < 1:
        problems.append(f"tree.budget={cfg.tree.budget} and tree.top_k={cfg.tree.top_k} must be >= 1")
    if cfg.tree.paths is not None:
        try:
            tree = Tree.from_paths(cfg.tree.paths)
        except SpecdecError as e:
            problems.append(f"tree.paths: {e}")
        else:
            if tree.depth > medusa.num_heads:
                problems.append(f"tree.paths is {tree.depth} deep but medusa.num_heads={medusa.num_heads}")
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
    if cfg.dry_run:  # the plan from config.json alone: nothing loads, nothing is written
        return dry_run(cfg, "medusa", lambda hf: medusa_plan(cfg, hf))
    run = start(cfg)
    data = conversations(cfg, run)
    accelerator, trainer, medusa = run.accelerator, cfg.trainer, cfg.medusa
    check_launch(
        accelerator,
        "medusa",
        ("zero1", "zero2"),
        "the heads are small and the frozen target is not sharded (Medusa-1); the jointly trained target "
        "(Medusa-2) is not gathered for validation and export yet",
    )
    target = load_target(cfg, run, target_dtype(cfg, run))
    examples, _ = training_examples(cfg, run, target, data)
    calib = calibration_examples(cfg, run, data, target, examples)  # the original target's responses
    model, groups = build_model(cfg, run, target)
    if medusa.cache_hidden:  # Medusa-1: the frozen target runs once per example, not once per epoch
        examples = hidden_states(cfg, run, target, examples)
    horizon = make_horizon(cfg, run)  # trainer.max_steps, or what fits max_minutes / train_until
    optimizer, scheduler = make_optimizer_from(cfg, groups, horizon)
    wrapped, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loss = HeadsLoss(wrapped, run, medusa.cache_hidden)
    tracker = make_tracker(cfg, run, "medusa")
    resumed = resume(cfg, run, optimizer, scheduler, horizon)  # + config.yaml: what runs from here on

    # ---------------------------------------------------------------- loop
    postfix = ("loss", "head1/top1", f"head{medusa.num_heads}/top1")
    progress = make_progress(cfg, run, tracker, resumed.step, horizon, medusa.mode, postfix)
    batches, stats = make_batches(cfg, run, examples), resumed.stats
    for step in horizon.steps_from(resumed.step):
        stats = optimizer_step(
            accelerator, wrapped, optimizer, scheduler, batches.step(step), loss, trainer.max_grad_norm
        )
        per_group_rates(stats, [f"head{k}" for k in range(1, medusa.num_heads + 1)])
        done = step + 1
        progress.update(done, stats, epoch=batches.epoch(done))
        if every(trainer.checkpoint_every, done, horizon.steps):
            state = {"stats": stats, "history": [], "horizon": horizon.state()}
            save_checkpoint(accelerator, run.checkpoints, step=done, state=state, keep=trainer.keep_checkpoints)
    progress.close()

    # ---------------------------------------------------------------- calibrate + validate
    trained = unwrap(accelerator, wrapped).eval()
    result: dict[str, Any] = {"train": stats, "history": [], "step": horizon.steps}
    tree, served = None, None
    if run.main:
        served = adapted_target(trained) if trained.joint else target  # what tree decoding runs on (merged once)
        tree, accuracy = calibrate_tree(cfg, run, trained, calib, result)
        result["validation"] = (
            validate_medusa(cfg, run, data, trained, tree, served, accuracy) if cfg.validate.enabled else {}
        )
        numbers = {f"val/{k}": v for k, v in result["validation"].items() if isinstance(v, int | float)}
        if numbers:
            tracker.log(numbers, horizon.steps)
    accelerator.wait_for_everyone()

    # ---------------------------------------------------------------- export
    if run.main:
        export = write_export(cfg, run, trained, tree, served, result)
        cmd = f"specdec generate --target {result.get('export_target', cfg.model.name)} --drafter {export} --baseline"
        finish(cfg, run, result, export, cmd, tracker, "medusa")
    tracker.finish()
    return result


def target_dtype(cfg: DictConfig, run: Run) -> torch.dtype:
    """model.dtype, except that a target Medusa-2 trains keeps fp32 weights (autocast does the math)."""
    dtype = resolve_dtype(cfg.model.dtype, run.device)
    if cfg.medusa.mode == "medusa2" and dtype != torch.float32:
        run.print_once(f"medusa2 trains the target: loading it in float32 (not {dtype}); autocast does the rest")
        return torch.float32
    return dtype


def build_model(cfg: DictConfig, run: Run, target: Any) -> tuple[MedusaTraining, list[dict[str, Any]]]:
    """The heads (initialized from the target's lm_head) and, for Medusa-2, the target made
    trainable (LoRA or full) as one module, with its optimizer parameter groups."""
    medusa, medusa2 = cfg.medusa, cfg.medusa2
    joint = medusa.mode == "medusa2"
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(target.config.hidden_size, target.config.vocab_size, medusa.num_heads, medusa.num_layers,
                        share_lm_head=medusa.share_lm_head)  # fmt: skip
    heads.init_lm_heads(target.get_output_embeddings().weight.float())
    groups = [{"params": list(heads.parameters()), "lr": cfg.optim.lr}]
    if joint:
        if medusa2.target == "lora":
            target = add_lora(target, cfg)
        else:
            target.requires_grad_(True)
        target.train()
        trained = [p for p in target.parameters() if p.requires_grad]
        groups.append(
            {"params": trained, "lr": cfg.optim.lr * medusa2.target_lr_ratio, "frozen_steps": medusa2.warmup_steps}
        )
        run.print_once(f"medusa2: {sum(p.numel() for p in trained):,} target parameters train ({medusa2.target}), "
                f"frozen for the first {medusa2.warmup_steps} steps")  # fmt: skip
    model = MedusaTraining(
        target,
        heads,
        decay=medusa.decay,
        heads_weight=medusa2.heads_weight if joint else 1.0,
        target_weight=medusa2.target_weight if joint else 0.0,
        full_finetune=joint and medusa2.target == "full",
    )
    run.print_once(f"{medusa.num_heads} Medusa heads, {medusa.num_layers} block(s) each, "
            f"{sum(p.numel() for p in heads.parameters()):,} parameters"
            f"{' (sharing the target lm_head)' if medusa.share_lm_head else ''}")  # fmt: skip
    return model, groups


def hidden_states(cfg: DictConfig, run: Run, target: Any, examples: list[Example]) -> list[Example]:
    """The examples with the frozen target's hidden states attached, computed once into
    $SPECDEC_CACHE/hidden/<key> (keyed by target, examples and dtype)."""
    key = cache_key(run.target_path, examples, target.dtype, what="final-norm hidden states")
    root = Path(cfg.responses.cache_dir).expanduser() if cfg.responses.cache_dir else cache_root()
    folder = root / "hidden" / key
    run.print_once(f"hidden-state cache: {folder}")
    accelerator = run.accelerator
    return cache_states(
        target,
        examples,
        folder,
        states=final_hidden,
        pad_id=run.pad_id,
        token_bytes=target.config.hidden_size * target.dtype.itemsize,
        batch_size=cfg.trainer.micro_batch,
        rank=accelerator.process_index,
        world=accelerator.num_processes,
        barrier=accelerator.wait_for_everyone,
        progress=lambda n: tqdm(total=n, desc="hidden states", unit="example", disable=not run.main),
        say=run.print_once,
    )


class HeadsLoss:
    """The loop's loss_fn: the prepared MedusaTraining's loss on a micro-batch (on cached hidden
    states when there are)."""

    def __init__(self, wrapped: Any, run: Run, cached: bool):
        self.wrapped, self.run, self.cached = wrapped, run, cached

    def __call__(self, mb: list[Example]) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        device = self.run.device
        batch = {k: v.to(device) for k, v in collate(mb, self.run.pad_id).items()}
        hidden = padded(mb, "hidden", device) if self.cached else None
        with self.run.accelerator.autocast():
            return self.wrapped(batch["input_ids"], batch["attention_mask"], batch["target_mask"], hidden)


def calibrate_tree(
    cfg: DictConfig, run: Run, model: MedusaTraining, calib: list[Example], result: dict
) -> tuple[Tree, torch.Tensor]:
    """Each head's top-k accuracy on held-out responses, and the tree (tree.paths, or the best
    expected acceptance for tree.budget nodes); recorded in result["calibration"]."""
    with run.accelerator.autocast():
        acc = head_accuracies(model, calib, pad_id=run.pad_id, top_k=cfg.tree.top_k)
    tree = Tree.from_paths(cfg.tree.paths) if cfg.tree.paths is not None else Tree.from_accuracies(acc, cfg.tree.budget)
    result["calibration"] = {
        "accuracy": acc.tolist(),
        "paths": [list(p) for p in tree.paths],
        "nodes": len(tree),
        "expected_tau": Tree.expected_tau(tree.paths, acc),
        "examples": len(calib),
    }
    run.print_once("per-head accuracy (top-1 / top-5) on held-out responses: " + ", ".join(
        f"head {k + 1} {acc[k, 0]:.2f}/{acc[k, :5].sum():.2f}" for k in range(cfg.medusa.num_heads)))  # fmt: skip
    run.print_once(
        f"tree: {len(tree)} nodes, depth {tree.depth}, expected tau {result['calibration']['expected_tau']:.2f}"
    )
    return tree, acc


def calibration_examples(
    cfg: DictConfig, run: Run, data: Conversations, target: Any, train_examples: list[Example]
) -> list[Example]:
    """Held-out examples for the tree: the target's responses to validation prompts not used for
    validation (tree.calibration_prompts of them); the training examples when there are none."""
    convs = data.rest_val[: cfg.tree.calibration_prompts]
    if not convs:
        run.print_once("no held-out prompts left for calibration: measuring head accuracy on the training examples")
        return train_examples[: max(cfg.tree.calibration_prompts, 1)]
    prompts = [prompt_ids(run.tokenizer, c) for c in convs]
    return with_responses(prompts, target_responses(cfg, run, target, prompts), cfg.trainer.max_seq_len)


def validate_medusa(
    cfg: DictConfig,
    run: Run,
    data: Conversations,
    model: MedusaTraining,
    tree: Tree,
    served: Any,
    accuracy: torch.Tensor,
) -> dict[str, Any]:
    """Tree decoding on the runtime against autoregressive decoding of `served`: the target, or
    under Medusa-2 the adapted target; with the tree's size and the heads' calibrated accuracy.

    Medusa-2 also measures how far the adapted target moved: greedy outputs identical to the
    original target's, and teacher-forced top-1 agreement (logged during training as target/agree).
    """
    device = run.device
    decoder = runtime_decoder(served, None, device)
    drafter = MedusaDrafter(copy.deepcopy(model.heads).float(), decoder, tree, name="medusa")
    metrics = validate(
        decoder,
        drafter,
        data.val_prompts,
        data.val_categories,
        stop_ids=run.stop_ids,
        gamma=tree.depth,
        max_new_tokens=cfg.validate.max_new_tokens,
        threads=run.threads.get("decode"),
    )
    metrics["device"] = str(device)
    metrics.update(nodes=len(tree), head_top1=accuracy[:, 0].tolist(), head_top5=accuracy[:, :5].sum(1).tolist())
    if model.joint:  # Medusa-2: the original target's greedy outputs vs the adapted one's
        metrics["measured_against"] = "the adapted target (export/target): tau, speedup and lossless are its own"
        run.print_once(
            "Medusa-2: speedup and losslessness are measured against the adapted target, which the heads serve"
        )
        before = original_target(model)
        original = runtime_decoder(before, None, device)
        kw = dict(sampler=Sampler, max_new_tokens=cfg.validate.max_new_tokens, stop_ids=run.stop_ids, warmup=False)
        prompts = [torch.as_tensor(p, device=device) for p in data.val_prompts]
        a = measure(original, None, prompts, **kw).spec
        b = measure(decoder, None, prompts, **kw).spec
        metrics["identical_to_original"] = sum(x.tokens == y.tokens for x, y in zip(a, b)) / len(a)
        agree = [sum(u == v for u, v in zip(x.tokens, y.tokens)) / max(len(x.tokens), 1) for x, y in zip(a, b)]
        metrics["position_agreement_with_original"] = sum(agree) / len(agree)
        drift = target_drift(before, served, [(p.tolist(), x.tokens) for p, x in zip(prompts, a)])
        metrics |= {"target_agreement": drift["agreement"], "target_kl": drift["kl"]}
        run.print_once(
            f"adapted target vs the original, teacher-forced on its {drift['tokens']} greedy validation tokens: "
            f"top-1 agreement {drift['agreement']:.3f}, KL(original || adapted) {drift['kl']:.4f} per token"
        )
        if drift["agreement"] < cfg.medusa2.min_agreement:
            run.print_once(
                f"WARNING: Medusa-2 changed the target: top-1 agreement {drift['agreement']:.3f} is below "
                f"medusa2.min_agreement={cfg.medusa2.min_agreement}; its outputs differ from the original's. "
                "Lower medusa2.target_lr_ratio or medusa2.heads_weight, or raise medusa2.target_weight"
            )
    return metrics


def original_target(model: MedusaTraining) -> Any:
    """The target before Medusa-2 training (LoRA: the base weights; full: the frozen copy)."""
    if model._original:
        return model._original[0]
    return copy.deepcopy(model.base).unload()  # peft: the base model without adapters


def write_export(
    cfg: DictConfig, run: Run, model: MedusaTraining, tree: Tree | None, served: Any, result: dict
) -> Path:
    """export/ = FasterDecoding layout (+ tree, card), export/vllm/ = vLLM layout; Medusa-2 adds
    export/target/ (`served`: the adapted target, merged) and export/lora/ (the adapter alone)."""
    out = run.out / "export"
    joint = cfg.medusa.mode == "medusa2"
    if joint:
        result["export_target"] = str(out / "target")
    medusa = cfg.medusa
    card = Card(
        **target_card(cfg, run),
        recipe="medusa",
        data=cfg.data.train,
        setup={
            "mode": "Medusa-2 (" + cfg.medusa2.target + "), adapted target in target/" if joint else "Medusa-1",
            "heads": f"{medusa.num_heads} x {medusa.num_layers} residual block(s)"
            + (", shared lm_head" * medusa.share_lm_head),
            "tree": f"{len(tree)} nodes, depth {tree.depth}" if tree is not None else "-",
            "responses": cfg.responses.source,
            "steps": result["step"],
            "learning rate": f"{cfg.optim.lr} ({cfg.optim.schedule})",
        },
        metrics=result.get("validation") or None,
        tags=["medusa"],
        hub_id=cfg.hub.repo_id,
    )
    calibration = result.get("calibration")
    return export_medusa(
        copy.deepcopy(model.heads).float(),
        out,
        card,
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
