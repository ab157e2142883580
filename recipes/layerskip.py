"""Find the sublayers a target skips to draft for itself (self-speculative decoding, Draft &
Verify), by Bayesian optimization of measured speed, then validate and write the skip set.

    python -m recipes.layerskip output_dir=runs/layerskip
    python -m recipes.layerskip experiment=layerskip_quickstart output_dir=runs/layerskip-quick
    python -m recipes.layerskip search.objective=proxy search.cost_model=params model=llama3_1b
    python -m recipes.layerskip search.storage=postgresql://user:pw@host/db search.study_name=llama-8b
    specdec generate --drafter runs/layerskip/skipset.json --baseline

Setup (config and search-space checks from the target's config.json, before any weights), the
target loaded once on specdec_runtime, calibration (its greedy outputs and autoregressive speed
on the calibration prompts), the study (optuna, resumable, shared through its storage), an
optional random-search baseline with the same budget, validation of the best set on held-out
prompts, and the outputs: skipset.json, trials.jsonl, search_trace.png, metrics.json, export/.
"""

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from recipes.checks import check_run_settings, check_shard, refuse, run_or_exit, target_hub_id
from recipes.data import val_source
from recipes.plan import dry_run, layerskip_plan
from recipes.run import Run, finish, make_tracker, record_config, start
from specdec_runtime.config import DecoderConfig
from specdec_runtime.drafters.layerskip import SkipSet, skip_drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.loading import LoadedModel, load_hf_config, load_model
from specdec_runtime.paths import config_folder
from train.data import prompts_of
from train.export import Card, export_skipset
from train.layerskip import (
    COST_MODELS,
    OBJECTIVES,
    SAMPLERS,
    Calibration,
    CostModel,
    Evaluator,
    ExitSettings,
    SearchSpace,
    best_trial,
    calibrate,
    finished,
    open_study,
    plot_traces,
    search,
)
from train.tracking import Tracker
from train.validate import validate


def check_config(cfg: DictConfig) -> list[str]:
    """Problems with the settings that need no model."""
    problems = check_run_settings(cfg)
    problems += check_shard(cfg, "layerskip")
    if cfg.search.sampler not in SAMPLERS:
        problems.append(f"search.sampler='{cfg.search.sampler}': use gp (Bayesian optimization) or random")
    if cfg.search.objective not in OBJECTIVES:
        problems.append(
            f"search.objective='{cfg.search.objective}': use speedup (measured) or proxy (tau x cost model)"
        )
    if cfg.search.cost_model not in COST_MODELS:
        problems.append(f"search.cost_model='{cfg.search.cost_model}': use measured or params")
    for key, low in (("n_trials", 1), ("n_startup_trials", 0), ("baseline_every", 0)):
        if not isinstance(cfg.search[key], int) or cfg.search[key] < low:
            problems.append(f"search.{key}={cfg.search[key]} must be an integer >= {low}")
    if (
        not isinstance(cfg.calibration.num_prompts, int)
        or cfg.calibration.num_prompts < 1
        or cfg.calibration.max_new_tokens < 2
    ):
        problems.append("calibration: need num_prompts >= 1 and max_new_tokens >= 2")
    if not isinstance(cfg.draft.gamma, int) or cfg.draft.gamma < 1:
        problems.append(f"draft.gamma={cfg.draft.gamma} must be an integer >= 1")
    if not 0 <= cfg.draft.threshold < 1 or not 0 < cfg.draft.target_acceptance <= 1:
        problems.append("draft: need 0 <= threshold < 1 and 0 < target_acceptance <= 1")
    if cfg.validate.enabled and (cfg.validate.max_new_tokens < 1 or cfg.validate.num_prompts < 0):
        problems.append("validate: need max_new_tokens >= 1 and num_prompts >= 0")
    return problems


def search_space(cfg: DictConfig, num_layers: int) -> SearchSpace:
    return SearchSpace(num_layers, cfg.search.keep_first, cfg.search.keep_last, float(cfg.search.max_skip_fraction))


