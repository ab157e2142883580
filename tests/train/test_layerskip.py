"""The layer-skip search: search space, the proxy's replay against real decoding, cost models, the
optuna study (resume, shared settings), and the recipe end to end on a tiny target."""

import json
import random
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from recipes import layerskip
from specdec_runtime.drafters.protocol import DraftExit
from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.loading import load_model
from specdec_runtime.model import LayerSkip
from tests.conftest import BigramStub, accelerate_launch, bigram_table, save_tiny_model, tiny_decoder, write_prompt_file
from train.layerskip import (
    Calibration,
    CostModel,
    Evaluator,
    ExitSettings,
    SearchSpace,
    best_trial,
    finished,
    open_study,
    replay_rounds,
    search,
)

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_search_space_names_bounds_and_feasible_random_draws():
    space = SearchSpace(num_layers=6, keep_first=1, keep_last=2, max_skip_fraction=0.25)
    assert space.problems() == []
    assert list(space.layers) == [1, 2, 3] and space.names == ["attn_1", "mlp_1", "attn_2", "mlp_2", "attn_3", "mlp_3"]
    assert space.max_skipped == 3  # floor(0.25 * 12)
    assert space.skip_of({"attn_2": True, "mlp_3": True, "mlp_1": False}) == LayerSkip(attn={2}, mlp={3})
    draws = [space.random_params(random.Random(i)) for i in range(400)]
    sizes = [sum(d.values()) for d in draws]
    assert set(sizes) == {1, 2, 3}
    assert all(95 < sizes.count(k) < 170 for k in range(1, 4))  # sizes uniform in 1..max_skipped
    assert space.violation(LayerSkip()) == 1 and space.violation(LayerSkip(attn={1, 2, 3}, mlp={1})) == 1
    assert space.random_params(random.Random(7)) == space.random_params(random.Random(7))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(keep_first=3, keep_last=3), "leaves no layer to skip: the target has 6 layers"),
        (dict(keep_first=-1), "search.keep_first=-1 must be an integer >= 0"),
        (dict(max_skip_fraction=0.0), "must be in \\(0, 1\\]"),
        (dict(max_skip_fraction=1.5), "must be in \\(0, 1\\]"),
        (dict(max_skip_fraction=0.05), "allows no sublayer of 12"),
    ],
)
def test_invalid_search_spaces_are_explained(kwargs, message):
    problems = SearchSpace(num_layers=6, **kwargs).problems()
    assert problems and any(__import__("re").search(message, p) for p in problems), problems


def test_replay_equals_real_decoding_for_a_context_free_drafter():
    """A bigram drafter's draft does not depend on context, so teacher forcing is exact: the
    replayed rounds (adaptive exit included) equal generate()'s, round for round."""
    table, d_table = bigram_table(40, seed=3), bigram_table(40, seed=3) + bigram_table(40, seed=4)
    for gamma, threshold in ((4, 0.5), (6, 0.2), (3, 0.0)):
        out = generate(
            BigramStub(table), [5], ModelDrafter(BigramStub(d_table), draft_exit=DraftExit(threshold)),
            max_new_tokens=80, gamma=gamma,
        )  # fmt: skip
        seq = [5, *out.tokens]
        probs = d_table[torch.tensor(seq[1:-1])].softmax(-1)  # drafts after output tokens 0..n-2
        conf, choice = probs.max(-1)
        agree = (choice == torch.tensor(seq[2:])).tolist()
        counts = replay_rounds(agree, conf.tolist(), gamma, DraftExit(threshold))
        s = out.stats
        assert (counts.tokens, counts.forwards, counts.drafted, counts.accepted) == (
            s.new_tokens, s.target_forwards, s.drafted, s.accepted,
        )  # fmt: skip
        assert 0 < s.accepted < s.drafted


def test_proxy_of_the_empty_set_is_exact_on_a_transformer():
    """Skipping nothing, the draft is the target itself: the proxy's tau and draft counts equal a
    real self-speculative run (all accepted; the exit rule sees the same confidences)."""
    target = tiny_decoder("llama", seed=1, num_hidden_layers=3)
    prompts = [[5, 9, 11, 2], [7, 3, 9, 7, 3]]
    outs = [generate(target, p, max_new_tokens=30).tokens for p in prompts]
    cal = Calibration(prompts, outs, ar_tokens_per_s=1.0)
    cost = CostModel(0.1, 0.1, 0.2, 0.05, 3, "test")  # a full draft step costs 1
    evaluator = Evaluator(
        target, cal, objective="proxy", gamma=5, exit_settings=ExitSettings(0.6), cost=cost,
        max_new_tokens=30, stop_ids=frozenset(),
    )  # fmt: skip
    got = evaluator(LayerSkip())
    tokens = forwards = drafted = 0
    draft_exit = DraftExit(0.6)
    for p in prompts:
        d = ModelDrafter(target, skip=LayerSkip(), shares_target_cache=True, draft_exit=draft_exit)
        s = generate(target, p, d, max_new_tokens=30, gamma=5).stats
        tokens, forwards, drafted = tokens + s.new_tokens, forwards + s.target_forwards, drafted + s.drafted
        assert s.accepted == s.drafted
    assert got["tau"] == pytest.approx(tokens / forwards) and got["acceptance"] == 1.0
    assert got["drafted_per_forward"] == pytest.approx(drafted / forwards)
    assert got["est_speedup"] == pytest.approx(tokens / (forwards + drafted * (1.0 + 0.05)))


