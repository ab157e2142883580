"""Every recipe on a tiny Qwen3 target (q/k norms, a head_dim apart from hidden / heads), end to
end as the Llama tests run them: training, validation on the runtime (the target's own greedy
output, losslessness) and the export; EAGLE-3 also on a tiny Qwen3-MoE target, and on a family
the runtime does not run (Gemma), which trains anyway and validates with the training-time
estimate. MTP pretrains a model of the target's family from scratch. The other recipes' Llama runs
are in their own files."""

import json

import pytest

from tests.conftest import save_tiny_model, save_tiny_tokenizer, write_prompt_file
from tests.train import test_distill_recipe, test_eagle3_recipe, test_layerskip, test_medusa_recipe, test_mtp


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3")


def target(root, kind: str, **over):
    return save_tiny_model(root / kind, kind, num_hidden_layers=4, head_dim=32, tie_word_embeddings=True, **over)


def validated(result: dict, out) -> dict:
    metrics = result["validation"]
    assert metrics["lossless"] == 1.0 and metrics["tau"] >= 1.0, metrics
    assert (out / "export" / "config.json").is_file() or (out / "export" / "skipset.json").is_file()
    return metrics


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_eagle3_on_qwen3(root, tmp_path, kind):
    data = write_prompt_file(root / "e3.jsonl", 24, stride=5, suffix=", and so on.")
    tiny = (target(root, kind), data, root / f"cache-{kind}")
    out = tmp_path / "run"
    config = test_eagle3_recipe.config(tiny, out, "trainer.max_steps=4", "validate.num_prompts=2")
    validated(test_eagle3_recipe.eagle3.run(config), out)
    speculators = json.loads((out / "export" / "config.json").read_text())["speculators_config"]
    assert speculators["verifier"]["architectures"] == ["Qwen3MoeForCausalLM" if kind == "qwen3_moe" else
                                                        "Qwen3ForCausalLM"]  # fmt: skip


@pytest.mark.slow
def test_distill_medusa_and_layerskip_on_qwen3(root, tmp_path):
    data = write_prompt_file(root / "p.jsonl", 16, stride=3, suffix=", say more.")
    tiny = (target(root, "qwen3"), data, root / "cache")
    out = tmp_path / "distill"
    validated(test_distill_recipe.distill.run(test_distill_recipe.config(tiny, out, "trainer.max_steps=3")), out)
    out = tmp_path / "medusa"
    validated(test_medusa_recipe.medusa.run(test_medusa_recipe.config(tiny, out, "trainer.max_steps=3")), out)
    out = tmp_path / "layerskip"
    validated(test_layerskip.layerskip.run(test_layerskip.config(tiny[:2], out)), out)


@pytest.mark.slow
def test_mtp_pretrains_a_qwen3_model(root, tmp_path):
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": "the quick brown fox jumps over the lazy dog. " * 6})
                                for _ in range(60)))  # fmt: skip
    tiny = (save_tiny_model(root / "tok", "qwen3", num_hidden_layers=1), corpus, root / "mtp-cache")
    out = tmp_path / "mtp"
    validated(test_mtp.recipe.run(test_mtp.config(tiny, out, "trainer.max_steps=4")), out)


def test_eagle3_trains_on_a_family_the_runtime_does_not_run(root, tmp_path, capfd):
    """A Gemma target: the responses come from transformers, the drafter (a Llama layer sized after
    it) trains and exports, and validation reports the training-time estimate, saying why."""
    from transformers import GemmaConfig, GemmaForCausalLM

    folder = root / "gemma"
    tok = save_tiny_tokenizer(folder)
    config = GemmaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)  # fmt: skip
    GemmaForCausalLM(config).save_pretrained(folder)
    data = write_prompt_file(root / "gemma.jsonl", 24, stride=5, suffix=", and so on.")
    out = tmp_path / "run"
    config = test_eagle3_recipe.config((folder, data, root / "cache-gemma"), out, "trainer.max_steps=3")
    metrics = test_eagle3_recipe.eagle3.run(config)["validation"]
    said = capfd.readouterr()
    assert "model_type 'gemma' is not supported by specdec_runtime" in said.out + said.err
    assert "the training-time estimate only" in said.out + said.err
    assert metrics["tau_estimate_chain"] >= 1.0 and "tau" not in metrics
    assert (out / "export" / "config.json").is_file()
