"""W&B offline runs carry the metrics (read back from the run file); Hub pushes go through HfApi."""

import json
from pathlib import Path

import torch

from recipes import distill
from tests.conftest import offline_run
from tests.train.test_distill_recipe import config, tiny  # noqa: F401  (the module fixture)
from train.export import push_to_hub


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
    url = push_to_hub(tmp_path, "me/drafter", private=True, revision="v1")
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

    from specdec_runtime.layerskip import SkipSet
    from specdec_runtime.medusa import MedusaHeads, read_layout
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
            heads, tmp_path / "medusa", card("medusa"), base="org/target", lm_head=model.lm_head.weight, tree=None
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
    assert set(load_file(exports["mtp"] / "mtp_heads.safetensors")) == set(heads_state_dict(mtp))
    assert SkipSet.load(exports["layerskip"] / "skipset.json").attn == [1]

    usage = {  # what each card must show how to use (transformers/vLLM only where they apply)
        "standalone": ["specdec generate", "assistant_model=drafter", "speculative_config", "hf download me/distill"],
        "medusa": ["specdec generate", '"method": "medusa"', '"model": "medusa/vllm"', "has no Medusa"],
        "mtp": ["--drafter mtp", "AutoModelForCausalLM.from_pretrained", "vLLM's `mtp`"],
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
        url = push_to_hub(folder, f"me/{kind}", private=False, revision="main")
        assert url == f"https://hub.invalid/me/{kind}/commit/1"
        assert FakeApi.calls[0] == ("init", "hf_env_token")
        assert FakeApi.calls[1] == (
            "create_repo",
            f"me/{kind}",
            {"private": False, "exist_ok": True, "repo_type": "model"},
        )
        (upload,) = [c for c in FakeApi.calls if c[0] == "upload_folder"]
        assert upload[1] == sorted(p.name for p in folder.iterdir()) and upload[3] == "main"