def test_cost_models_split_a_decode_step():
    target = tiny_decoder("llama", seed=0, num_hidden_layers=3)
    # The measured model's shares come from timings, which on a tiny model on a busy machine may
    # show no saving at all (fixed 1, shares 0): only what holds for any timings is asserted of it.
    for cost in (CostModel.from_params(target), CostModel.measure(target, gamma=4, repeats=3)):
        assert cost.draft_cost(LayerSkip()) == pytest.approx(1.0)
        assert cost.draft_cost(LayerSkip(attn={0, 1, 2}, mlp={0, 1, 2})) == pytest.approx(cost.fixed)
        assert cost.fixed + 3 * (cost.attn_share + cost.mlp_share) == pytest.approx(1.0)
        assert 0 < cost.fixed <= 1 and cost.attn_share >= 0 and cost.mlp_share >= 0
        assert cost.verify_extra >= 0
    p = CostModel.from_params(target)  # hidden 64, 4 heads / 2 kv heads of 16, intermediate 128, vocab 256
    attn, mlp, head = 64 * (64 + 2 * 32) + 64 * 64, 3 * 64 * 128, 64 * 256
    total = 3 * (attn + mlp) + head
    assert (p.attn_share, p.mlp_share, p.fixed) == pytest.approx((attn / total, mlp / total, head / total))


def toy_study(path: Path, sampler: str, n_trials: int, evaluate, seed: int = 0, meta=None):
    space = SearchSpace(num_layers=5, keep_first=1, keep_last=1, max_skip_fraction=0.5)
    study = open_study(
        f"sqlite:///{path}", "toy", sampler=sampler, seed=seed, n_startup=3, meta=meta or {"objective": "proxy"}
    )
    search(study, space, evaluate, n_trials=n_trials, sampler=sampler, seed=seed, n_startup=3)
    return study


def toy_objective(skip: LayerSkip) -> dict:
    """Skipping later sublayers pays; skipping attention of layer 2 costs."""
    value = sum(0.1 * i for i in skip.mlp) + sum(0.05 * i for i in skip.attn) - (1.0 if 2 in skip.attn else 0)
    return {"value": value, "tau": 1.0 + value}


def test_study_resumes_from_its_sqlite_file_after_an_interruption(tmp_path):
    db = tmp_path / "study.db"
    calls = []

    def interrupted(skip):
        calls.append(skip)
        if len(calls) == 5:
            raise RuntimeError("power cut")
        return toy_objective(skip)

    with pytest.raises(RuntimeError, match="power cut"):
        toy_study(db, "gp", 10, interrupted)
    kept = open_study(f"sqlite:///{db}", "toy", sampler="gp", seed=0, n_startup=3, meta={"objective": "proxy"})
    first = [(t.number, t.params, t.value) for t in finished(kept)]
    assert len(first) >= 3  # trials before the failure are kept (duplicates cost no evaluation)
    resumed = []
    study = toy_study(db, "gp", 10, lambda s: resumed.append(s) or toy_objective(s))
    done = finished(study)
    assert len(done) == 10
    assert [(t.number, t.params, t.value) for t in done[: len(first)]] == first
    assert len(resumed) <= 10 - len(first)  # no finished trial was evaluated again
    with pytest.raises(SpecdecError, match="different settings \\(objective\\)"):
        toy_study(db, "gp", 10, toy_objective, meta={"objective": "speedup"})


