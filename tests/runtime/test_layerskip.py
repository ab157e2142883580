"""Layer-skip self-speculation: exactness, the KV cache after rejected self-drafts, the handed-over
prefix, the adaptive draft exit, skip-set files and their CLI use."""

import itertools
import json
import random

import pytest
import torch

from specdec_runtime.cli import main as cli_main
from specdec_runtime.drafters.layerskip import SkipSet, skip_drafter
from specdec_runtime.drafters.protocol import DraftExit
from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.loading import load_model
from specdec_runtime.model import LayerSkip
from specdec_runtime.sampling import Sampler
from tests.conftest import (
    BigramStub,
    assert_cache_is_a_fresh_prefill,
    assert_sequences_follow,
    bigram_table,
    runtime_from_hf,
    save_tiny_model,
    sequence_joint,
    tiny_decoder,
    tiny_hf_model,
)


def random_skip(n_layers: int, seed: int) -> LayerSkip:
    rng = random.Random(seed)
    return LayerSkip(
        attn={i for i in range(n_layers) if rng.random() < 0.4}, mlp={i for i in range(n_layers) if rng.random() < 0.4}
    )


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_self_speculation_equals_target_greedy_for_random_skip_sets(kind, seed):
    target = tiny_decoder(kind, seed=0, num_hidden_layers=4)
    prompt = [7, 3, 9, 7, 3, 1, 4, 7, 3]
    ar = generate(target, prompt, max_new_tokens=40)
    skip = random_skip(4, seed)
    exit_rule = DraftExit(0.3) if seed % 2 else None  # adaptive exit on half of them
    drafter = ModelDrafter(target, skip=skip, shares_target_cache=True, draft_exit=exit_rule)
    out = generate(target, prompt, drafter, max_new_tokens=40, gamma=5)
    assert out.tokens == ar.tokens
    assert out.stats.drafted > 0


@pytest.mark.parametrize("greedy", [True, False])
def test_kv_cache_after_rejected_self_drafts_equals_a_fresh_prefill(greedy):
    hf = tiny_hf_model("llama", seed=0, num_hidden_layers=4)
    target = runtime_from_hf(hf)
    drafter = ModelDrafter(target, skip=LayerSkip(attn={1, 3}, mlp={2}), shares_target_cache=True)
    prompt = [1, 2, 3, 4, 5]
    sampler = Sampler() if greedy else Sampler(1.0, seed=0)
    out = generate(target, prompt, drafter, sampler, max_new_tokens=37, gamma=5)
    assert out.stats.drafted > out.stats.accepted > 0  # there were rejections
    # fp32 rounding differs between chunked and whole-sequence forwards (~1e-5); a stale slot is O(1) off
    assert_cache_is_a_fresh_prefill(target, hf, prompt + out.tokens, atol=5e-5, rtol=1e-4)


def test_the_layers_before_the_first_skip_are_handed_to_verification():
    """A set that skips from layer 2 on drafts with the target's exact layers 0-1; resuming
    verification at layer 2 from them gives the full forward's logits."""
    hf = tiny_hf_model("llama", seed=8, num_hidden_layers=4)
    target, reference = runtime_from_hf(hf), runtime_from_hf(hf)
    ids = torch.tensor([4, 8, 15, 16, 23, 42])
    target.setup_cache(1, 32)
    target(ids[None, :-1], 0)
    drafter = ModelDrafter(target, skip=LayerSkip(attn={3}, mlp={2}), shares_target_cache=True)
    draft = drafter.draft(ids, 3, Sampler())
    assert draft.resume_layer == 2 and draft.residual.shape == (1, 4, 64)
    resumed = target(draft.residual, 5, first_layer=2).logits
    reference.setup_cache(1, 32)
    full = reference(torch.cat([ids, draft.tokens])[None], 0).logits[:, 5:]
    torch.testing.assert_close(resumed, full, atol=2e-5, rtol=1e-5)
    assert ModelDrafter(target, skip=LayerSkip(mlp={0}), shares_target_cache=True).resume_layer == 0
    assert ModelDrafter(tiny_decoder(), skip=LayerSkip(mlp={3})).resume_layer == 0  # own cache: nothing shared


def test_self_speculative_sampling_follows_the_target_distribution():
    """Four sampled tokens (top-k 3), the last three through drafts, from a tiny transformer with a
    skip-set drafter: the joint of the output is the target's, computed exactly by enumerating
    the sequences."""
    target = tiny_decoder("llama", seed=2, num_hidden_layers=3, initializer_range=0.05)
    prompt = [3, 1, 4]
    w = dict(temperature=1.0, top_k=3)

    def next_logits(ids: list[int]) -> torch.Tensor:
        target.setup_cache(1, 8)
        return target(torch.tensor([ids]), 0).logits[0, -1]

    joint = sequence_joint(next_logits, prompt, 4, **w)
    drafter = ModelDrafter(target, skip=LayerSkip(attn={1}, mlp={2}), shares_target_cache=True)
    samples, drafted = [], 0
    for seed in range(3000):
        out = generate(target, prompt, drafter, Sampler(seed=seed, **w), max_new_tokens=4, gamma=2)
        samples.append(out.tokens)
        drafted += out.stats.drafted
    assert drafter.model is target and drafted > 3000
    assert_sequences_follow(samples, joint)


class RecordingExit(DraftExit):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates = []

    def update(self, accepted, drafted, full):
        self.updates.append((accepted, drafted, full))
        super().update(accepted, drafted, full)


