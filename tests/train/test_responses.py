"""Batched, cached, resumable response generation."""

import pytest
import torch

from specdec_runtime.generate import generate
from specdec_runtime.sampling import Sampler
from tests.conftest import runtime_from_hf, tiny_hf_model
from train import responses as R

PROMPTS = [[1, 5, 9], [1, 7, 7, 7, 30, 12], [1, 4], [1, 20, 21, 22], [1, 3, 3]]


def oracle(model, prompt, n):
    """Greedy continuation by the runtime, one prompt at a time (no padding)."""
    out = generate(runtime_from_hf(model), torch.tensor(prompt), None, Sampler(), max_new_tokens=n, stop_ids={2})
    return out.tokens


def test_batched_greedy_responses_equal_one_by_one_decoding():
    model = tiny_hf_model(seed=2)
    got = R.generate_responses(model, PROMPTS, pad_id=0, stop_ids=frozenset({2}), max_new_tokens=12, batch_size=3)
    assert got == [oracle(model, p, 12) for p in PROMPTS]


def test_the_runtime_engine_gives_one_by_one_decodings_responses():
    """A runtime Decoder generates with generate_batch (left-padded rows through the runtime)."""
    model = tiny_hf_model(seed=2)
    decoder = runtime_from_hf(model)
    got = R.generate_responses(decoder, PROMPTS, pad_id=0, stop_ids=frozenset({2}), max_new_tokens=12, batch_size=3)
    assert got == [oracle(model, p, 12) for p in PROMPTS]


def test_sampled_transformers_responses_draw_from_the_whole_vocabulary():
    """temperature / top_p as given and nothing else: transformers' generate would otherwise keep
    only the 50 likeliest tokens (its top_k default). Oracle: the model's own softmax, checked on
    the first token of 600 draws after one prompt (the share drawn outside its top 50)."""
    model = tiny_hf_model(seed=2)
    prompt = [1, 5, 9]
    with torch.no_grad():
        probs = model(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
    top50 = set(probs.topk(50).indices.tolist())
    outside = 1 - float(probs[sorted(top50)].sum())  # 0.32 for this model (top_k=50 draws 0 there)
    n = 600
    torch.manual_seed(0)
    generate = R.batch_generator(model, pad_id=0, stop_ids=frozenset({2}), max_new_tokens=1, temperature=1.0,
                                  top_p=1.0, seed=0)  # fmt: skip
    share = sum(r[0] not in top50 for r in generate([prompt] * n)) / n
    assert abs(share - outside) < 5 * (outside * (1 - outside) / n) ** 0.5


def test_cut_at_stop_keeps_the_stop_token():
    assert R.cut_at_stop([5, 6, 2, 0, 0], {2}) == [5, 6, 2]
    assert R.cut_at_stop([5, 6], {2}) == [5, 6]


def test_cache_resumes_an_interrupted_run_and_is_reused(tmp_path, monkeypatch):
    model = tiny_hf_model(seed=2)
    kw = dict(pad_id=0, stop_ids=frozenset({2}), max_new_tokens=8, batch_size=2, cache_dir=tmp_path)
    want = R.generate_responses(model, PROMPTS, **{**kw, "cache_dir": None})
    real, calls = R._transformers_batch, []

    def dies_after_two(*a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(R, "_transformers_batch", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        R.generate_responses(model, PROMPTS, **kw)
    assert not (tmp_path / R.DONE).exists()
    calls.clear()
    monkeypatch.setattr(R, "_transformers_batch", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    assert R.generate_responses(model, PROMPTS, **kw) == want
    assert sum(len(b) for b in calls) == 1  # only the prompt not finished before the interruption
    assert (tmp_path / R.DONE).is_file() and not list(tmp_path.glob("part-*"))
    assert R.generate_responses(None, PROMPTS, **kw) == want  # served from the cache, no model needed


def test_cache_key_depends_on_prompts_and_settings(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    k = R.cache_key(tmp_path, PROMPTS, {"t": 0})
    assert k == R.cache_key(tmp_path, PROMPTS, {"t": 0})
    assert k != R.cache_key(tmp_path, PROMPTS[:-1], {"t": 0})
    assert k != R.cache_key(tmp_path, PROMPTS, {"t": 1})
