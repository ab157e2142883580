"""Train an EAGLE-3 drafter for the target, validate it on specdec_runtime (chain or EAGLE-2 tree),
export it in the speculators format that vLLM and SGLang load.

    python -m recipes.eagle3 output_dir=runs/eagle3
    python -m recipes.eagle3 experiment=eagle3_quickstart output_dir=runs/eagle3-quick
    accelerate launch --config_file conf/accelerate/multi_gpu.yaml -m recipes.eagle3 model=llama-3.2-1b-instruct
    specdec generate --drafter runs/eagle3-quick/export --baseline

Setup (config checks against the target's config.json, target, self-distilled responses, draft
vocabulary, the drafter warm-started from the target, the target's states cached), loop (the
training-time test: steps unrolled on the drafter's own outputs, forward KL to the target per
step; per-step top-1 logged), validate (a tau estimate from held-out per-step accuracies, then tau,
speedup and losslessness on the runtime), export (speculators format + model card).
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
from recipes.plan import dry_run, eagle3_plan
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
from specdec_runtime.config import DecoderConfig
from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model
from specdec_runtime.drafters.lookup import LookupFirst
from specdec_runtime.drafters.phrases import PhraseTable
from specdec_runtime.drafters.spec import LOOKUP
from specdec_runtime.loading import load_hf_config
from specdec_runtime.paths import cache_root, config_folder
from specdec_runtime.tree import Tree
from train.checkpoint import save_checkpoint
from train.data import Example, collate, prompt_ids, responses_of, with_responses
from train.draft_model import draft_vocab
from train.eagle3 import Eagle3Training, accuracies, pack, replay_chain, target_states, tau_estimate, warm_start
from train.export import Card, export_eagle3
from train.hidden_cache import cache_key, cache_states, padded
from train.launch import check_launch, most, unwrap
from train.loop import every, optimizer_step, per_group_rates
from train.validate import runtime_decoder, validate

INITS = ("target", "random")


def check_config(cfg: DictConfig) -> Eagle3Config:
    """Refuse bad values before anything is loaded (the aux layers and the draft vocabulary are
    checked against the target's config.json); returns the drafter's config."""
    eagle3 = cfg.eagle3
    problems = check_conversations(cfg, ("target", "dataset"))
    problems += check_shard(cfg, "eagle3")
    if not isinstance(eagle3.ttt_steps, int) or eagle3.ttt_steps < 1:
        problems.append(f"eagle3.ttt_steps={eagle3.ttt_steps} must be a positive integer")
    if not 0 < eagle3.step_decay <= 1:
        problems.append(f"eagle3.step_decay={eagle3.step_decay} must be in (0, 1]")
    if eagle3.pack_tokens and eagle3.pack_tokens < cfg.trainer.max_seq_len:
        problems.append(
            f"eagle3.pack_tokens={eagle3.pack_tokens} is below trainer.max_seq_len={cfg.trainer.max_seq_len}: "
            "a row must hold the longest sequence (0 turns packing off)"
        )
    if eagle3.init not in INITS:
        problems.append(f"eagle3.init='{eagle3.init}': use target (warm start from the target) or random")
    if not eagle3.train_lm_head and eagle3.init != "target":
        problems.append("eagle3.train_lm_head=false keeps the lm_head as initialized: it needs eagle3.init=target")
    if not isinstance(cfg.validate.lookup, bool):
        problems.append(f"validate.lookup={cfg.validate.lookup} must be true or false")
    if (
        cfg.validate.gamma < 1
        or cfg.validate.tree_budget < 0
        or cfg.validate.top_k < 1
        or cfg.validate.estimate_prompts < 0
    ):
        problems.append("validate: need gamma >= 1, tree_budget >= 0, top_k >= 1 and estimate_prompts >= 0")
    refuse(problems)
    # any family: the drafter's own layer is a Llama one, sized after the target (validation then
    # says what it cannot measure where the runtime does not run the target: Validation)
    target = DecoderConfig.from_hf(load_hf_config(config_folder(cfg.model.name)), any_family=True)
    aux = tuple(eagle3.aux_layers) if eagle3.aux_layers is not None else None
    return Eagle3Config.for_target(target, aux_layers=aux, draft_vocab_size=eagle3.draft_vocab_size)


def run(cfg: DictConfig) -> dict[str, Any]:
    # ---------------------------------------------------------------- setup
    config = check_config(cfg)
    if cfg.dry_run:  # the plan from config.json alone: nothing loads, nothing is written
        return dry_run(cfg, "eagle3", lambda hf: eagle3_plan(cfg, hf))
    run = start(cfg)
    data = conversations(cfg, run)
    accelerator, trainer, eagle3 = run.accelerator, cfg.trainer, cfg.eagle3
    check_launch(accelerator, "eagle3", ("zero1", "zero2"), "the drafter is small and validated and exported whole")
    target = load_target(cfg, run)
    examples, _ = training_examples(cfg, run, target, data)
    held_out = estimate_examples(cfg, run, data, target)
    draft_ids = draft_vocab([x.ids for x in examples], config.draft_vocab_size, config.vocab_size, run.stop_ids)
    phrases = phrase_table(run, examples) if eagle3.phrase_table else None
    model = build_model(cfg, run, config, target, draft_ids)
    if eagle3.cache_hidden:  # the frozen target runs once per example, not once per epoch
        examples = target_features(cfg, run, target, config, examples)
    if eagle3.cache_hidden or cfg.model.get("shard"):  # a split target cannot run on rank 0 alone in validation
        held_out = target_features(cfg, run, target, config, held_out)
    head_rows = target.get_output_embeddings().weight.detach()[draft_ids.to(run.device)]
    embed = target.get_input_embeddings().weight.detach()
    training = Eagle3Training(
        model,
        embed,
        head_rows,
        steps=eagle3.ttt_steps,
        decay=eagle3.step_decay,
        ranks=cfg.validate.top_k,
        checkpoint_steps=eagle3.checkpoint_steps,
    )
    horizon = make_horizon(cfg, run)  # trainer.max_steps, or what fits max_minutes / train_until
    optimizer, scheduler = make_optimizer_from(cfg, [p for p in model.parameters() if p.requires_grad], horizon)
    wrapped, optimizer, scheduler = accelerator.prepare(training, optimizer, scheduler)
    loss = TTTLoss(wrapped, run, target, config, eagle3.prompt_loss, eagle3.pack_tokens)
    tracker = make_tracker(cfg, run, "eagle3")
    resumed = resume(cfg, run, optimizer, scheduler, horizon)  # + config.yaml: what runs from here on
    # Rank 0 validates alone: the held-out estimate runs the unwrapped module, as a DDP module's
    # forward is a collective the waiting ranks never join (the run hung there).
    plain = unwrap(accelerator, wrapped)
    held_out_loss = TTTLoss(plain, run, target, config, eagle3.prompt_loss)  # unpacked: its hits are replayed by row
    validation = Validation(cfg, run, data, target, plain, held_out, held_out_loss, tracker, phrases)

    # ---------------------------------------------------------------- loop
    steps = [f"step{k}" for k in range(eagle3.ttt_steps)]
    progress = make_progress(
        cfg, run, tracker, resumed.step, horizon, "eagle3", ("loss", "step0/top1", f"{steps[-1]}/top1")
    )
    batches, stats, history = make_batches(cfg, run, examples), resumed.stats, resumed.history
    for step in horizon.steps_from(resumed.step):
        stats = optimizer_step(
            accelerator, wrapped, optimizer, scheduler, batches.step(step), loss, trainer.max_grad_norm
        )
        per_group_rates(stats, steps)
        stats["tau_estimate"] = tau_estimate([stats[f"{s}/top1"] for s in steps])  # training data
        done = step + 1
        progress.update(done, stats, epoch=batches.epoch(done))
        if every(trainer.checkpoint_every, done, horizon.steps):
            state = {"stats": stats, "history": history, "horizon": horizon.state()}
            save_checkpoint(accelerator, run.checkpoints, step=done, state=state, keep=trainer.keep_checkpoints)
        if validation_due(cfg, done, horizon.steps):
            history.append({"step": done, **validation(done)})
    progress.close()

    # ---------------------------------------------------------------- validate
    metrics = validation(horizon.steps)
    result = {"validation": metrics, "train": stats, "history": history, "step": horizon.steps}

    # ---------------------------------------------------------------- export
    if run.main:
        export = write_export(cfg, run, validation.model, metrics, len(examples), horizon.steps, phrases)
        spec = f"{export}{LOOKUP}" if cfg.validate.lookup else export
        finish(cfg, run, result, export, f"specdec generate --target {cfg.model.name} --drafter {spec} --baseline",
               tracker, "eagle3")  # fmt: skip
    tracker.finish()
    return result


# The phrase table's text: its Python index holds ~300 bytes a token while it is built, and more
# text past ~0.4M tokens bought little tau (docs/log/eagle3.md).
PHRASE_TOKENS = 4_000_000


def phrase_table(run: Run, examples: list[Example]) -> PhraseTable | None:
    """What the training responses agree follows 4 tokens (specdec_runtime.drafters.phrases), for lookup;
    built on the main process (validation and export run there) from up to PHRASE_TOKENS tokens."""
    if not run.main:
        return None
    runs, total = [], 0
    for r in responses_of(examples):
        if total + len(r) > PHRASE_TOKENS:
            run.print_once(f"phrase table: from the first {total:,} response tokens (of more)")
            break
        runs.append(r)
        total += len(r)
    table = PhraseTable.build(runs, device=run.device)  # where validation drafts from it
    run.print_once(f"phrase table: {len(table):,} 4-token phrases the responses continue alike for 3-8 tokens")
    return table


def build_model(cfg: DictConfig, run: Run, config: Eagle3Config, target: Any, draft_ids: torch.Tensor) -> Eagle3Model:
    """The drafter in fp32 master weights (autocast does bf16/fp16), warm-started from the target."""
    torch.manual_seed(cfg.seed)
    model = Eagle3Model(config).to(run.device)
    model.set_draft_vocab(draft_ids)
    if cfg.eagle3.init == "target":
        warm_start(model, target, draft_ids)
    if not cfg.eagle3.train_lm_head:  # as speculators trains: the target's own rows, frozen
        model.lm_head.requires_grad_(False)
    covered = sum(1 for _ in draft_ids)
    run.print_once(
        f"EAGLE-3 drafter: taps after layers {list(config.aux_layers)} of {target.config.num_hidden_layers}, "
        f"draft vocabulary {covered} of {config.vocab_size}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, init {cfg.eagle3.init}"
    )
    return model.float()


def target_features(cfg: DictConfig, run: Run, target: Any, config: Eagle3Config, examples: list) -> list[Example]:
    """The examples with the frozen target's taps and final states attached, computed once into
    $SPECDEC_CACHE/hidden/<key> (keyed by target, aux layers, examples and dtype)."""
    if not examples:
        return examples
    key = cache_key(run.target_path, examples, target.dtype, what=f"eagle3 taps {list(config.aux_layers)} + final")
    root = Path(cfg.responses.cache_dir).expanduser() if cfg.responses.cache_dir else cache_root()
    folder = root / "hidden" / key
    run.print_once(f"target states cache: {folder}")
    accelerator = run.accelerator
    return cache_states(
        target,
        examples,
        folder,
        states=target_states(config.aux_layers),
        pad_id=run.pad_id,
        token_bytes=(len(config.aux_layers) + 1) * target.config.hidden_size * target.dtype.itemsize,  # taps + final
        batch_size=cfg.trainer.micro_batch,
        rank=accelerator.process_index,
        world=accelerator.num_processes,
        barrier=accelerator.wait_for_everyone,
        progress=lambda n: tqdm(total=n, desc="target states", unit="example", disable=not run.main),
        say=run.print_once,
        together=most if cfg.model.get("shard") else None,
    )


class TTTLoss:
    """The loop's loss_fn: the training-time test on a micro-batch, on cached target states when
    there are, else on states computed now by the frozen target. prompt_loss: the prompts'
    positions carry loss as well (the target's distributions there are data too). pack_tokens > 0:
    the micro-batch's sequences packed into rows of at most that many tokens after the target's
    states are computed (each sequence's own), with document masks (train.eagle3.pack)."""

    def __init__(
        self,
        wrapped: Any,
        run: Run,
        target: Any,
        config: Eagle3Config,
        prompt_loss: bool = False,
        pack_tokens: int = 0,
    ):
        self.wrapped, self.run, self.target, self.prompt_loss = wrapped, run, target, prompt_loss
        self.states = target_states(config.aux_layers)
        self.pack_tokens = pack_tokens

    def __call__(self, mb: list[Example], responses_only: bool = False) -> tuple:
        device = self.run.device
        batch = {k: v.to(device) for k, v in collate(mb, self.run.pad_id).items()}
        ids, attn = batch["input_ids"], batch["attention_mask"]
        if "taps" in mb[0].meta:
            taps, final = padded(mb, "taps", device), padded(mb, "final", device)
        else:
            with torch.no_grad():
                s = self.states(self.target, ids, attn)
            taps, final = s["taps"], s["final"]
        mask = batch["target_mask"] if responses_only or not self.prompt_loss else attn[:, 1:].bool()
        if self.pack_tokens:
            packed = pack(attn.sum(1).tolist(), self.pack_tokens, ids, mask, taps, final)
            ids, mask, taps, final, documents = (
                packed[k] for k in ("input_ids", "target_mask", "taps", "final", "documents")
            )
            attn = documents >= 0
        else:
            documents = None
        with self.run.accelerator.autocast():
            return self.wrapped(ids, attn, mask, taps, final, documents)


def estimate_examples(cfg: DictConfig, run: Run, data: Conversations, target: Any) -> list[Example]:
    """Held-out examples for the tau estimate: the target's responses to validation prompts not used
    for validation (validate.estimate_prompts of them)."""
    convs = data.rest_val[: cfg.validate.estimate_prompts]
    if not convs:
        return []
    prompts = [prompt_ids(run.tokenizer, c) for c in convs]
    return with_responses(prompts, target_responses(cfg, run, target, prompts), cfg.trainer.max_seq_len)


class Validation:
    """Rank 0 (the others wait): the training-time test on held-out examples (per-step accuracy and
    the tau it predicts, chain and tree), then the drafter on specdec_runtime (tau, speedup,
    losslessness; a tree of validate.tree_budget nodes, or a chain), logged as val/*."""

    def __init__(self, cfg, run, data, target, training, held_out, loss, tracker, phrases=None):  # noqa: ANN001
        self.cfg, self.run, self.data, self.target, self.training = cfg, run, data, target, training
        self.held_out, self.loss, self.tracker, self.phrases = held_out, loss, tracker, phrases
        self.model: Eagle3Model = training.drafter
        self.runtime = None  # the target on the runtime, built at the first validation

    def estimate(self) -> dict[str, Any]:
        """On held-out examples: per-step top-k accuracy, the tau a greedy chain reaches (the
        training-time test's hits replayed round by round, as the runtime decodes) and the tau
        the best static tree of tree_budget nodes would reach with those accuracies."""
        cfg, micro_batch = self.cfg, self.cfg.trainer.micro_batch
        sums: dict[str, float] = {}
        tokens = forwards = 0
        lengths = []  # tokens each held-out response makes (within the budget)
        with torch.no_grad():
            for i in range(0, len(self.held_out), micro_batch):
                batch = self.held_out[i : i + micro_batch]
                self.training.hits = []
                _, _, m = self.loss(batch, responses_only=True)
                for k, x in m.items():
                    sums[k] = sums.get(k, 0.0) + float(x)
                for b, ex in enumerate(batch):
                    first = ex.loss_mask.index(True)  # the prefill makes the first response token
                    end = min(len(ex.ids), first + cfg.validate.max_new_tokens)
                    t, f = replay_chain([h[b] for h in self.training.hits], first, end, cfg.validate.gamma)
                    tokens, forwards = tokens + t, forwards + f
                    lengths.append(t)
        self.training.hits = None
        per_group_rates(sums, [f"step{k}" for k in range(cfg.eagle3.ttt_steps)])
        acc = accuracies(sums, cfg.eagle3.ttt_steps, cfg.validate.top_k)
        out = {"step_top1": [a[0] for a in acc], "tau_estimate_chain": tokens / max(forwards, 1)}
        if cfg.validate.tree_budget:
            depth = [acc[min(k, len(acc) - 1)] for k in range(cfg.validate.gamma)]
            tree = Tree.from_accuracies(depth, cfg.validate.tree_budget)
            per_round = Tree.expected_tau(tree.paths, depth)  # tokens per verify round; + each prefill's one
            out["tau_estimate_tree"] = sum(lengths) / sum(1 + (n - 1) / per_round for n in lengths)
        return out

    def __call__(self, step: int) -> dict[str, Any]:
        cfg, run = self.cfg, self.run
        metrics: dict[str, Any] = {}
        if cfg.validate.enabled and run.main and (why := run.runtime_refusal):
            self.training.eval()
            metrics = {"device": str(run.device), **(self.estimate() if self.held_out else {})}
            self.training.train()
            run.print_once(
                f"validation: {why}: the training-time estimate only (tau_estimate_*); measure the export "
                "with an engine (vLLM, SGLang) or `specdec bench` where the runtime runs the target"
            )
            self.tracker.log({f"val/{k}": x for k, x in metrics.items() if isinstance(x, int | float)}, step)
        elif cfg.validate.enabled and run.main:
            self.training.eval()
            estimate = self.estimate() if self.held_out else {}
            self.runtime = self.runtime or runtime_decoder(self.target, None, run.device)
            drafter = Eagle3Drafter(copy.deepcopy(self.model), self.runtime, tree_budget=cfg.validate.tree_budget,
                                    top_k=cfg.validate.top_k, gamma=cfg.validate.gamma, name="eagle3")  # fmt: skip
            if cfg.validate.lookup:  # prompt lookup where it matches, then the phrase table, the drafter elsewhere
                drafter = LookupFirst(drafter, table=self.phrases)
            metrics = validate(
                self.runtime,
                drafter,
                self.data.val_prompts,
                self.data.val_categories,
                stop_ids=run.stop_ids,
                gamma=cfg.validate.gamma,
                max_new_tokens=cfg.validate.max_new_tokens,
                threads=run.threads.get("decode"),
                batch_sizes=list(cfg.validate.batch_sizes),
            )
            metrics |= {
                "device": str(run.device),
                "nodes": cfg.validate.tree_budget or None,
                "drafter": drafter.name,
                **estimate,
            }
            self.training.train()
            self.tracker.log({f"val/{k}": x for k, x in metrics.items() if isinstance(x, int | float)}, step)
        run.accelerator.wait_for_everyone()
        return metrics


def write_export(
    cfg: DictConfig,
    run: Run,
    model: Eagle3Model,
    metrics: dict[str, Any],
    n_examples: int,
    steps: int,
    phrases: PhraseTable | None = None,
) -> Path:
    """export/: the speculators folder (config.json, model.safetensors), the phrase table and a model card."""
    eagle3 = cfg.eagle3
    card = Card(
        **target_card(cfg, run),
        recipe="eagle3",
        data=cfg.data.train,
        setup={
            "taps (layers)": list(model.config.aux_layers),
            "draft vocabulary": model.config.draft_vocab_size,
            "training-time test": f"{eagle3.ttt_steps} steps, decay {eagle3.step_decay}",
            "init": eagle3.init,
            "responses": cfg.responses.source,
            "examples": n_examples,
            "steps": steps,
            "learning rate": f"{cfg.optim.lr} ({cfg.optim.schedule})",
            "validation drafts": (
                f"tree of {cfg.validate.tree_budget} nodes, depth {cfg.validate.gamma}, top-{cfg.validate.top_k}"
                if cfg.validate.tree_budget
                else f"chain of {cfg.validate.gamma}"
            )
            + (" (prompt lookup first: `--drafter DIR+lookup`)" if cfg.validate.lookup else ""),  # fmt: skip
        },
        metrics=metrics or None,
        tags=["eagle3", "eagle"],
        hub_id=cfg.hub.repo_id,
    )
    drafting = {"gamma": cfg.validate.gamma, "tree_budget": cfg.validate.tree_budget, "top_k": cfg.validate.top_k}
    return export_eagle3(copy.deepcopy(model).float(), run.out / "export", card, drafting=drafting, phrases=phrases)


@hydra.main(config_path="../conf", config_name="eagle3", version_base=None)
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