def test_draft_exit_learns_from_each_verified_draft():
    table, d_table = bigram_table(30, seed=0), bigram_table(30, seed=0) + bigram_table(30, seed=1) * 0.8
    draft_exit = RecordingExit(0.5)
    drafter = ModelDrafter(BigramStub(d_table), draft_exit=draft_exit)
    out = generate(BigramStub(table), [3], drafter, max_new_tokens=60, gamma=4)
    s = out.stats
    # every draft but the last is reported once verified, with what verification accepted of it
    assert len(draft_exit.updates) == s.rounds_with_draft - 1
    last_drafted = drafter.last[1]
    assert sum(d for _, d, _ in draft_exit.updates) + last_drafted == s.drafted
    assert 0 <= s.accepted - sum(a for a, _, _ in draft_exit.updates) <= last_drafted
    assert all(0 <= a <= d <= 4 and full == (d == 4) for a, d, full in draft_exit.updates)
    assert any(a < d for a, d, _ in draft_exit.updates) and any(not full for _, _, full in draft_exit.updates)
    assert out.tokens == generate(BigramStub(table), [3], max_new_tokens=60).tokens


def test_adaptive_threshold_rises_when_drafts_are_rejected_and_falls_when_accepted():
    rule = DraftExit(0.5, target_acceptance=0.8)  # steps of (1 - beta2) * epsilon = 0.001 per draft
    for _ in range(300):
        rule.update(0, 2, full=False)
    assert rule.threshold == pytest.approx(0.8)
    low = DraftExit(0.5, target_acceptance=0.8)
    for _ in range(300):
        low.update(3, 3, full=False)
    assert low.threshold == pytest.approx(0.204)  # the smoothed acceptance passes 0.8 at the third draft
    full = DraftExit(0.5)
    full.update(0, 4, full=True)  # a draft that used all of gamma leaves the threshold alone
    assert full.threshold == 0.5
    fixed = DraftExit(0.5, adaptive=False)
    fixed.update(0, 2, full=False)
    assert fixed.threshold == 0.5
    with pytest.raises(SpecdecError, match="threshold < 1"):
        DraftExit(1.5)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("ls") / "target", num_hidden_layers=4)


def test_skip_set_files_round_trip_and_bad_ones_are_refused(tiny_target, tmp_path):
    target = load_model(str(tiny_target), device="cpu")
    s = SkipSet(attn=[2, 1, 2], mlp=[3], num_layers=4, target="tiny", hidden_size=64, tau=1.5, speedup=0.9)
    path = s.save(tmp_path / "skipset.json")
    back = SkipSet.load(path)
    assert back == s and back.attn == [1, 2] and back.layer_skip == LayerSkip(attn={1, 2}, mlp={3})
    drafter = build_drafter(str(path), target)
    assert drafter.skip == s.layer_skip and drafter.model is target.model and drafter.gamma == 8
    assert drafter.draft_exit.adaptive and drafter.draft_exit.threshold == 0.5
    assert build_drafter(str(path), target, confidence=0.7).draft_exit.adaptive is False

    with pytest.raises(SpecdecError, match="does not exist"):
        build_drafter(str(tmp_path / "missing.json"), target)
    (tmp_path / "other.json").write_text(json.dumps({"paths": [[0]]}))
    with pytest.raises(SpecdecError, match="not a layer-skip set"):
        build_drafter(str(tmp_path / "other.json"), target)
    with pytest.raises(SpecdecError, match="outside 0..3"):
        SkipSet(attn=[4], mlp=[], num_layers=4)
    deep = SkipSet(attn=[1], mlp=[], num_layers=30, target="smollm2", hidden_size=576).save(tmp_path / "deep.json")
    with pytest.raises(SpecdecError, match="found for 'smollm2' \\(30 layers.*has 4 layers.*run recipes.layerskip"):
        skip_drafter(target, SkipSet.load(deep))


def test_generate_cli_with_a_skip_set(tiny_target, tmp_path, capsys):
    path = SkipSet(attn=[1], mlp=[2], num_layers=4, hidden_size=64).save(tmp_path / "skipset.json")
    out_file = tmp_path / "out.jsonl"
    cli_main(["generate", "--target", str(tiny_target), "--drafter", str(path), "--prompt", "abc abc",
              "--max-new-tokens", "24", "--baseline", "--output", str(out_file)])  # fmt: skip
    rec = json.loads(out_file.read_text())
    assert rec["identical_to_baseline"] and rec["stats"]["drafted_at"]
    assert len(rec["stats"]["drafted_at"]) <= 8  # the set's own gamma (8) is the default
    assert "gamma 8" in capsys.readouterr().out


def test_every_tiny_skip_set_is_exact():
    """All 2^4 sets of a 2-layer model, greedy: self-speculation never changes the output."""
    target = tiny_decoder("llama", seed=5)
    prompt = [5, 9, 11, 2]
    ar = generate(target, prompt, max_new_tokens=24).tokens
    for bits in itertools.product([0, 1], repeat=4):
        skip = LayerSkip(attn={i for i in range(2) if bits[i]}, mlp={i for i in range(2) if bits[2 + i]})
        drafter = ModelDrafter(target, skip=skip, shares_target_cache=True, draft_exit=DraftExit(0.2))
        assert generate(target, prompt, drafter, max_new_tokens=24, gamma=4).tokens == ar, skip
