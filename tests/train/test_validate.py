"""train.validate.validate at several batch sizes: each size's figures from decoding the prompts
that many at a time against autoregressive decoding at the same size, lossless; a drafter that
decodes a prompt at a time says so instead."""

import pytest

from specdec_runtime.drafters.lookup import LookupFirst
from specdec_runtime.drafters.standalone import ModelDrafter
from tests.conftest import tiny_decoder
from train.validate import validate

PROMPTS = [[1, 5, 9, 5, 9], [1, 7, 7, 7, 30, 12, 40], [1, 4], [1, 20, 21, 22, 23, 20, 21]]


def test_validation_measures_each_batch_size_named():
    target, draft = tiny_decoder(seed=3), tiny_decoder(seed=3)
    drafter = LookupFirst(ModelDrafter(draft))  # batched: lookups no longer than gamma, the model elsewhere
    m = validate(target, drafter, PROMPTS, [None] * 4, stop_ids=frozenset(), gamma=3, max_new_tokens=12,
                 progress=False, batch_sizes=[1, 3])  # fmt: skip
    assert m["lossless"] == m["lossless_batch3"] == 1.0
    for B in (3,):  # the draft model is the target: every draft accepted, 3 + 1 tokens a forward
        assert m[f"tau_batch{B}"] == pytest.approx(12 / 4, rel=0.2)
        assert m[f"speedup_batch{B}"] == pytest.approx(m[f"tokens_per_s_batch{B}"] / m[f"ar_tokens_per_s_batch{B}"])
    assert "tau_batch1" not in m and "tau_batch2" not in m


def test_a_drafter_that_decodes_a_prompt_at_a_time_says_so_at_other_sizes():
    target = tiny_decoder(seed=3)
    drafter = ModelDrafter(target, exit_layer=1, shares_target_cache=True, confidence=0.5, name="truncate:1")  # (exits)
    m = validate(target, drafter, PROMPTS, [None] * 4, stop_ids=frozenset(), gamma=2, max_new_tokens=8,
                 progress=False, batch_sizes=[4])  # fmt: skip
    assert m["batch4"] == "truncate:1 decodes one prompt at a time" and "speedup_batch4" not in m
