"""model.shard=true: the frozen target's decoder layers split across 2 CPU processes (FSDP2),
its states equal to the whole target's, the state store filled and responses generated in
lockstep with unequal shares (the responses the whole target's greedy ones), and recipes.eagle3
generating its responses, training, validating (the training-time estimate) and exporting on
it; other recipes and the runtime engine are refused before anything loads."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recipes import distill, eagle3
from specdec_runtime.errors import SpecdecError
from tests.conftest import WORDS, accelerate_launch, save_tiny_model

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-layer tiny target and chats with assistant turns (what recipes.regenerate writes)."""
    root = tmp_path_factory.mktemp("shard")
    target = save_tiny_model(root / "target", num_hidden_layers=4)
    rows = [
        {"messages": [{"role": "user", "content": f"say {w} {v}"}, {"role": "assistant", "content": f"{w} {v} {w}."}]}
        for w in WORDS
        for v in WORDS[:4]
    ]
    data = root / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    return target, data


def test_split_target_states_equal_the_whole_targets_and_the_store_runs_in_lockstep(tiny, tmp_path):
    target, _ = tiny
    proc = accelerate_launch("multi_cpu", ["tests/train/shard_worker.py", str(target), str(tmp_path)], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["world"] == 2 and r["diff"] < 1e-5 and r["store_diff"] < 1e-5
        assert r["kept"] == [32, 64]  # half of q_proj's rows on each process
        assert r["responses_equal"] and all(r["responses"]), r["responses"]


def overrides(tiny, out: Path, *extra: str) -> list[str]:
    target, data = tiny
    return [
        f"output_dir={out}", "device=cpu", f"model.name={target}", "model.shard=true", "data=files",
        f"data.train={data}", f"data.val={data}", "responses.max_new_tokens=8", "eagle3.aux_layers=[1,2,3]",
        "eagle3.draft_vocab_size=30", "eagle3.ttt_steps=2", "eagle3.cache_hidden=false", "trainer.micro_batch=2",
        "trainer.max_steps=3", "trainer.checkpoint_every=3", "validate.estimate_prompts=4", *extra,
    ]  # fmt: skip


def test_eagle3_trains_validates_and_exports_on_a_split_target(tiny, tmp_path):
    out = tmp_path / "run"
    proc = accelerate_launch("multi_cpu", ["-m", "recipes.eagle3", *overrides(tiny, out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "split across the 2 processes (model.shard=true)" in proc.stdout + proc.stderr
    assert "the training-time estimate only" in proc.stdout + proc.stderr
    metrics = json.loads((out / "metrics.json").read_text())["validation"]
    assert metrics["tau_estimate_chain"] >= 1.0 and "tau" not in metrics
    assert (out / "export" / "config.json").is_file() and (out / "export" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "recipe, extra, message",
    [
        (eagle3, ("responses.engine=runtime",), "the runtime decodes with a whole target"),
        (distill, ("responses.source=dataset",), "recipes.distill keeps a whole target on every process"),
    ],
)
def test_what_a_split_target_cannot_do_is_refused_before_anything_loads(tiny, tmp_path, monkeypatch, recipe, extra,
                                                                        message):  # fmt: skip
    monkeypatch.setattr(recipe, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    target, data = tiny
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(recipe.__name__.split(".")[-1], overrides=[
            f"output_dir={tmp_path / 'bad'}", f"model.name={target}", "model.shard=true", "data=files",
            f"data.train={data}", *extra])  # fmt: skip
    with pytest.raises(SpecdecError, match=message):
        recipe.run(cfg)
    assert not (tmp_path / "bad").exists()