def study_meta(cfg: DictConfig, space: SearchSpace, sampler: str) -> dict[str, Any]:
    """What must not change when a study is resumed or shared."""
    return {
        "target": cfg.model.name,
        "sampler": sampler,
        "objective": cfg.search.objective,
        "cost_model": cfg.search.cost_model if cfg.search.objective == "proxy" else None,
        "space": {"num_layers": space.num_layers, "keep_first": space.keep_first, "keep_last": space.keep_last},
        "max_skip_fraction": space.max_skip_fraction,
        "draft": OmegaConf.to_container(cfg.draft, resolve=True),
        "calibration": OmegaConf.to_container(cfg.calibration, resolve=True) | {"data": cfg.data.train},
    }


def cost_model(cfg: DictConfig, study: Any, target: Any) -> CostModel | None:
    """The proxy's cost model: stored with the study (so every worker and a resumed search use the
    same one), else measured here or computed from the weights."""
    if cfg.search.objective != "proxy":
        return None
    stored = study.user_attrs.get("cost_model")
    if stored:
        return CostModel(**stored)
    if cfg.search.cost_model == "params":
        cost = CostModel.from_params(target.model)
    else:
        cost = CostModel.measure(target.model, cfg.draft.gamma)
    study.set_user_attr("cost_model", cost.__dict__)
    return cost


def run_study(
    cfg: DictConfig,
    study: Any,
    sampler: str,
    evaluator: Evaluator,
    space: SearchSpace,
    tracker: Tracker,
    prefix: str,
    step: Callable[[], int],
) -> None:
    """Run one study to search.n_trials complete trials, logging each under `prefix`/ at step()
    (the trials finished in all studies: monotonic across studies and resumed runs)."""
    best = [max((t.value for t in finished(study)), default=float("-inf"))]

    def on_trial(trial: Any) -> None:
        best[0] = max(best[0], trial.value)
        attrs = trial.user_attrs
        metrics = {"trial": trial.number + 1, "value": trial.value, "best": best[0], "skipped": attrs.get("skipped")}
        metrics |= {k: attrs[k] for k in ("tau", "speedup", "est_speedup", "acceptance") if k in attrs}
        tracker.log({f"{prefix}/{k}": v for k, v in metrics.items() if v is not None}, step() + 1)

    def progress(done: int, total: int) -> Any:
        return tqdm(
            total=total, initial=done, desc=f"{study.study_name} ({sampler}, {cfg.search.objective})", unit="trial"
        )

    search(
        study,
        space,
        evaluator,
        n_trials=cfg.search.n_trials,
        sampler=sampler,
        seed=cfg.seed,
        n_startup=cfg.search.n_startup_trials,
        on_trial=on_trial,
        progress=progress,
    )


