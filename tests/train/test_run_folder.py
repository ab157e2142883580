"""Nothing a user has is lost or misrecorded (on the distill recipe and a tiny target): one run per
folder (two real processes), resuming with other settings refused or recorded, a failed rerun
leaving a finished run as it was, damaged checkpoints set aside, a finished run's metrics kept,
and runs killed at any point of a checkpoint save resuming with the same losses."""

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from recipes import distill
from specdec_runtime.errors import SpecdecError
from tests.conftest import ROOT
from tests.train.test_distill_recipe import config, losses, overrides, tiny  # noqa: F401  (the module fixture)
from train import checkpoint
from train.loop import make_optimizer

QUIET = ("validate.enabled=false",)


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory):  # noqa: F811
    """An uninterrupted 6-step run: checkpoints at steps 3 and 6, its losses the oracle."""
    out = tmp_path_factory.mktemp("straight") / "run"
    distill.run(config(tiny, out, *QUIET))
    return out


def test_a_second_run_on_the_same_folder_is_refused_naming_the_first(tiny, tmp_path, capfd):  # noqa: F811
    out = tmp_path / "run"
    long = overrides(tiny, out, *QUIET, "trainer.max_steps=1000000", "trainer.checkpoint_every=1000000")
    first = subprocess.Popen([sys.executable, "-m", "recipes.distill", *long], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # the first run takes the folder once it has started
            text = (out / ".lock").read_text() if (out / ".lock").is_file() else ""
            if f'"pid": {first.pid}' in text:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the first run never locked its folder")
        second = subprocess.run(
            [sys.executable, "-m", "recipes.distill", *overrides(tiny, out, *QUIET)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"is in use by another run (pid {first.pid} on " in second.stderr and "Traceback" not in second.stderr
    finally:
        first.kill()
        first.wait()
    # The killed run's lock file stays behind; the next run finds it stale and takes the folder.
    assert (out / ".lock").is_file()
    distill.run(config(tiny, out, *QUIET, "trainer.max_steps=2"))
    assert "the run that held it before" in capfd.readouterr().err
    assert not (out / ".lock").exists()  # a finished run frees its folder


def test_resuming_with_other_settings_is_refused_or_recorded(tiny, straight, tmp_path, capfd):  # noqa: F811
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    distill.run(config(tiny, out, *QUIET, "trainer.max_steps=8"))  # allowed: more steps
    assert "changed settings: trainer.max_steps: 6 -> 8" in capfd.readouterr().err
    saved = lambda: OmegaConf.load(out / "config.yaml")  # noqa: E731
    assert saved().trainer.max_steps == 8
    before = (out / "config.yaml").read_text()
    changed = ("trainer.max_steps=10", "loss.kind=tvd", "optim.lr=0.05")
    with pytest.raises(SpecdecError) as e:
        distill.run(config(tiny, out, *QUIET, *changed))
    message = str(e.value)
    assert "loss.kind: 'jsd' -> 'tvd'" in message and "optim.lr: 0.01 -> 0.05" in message
    assert "trainer.max_steps" not in message and "another output_dir" in message and "allow_changes" in message
    assert (out / "config.yaml").read_text() == before  # nothing was written
    distill.run(config(tiny, out, *QUIET, *changed, "trainer.allow_changes=true"))
    assert saved().loss.kind == "tvd" and saved().optim.lr == 0.05  # config.yaml says what ran
    history = [json.loads(line) for line in (out / "config_history.jsonl").read_text().splitlines()]
    assert [h["from_step"] for h in history] == [6, 8]
    assert history[1]["changes"]["optim.lr"] == [0.01, 0.05]
    # ... and the new steps ran at the new learning rate (the checkpoint's scheduler state did not win)
    _, scheduler = make_optimizer([torch.nn.Parameter(torch.zeros(1))], lr=0.05, weight_decay=0.0,
                                  warmup_steps=1, max_steps=10)  # fmt: skip
    for _ in range(9):
        scheduler.step()
    lr9 = [
        json.loads(line)["train/lr"] for line in (out / "log.jsonl").read_text().splitlines() if '"step": 9,' in line
    ]
    assert lr9 == [pytest.approx(scheduler.get_last_lr()[0], rel=1e-12)]


def test_a_run_from_before_a_setting_existed_resumes(tiny, straight, tmp_path, capfd):  # noqa: F811
    """A run folder written by a specdec without some of today's settings (its config.yaml lacks
    them) resumes: the new keys are said, not refused; a setting it had that differs still is."""
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    saved = OmegaConf.load(out / "config.yaml")
    del saved["collective_timeout_minutes"], saved.data["mix"]  # as written before those existed
    OmegaConf.save(saved, out / "config.yaml")
    distill.run(config(tiny, out, *QUIET, "trainer.max_steps=8"))
    err = capfd.readouterr().err
    assert "collective_timeout_minutes: None -> 120" in err and "data.mix: None -> []" in err
    with pytest.raises(SpecdecError, match=r"optim.lr: 0.01 -> 0.05"):
        distill.run(config(tiny, out, *QUIET, "trainer.max_steps=9", "optim.lr=0.05"))


def test_a_failed_rerun_leaves_a_finished_run_as_it_was(tiny, straight, tmp_path, monkeypatch):  # noqa: F811
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    monkeypatch.setattr(distill, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SpecdecError, match=r"optim.lr=-0.001 must be positive"):
        distill.run(config(tiny, out, *QUIET, "optim.lr=-0.001"))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


def test_an_output_dir_that_is_a_file_is_refused(tiny, tmp_path):  # noqa: F811
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    with pytest.raises(SpecdecError, match="output_dir=.*taken is a file: give a folder"):
        distill.run(config(tiny, a_file, *QUIET))
    assert a_file.read_text() == "x"


@pytest.mark.parametrize("damaged", ["model.safetensors", "trainer_state.json"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_older_one_resumed(tiny, straight, tmp_path, damaged, capfd):  # noqa: F811,E501
    out = tmp_path / "run"
    shutil.copytree(straight, out, ignore=shutil.ignore_patterns("export", "metrics.json"))
    newest = out / "checkpoints" / "step-0000006" / damaged
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    distill.run(config(tiny, out, *QUIET))
    said = "".join(capfd.readouterr())
    assert f"step-0000006 is damaged ({damaged} has" in said and "resumed from" in said and "step-0000003" in said
    assert (out / "checkpoints" / "step-0000006.corrupt").is_dir()
    assert losses(out) == pytest.approx(losses(straight), rel=1e-6, abs=1e-7)  # steps 4-6 redone, logged once


def test_rerunning_a_finished_run_re_exports_and_keeps_its_metrics(tiny, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    distill.run(config(tiny, out, "validate.num_prompts=1"))
    before = json.loads((out / "metrics.json").read_text())
    shutil.rmtree(out / "export")
    distill.run(config(tiny, out, "validate.num_prompts=1"))
    after = json.loads((out / "metrics.json").read_text())
    assert after["train"] == before["train"] and after["train"]["loss"] > 0 and after["history"] == before["history"]
    assert (out / "export" / "model.safetensors").is_file()


class Kill(BaseException):
    """What a SIGKILL at that point would leave: nothing after it runs."""


class Crash:
    """Counts the file-system events of a checkpoint save (writes, renames, removals) and, once
    armed with `at`, dies at that event: a write is cut to half its length first."""

    def __init__(self, at: int | None):
        self.at, self.events = at, 0

    def event(self, path: Path | None = None) -> None:
        self.events += 1
        if self.at is not None and self.events == self.at + 1:
            if path is not None and Path(path).is_file():
                Path(path).write_bytes(Path(path).read_bytes()[: Path(path).stat().st_size // 2])
            raise Kill

    def patch(self, monkeypatch) -> None:
        import accelerate.utils.other as other

        def writer(real, path_arg):
            def wrapped(*args, **kwargs):
                out = real(*args, **kwargs)
                self.event(path_arg(args))
                return out

            return wrapped

        def before(real):
            def wrapped(*args, **kwargs):
                self.event()
                return real(*args, **kwargs)

            return wrapped

        monkeypatch.setattr(torch, "save", writer(torch.save, lambda a: a[1]))
        monkeypatch.setattr(other, "safe_save_file", writer(other.safe_save_file, lambda a: a[1]))
        monkeypatch.setattr(Path, "write_text", writer(Path.write_text, lambda a: a[0]))
        monkeypatch.setattr(Path, "rename", before(Path.rename))
        monkeypatch.setattr(shutil, "rmtree", before(shutil.rmtree))


def crashing_save(crash: Crash, step: int, monkeypatch):
    """distill's save_checkpoint, with `crash` patched in for the save of `step` only."""
    real = checkpoint.save_checkpoint

    def save(*args, **kwargs):
        if kwargs["step"] != step:
            return real(*args, **kwargs)
        with monkeypatch.context() as m:
            crash.patch(m)
            return real(*args, **kwargs)

    return save


@pytest.mark.parametrize("step", [3, 6])
def test_a_run_killed_anywhere_in_a_checkpoint_save_resumes_with_the_same_losses(
    tiny,  # noqa: F811
    straight,
    tmp_path,
    monkeypatch,
    step,
):
    """Fault injection: the save of step 6 dies at every one of its file-system events in turn,
    the save of step 3 at three random ones (seeds 0-2); each time a rerun resumes from a complete
    checkpoint and logs exactly the uninterrupted run's losses."""
    count = Crash(None)
    monkeypatch.setattr(distill, "save_checkpoint", crashing_save(count, step, monkeypatch))
    distill.run(config(tiny, tmp_path / "count", *QUIET))
    events = count.events
    assert events >= 8
    points = range(events) if step == 6 else [random.Random(seed).randrange(events) for seed in range(3)]
    for at in points:
        out = tmp_path / f"killed-{at}"
        monkeypatch.setattr(distill, "save_checkpoint", crashing_save(Crash(at), step, monkeypatch))
        with pytest.raises(Kill):
            distill.run(config(tiny, out, *QUIET))
        monkeypatch.setattr(distill, "save_checkpoint", checkpoint.save_checkpoint)
        distill.run(config(tiny, out, *QUIET))
        assert losses(out) == pytest.approx(losses(straight), rel=1e-6, abs=1e-7), f"killed at event {at} of {events}"
        assert not list((out / "checkpoints").glob("*.corrupt"))  # an interrupted save is never taken for complete
