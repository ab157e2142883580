"""Batched speculative decoding (specdec_runtime.batched) against each prompt decoded alone: greedy
rows equal generate()'s output (itself the target's greedy output) with every batched drafter,
rows of different prompt lengths, ragged acceptance and stops; sampled rows follow the target's
distribution (chi-square); the per-row forward equals a row decoded alone."""

import pytest
import torch

from specdec_runtime.batched import generate_many
from specdec_runtime.drafters.batched import RowEagle3, RowLookup, RowModel, batch_drafter
from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.lookup import LookupFirst, NgramDrafter
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.sampling import Sampler
from tests.conftest import assert_sequences_follow, runtime_from_hf, sequence_joint, tiny_decoder, tiny_hf_model
from tests.runtime.test_eagle3 import tiny as eagle3_tiny

PROMPTS = [[1, 5, 9, 5, 9], [1, 7, 7, 7, 30, 12, 40, 41, 42, 43, 7, 7, 7], [1, 4], [1, 20, 21, 22, 23, 20, 21], [3]]


def perturbed(model):
    """A copy of the target with noise on its weights: a drafter right often, not always."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2 * p.std())
    return model


def test_a_row_at_slots_of_its_own_computes_what_it_computes_alone():
    """Left-padded rows at their own slots: each row's logits equal the row decoded alone (prefill
    and a step of 3 tokens at different slots per row)."""
    target = tiny_decoder("qwen3", seed=1)
    prompts = [[1, 5, 9, 11], [2, 3]]
    alone = []
    for p in prompts:
        target.setup_cache(1, 16)
        first = target.prefill(torch.tensor([p])).logits[0]
        alone.append((first, target(torch.tensor([[4, 6, 8]]), len(p)).logits[0]))
    target.setup_cache(2, 16)
    target.left_pad(torch.tensor([0, 2]))
    ids = torch.tensor([[1, 5, 9, 11], [0, 0, 2, 3]])
    first = target(ids, torch.zeros(2, dtype=torch.long)).logits
    step = target(torch.tensor([[4, 6, 8], [4, 6, 8]]), torch.tensor([4, 4])).logits
    for b, (f, s) in enumerate(alone):
        torch.testing.assert_close(first[b, 4 - len(prompts[b]) :], f, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step[b], s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kind, overrides",
    [("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 8})],
    ids=["llama", "qwen3", "mistral-window"],
)
@pytest.mark.parametrize("drafter", ["none", "lookup", "model"])
@pytest.mark.parametrize("rows", [None, 2], ids=["one-batch", "queue"])
def test_greedy_rows_equal_each_prompt_decoded_alone(kind, overrides, drafter, rows):
    """Every prompt at once, or two rows at a time, each prompt from the queue taking the row the
    first to stop leaves (rows = 2: three prompts wait, one of them longer than the first two)."""
    target = tiny_decoder(kind, seed=3, **overrides)
    draft_model = perturbed(tiny_decoder(kind, seed=3, **overrides))
    free = [generate(target, p, max_new_tokens=20).tokens for p in PROMPTS]
    stop = free[1][6]  # row 1 stops at its 7th token (maybe others too)
    alone = [generate(target, p, max_new_tokens=20, stop_ids={stop}).tokens for p in PROMPTS]
    assert len(alone[1]) <= 7 and any(len(a) == 20 for a in alone)
    row_drafter = {"none": None, "lookup": RowLookup(), "model": RowModel(draft_model)}[drafter]
    many = generate_many(target, PROMPTS, row_drafter, max_new_tokens=20, gamma=3, stop_ids={stop}, rows=rows)
    assert [g.tokens for g in many] == alone
    assert [g.stop_reason for g in many] == ["stop_token" if a[-1] == stop else "length" for a in alone]
    if drafter == "model":  # drafts accepted, more in some rows than in others
        assert len({g.stats.accepted for g in many}) > 2, [g.stats.accepted for g in many]
    assert generate(target, PROMPTS[0], max_new_tokens=20).tokens == free[0]  # nothing left behind


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_sampled_rows_follow_the_targets_distribution(kind):
    """Short prompts beside a long one, a sampling drafter: their first two tokens (the second
    from speculative sampling of a draft) follow the exact joint of the target's warped
    distribution (chi-square over the 9 pairs of top-3 tokens). 700 rows: the last 100 prompts
    wait in the queue for a row."""
    if kind == "model":
        hf = tiny_hf_model(seed=4)
        target, rows, short = runtime_from_hf(hf), RowModel(perturbed(runtime_from_hf(hf))), [1, 5, 9]
    else:  # (a prompt after which its random drafts are accepted at times)
        hf, target, model = eagle3_tiny(vocab=16, draft_vocab=12)
        rows, short = RowEagle3(Eagle3Drafter(model, target, cpu_bf16=False)), [1, 2, 3, 4]
    long = [1, 7, 7, 7, 3, 12, 4, 11, 2, 13]
    sampler = Sampler(1.0, top_k=3, seed=0)
    out = generate_many(target, [long] + [short] * 799, rows, sampler, max_new_tokens=3, gamma=2, rows=700)
    assert sum(g.stats.drafted for g in out) >= 799 and 0 < sum(g.stats.accepted for g in out) < 799

    def next_logits(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1]

    assert_sequences_follow(
        [g.tokens[:2] for g in out[1:]], sequence_joint(next_logits, short, 2, temperature=1.0, top_k=3)
    )


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("batch", [None, 2], ids=["one-batch", "queue"])
def test_eagle3_chains_draft_for_each_row_what_they_draft_alone(sampled, batch):
    """An EAGLE-3 drafter: every row's output equals the target's greedy output, and its
    drafts were accepted exactly as often, position by position, as the same drafter's chains
    decoding that prompt alone (the drafts are the same); sampled, the rows are the target's
    distribution's (the tokens differ from batch 1's: the random draws are the batch's)."""
    _, target, model = eagle3_tiny(vocab=16, draft_vocab=12)  # a vocabulary small enough for random drafts to hit
    drafter = Eagle3Drafter(model, target, cpu_bf16=False)
    prompts = [[t % 16 for t in p] for p in PROMPTS]
    rows = batch_drafter(drafter)
    assert isinstance(rows, RowEagle3) and rows.hidden_layers == drafter.hidden_layers
    if sampled:
        many = generate_many(target, prompts, rows, Sampler(1.0, seed=0), max_new_tokens=24, gamma=3, rows=batch)
        assert all(len(g.tokens) == 24 for g in many) and sum(g.stats.accepted for g in many) > 0
        return
    many = generate_many(target, prompts, rows, max_new_tokens=24, gamma=3, rows=batch)
    for p, g in zip(prompts, many, strict=True):
        alone = generate(target, p, drafter, max_new_tokens=24, gamma=3)
        assert g.tokens == alone.tokens == generate(target, p, max_new_tokens=24).tokens
        assert g.stats.accepted_at == alone.stats.accepted_at and g.stats.drafted_at == alone.stats.drafted_at
    assert sum(g.stats.accepted for g in many) > 5


def test_drafters_that_decode_a_prompt_at_a_time_say_so():
    target = tiny_decoder(seed=0)
    assert isinstance(batch_drafter(NgramDrafter(4)), RowLookup)
    assert isinstance(batch_drafter(ModelDrafter(tiny_decoder(seed=1))), RowModel)
    assert batch_drafter(LookupFirst(ModelDrafter(tiny_decoder(seed=1)))) is None
    assert batch_drafter(ModelDrafter(target, exit_layer=1, shares_target_cache=True)) is None
    with pytest.raises(SpecdecError, match="empty"):
        generate_many(target, [[1, 2], []])