def write_trials(path: Path, studies: dict[str, Any]) -> None:
    """Every complete trial of every study, one JSON line each (rewritten atomically)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for sampler, study in studies.items():
            for t in finished(study):
                f.write(json.dumps({"sampler": sampler, "trial": t.number, "value": t.value, **t.user_attrs}) + "\n")
    os.replace(tmp, path)


def run(cfg: DictConfig) -> dict[str, Any]:
    # ---------------------------------------------------------------- setup
    refuse(check_config(cfg))
    dcfg = DecoderConfig.from_hf(load_hf_config(config_folder(cfg.model.name)))  # clear errors, no weights
    space = search_space(cfg, dcfg.num_layers)
    refuse(space.problems())
    if cfg.dry_run:  # the plan from config.json alone: nothing loads, nothing is written
        return dry_run(cfg, "layerskip", lambda hf: layerskip_plan(cfg, hf))
    run = start(cfg)
    if run.accelerator.num_processes > 1:
        raise SpecdecError(
            "recipes.layerskip runs as one process: start it once per machine or GPU (python -m recipes.layerskip "
            "device=cuda:N) with the same search.storage URL, and the workers share one study"
        )
    studies = open_studies(cfg, run, space)  # before the model loads: a bad storage or setting fails now
    record_config(cfg, run)
    logged = lambda: sum(len(finished(st)) for st in studies.values())  # noqa: E731
    target = load_model(cfg.model.name, device=cfg.device, dtype=cfg.model.dtype)
    run.print_once(
        f"target {cfg.model.name} on {target.model.device} in {target.model.dtype}: {dcfg.num_layers} layers"
    )
    tracker = make_tracker(cfg, run, "layerskip")
    cal = calibration(cfg, run, target)

    # ---------------------------------------------------------------- search
    for sampler, study in studies.items():
        prefix = "search" if sampler == cfg.search.sampler else sampler
        run_study(cfg, study, sampler, evaluator(cfg, study, target, cal), space, tracker, prefix, logged)
    write_trials(run.out / "trials.jsonl", studies)
    plot_traces(
        {s: [[t.value for t in finished(st)]] for s, st in studies.items()},
        run.out / "search_trace.png",
        ylabel="speedup over autoregressive" if cfg.search.objective == "speedup" else "estimated speedup (proxy)",
        title=f"layer-skip search on {cfg.model.name} ({cfg.search.objective})",
    )
    skipset, summary = best_skipset(cfg, run, studies, space, dcfg)
    result: dict[str, Any] = {"search": summary, "calibration_ar_tokens_per_s": cal.ar_tokens_per_s}

    # ---------------------------------------------------------------- validate
    if cfg.validate.enabled:
        result["validation"] = validate_skipset(cfg, run, target, skipset)
        numbers = {f"val/{k}": v for k, v in result["validation"].items() if isinstance(v, (int, float))}
        tracker.log(numbers, logged() + 1)

    # ---------------------------------------------------------------- export
    skipset.save(run.out / "skipset.json")
    result["best"] = skipset.to_dict()
    export = write_export(cfg, run.out, skipset, result.get("validation"))
    command = f"specdec generate --target {cfg.model.name} --drafter {run.out / 'skipset.json'} --baseline"
    finish(cfg, run, result, export, command, tracker, "layerskip")
    tracker.finish()
    return result


def open_studies(cfg: DictConfig, run: Run, space: SearchSpace) -> dict[str, Any]:
    """The study of search.sampler (+ a random-search baseline with the same budget when asked),
    opened or resumed in search.storage (default: the run folder's study.db)."""
    storage = cfg.search.storage or f"sqlite:///{(run.out / 'study.db').resolve()}"
    samplers = [cfg.search.sampler]
    if cfg.search.random_baseline and cfg.search.sampler != "random":
        samplers.append("random")
    return {
        sampler: open_study(
            storage,
            cfg.search.study_name + ("" if sampler == cfg.search.sampler else f"-{sampler}"),
            sampler=sampler,
            seed=cfg.seed,
            n_startup=cfg.search.n_startup_trials,
            meta=study_meta(cfg, space, sampler),
        )
        for sampler in samplers
    }


def calibration(cfg: DictConfig, run: Run, target: LoadedModel) -> Calibration:
    """The target's greedy outputs and autoregressive speed on the calibration prompts."""
    data = cfg.data
    prompts, _ = prompts_of(
        target.tokenizer, data.train, cfg.calibration.num_prompts, data.split, data.column, skipped=run.print_once
    )
    run.print_once(f"calibration: {len(prompts)} prompts from {data.train}, {cfg.calibration.max_new_tokens} tokens")
    cal = calibrate(target.model, prompts, max_new_tokens=cfg.calibration.max_new_tokens, stop_ids=target.stop_ids)
    run.print_once(
        f"autoregressive on the calibration prompts: {cal.ar_tokens_per_s:.1f} tokens/s ({cal.tokens} tokens)"
    )
    return cal


def evaluator(cfg: DictConfig, study: Any, target: LoadedModel, cal: Calibration) -> Evaluator:
    """How the study scores a skip set (measured speedup, or the proxy with the study's cost model)."""
    draft = cfg.draft
    return Evaluator(
        target.model,
        cal,
        objective=cfg.search.objective,
        gamma=draft.gamma,
        exit_settings=ExitSettings(float(draft.threshold), bool(draft.adaptive), float(draft.target_acceptance)),
        cost=cost_model(cfg, study, target),
        max_new_tokens=cfg.calibration.max_new_tokens,
        stop_ids=target.stop_ids,
        baseline_every=cfg.search.baseline_every,
    )


def best_skipset(
    cfg: DictConfig, run: Run, studies: dict[str, Any], space: SearchSpace, dcfg: DecoderConfig
) -> tuple[SkipSet, dict[str, Any]]:
    """The best trial of the main study as a SkipSet, and each study's best value and trial count."""
    study = studies[cfg.search.sampler]
    best = best_trial(study)
    if best is None:
        raise SpecdecError("no trial produced a usable skip set (all infeasible or not lossless): see trials.jsonl")
    skip = space.skip_of(best.params)
    summary = {
        s: {"best": max(t.value for t in finished(st)), "trials": len(finished(st))} for s, st in studies.items()
    }
    run.print_once("best per sampler: " + ", ".join(f"{s} {v['best']:.3f}" for s, v in summary.items()))
    skipset = SkipSet(
        attn=sorted(skip.attn),
        mlp=sorted(skip.mlp),
        num_layers=dcfg.num_layers,
        target=cfg.model.name,
        hidden_size=dcfg.hidden_size,
        draft=OmegaConf.to_container(cfg.draft, resolve=True),
        search={
            "sampler": cfg.search.sampler,
            "objective": cfg.search.objective,
            "trials": len(finished(study)),
            "best_trial": best.number,
            "best_value": best.value,
            "calibration_tau": best.user_attrs.get("tau"),
        },
    )
    return skipset, summary


def validate_skipset(cfg: DictConfig, run: Run, target: LoadedModel, skipset: SkipSet) -> dict[str, Any]:
    """The set on held-out prompts (tau, speedup, losslessness); records tau and speedup in it."""
    data = cfg.data
    prompts, cats = prompts_of(
        target.tokenizer, data.val, cfg.validate.num_prompts, **val_source(data), skipped=run.print_once
    )
    metrics = validate(
        target.model,
        skip_drafter(target, skipset),
        prompts,
        cats,
        stop_ids=target.stop_ids,
        gamma=cfg.draft.gamma,
        max_new_tokens=cfg.validate.max_new_tokens,
        threads=run.threads.get("decode"),
    )
    metrics["device"] = str(target.model.device)
    skipset.tau, skipset.speedup = metrics["tau"], metrics["speedup"]
    if metrics["speedup"] < 1:
        run.print_once(
            f"note: the best set is slower than autoregressive decoding here ({metrics['speedup']:.2f}x, tau "
            f"{metrics['tau']:.2f}). Self-speculation pays only when a draft token is accepted more often than "
            "its draft step plus its share of verification cost, relative to one decode step: skipping more "
            "makes drafts cheaper but rarer to accept (see trials.jsonl: tau and acceptance per trial)."
        )
    return metrics


def write_export(cfg: DictConfig, out: Path, skipset: SkipSet, metrics: dict[str, Any] | None) -> Path:
    """export/: skipset.json and a model card (what a Hub repo of the set holds)."""
    card = Card(
        target=cfg.model.name,
        recipe="layerskip",
        data=f"{cfg.data.train} (calibration: {cfg.calibration.num_prompts} prompts)",
        setup={
            "skipped attention layers": skipset.attn or "none",
            "skipped MLP layers": skipset.mlp or "none",
            "skipped fraction of sublayers": f"{skipset.skipped_fraction:.2f}",
            "search": f"{cfg.search.sampler}, {skipset.search['trials']} trials, objective {cfg.search.objective}",
            "draft exit": f"threshold {cfg.draft.threshold}, adaptive {cfg.draft.adaptive}, gamma {cfg.draft.gamma}",
        },
        metrics=metrics,
        tags=["self-speculative-decoding", "layer-skip"],
        target_hub_id=target_hub_id(cfg),
        hub_id=cfg.hub.repo_id,
    )
    return export_skipset(skipset, out / "export", card)


@hydra.main(config_path="../conf", config_name="layerskip", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
