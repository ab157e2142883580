"""A recipe's data: the conversations it trains and validates on, the target's own responses to them
(generated in the run, resumable), and the training examples they become."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from omegaconf import DictConfig
from tqdm.auto import tqdm

from recipes.run import Run
from specdec_runtime.errors import SpecdecError
from specdec_runtime.paths import cache_root
from train.data import (
    Conversation,
    Example,
    encode_conversation,
    load_conversations,
    mixed,
    pre_query_ids,
    prompt_ids,
    round_robin_by_category,
    self_written,
    with_responses,
)
from train.launch import most
from train.responses import DONE as RESPONSES_DONE
from train.responses import cache_key, generate_responses
from train.validate import runtime_decoder


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


def val_source(data: DictConfig) -> dict[str, Any]:
    """The split and column of data.val: data.val_split and data.val_column, else the training set's
    for a dataset, and detection for the built-in prompts (a ShareGPT column is not theirs)."""
    builtin = str(data.val).startswith("builtin:")
    return {
        "split": data.get("val_split") or data.split,
        "column": data.get("val_column") or (None if builtin else data.column),
    }


def training_sources(data: DictConfig) -> list[tuple[str, dict[str, Any], float]]:
    """(source, its split and column, weight) of the training data: data.mix's entries (each with
    its own split, default train, and column, default detected), else data.train alone."""
    if not data.get("mix"):
        return [(data.train, {"split": data.split, "column": data.column}, 1.0)]
    return [(m.train, {"split": m.get("split") or "train", "column": m.get("column")}, float(m.get("weight", 1.0)))
            for m in data.mix]  # fmt: skip


def training_conversations(data: DictConfig, say: Callable[[str], Any]) -> list[Conversation]:
    """data.train, or data.mix's sources in their weights' proportions, up to data.max_samples;
    unusable records left out and said (up to data.max_unusable of a source)."""
    limit = dict(skipped=say, max_left_out=data.get("max_unusable", 1.0))
    sources = [(name, load_conversations(name, **how, **limit), w) for name, how, w in training_sources(data)]
    if len(sources) == 1:
        return round_robin_by_category(sources[0][1], data.max_samples or 0)
    train, said = mixed(sources, data.max_samples or 0)
    say(said)
    return train


def conversations(cfg: DictConfig, run: Run) -> Conversations:
    """data.train (or data.mix) and data.val: records a dataset holds that cannot be trained on
    (empty or one-sided conversations) are left out and said, up to data.max_unusable of a source;
    data.val is read with val_source()."""
    data = cfg.data
    train = training_conversations(data, run.print_once)
    limit = dict(skipped=run.print_once, max_left_out=data.get("max_unusable", 1.0))
    all_val = load_conversations(data.val, **val_source(data), **limit)
    val = round_robin_by_category(list(all_val), cfg.validate.num_prompts)
    chosen = {id(c) for c in val}
    rest = [c for c in all_val if id(c) not in chosen]
    return Conversations(train, val, [prompt_ids(run.tokenizer, c) for c in val], rest)


def generation_kwargs(cfg: DictConfig, run: Run) -> dict[str, Any]:
    """generate_responses() settings: sampling from cfg.responses, the process group from the run."""
    responses, accelerator = cfg.responses, run.accelerator

    def progress(todo: int, total: int) -> Any:
        done = total - todo * accelerator.num_processes
        return tqdm(total=todo, desc=f"responses ({done} cached)", unit="prompt", disable=not run.main)

    return dict(
        pad_id=run.pad_id,
        stop_ids=run.stop_ids,
        max_new_tokens=responses.max_new_tokens,
        batch_size=responses.batch_size,
        temperature=responses.temperature,
        top_p=responses.top_p,
        rank=accelerator.process_index,
        world=accelerator.num_processes,
        barrier=accelerator.wait_for_everyone,
        gather=lambda d: gather_object([d]),  # every process gets every share
        progress=progress,
        together=most if cfg.model.get("shard") else None,  # a split target: every process the same forwards
    )


def target_responses(
    cfg: DictConfig, run: Run, target: Any, prompts: list[list[int]], sampling: dict[str, Any] | None = None
) -> list[list[int]]:
    """The target's responses to prompts, cached on disk by target + prompts + settings; sampling
    (max_new_tokens, temperature, top_p, what) overrides cfg.responses' for another kind of text."""
    sampling = sampling or {}
    settings = {k: cfg.responses[k] for k in ("max_new_tokens", "temperature", "top_p")} | sampling
    settings |= {"seed": cfg.seed, "dtype": str(target.dtype)}
    engine = response_engine(cfg, run)
    if engine == "runtime":  # (transformers' responses keep the cache keys they had before engines)
        settings["engine"] = engine
    elif settings["temperature"] > 0:  # transformers' sampled responses drew from its top 50 before top_k=0: not those
        settings["top_k"] = 0
    root = Path(cfg.responses.cache_dir).expanduser() if cfg.responses.cache_dir else cache_root() / "responses"
    cache = root / cache_key(run.target_path, prompts, settings)
    run.print_once(f"{sampling.get('what', 'self-distillation responses')} ({engine}): {cache}")
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
    run.print_once(f"self-written prompts: {len(convs)} of {n} finished and distinct")
    return [prompt_ids(run.tokenizer, c) for c in convs]


def response_engine(cfg: DictConfig, run: Run) -> str:
    """What generates the target's responses: responses.engine (local_engine); transformers where
    the runtime cannot run the target (run.runtime_refusal)."""
    setting = cfg.responses.get("engine", "auto")
    if run.runtime_refusal and setting != "transformers":
        if setting == "runtime":
            raise SpecdecError(f"responses.engine=runtime: {run.runtime_refusal}; use responses.engine=transformers")
        return "transformers"
    return local_engine(setting, run.device)


def local_engine(setting: str, device: torch.device) -> str:
    """What generates in this job (responses.engine, recipes.regenerate's engine.backend): auto is the
    runtime's batched decoding on a CPU (the same tokens, faster than transformers' generate:
    docs/results.md) and transformers' generate on GPUs (the runtime's batches run eagerly there;
    not measured)."""
    if setting == "auto":
        return "runtime" if device.type == "cpu" else "transformers"
    return setting


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
        run.print_once(f"skipping {len(prompts) - len(keep)} prompts longer than trainer.max_seq_len={max_len}")
    prompts = [prompts[i] for i in keep]
    if cfg.responses.source == "target" and cfg.responses.samples_per_prompt > 1:  # independent samples each
        prompts = [p for p in prompts for _ in range(cfg.responses.samples_per_prompt)]
    if cfg.responses.source == "dataset":
        examples = [encode_conversation(run.tokenizer, data.train[i], max_len) for i in keep]
        return [e for e in examples if e.n_targets], prompts
    own = [p for p in self_prompts(cfg, run, target) if len(p) < max_len - 8]  # one response each
    if cfg.responses.source == "target":
        cut: list[int] = []
        examples = with_responses(prompts, target_responses(cfg, run, target, prompts), max_len, cut)
        if own:  # their own cache: the data's responses are kept when only self_prompts changes
            examples += with_responses(own, target_responses(cfg, run, target, own), max_len, cut)
        if cut:
            run.print_once(
                f"{len(cut)} of {len(examples)} responses did not fit trainer.max_seq_len={max_len} with their prompt "
                f"and were cut (by up to {max(cut)} tokens): raise trainer.max_seq_len to keep them whole"
            )
        return examples, prompts + own
    return [], prompts + own
