"""Loading models by name, and the clear errors a user's mistakes get."""

import json

import pytest
import torch

from specdec_runtime.drafter_spec import build_drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.loading import check_same_vocab, load_model, resolve_model
from tests.conftest import save_tiny_model, save_tiny_tokenizer, tiny_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", "llama", seed=0)


def test_local_folder_loads_with_the_same_logits_as_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM

    loaded = load_model(str(tiny_dir), device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    ids = torch.tensor([[1, 5, 9, 12, 3]])
    loaded.model.setup_cache(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids, 0).logits, hf(ids).logits, atol=2e-5, rtol=1e-5)
    assert loaded.stop_ids == {2, 3}  # eos </s> and the chat template's end of turn <eot>


def test_bundled_model_has_chat_template_and_end_of_turn(bundled):
    tok = bundled.tokenizer
    assert bundled.config.num_layers == 30 and bundled.config.vocab_size == 49152
    assert tok.convert_ids_to_tokens(sorted(bundled.stop_ids)) == ["<|im_end|>"]
    assert bundled.path.name == "smollm2-135m-instruct" and (bundled.path / "model.safetensors").is_file()
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize(
    "name, message",
    [
        ("smolm2-135m-instruct", "unknown model 'smolm2-135m-instruct'.*Did you mean 'smollm2-135m-instruct'"),
        ("./no/such/folder", "unknown model './no/such/folder': no such folder"),
        ("not a model", "unknown model 'not a model'"),
        ("someone/does-not-exist-xyz", "not in the local Hugging Face cache and the Hub cannot be reached"),
    ],
)
def test_bad_model_names_say_what_to_do(name, message):
    with pytest.raises(SpecdecError, match=message):
        resolve_model(name)


def test_folder_without_config_and_unsupported_architecture(tmp_path):
    with pytest.raises(SpecdecError, match="has no config.json"):
        resolve_model(str(tmp_path))
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(
        SpecdecError, match="'gpt2' is not supported by specdec_runtime; supported: llama, mistral, qwen2"
    ):
        load_model(str(tmp_path))


def test_drafter_with_a_different_tokenizer_is_refused(tmp_path, tiny_dir):
    other = tmp_path / "other"
    save_tiny_tokenizer(other, extra_tokens=("0", "1", "2"))
    tiny_hf_model("llama", seed=1, vocab_size=38).save_pretrained(other)
    with pytest.raises(SpecdecError, match="does not share the target 'T' tokenizer.*3 \\(token, id\\) pairs differ"):
        target, drafter = load_model(str(tiny_dir)), load_model(str(other))
        target.name = "T"
        check_same_vocab(target, drafter)


def test_drafter_specs(tiny_dir):
    target = load_model(str(tiny_dir))
    assert build_drafter("none", target) is None
    assert build_drafter("ngram:4", target).max_ngram == 4
    assert build_drafter("truncate:1", target).exit_layer == 1
    same = build_drafter(str(tiny_dir), target)
    assert same.model is not target.model and same.vocab_size == target.config.vocab_size
    for spec, message in [
        ("truncate:2", "K must be in 1..1"),
        ("truncate:0", "K must be in 1..1"),
        ("truncate", "expected truncate:N"),
        ("ngram:x", "expected ngram:N"),
    ]:
        with pytest.raises(SpecdecError, match=message):
            build_drafter(spec, target)


def test_cached_conversion_is_reused(bundled, monkeypatch):
    """A second resolve reads the cached folder and never touches the GGUF converter."""
    import specdec_runtime.loading as loading

    monkeypatch.setattr(loading, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model("smollm2-135m-instruct") == bundled.path
    config = json.loads((bundled.path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"


def test_fast_dtype_follows_the_measured_bf16_speed(monkeypatch):
    """'fast' is bf16 exactly when a bf16 matmul took under 0.8x of fp32's time on this device
    (measured once per process); both verdicts reach model.dtype and trainer.mixed_precision."""
    from recipes.common import mixed_precision
    from specdec_runtime import loading

    cpu = torch.device("cpu")
    speed = loading.fast_bf16(cpu)
    assert speed.ratio > 0 and speed.fast == (speed.ratio < 0.8) and loading.fast_bf16(cpu) is speed
    assert f"on this CPU with {torch.get_num_threads()} thread" in str(speed)
    assert loading.resolve_dtype("fast", cpu) == (torch.bfloat16 if speed.fast else torch.float32)
    for ratio, dtype, mp in ((0.3, torch.bfloat16, "bf16"), (9.0, torch.float32, "no")):
        verdict = loading.Bf16Speed("CPU", ratio, ratio < 0.8)
        monkeypatch.setattr(loading, "_bf16_speed", lambda device_type, v=verdict: v)
        monkeypatch.setattr("recipes.common.fast_bf16", lambda device, v=verdict: v)
        assert loading.resolve_dtype("fast", cpu) == dtype and mixed_precision("fast", "cpu") == mp
        assert ("using bf16" if dtype == torch.bfloat16 else "using fp32") in str(verdict)
