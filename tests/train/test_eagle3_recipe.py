"""The eagle3 recipe end to end on a tiny target: pinned losses, exact resume, the drafter learns
(tau estimate and measured tau), the export's round trip through the runtime and the CLI, two
processes against one, launchers it does not fit and bad values refused before anything loads."""

import json
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState
from hydra import compose, initialize_config_dir

from recipes import eagle3
from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.lookup import LookupFirst
from specdec_runtime.drafters.phrases import PhraseTable
from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.loading import load_model
from tests.conftest import accelerate_launch, save_tiny_model, write_prompt_file
from train import checkpoint

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer tiny target and a prompt file its character-level tokenizer covers."""
    root = tmp_path_factory.mktemp("eagle3")
    target = save_tiny_model(root / "target", num_hidden_layers=4, tie_word_embeddings=True)
    data = write_prompt_file(root / "prompts.jsonl", 24, stride=5, suffix=", and so on.")
    return target, data, root / "cache"


def overrides(tiny, out: Path, *extra: str) -> list[str]:
    target, data, cache = tiny
    return [
        f"output_dir={out}",
        "device=cpu",  # the pinned losses are CPU numerics
        f"model.name={target}",
        f"data.train={data}",
        f"data.val={data}",
        f"responses.cache_dir={cache}",
        "responses.max_new_tokens=16",
        "responses.batch_size=8",
        "eagle3.aux_layers=[1,2,3]",
        "eagle3.draft_vocab_size=30",
        "eagle3.ttt_steps=3",
        "trainer.micro_batch=4",
        "trainer.grad_accum=2",
        "trainer.max_steps=8",
        "trainer.log_every=1",
        "trainer.checkpoint_every=4",
        "optim.lr=1e-2",
        "optim.warmup_steps=1",
        "validate.num_prompts=4",
        "validate.max_new_tokens=12",
        "validate.estimate_prompts=8",
        "validate.gamma=3",
        "validate.tree_budget=6",
        "validate.top_k=2",
        *extra,
    ]


def config(tiny, out: Path, *extra: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("eagle3", overrides=overrides(tiny, out, *extra))


def logged(out: Path, key: str = "train/loss") -> list[float]:
    return [json.loads(line)[key] for line in (out / "log.jsonl").read_text().splitlines() if key in line]


# Pinned on torch 2.13.0 CPU (seeded tiny run; data, draft vocabulary and drafter are deterministic).
BF16_REL = 0.1  # bf16 responses, states and autocast: measured at most 5.8% from the fp32 losses (step 3)
PINNED = [4.984434605, 3.863532066, 3.148716211, 2.535025835, 2.213505745, 2.11321497, 1.858638763, 1.918724298]


def test_tiny_run_pinned_losses_learning_validation_and_export(tiny, tmp_path, capfd):
    out = tmp_path / "run"
    result = eagle3.run(config(tiny, out))
    got = logged(out)
    assert got == pytest.approx(PINNED, rel=1e-4, abs=1e-6)
    assert max(got[-2:]) < min(got[:2])  # it learns
    v = result["validation"]
    assert v["lossless"] == 1.0 and v["nodes"] == 6 and v["prompts"] == 4
    assert v["speedup"] == pytest.approx(v["tokens_per_s"] / v["ar_tokens_per_s"])
    closing = (  # the run's last word: the ratio and the two rates it comes from
        f"tau {v['tau']:.2f}, speedup {v['speedup']:.2f}x over autoregressive ({v['tokens_per_s']:.1f} against "
        f"{v['ar_tokens_per_s']:.1f} tok/s, drafter eagle3), lossless 100% (4 validation prompts)"
    )
    assert closing in capfd.readouterr().out
    assert {"tau_estimate_chain", "tau_estimate_tree", "step_top1"} <= set(v) and len(v["step_top1"]) == 3
    export = Path(result["export"])
    card = (export / "README.md").read_text()
    assert "vllm serve" in card and "--speculative-algorithm EAGLE3" in card and "tau" in card
    # the export, loaded by `specdec generate --drafter DIR`: greedy output is the target's own
    target = load_model(str(tiny[0]), device="cpu", dtype="float32")
    drafter = build_drafter(str(export), target)
    assert isinstance(drafter, Eagle3Drafter) and drafter.tree_budget == 6 and drafter.gamma == 3
    assert build_drafter(str(export), target, tree="chain").tree_budget == 0
    prompt = target.tokenizer.encode("apple river, and so on.")
    ar = generate(target.model, prompt, None, max_new_tokens=20, stop_ids=target.stop_ids)
    spec = generate(target.model, prompt, drafter, max_new_tokens=20, gamma=3, stop_ids=target.stop_ids)
    assert spec.tokens == ar.tokens
    # DIR+lookup: prompt lookup, then the export's phrase table (what the training responses repeat)
    looked = build_drafter(f"{export}+lookup", target)
    saved = PhraseTable.load(export / PhraseTable.FILE)
    assert [f.name for f in export.glob("*.safetensors")] == ["model.safetensors"]  # what engines load as weights
    assert isinstance(looked, LookupFirst) and len(looked.table) == len(saved) > 0
    assert "phrase table" in card and f"--drafter {export}+lookup" in card
    spec = generate(target.model, prompt, looked, max_new_tokens=20, gamma=3, stop_ids=target.stop_ids)
    assert spec.tokens == ar.tokens


def test_the_drafter_learns_the_targets_continuations(tiny, tmp_path):
    """A longer run on the tiny data: the drafter is accepted (tau > 1.5), and the training-time
    estimate of a chain's tau (its hits replayed round by round) is within 10% of what the runtime
    measures with a chain."""
    out = tmp_path / "learn"
    more = ("trainer.max_steps=80", "trainer.checkpoint_every=80", "validate.tree_budget=0", "validate.num_prompts=8")
    v = eagle3.run(config(tiny, out, *more))["validation"]
    assert v["lossless"] == 1.0 and v["tau"] > 1.5
    assert v["tau_estimate_chain"] == pytest.approx(v["tau"], rel=0.1)


def test_bf16_target_and_autocast_follow_the_fp32_losses(tiny, tmp_path):
    """What `dtype: fast` picks on CPUs with fast bf16 (AMX): the target (responses and states) in
    bf16 and the drafter under bf16 autocast. The losses follow the pinned fp32 run's within bf16's
    precision, the states are cached under their own key, and validation (fp32) stays lossless."""
    out = tmp_path / "bf16"
    AcceleratorState._reset_state(reset_partial_state=True)  # a process's first Accelerator fixes its precision
    try:
        result = eagle3.run(config(tiny, out, "model.dtype=bfloat16", "trainer.mixed_precision=bf16"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    got = logged(out)
    assert got == pytest.approx(PINNED, rel=BF16_REL) and got != pytest.approx(PINNED, rel=1e-4, abs=1e-6)
    assert result["validation"]["lossless"] == 1.0


def test_resume_continues_with_the_same_losses(tiny, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    eagle3.run(config(tiny, straight, "validate.enabled=false"))
    real = checkpoint.save_checkpoint

    def save_then_die(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(eagle3, "save_checkpoint", save_then_die)
    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        eagle3.run(config(tiny, resumed, "validate.enabled=false"))
    monkeypatch.setattr(eagle3, "save_checkpoint", real)
    eagle3.run(config(tiny, resumed, "validate.enabled=false"))
    assert logged(resumed) == pytest.approx(logged(straight), rel=1e-6, abs=1e-7)


def test_max_minutes_cuts_the_run_and_a_resumed_run_keeps_the_cut(tiny, tmp_path, monkeypatch, capfd):
    """A time limit already spent when the warm-up ends (step 10): the run stops there, with the
    losses of the uncut run's first 10 steps; the cut is in the checkpoint, the metrics and the
    card, and a run killed right after its last checkpoint resumes into validation, not more steps."""
    limited = ("validate.enabled=false", "trainer.max_steps=14", "trainer.checkpoint_every=5")
    uncut = tmp_path / "uncut"
    eagle3.run(config(tiny, uncut, *limited))
    real = checkpoint.save_checkpoint

    def save_then_die(*args, **kwargs):
        real(*args, **kwargs)
        if kwargs["step"] == 10:
            raise KeyboardInterrupt

    monkeypatch.setattr(eagle3, "save_checkpoint", save_then_die)
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        eagle3.run(config(tiny, cut, *limited, "trainer.max_minutes=1e-6"))
    assert "trainer.max_minutes=1e-06: 14 steps would take" in capfd.readouterr().out
    state = json.loads((cut / "checkpoints" / "step-0000010" / "trainer_state.json").read_text())
    assert state["horizon"] == {"max_steps": 14, "steps": 10}
    monkeypatch.setattr(eagle3, "save_checkpoint", real)
    result = eagle3.run(config(tiny, cut, *limited, "trainer.max_minutes=1e-6"))
    assert result["step"] == 10 and logged(cut) == pytest.approx(logged(uncut)[:10], rel=1e-6, abs=1e-7)
    assert "| steps | 10 |" in (Path(result["export"]) / "README.md").read_text()
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step-0000005", "step-0000010"]


def test_a_past_train_until_cuts_the_run_and_a_rerun_may_move_it(tiny, tmp_path, capfd):
    """trainer.train_until, the quickstart's deadline (a Unix time): one already past when the
    warm-up ends cuts the run to its 10 steps, said; run again with another deadline (each
    quickstart.sh run gives its own), the run is resumed, not refused as a changed setting."""
    limited = ("validate.enabled=false", "trainer.max_steps=14", "trainer.checkpoint_every=5")
    out = tmp_path / "run"
    assert eagle3.run(config(tiny, out, *limited, "trainer.train_until=1"))["step"] == 10
    said = capfd.readouterr()
    assert "trainer.train_until (0.0 min left): 14 steps would take" in said.out + said.err
    assert "(trainer.train_until)" in said.out + said.err  # the training line's "ending by HH:MM:SS"
    assert eagle3.run(config(tiny, out, *limited, "trainer.train_until=2"))["step"] == 10


def test_live_target_states_give_the_cached_runs_losses(tiny, tmp_path):
    cached, live = tmp_path / "cached", tmp_path / "live"
    eagle3.run(config(tiny, cached, "validate.enabled=false", "trainer.max_steps=3"))
    eagle3.run(config(tiny, live, "validate.enabled=false", "trainer.max_steps=3", "eagle3.cache_hidden=false"))
    assert logged(live) == pytest.approx(logged(cached), rel=1e-5, abs=1e-6)


def test_packed_and_checkpointed_training_gives_the_plain_runs_losses(tiny, tmp_path, monkeypatch):
    """eagle3.pack_tokens (a micro-batch's 4 sequences in one row, document masks) and
    eagle3.checkpoint_steps (each step's layer recomputed in the backward) change memory, not
    the losses."""
    plain, lean = tmp_path / "plain", tmp_path / "lean"
    short = ("validate.enabled=false", "trainer.max_steps=3", "trainer.max_seq_len=128")
    eagle3.run(config(tiny, plain, *short))
    rows, pack = [], eagle3.pack
    monkeypatch.setattr(eagle3, "pack", lambda *a: rows.append(pack(*a)["input_ids"].shape[0]) or pack(*a))
    eagle3.run(config(tiny, lean, *short, "eagle3.pack_tokens=256", "eagle3.checkpoint_steps=true"))
    assert rows == [1] * 6  # 3 steps x 2 micro-batches, each one row
    assert logged(lean) == pytest.approx(logged(plain), rel=1e-5, abs=1e-6)


# ~40 s on a 2-core CPU, which kept the default run past 10 minutes: -m slow. By default the recipe
# runs under 2 processes in test_two_processes_validate_and_export_as_a_user_runs_them, and DDP's
# loss equality is checked there for distill, Medusa and MTP.
@pytest.mark.slow
def test_two_processes_match_one_on_the_same_global_batch_and_zero3_is_refused(tiny, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    short = ("trainer.micro_batch=2", "trainer.max_steps=4", "validate.enabled=false")
    # a spent time limit: both cut 12 steps to 10, the two processes by rank 0's decision (a broadcast)
    cut = ("trainer.max_steps=12", "trainer.max_minutes=1e-6", "trainer.checkpoint_every=12")
    eagle3.run(config(tiny, one, *short, *cut, "trainer.micro_batch=4"))  # 4 x 2 accumulation = 2 x 2 x 2 processes
    proc = accelerate_launch("multi_cpu", ["-m", "recipes.eagle3", *overrides(tiny, two, *short, *cut)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(logged(one)) == 10 and logged(two) == pytest.approx(logged(one), rel=1e-5, abs=1e-6)
    z3 = tmp_path / "z3"
    refused = accelerate_launch("deepspeed_zero3", ["-m", "recipes.eagle3", *overrides(tiny, z3, *short)])
    assert refused.returncode != 0 and "recipes.eagle3 does not run under DeepSpeed ZeRO-3" in refused.stderr
    assert not (z3 / "checkpoints").exists() and not (z3 / "log.jsonl").exists()


def test_two_processes_validate_and_export_as_a_user_runs_them(tiny, tmp_path):
    """2 gloo processes with validation on (the training-time estimate, then the runtime on rank 0
    while the other waits) and the export: the run ends, within the helper's time limit, with the
    export written and validated figures in metrics.json. Rank 0's estimate used to run the
    DDP-wrapped module alone, whose forward waits for ranks that never join: both sat on a futex."""
    out = tmp_path / "two"
    short = ("trainer.micro_batch=2", "trainer.max_steps=3", "validate.num_prompts=2", "validate.max_new_tokens=8")
    proc = accelerate_launch("multi_cpu", ["-m", "recipes.eagle3", *overrides(tiny, out, *short)], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["validation"]["tau"] >= 1.0 and "tau_estimate_chain" in metrics["validation"]
    assert (out / "export" / "config.json").is_file()


@pytest.mark.parametrize(
    "override, message",
    [
        ("eagle3.aux_layers=[1,2,4]", r"aux layers \[1, 2, 4\]: give 3 ascending layer counts in 1..3"),
        ("eagle3.draft_vocab_size=100000", "draft vocabulary of 100000 tokens: need 1..35"),
        ("eagle3.ttt_steps=0", "eagle3.ttt_steps=0 must be a positive integer"),
        ("eagle3.pack_tokens=100", "eagle3.pack_tokens=100 is below trainer.max_seq_len=768"),
        ("eagle3.init=zeros", "eagle3.init='zeros'"),
        ("validate.top_k=0", "validate: need gamma >= 1"),
        ("trainer.max_minutes=0", "trainer.max_minutes=0: give a positive number of minutes"),
        ("trainer.train_until=soon", "trainer.train_until=soon: give a Unix time in seconds"),
    ],
)
def test_bad_values_stop_before_anything_loads(tiny, tmp_path, monkeypatch, override, message):
    monkeypatch.setattr(eagle3, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "bad"
    with pytest.raises(SpecdecError, match=message):
        eagle3.run(config(tiny, out, override))
    assert not out.exists()


def test_the_exports_drafting_settings_are_those_validation_used(tiny, tmp_path):
    """The export's drafting settings (specdec_drafting.json) are what validation used."""
    out = tmp_path / "run"
    result = eagle3.run(config(tiny, out, "trainer.max_steps=2", "validate.num_prompts=1"))
    drafting = json.loads((Path(result["export"]) / "specdec_drafting.json").read_text())
    assert drafting == {"gamma": 3, "tree_budget": 6, "top_k": 2}


def test_training_and_validation_run_on_the_threads_measured_fastest_for_each(tiny, tmp_path, monkeypatch, capfd):
    """One process on a CPU: training takes the thread count its timed matmul ran fastest on,
    validation the one decoding ran fastest on (metrics.json says which), and the process goes
    back to training's after validating; both choices are said up front."""
    import torch

    from specdec_runtime.hardware import ThreadChoice

    choices = {
        "train": ThreadChoice("train", 1, ((1, 0.010), (2, 0.012))),
        "decode": ThreadChoice("decode", 2, ((1, 0.009), (2, 0.005))),
    }
    monkeypatch.setattr("recipes.run.cpu_threads", choices.get)
    seen = []

    def validate(*args, **kwargs):
        seen.append(torch.get_num_threads())
        metrics = eagle3_validate(*args, **kwargs)
        seen.append(torch.get_num_threads())
        return metrics

    eagle3_validate = eagle3.validate
    monkeypatch.setattr(eagle3, "validate", validate)
    before = torch.get_num_threads()
    try:
        result = eagle3.run(config(tiny, tmp_path / "run", "trainer.max_steps=2", "validate.tree_budget=0"))
    finally:
        torch.set_num_threads(before)
    err = capfd.readouterr().err
    assert "threads: training on 1 CPU thread: its timed work took 10.00 ms with 1, 12.00 ms with 2" in err
    assert "threads: decoding on 2 CPU threads: its timed work took 9.00 ms with 1, 5.00 ms with 2" in err
    assert seen == [1, 1] and result["validation"]["threads"] == 2
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["validation"]["threads"] == 2
    assert "| CPU threads (decoding) | 2 |" in (Path(result["export"]) / "README.md").read_text()


def test_thread_choices_are_one_line_when_nothing_was_timed_and_untouched_under_several_processes(monkeypatch, capsys):
    from types import SimpleNamespace

    import torch

    from recipes.run import choose_threads
    from specdec_runtime.hardware import ThreadChoice

    why = "one per core: 2 usable CPUs, no SMT siblings to try"
    monkeypatch.setattr("recipes.run.cpu_threads", lambda work: ThreadChoice(work, 2, why=why))
    cpu = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    before = torch.get_num_threads()
    try:
        assert choose_threads(cpu, training=True) == {"train": 2, "decode": 2}
        assert capsys.readouterr().err == f"threads: training and decoding on 2 CPU threads ({why})\n"
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        assert choose_threads(cpu, training=False) == {"decode": 2}  # a recipe that does not train (layerskip)
        assert capsys.readouterr().err == f"threads: decoding on 2 CPU threads ({why})\n"
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        assert choose_threads(SimpleNamespace(device=torch.device("cpu"), num_processes=2), training=True) == {}
        assert choose_threads(SimpleNamespace(device=torch.device("cuda"), num_processes=1), training=True) == {}
        assert capsys.readouterr().err == "" and torch.get_num_threads() == 1  # accelerate's setting stands
    finally:
        torch.set_num_threads(before)


def test_the_gpu_preset_is_the_quickstarts_validation_with_gpu_sized_data():
    """experiment=eagle3_gpu composes on eagle3_quickstart: its own data and training settings win,
    the quickstart's validation is kept (what the CPU bench measures) but for the trees: 3 deep (the
    steps its drafter trains), 8 nodes, the top 4 of each expanded node."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        gpu = compose("eagle3", overrides=["experiment=eagle3_gpu"])
        quick = compose("eagle3", overrides=["experiment=eagle3_quickstart"])
    r, t = gpu.responses, gpu.trainer
    assert (r.samples_per_prompt, r.temperature, r.max_new_tokens, r.engine) == (8, 0.7, 128, "transformers")
    assert (r.self_prompts, quick.responses.self_prompts, gpu.eagle3.phrase_table) == (12288, 0, True)
    e = gpu.eagle3
    assert (gpu.model.dtype, gpu.data.max_samples, e.cache_hidden, e.ttt_steps) == ("float32", 2048, False, 3)
    assert (t.micro_batch, t.mixed_precision, t.max_minutes) == (64, "bf16", None)
    v, q = gpu.validate, quick.validate
    assert (v.gamma, v.tree_budget, v.top_k, q.gamma, q.tree_budget, q.top_k) == (e.ttt_steps, 8, 4, 2, 5, 3)
    assert dict(v, gamma=2, tree_budget=5, top_k=3) == dict(q) and e.draft_vocab_size == quick.eagle3.draft_vocab_size


def test_the_phrase_table_is_built_once_from_at_most_phrase_tokens(monkeypatch):
    """On the main process only, from the responses in order while they fit PHRASE_TOKENS (said)."""
    from types import SimpleNamespace

    from train.data import Example

    said = []
    run = SimpleNamespace(main=True, print_once=said.append, device="cpu")
    phrase = [1, 2, 3, 4, 5, 6, 7, 8]
    examples = [Example([0] + phrase, [False] + [True] * 8) for _ in range(2)]
    examples.append(Example([0] + phrase[::-1], [False] + [True] * 8))
    monkeypatch.setattr(eagle3, "PHRASE_TOKENS", 20)  # the first two responses fit, the third does not
    table = eagle3.phrase_table(run, examples)
    assert table.get([1, 2, 3, 4]).tolist() == [5, 6, 7, 8] and table.get([8, 7, 6, 5]) is None
    assert said[0] == "phrase table: from the first 16 response tokens (of more)"
    assert eagle3.phrase_table(SimpleNamespace(main=False, print_once=said.append), examples) is None