def test_gp_and_random_share_their_start_then_gp_proposes(tmp_path):
    gp = toy_study(tmp_path / "gp.db", "gp", 12, toy_objective, seed=3)
    rnd = toy_study(tmp_path / "random.db", "random", 12, toy_objective, seed=3)
    g, r = finished(gp), finished(rnd)
    assert [t.params for t in g[:3]] == [t.params for t in r[:3]]  # paired random starts
    assert all("fixed_params" in t.system_attrs for t in r)  # random search: feasible draws, enqueued
    assert not any("fixed_params" in t.system_attrs for t in g[3:])  # then the GP sampler proposes
    assert all(t.user_attrs["constraint"] <= 0 for t in r)
    best = best_trial(gp)
    assert best.value == max(t.value for t in g if t.user_attrs["constraint"] <= 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("layerskip")
    target = save_tiny_model(root / "target", num_hidden_layers=4, initializer_range=0.05)
    data = write_prompt_file(root / "prompts.jsonl", 8, stride=5, suffix=" again")
    return target, data


def config(tiny, out: Path, *overrides: str):
    target, data = tiny
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(
            "layerskip",
            overrides=[
                f"output_dir={out}",
                f"model.name={target}",
                f"data.train={data}",
                f"data.val={data}",
                "device=cpu",
                "search.n_trials=6",
                "search.n_startup_trials=3",
                "search.objective=proxy",
                "search.keep_first=0",
                "search.keep_last=0",
                "calibration.num_prompts=2",
                "calibration.max_new_tokens=12",
                "draft.gamma=4",
                "validate.num_prompts=2",
                "validate.max_new_tokens=16",
                *overrides,
            ],
        )


def test_recipe_end_to_end_on_a_tiny_target(tiny, tmp_path):
    out = tmp_path / "run"
    result = layerskip.run(config(tiny, out, "search.random_baseline=true"))
    for name in ("config.yaml", "study.db", "trials.jsonl", "skipset.json", "search_trace.png", "metrics.json"):
        assert (out / name).is_file(), name
    assert (out / "export" / "skipset.json").is_file() and "layer-skip" in (out / "export" / "README.md").read_text()
    trials = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert sorted({t["sampler"] for t in trials}) == ["gp", "random"] and len(trials) == 12
    assert set(result["search"]) == {"gp", "random"}
    best = json.loads((out / "skipset.json").read_text())
    assert best["format"] == "specdec-layerskip" and best["num_layers"] == 4
    feasible = [t["value"] for t in trials if t["sampler"] == "gp" and t["constraint"] <= 0]
    assert best["search"]["best_value"] == max(feasible)
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in log]
    assert steps == sorted(steps) and "val/tau" in log[-1]
    assert sum("search/value" in r for r in log) == 6 and sum("random/value" in r for r in log) == 6
    val = result["validation"]
    assert val["lossless"] == 1.0 and best["tau"] == val["tau"] and best["speedup"] == val["speedup"]
    # the found set decodes exactly the target's greedy output
    target = load_model(str(tiny[0]), device="cpu")
    drafter = build_drafter(str(out / "skipset.json"), target)
    prompt = [3, 4, 5, 6, 7]
    assert (
        generate(target.model, prompt, drafter, max_new_tokens=30, gamma=4).tokens
        == generate(target.model, prompt, max_new_tokens=30).tokens
    )
    # rerun with a larger budget: resumes the same studies
    layerskip.run(config(tiny, out, "search.n_trials=8", "validate.enabled=false"))
    trials = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert len([t for t in trials if t["sampler"] == "gp"]) == 8


def test_recipe_with_the_measured_objective(tiny, tmp_path):
    out = tmp_path / "measured"
    overrides = ("search.objective=speedup", "search.n_trials=3", "search.baseline_every=2", "validate.enabled=false")
    result = layerskip.run(config(tiny, out, *overrides))  # re-times autoregressive decoding at trial 2
    trials = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert len(trials) == 3 and all(t["lossless"] for t in trials if t["constraint"] <= 0 and "duplicate_of" not in t)
    assert all(t["speedup"] > 0 and t["tau"] >= 1 for t in trials if "speedup" in t)
    assert result["best"]["search"]["objective"] == "speedup"


@pytest.mark.parametrize(
    "override, message",
    [
        ("search.sampler=tpe", "search.sampler='tpe': use gp"),
        ("search.objective=tau", "search.objective='tau'"),
        ("search.cost_model=flops", "search.cost_model='flops'"),
        ("search.n_trials=0", "search.n_trials=0 must be an integer >= 1"),
        ("draft.gamma=0", "draft.gamma=0"),
        ("search.keep_first=3", "leaves no layer to skip: the target has 4 layers"),
        ("search.max_skip_fraction=0", "search.max_skip_fraction=0"),
        ("model.name=no-such-model", "unknown model 'no-such-model'"),
        ("search.storage=nosuchdb://host/db", "search.storage='nosuchdb://host/db': optuna cannot open it"),
    ],
)
def test_invalid_settings_are_refused_before_any_work(tiny, tmp_path, override, message):
    out = tmp_path / "bad"
    with pytest.raises(SpecdecError, match=message):
        layerskip.run(config(tiny, out, override, "search.keep_last=2"))
    assert not (out / "study.db").exists()


# ~15 s of launching two processes to see one refusal; -m slow since the default run passed 10
# minutes (issue 60's 2-process tests of a split target took its place)
@pytest.mark.slow
def test_two_processes_are_refused_with_what_to_do_instead(tiny, tmp_path):
    """Under `accelerate launch` with 2 processes the search stops at start-up and says how to run
    parallel workers (one process each against one storage); no study is created."""
    out = tmp_path / "two"
    target, data = tiny[0], tiny[1]
    args = ["-m", "recipes.layerskip", f"output_dir={out}", f"model.name={target}", f"data.train={data}"]
    proc = accelerate_launch("multi_cpu", [*args, f"data.val={data}", "device=cpu"])
    assert proc.returncode != 0
    assert "runs as one process" in proc.stderr and "same search.storage URL" in proc.stderr
    assert not (out / "study.db").exists()
