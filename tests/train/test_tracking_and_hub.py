"""W&B offline runs carry the metrics (read back from the run file); Hub pushes go through HfApi."""

import json
from pathlib import Path

import pytest
import torch

from recipes import distill
from specdec_runtime.export_check import check_export
from specdec_runtime.hub import push_folder
from tests.conftest import offline_run
from tests.train.test_distill_recipe import config, tiny  # noqa: F401  (the module fixture)


def test_wandb_offline_run_has_config_losses_throughput_validation_and_the_drafter(tiny, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    distill.run(config(tiny, out, "tracking=wandb", "validate.num_prompts=1"))
    history, config_keys, artifacts = offline_run(out)
    assert {"loss", "trainer", "drafter", "model"} <= config_keys
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses = [h["train/loss"] for h in history if "train/loss" in h]
    assert losses == [x["train/loss"] for x in logged if "train/loss" in x] and len(losses) == 6
    for h in history:
        if "train/loss" in h:
            assert h["train/lr"] > 0 and h["train/tokens_per_s"] > 0 and "train/acceptance_est" in h
    metrics = json.loads((out / "metrics.json").read_text())["validation"]
    assert [h["val/tau"] for h in history if "val/tau" in h] == [metrics["tau"]]
    assert [h["val/speedup"] for h in history if "val/speedup" in h] == [metrics["speedup"]]
    (artifact,) = artifacts
    assert artifact.type == "model" and artifact.name == "distill-run"
    files = {entry.path for entry in artifact.manifest.contents}
    assert files == {p.name for p in (out / "export").iterdir()} and "model.safetensors" in files
    assert json.loads(artifact.metadata)["tau"] == metrics["tau"]


class FakeApi:
    calls: list = []

    def __init__(self, token=None):
        FakeApi.calls.append(("init", token))

    def whoami(self):
        FakeApi.calls.append(("whoami",))
        return {"name": "me", "orgs": [{"name": "my-org"}], "auth": {"accessToken": {"role": "write"}}}

    def repo_info(self, repo_id, **kw):
        from huggingface_hub.errors import RepositoryNotFoundError

        FakeApi.calls.append(("repo_info", repo_id))
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # (its constructor wants an HTTP response)
        Exception.__init__(error, f"{repo_id} not found")
        raise error

    def create_repo(self, repo_id, **kw):
        FakeApi.calls.append(("create_repo", repo_id, kw))

    def create_branch(self, repo_id, branch, **kw):
        FakeApi.calls.append(("create_branch", repo_id, branch))

    def upload_folder(self, folder_path, repo_id, revision=None, commit_message=""):
        FakeApi.calls.append(("upload_folder", sorted(p.name for p in Path(folder_path).iterdir()), repo_id, revision))
        return type("Info", (), {"commit_url": f"https://hub.invalid/{repo_id}/commit/1"})()


def test_push_to_hub_creates_the_repo_and_uploads_the_export(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", "hf_env_token")
    (tmp_path / "config.json").write_text("{}")
    FakeApi.calls = []
    url = push_folder(tmp_path, "me/drafter", private=True, revision="v1", check=False)
    assert url == "https://hub.invalid/me/drafter/commit/1"
    assert FakeApi.calls == [
        ("init", "hf_env_token"),
        ("create_repo", "me/drafter", {"private": True, "exist_ok": True, "repo_type": "model"}),
        ("create_branch", "me/drafter", "v1"),
        ("upload_folder", ["config.json"], "me/drafter", "v1"),
    ]


def test_recipe_pushes_its_export_when_a_repo_is_set(tiny, tmp_path, monkeypatch):  # noqa: F811
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", "hf_env_token")
    FakeApi.calls = []
    result = distill.run(config(tiny, tmp_path / "run", "hub.repo_id=me/tiny-drafter", "validate.enabled=false"))
    upload = [c for c in FakeApi.calls if c[0] == "upload_folder"]
    assert upload and upload[0][2] == "me/tiny-drafter"
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= set(upload[0][1])
    assert result["hub"].endswith("/commit/1")


def test_every_drafter_type_exports_a_card_and_pushes_through_the_hub_client(tmp_path, monkeypatch):
    """One export module for the four drafter types: each folder loads back, carries a model card
    (target, recipe, data, measured tau and speedup, usage per serving stack) and is uploaded whole."""
    import huggingface_hub
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec_runtime.drafters.layerskip import SkipSet
    from specdec_runtime.drafters.medusa import MedusaHeads, read_layout
    from tests.conftest import save_tiny_model
    from tests.train.mtp_grad_worker import tiny_mtp
    from train.export import Card, export_medusa, export_mtp, export_skipset, export_standalone
    from train.mtp import heads_state_dict

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", "hf_env_token")
    path = save_tiny_model(tmp_path / "tiny", num_hidden_layers=2)
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    metrics = {"tau": 2.345, "speedup": 1.789, "lossless": 1.0, "prompts": 4}

    def card(kind: str) -> Card:
        return Card(target="org/target", recipe=kind, data="builtin", setup={"steps": 3}, metrics=metrics,
                    hub_id=f"me/{kind}")  # fmt: skip

    heads = MedusaHeads(64, model.config.vocab_size, num_heads=2, num_layers=1)
    mtp = tiny_mtp()
    exports = {
        "standalone": export_standalone(
            model, tok, tmp_path / "standalone", card("distill"), vocab_ids=None, generation_config=None, gamma=5
        ),
        "medusa": export_medusa(
            heads, tmp_path / "medusa", card("medusa"), lm_head=model.lm_head.weight, tree=None
        ),
        "mtp": export_mtp(
            mtp.lm, heads_state_dict(mtp), {"num_heads": 3}, tok, tmp_path / "mtp", card("mtp"), generation_config=None
        ),  # fmt: skip
        "layerskip": export_skipset(SkipSet([1], [0], 2, target="org/target"), tmp_path / "skip", card("layerskip")),
    }
    # each format loads back as what was exported
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(exports["standalone"]).eval()
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    for layout in (exports["medusa"], exports["medusa"] / "vllm"):
        got = read_layout(layout)[0].state_dict()
        for k, v in heads.state_dict().items():
            torch.testing.assert_close(got[k], v)
    assert set(load_file(exports["mtp"] / "specdec" / "mtp_heads.safetensors")) == set(heads_state_dict(mtp))
    assert SkipSet.load(exports["layerskip"] / "skipset.json").attn == [1]

    usage = {  # what each card must show how to use (transformers/vLLM only where they apply)
        "standalone": ["specdec generate", "assistant_model=drafter", "speculative_config", "hf download me/distill"],
        "medusa": ["specdec generate", '"method": "medusa"', '"model": "medusa/vllm"', "has no Medusa"],
        "mtp": ["--drafter mtp", "AutoModelForCausalLM.from_pretrained", "its `mtp` speculation"],
        "layerskip": ["--drafter layerskip/skipset.json", "transformers and vLLM have no"],
    }
    for kind, folder in exports.items():
        text = (folder / "README.md").read_text()
        assert text.startswith("---\n") and f"- specdec-{kind}" in text
        for needle in ["org/target", "| data | builtin |", "| tau (tokens per target forward) | 2.35 |",
                       "| speedup over autoregressive | 1.79 |", *usage[kind]]:  # fmt: skip
            assert needle in text, (kind, needle)
        assert json.loads((folder / "specdec_metrics.json").read_text()) == metrics
        assert not folder.with_name(folder.name + ".tmp").exists()

        FakeApi.calls = []
        url = push_folder(folder, f"me/{kind}", private=False, revision="main")
        assert url == f"https://hub.invalid/me/{kind}/commit/1"
        assert FakeApi.calls[0] == ("init", "hf_env_token")
        assert FakeApi.calls[1] == (
            "create_repo",
            f"me/{kind}",
            {"private": False, "exist_ok": True, "repo_type": "model"},
        )
        (upload,) = [c for c in FakeApi.calls if c[0] == "upload_folder"]
        assert upload[1] == sorted(p.name for p in folder.iterdir()) and upload[3] == "main"


class Unreachable(FakeApi):
    """A Hub that cannot be reached (as httpx says it: no ConnectionError, no OSError)."""

    def whoami(self):
        raise RuntimeError("[Errno -2] Name or service not known")

    def upload_folder(self, *args, **kwargs):
        raise RuntimeError("[Errno -2] Name or service not known")


def test_a_push_that_cannot_work_is_refused_before_anything_is_loaded(tiny, tmp_path, monkeypatch):  # noqa: F811
    """No token, a read-only one, a namespace that is not the user's: said at start, nothing trained."""
    import huggingface_hub

    from specdec_runtime.errors import SpecdecError

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    out = tmp_path / "run"
    with pytest.raises(SpecdecError, match="no Hugging Face token: set HF_TOKEN or run `hf auth login`"):
        distill.run(config(tiny, out, "hub.repo_id=me/drafter"))
    monkeypatch.setenv("HF_TOKEN", "hf_env_token")
    with pytest.raises(SpecdecError, match="cannot create it under 'someone': push to one of me, my-org"):
        distill.run(config(tiny, out, "hub.repo_id=someone/drafter"))
    monkeypatch.setattr(FakeApi, "whoami", lambda self: {"name": "me", "auth": {"accessToken": {"role": "read"}}})
    with pytest.raises(SpecdecError, match="read-only"):
        distill.run(config(tiny, out, "hub.repo_id=me/drafter"))
    assert not (out / "checkpoints").exists() and not (out / "export").exists()


def test_without_a_network_the_run_stops_at_start_or_trains_and_says_how_to_push(tiny, tmp_path, monkeypatch, capsys):  # noqa: F811, E501
    """hub.repo_id with no network: stopped before training; with hub.offline_ok the run trains and
    exports, the push fails, and the run keeps its export and results and prints the retry command."""
    import huggingface_hub

    from recipes.checks import run_or_exit
    from specdec_runtime.errors import SpecdecError

    monkeypatch.setattr(huggingface_hub, "HfApi", Unreachable)
    monkeypatch.setenv("HF_TOKEN", "hf_env_token")
    out = tmp_path / "run"
    with pytest.raises(SpecdecError, match="the Hub cannot be reached .* hub.offline_ok=true"):
        distill.run(config(tiny, out, "hub.repo_id=me/drafter"))
    assert not (out / "export").exists()
    cfg = config(tiny, out, "hub.repo_id=me/drafter", "hub.offline_ok=true", "validate.num_prompts=1")
    with pytest.raises(SystemExit) as exit:
        run_or_exit(distill.run, cfg)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "cannot reach the Hub now" in err and "the push to me/drafter failed: RuntimeError" in err
    assert f"specdec push {out / 'export'} me/drafter" in err and "Traceback" not in err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["hub_retry"] == f"specdec push {out / 'export'} me/drafter" and "tau" in metrics["validation"]
    assert check_export(out / "export").ok and (out / "export" / "model.safetensors").is_file()


def test_specdec_push_checks_the_export_first(tmp_path, monkeypatch, capsys):
    """`specdec push DIR REPO` uploads an export every engine it claims loads, and refuses, with
    check-export's words, one an engine would load wrong (--force pushes it anyway)."""
    import huggingface_hub

    from specdec_runtime.cli import main
    from tests.train.test_export_engines import export_all, rewrite

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", "hf_env_token")
    folder = export_all(tmp_path, "llama")["eagle3"]
    FakeApi.calls = []
    main(["push", str(folder), "me/eagle3", "--revision", "v1"])
    assert "pushed" in capsys.readouterr().out and FakeApi.calls[-1][0] == "upload_folder"
    rewrite(folder / "sglang" / "config.json", lambda c: c.pop("torch_dtype") and c.pop("dtype"))
    FakeApi.calls = []
    with pytest.raises(SystemExit) as exit:
        main(["push", str(folder), "me/eagle3"])
    assert exit.value.code == 2 and not FakeApi.calls
    assert "not pushing" in capsys.readouterr().err
    main(["push", str(folder), "me/eagle3", "--force"])
    assert FakeApi.calls[-1][0] == "upload_folder"


def test_a_bad_target_hub_id_stops_the_run_and_a_missing_one_is_said_at_start(tiny, tmp_path, capsys):  # noqa: F811
    from specdec_runtime.errors import SpecdecError

    with pytest.raises(SpecdecError, match="model.hub_id='not a hub id' is not a Hugging Face Hub id"):
        distill.run(config(tiny, tmp_path / "a", "model.hub_id='not a hub id'"))
    assert not (tmp_path / "a" / "checkpoints").exists()
    distill.run(config(tiny, tmp_path / "b", "validate.enabled=false", "trainer.max_steps=1"))
    assert "has no Hub id, so the export cannot name its target" in capsys.readouterr().err
    distill.run(config(tiny, tmp_path / "c", "validate.enabled=false", "trainer.max_steps=1", "model.hub_id=org/tiny"))
    assert "has no Hub id" not in capsys.readouterr().err
    assert json.loads((tmp_path / "c" / "export" / "specdec_export.json").read_text())["target"]["hub_id"] == "org/tiny"
