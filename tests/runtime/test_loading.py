"""Loading models by name, and the clear errors a user's mistakes get."""

import json

import pytest
import torch

from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.loading import check_same_vocab, load_model
from specdec_runtime.paths import resolve_model
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
    import specdec_runtime.paths as paths

    monkeypatch.setattr(paths, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model("smollm2-135m-instruct") == bundled.path
    config = json.loads((bundled.path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"


def test_fast_dtype_follows_the_measured_bf16_speed(monkeypatch):
    """'fast' is bf16 exactly when a bf16 matmul took under 0.8x of fp32's time on this device
    (measured once per process); both verdicts reach model.dtype and trainer.mixed_precision."""
    from recipes.run import mixed_precision
    from specdec_runtime import hardware

    cpu = torch.device("cpu")
    speed = hardware.fast_bf16(cpu)
    assert speed.ratio > 0 and speed.fast == (speed.ratio < 0.8) and hardware.fast_bf16(cpu) is speed
    assert f"on this CPU with {torch.get_num_threads()} thread" in str(speed)
    assert hardware.resolve_dtype("fast", cpu) == (torch.bfloat16 if speed.fast else torch.float32)
    for ratio, dtype, mp in ((0.3, torch.bfloat16, "bf16"), (9.0, torch.float32, "no")):
        verdict = hardware.Bf16Speed("CPU", ratio, ratio < 0.8)
        monkeypatch.setattr(hardware, "_bf16_speed", lambda device_type, v=verdict: v)
        monkeypatch.setattr("recipes.run.fast_bf16", lambda device, v=verdict: v)
        assert hardware.resolve_dtype("fast", cpu) == dtype and mixed_precision("fast", "cpu") == mp
        assert ("using bf16" if dtype == torch.bfloat16 else "using fp32") in str(verdict)


@pytest.mark.parametrize(
    "default, usable, quota, env, candidates, why",
    [
        (2, 4, None, "", [2, 4], ""),  # SMT siblings: both counts are timed
        (2, 2, None, "", [2], "one per core: 2 usable CPUs, no SMT siblings to try"),
        (8, 16, 2, "", [2], "the cgroup's quota: 2 CPUs of the 8 cores torch would use"),
        (2, 4, 3, "", [2, 3], ""),  # a quota above the cores, below the siblings
        (2, 4, None, "3", [2], "OMP_NUM_THREADS"),  # the user's setting (torch applied it): kept
    ],
)
def test_thread_candidates_are_the_cores_and_the_usable_cpus_within_a_quota(
    monkeypatch, default, usable, quota, env, candidates, why
):
    from specdec_runtime import hardware

    monkeypatch.setattr(torch, "get_num_threads", lambda: default)
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: set(range(usable)))
    monkeypatch.setattr(hardware, "_cgroup_cpus", lambda: quota)
    monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert hardware.thread_candidates() == (candidates, why)


@pytest.mark.parametrize(
    "files, cpus",
    [
        ({"cpu.max": "200000 100000\n"}, 2),
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),  # no cgroup files
    ],
)
def test_cgroup_quota_in_cpus(tmp_path, files, cpus):
    from specdec_runtime.hardware import _cgroup_cpus

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert _cgroup_cpus(tmp_path) == cpus


def test_thread_timing_runs_each_count_alternately_and_restores_torchs():
    from specdec_runtime.hardware import _median_times

    before, ran = torch.get_num_threads(), []
    median = _median_times(lambda: ran.append(torch.get_num_threads()), [1, 2], repeats=3)
    assert ran == [2, 1, 1, 2, 2, 1, 1, 2]  # a warm-up pair, then each repeat in the other order
    assert set(median) == {1, 2} and all(t >= 0 for t in median.values())
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(
    "times, chosen",
    [({2: 1.0, 4: 0.90}, 4), ({2: 1.0, 4: 0.97}, 2), ({2: 1.0, 4: 1.30}, 2), ({2: 0.5, 4: 1.0}, 2)],
)
def test_a_count_other_than_torchs_must_be_5_percent_faster(monkeypatch, times, chosen):
    from specdec_runtime import hardware

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(hardware, "thread_candidates", lambda: ([2, 4], ""))
    monkeypatch.setattr(hardware, "_median_times", lambda work, candidates: times)
    hardware.cpu_threads.cache_clear()
    try:
        for work in ("decode", "train"):
            choice = hardware.cpu_threads(work)
            assert choice.threads == chosen and choice.timed == tuple(sorted(times.items()))
            assert f"on {chosen} CPU threads: its timed work took {1e3 * times[2]:.2f} ms with 2" in str(choice)
    finally:
        hardware.cpu_threads.cache_clear()
    with pytest.raises(ValueError, match="'decode' or 'train'"):
        hardware.cpu_threads("verify")


def test_thread_choice_on_this_machine_times_real_work_where_there_is_a_choice(monkeypatch):
    """Forced to choose between 1 thread and torch's count, both kinds of work run and are timed
    on this CPU, and the choice follows the rule from the times it recorded."""
    from specdec_runtime import hardware

    default = torch.get_num_threads()
    if default < 2:
        pytest.skip("one CPU thread: nothing to choose between")
    monkeypatch.setattr(hardware, "thread_candidates", lambda: ([1, default], ""))
    hardware.cpu_threads.cache_clear()
    try:
        for work in ("decode", "train"):
            choice = hardware.cpu_threads(work)
            times = dict(choice.timed)
            assert set(times) == {1, default} and torch.get_num_threads() == default
            assert choice.threads == (1 if times[1] < 0.95 * times[default] else default)
    finally:
        hardware.cpu_threads.cache_clear()
    monkeypatch.undo()
    candidates, why = hardware.thread_candidates()  # unpatched: what this machine offers
    assert max(candidates) <= len(hardware.os.sched_getaffinity(0)) and min(candidates) == min(default, max(candidates))
    assert bool(why) == (len(candidates) == 1)
