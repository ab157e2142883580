"""Integration on the bundled SmolLM2-135M-Instruct: speculative greedy output is transformers'."""

import pytest
import torch

from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.generate import generate
from specdec_runtime.prompts import encode_prompt

PROMPTS = [
    "Summarize: The council agreed to plant fifty trees this spring and to build a playground next year.",
    "Write a Python function that returns the factorial of n.",
]


@pytest.mark.parametrize("spec", ["ngram", "truncate:26"])
def test_greedy_output_equals_transformers_generate(bundled, bundled_hf, spec):
    drafter = build_drafter(spec, bundled)
    stop = sorted(bundled.stop_ids)
    for text in PROMPTS:
        ids = encode_prompt(bundled.tokenizer, text)
        ours = generate(bundled.model, ids, drafter, max_new_tokens=40, gamma=4, stop_ids=bundled.stop_ids)
        with torch.no_grad():
            ref = bundled_hf.generate(
                torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=stop, pad_token_id=stop[0]
            )
        assert ours.tokens == ref[0, len(ids) :].tolist()
        assert ours.stats.drafted > 0
