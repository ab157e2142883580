"""The generate loop: greedy losslessness, exact sampling, cache rollback, stopping, gamma control."""

import importlib

import pytest
import torch

from specdec_runtime.drafters.lookup import LookupFirst, NgramDrafter, merged
from specdec_runtime.drafters.protocol import Draft, Drafter
from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import cut, generate, generate_batch
from specdec_runtime.model import LayerSkip
from specdec_runtime.sampling import Sampler
from specdec_runtime.stats import GenerationStats
from specdec_runtime.tree import Tree
from tests.conftest import (
    BigramStub,
    assert_cache_is_a_fresh_prefill,
    assert_follows,
    assert_not_follows,
    assert_sequences_follow,
    bigram_greedy,
    bigram_table,
    exact_joint,
    runtime_from_hf,
    sequence_joint,
    tiny_decoder,
    tiny_hf_model,
)


class OracleDrafter(Drafter):
    """Stub drafter that knows the target's greedy chain; each draft is right for its first
    `correct` tokens (None: always right) and wrong after that."""

    def __init__(self, table: torch.Tensor, correct: int | None):
        self.next = table.argmax(-1)  # greedy successor of each token
        self.correct, self.name = correct, f"oracle:{correct}"

    def draft(self, ids, gamma, sampler):
        tokens, last = [], ids[-1]
        for i in range(gamma):
            last = self.next[last]
            right = self.correct is None or i < self.correct
            tokens.append(last if right else (last + 1) % self.next.numel())
            last = tokens[-1]
        return Draft(torch.stack(tokens), None)


@pytest.mark.parametrize("correct", [None, 0, 1, 2])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_equals_target_greedy_with_stub_drafters(correct, gamma):
    table = bigram_table(50, seed=0)
    target = BigramStub(table)
    out = generate(target, [3], OracleDrafter(table, correct), max_new_tokens=40, gamma=gamma)
    assert out.tokens == bigram_greedy(table, 3, 40)
    s = out.stats
    assert s.new_tokens == 40 and s.target_forwards == target.calls
    if correct is None:
        assert s.acceptance_rate == 1.0
    else:
        assert s.accepted_at[: min(correct, gamma)] == s.drafted_at[: min(correct, gamma)]
        assert sum(s.accepted_at[correct:]) == 0


def test_always_right_drafter_gives_gamma_plus_one_tokens_per_forward():
    table = bigram_table(50, seed=1)
    target = BigramStub(table)
    out = generate(target, [3], OracleDrafter(table, None), max_new_tokens=41, gamma=4)
    # prefill gives 1 token, then 8 rounds of 4 accepted + 1 bonus
    assert out.stats.target_forwards == 9 and out.stats.tau == pytest.approx(41 / 9)
    assert out.stats.acceptance_per_position == [1.0, 1.0, 1.0, 1.0]


def test_drafter_that_is_the_target_gets_everything_accepted():
    hf = tiny_hf_model("llama", seed=0)
    target, twin = runtime_from_hf(hf), runtime_from_hf(hf)
    ar = generate(target, [5, 9, 11, 2], max_new_tokens=30)
    spec = generate(target, [5, 9, 11, 2], ModelDrafter(twin), max_new_tokens=30, gamma=4)
    assert spec.tokens == ar.tokens
    assert spec.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("spec", ["draft-model", "truncate", "ngram", "draft-model-adaptive", "lookup-adaptive"])
def test_greedy_speculative_equals_target_greedy_with_real_tiny_models(kind, spec):
    target = tiny_decoder(kind, seed=0, num_hidden_layers=3)
    prompt = [7, 3, 9, 7, 3, 1, 4, 7, 3]
    ar = generate(target, prompt, max_new_tokens=48)
    drafter = {
        "draft-model": lambda: ModelDrafter(tiny_decoder(kind, seed=1)),
        "draft-model-adaptive": lambda: ModelDrafter(tiny_decoder(kind, seed=1), confidence=0.2),
        "truncate": lambda: ModelDrafter(target, exit_layer=1, shares_target_cache=True),
        "ngram": lambda: NgramDrafter(3),
        "lookup-adaptive": lambda: LookupFirst(ModelDrafter(tiny_decoder(kind, seed=1), confidence=0.2)),
    }[spec]()
    out = generate(target, prompt, drafter, max_new_tokens=48, gamma=4, adaptive_gamma=spec.endswith("adaptive"))
    assert out.tokens == ar.tokens
    assert out.stats.drafted > 0
    if spec.startswith("lookup"):  # both kinds of rounds
        assert 0 < drafter.lookups < out.stats.rounds_with_draft


@pytest.mark.parametrize("drafter_kind", ["draft-model", "truncate"])
def test_kv_cache_after_rejections_equals_a_fresh_prefill(drafter_kind):
    hf = tiny_hf_model("llama", seed=0, num_hidden_layers=3)
    target = runtime_from_hf(hf)
    drafter = (
        ModelDrafter(tiny_decoder("llama", seed=3))
        if drafter_kind == "draft-model"
        else ModelDrafter(target, exit_layer=1, shares_target_cache=True)
    )
    prompt = [1, 2, 3, 4, 5]
    out = generate(target, prompt, drafter, Sampler(1.0, seed=0), max_new_tokens=37, gamma=5)
    assert out.stats.drafted > out.stats.accepted > 0  # there were rejections
    assert_cache_is_a_fresh_prefill(target, hf, prompt + out.tokens)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.6, 0, 0.9), (1.5, 2, 1.0)])
def test_speculative_sampling_follows_the_target_distribution(temperature, top_k, top_p):
    """Three tokens from a bigram target with a different bigram drafter: the joint distribution
    of the output is the target's (chi-square over all 27 sequences), not the drafter's."""
    V = 3
    t_table, d_table = bigram_table(V, seed=10, scale=1.5), bigram_table(V, seed=11, scale=1.5)
    target, drafter = BigramStub(t_table), ModelDrafter(BigramStub(d_table))
    samples = []
    for seed in range(3000):
        out = generate(target, [0], drafter, Sampler(temperature, top_k, top_p, seed=seed), max_new_tokens=3, gamma=2)
        a, b, c = out.tokens
        samples.append(a * V * V + b * V + c)
    w = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    assert_follows(samples, exact_joint(t_table, 0, 3, **w))
    assert_not_follows(samples, exact_joint(d_table, 0, 3, **w))


def test_stops_at_a_stop_token_inside_an_accepted_draft():
    table = bigram_table(50, seed=2)
    chain = bigram_greedy(table, 3, 30)
    stop = chain[6]
    first_stop = chain.index(stop)
    for drafter in (None, OracleDrafter(table, None)):
        out = generate(BigramStub(table), [3], drafter, max_new_tokens=30, gamma=4, stop_ids={stop})
        assert out.tokens == chain[: first_stop + 1] and out.stop_reason == "stop_token"


def test_stop_token_as_first_token_and_exact_length_budget():
    table = bigram_table(50, seed=3)
    chain = bigram_greedy(table, 3, 30)
    out = generate(BigramStub(table), [3], OracleDrafter(table, None), max_new_tokens=30, stop_ids={chain[0]})
    assert out.tokens == chain[:1] and out.stats.target_forwards == 1
    for n in (1, 2, 7, 11):  # drafts are cut so a round never runs past the budget
        out = generate(BigramStub(table), [3], OracleDrafter(table, None), max_new_tokens=n, gamma=4)
        assert out.tokens == chain[:n] and out.stop_reason == "length"


def test_adaptive_gamma_follows_the_transformers_heuristic():
    table = bigram_table(50, seed=4)
    right = generate(
        BigramStub(table), [3], OracleDrafter(table, None), max_new_tokens=60, gamma=1, adaptive_gamma=True, max_gamma=7
    )
    assert len(right.stats.drafted_at) == 7  # 1, 3, 5, 7, 7, ... after fully accepted drafts
    wrong = generate(BigramStub(table), [3], OracleDrafter(table, 0), max_new_tokens=20, gamma=4, adaptive_gamma=True)
    # 19 rounds of one token each; the last has a budget of 1 token, so it drafts nothing
    assert wrong.stats.drafted_at == [18, 3, 2, 1]  # gamma 4, 3, 2, 1, then 1 forever


def test_confidence_cutoff_stops_unsure_drafts():
    table = bigram_table(20, seed=5)
    unsure = ModelDrafter(BigramStub(torch.zeros(20, 20)), confidence=0.5)  # uniform drafter: p = 0.05
    out = generate(BigramStub(table), [3], unsure, max_new_tokens=20, gamma=4)
    assert len(out.stats.drafted_at) == 1
    assert out.tokens == bigram_greedy(table, 3, 20)


def test_prompt_that_does_not_fit_the_context_is_refused_before_work():
    target = BigramStub(bigram_table(10, seed=0), context=16)
    with pytest.raises(SpecdecError, match="needs 20 positions but the target's context is 16"):
        generate(target, list(range(10)), max_new_tokens=10)
    assert target.calls == 0
    with pytest.raises(SpecdecError, match="empty"):
        generate(target, [], max_new_tokens=1)


def test_early_exit_drafts_let_verification_resume_at_the_exit_layer():
    """truncate:K hands over its layer-K residual stream; resuming there gives the full forward's logits."""
    hf = tiny_hf_model("qwen2", seed=8, num_hidden_layers=4)
    target, reference = runtime_from_hf(hf), runtime_from_hf(hf)
    ids = torch.tensor([4, 8, 15, 16, 23, 42])
    target.setup_cache(1, 32)
    target(ids[None, :-1], 0)  # the verified prefix; ids[-1] is the newest token
    draft = ModelDrafter(target, exit_layer=2, shares_target_cache=True).draft(ids, 3, Sampler())
    assert draft.resume_layer == 2 and draft.residual.shape == (1, 4, 64)
    resumed = target(draft.residual, 5, first_layer=2).logits
    reference.setup_cache(1, 32)
    full = reference(torch.cat([ids, draft.tokens])[None], 0).logits[:, 5:]
    torch.testing.assert_close(resumed, full, atol=2e-5, rtol=1e-5)
    assert (
        ModelDrafter(target, exit_layer=2, skip=LayerSkip(attn={0}), shares_target_cache=True)
        .draft(ids, 3, Sampler())
        .residual
        is None
    )


def test_drafter_with_a_shorter_context_is_refused():
    target = BigramStub(bigram_table(10, seed=0), context=64)
    short = ModelDrafter(BigramStub(bigram_table(10, seed=1), context=16), name="short")
    with pytest.raises(
        SpecdecError, match="drafter 'short' has a context of 16 tokens, shorter than prompt \\+ max_new_tokens = 22"
    ):
        generate(target, [1, 2], short, max_new_tokens=20)


def test_drafts_after_a_stop_token_are_not_counted_as_accepted():
    """A round whose accepted draft holds the stop token outputs up to it: the drafts after it (and
    the bonus token) are not output, so they do not count as accepted (tau and acceptance agree)."""
    table = bigram_table(50, seed=1)
    chain = bigram_greedy(table, 3, 6)  # the target's own continuation of token 3
    target = BigramStub(table)
    out = generate(target, [3], OracleDrafter(table, None), max_new_tokens=20, gamma=4, stop_ids={chain[2]})
    assert out.tokens == chain[:3] and out.stop_reason == "stop_token"  # prefill: chain[0]; round 1: chain[1:3]
    s = out.stats
    assert s.target_forwards == 2 and s.drafted_at == [1, 1, 1, 1] and s.accepted_at == [1, 1, 0, 0]
    assert s.new_tokens == 1 + s.accepted  # the prefill's token, then the two accepted drafts (no bonus)


def test_lookup_needs_a_drafter_to_fall_back_on():
    with pytest.raises(SpecdecError, match="plain lookup is 'ngram'"):
        build_drafter("none+lookup", None)


def test_measure_alternates_which_side_of_a_pair_decodes_first(monkeypatch):
    """measure(baseline=True): the autoregressive run of a prompt comes first on even prompts and
    second on odd ones, and each side's records stay in prompt order, with the target's greedy tokens."""
    measure_module = importlib.import_module("specdec_runtime.measure")  # the package exports its function

    table = bigram_table(50, seed=2)
    target = BigramStub(table)
    order, real = [], measure_module.generate

    def recording(model, ids, drafter, *args, **kwargs):
        order.append((int(ids[0]), drafter is None))
        return real(model, ids, drafter, *args, **kwargs)

    monkeypatch.setattr(measure_module, "generate", recording)
    prompts = [torch.tensor([p]) for p in (3, 4, 5, 6)]
    drafter = OracleDrafter(table, 1)
    report = measure_module.measure(
        target, drafter, prompts, sampler=Sampler, baseline=True, warmup=False, max_new_tokens=12, gamma=3
    )
    assert order == [(3, True), (3, False), (4, False), (4, True), (5, True), (5, False), (6, False), (6, True)]
    for p, ar, spec in zip((3, 4, 5, 6), report.baseline, report.spec):
        assert ar.tokens == spec.tokens == bigram_greedy(table, p, 12)


def test_a_chain_longer_than_gamma_is_verified_and_cut_to_the_tokens_left():
    """A drafter may return more than gamma tokens (LookupFirst's lookups): the loop verifies them
    all while they fit, cuts the chain to the tokens left to generate near the end, and the output
    is the target's greedy output, exactly max_new_tokens long."""

    class Long(OracleDrafter):
        def draft(self, ids, gamma, sampler):
            return super().draft(ids, 10, sampler)  # always 10 right tokens, whatever gamma

    table = bigram_table(50, seed=3)
    target = BigramStub(table)
    out = generate(target, [4], Long(table, None), max_new_tokens=16, gamma=2)
    assert out.tokens == bigram_greedy(table, 4, 16)
    # the prefill makes 1; a round of 10 + 1 bonus; then 4 left: 3 drafts (cut from 10) + 1 bonus
    assert out.stats.target_forwards == 3 and out.stats.drafted_at == [2] * 3 + [1] * 7


def token_paths(draft: Draft) -> list[tuple[int, ...]]:
    """Each node's tokens from the root, in the draft's node order (a chain: its prefixes)."""
    tokens = draft.tokens.tolist()
    if draft.tree is None:
        return [tuple(tokens[: d + 1]) for d in range(len(tokens))]
    parents, paths = draft.tree.structure[0], [()]
    for t, parent in zip(tokens, parents[1:]):
        paths.append(paths[parent] + (t,))
    return paths[1:]


def test_a_merged_tree_holds_every_path_of_both_drafts_once_the_chain_first():
    """merged(chain, draft): the union of both drafts' token paths, each one node (the chain's first
    two tokens are also the other tree's), the chain as every node's first child; cut() keeps the
    paths up to a depth."""
    chain = torch.tensor([5, 6, 7, 8])
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    other = Draft(torch.tensor([5, 9, 6, 10, 4]), None, tree=tree)  # (5,), (9,), (5, 6), (5, 10), (9, 4)
    prefixes = {(5,), (5, 6), (5, 6, 7), (5, 6, 7, 8)}
    cases = [
        (other, prefixes | {(9,), (5, 10), (9, 4)}),
        (Draft(torch.tensor([9, 4, 4]), None), prefixes | {(9,), (9, 4), (9, 4, 4)}),
    ]
    for draft, union in cases:
        m = merged(chain, draft)
        assert sorted(token_paths(m)) == sorted(union) and m.probs is None  # no path twice
        at = {p: i for i, p in enumerate(m.tree.paths)}
        assert [m.tokens[at[(0,) * d]].item() for d in (1, 2, 3, 4)] == chain.tolist()
        for depth in (1, 2, 3):
            assert sorted(token_paths(cut(m, depth))) == sorted(p for p in union if len(p) <= depth)


def test_a_tree_deeper_than_the_tokens_left_is_cut():
    """A merged lookup deeper than the tokens left to generate: the loop keeps its nodes up to that
    depth, and the output is the target's greedy output, exactly max_new_tokens long."""

    class LongTree(OracleDrafter):
        tree_nodes = 20

        def draft(self, ids, gamma, sampler):
            right = super().draft(ids, 10, sampler).tokens  # 10 right tokens beside 10 wrong ones
            return merged((right + 1) % self.next.numel(), Draft(right, None))

    table = bigram_table(50, seed=3)
    out = generate(BigramStub(table), [4], LongTree(table, None), max_new_tokens=16, gamma=2)
    assert out.tokens == bigram_greedy(table, 4, 16)
    assert out.stats.target_forwards == 3  # the prefill's token; 10 + 1; then 3 (cut from 10) + 1


def test_merged_lookups_accept_the_models_tokens_where_the_copy_breaks_off():
    """The prompt holds a b c with c not the target's choice after b: once the output reaches a b,
    the lookup drafts c first, which is rejected. Merged with the model's 2 tokens (right ones
    here), that round accepts 2: fewer target forwards than without merging, the same greedy output."""
    table = bigram_table(50, seed=5)
    nxt = table.argmax(-1)
    a = 3
    b = int(nxt[a])
    c = (int(nxt[b]) + 1) % 50
    prompt = [a, b, c, a]  # the first new token is b: "a b" again
    runs = {}
    for merge in (0, 2):
        drafter = LookupFirst(OracleDrafter(table, None), merge=merge)
        runs[merge] = generate(BigramStub(table), prompt, drafter, max_new_tokens=30, gamma=2)
        assert runs[merge].tokens == bigram_greedy(table, a, 30) and drafter.lookups > 0
        assert drafter.tree_nodes == (10 if merge else 0)
    assert runs[2].stats.target_forwards < runs[0].stats.target_forwards

    class Counted(OracleDrafter):
        asked = 0

        def draft_best(self, ids, gamma, sampler, nodes):
            self.asked += 1
            return super().draft_best(ids, gamma, sampler, nodes)

    model = Counted(table, None)  # sampling: the model's greedy chain, merged all the same
    generate(BigramStub(table), prompt, LookupFirst(model, merge=2), Sampler(0.1, seed=0), max_new_tokens=30, gamma=2)
    assert model.asked > 0
    with pytest.raises(ValueError, match="merge >= 0"):
        LookupFirst(NgramDrafter(3), merge=-1)


def test_a_model_drafter_after_lookup_rounds_drafts_from_the_sequence_it_is_given():
    """A stand-alone model under LookupFirst: each of its drafts is the model's own greedy chain on
    the sequence so far (a fresh model's argmax), also after rounds that lookup drafted, where its
    cache still holds its own last draft past the tokens that were verified instead."""
    target, model = tiny_decoder("qwen3", seed=3), tiny_decoder("qwen3", seed=4)
    fresh, drafts = tiny_decoder("qwen3", seed=4), []
    draft = ModelDrafter.draft

    def recorded(self, ids, gamma, sampler):
        out = draft(self, ids, gamma, sampler)
        drafts.append((ids.tolist(), out.tokens.tolist()))
        return out

    prompt = [1, 7, 7, 7, 30, 12, 40, 41, 42, 43, 7, 7, 7]
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(ModelDrafter, "draft", recorded)
        drafter = LookupFirst(ModelDrafter(model), merge=0)
        out = generate(target, prompt, drafter, max_new_tokens=40, gamma=3)
    assert out.tokens == generate(target, prompt, max_new_tokens=40).tokens
    assert drafter.lookups > 2 and len(drafts) > 2
    for ids, tokens in drafts:
        chain = generate(fresh, ids, max_new_tokens=len(tokens)).tokens
        assert tokens == chain, (len(ids), tokens, chain)


def test_lookup_first_drafts_its_own_length_where_lookup_matches():
    """LookupFirst's lookups draft `tokens` tokens where the round's gamma is shorter (the model
    drafter keeps gamma), and they are accepted where the output repeats itself: a bigram target's
    greedy output runs into a cycle, which lookup then copies, losslessly."""
    table = bigram_table(50, seed=4)
    target = BigramStub(table)
    asked = []

    class Spy(OracleDrafter):
        def draft(self, ids, gamma, sampler):
            asked.append(gamma)
            return super().draft(ids, gamma, sampler)

    drafter = LookupFirst(Spy(table, 1), tokens=5)
    out = generate(target, [3], drafter, max_new_tokens=60, gamma=2)
    assert out.tokens == bigram_greedy(table, 3, 60)
    s = out.stats
    assert drafter.lookups > 0 and s.lookup_rounds == drafter.lookups  # counted apart from the model's rounds
    assert len(s.drafted_at) <= 2 and s.lookup_drafted > 2 * s.lookup_rounds  # lookups of 5, the model's of 2
    assert s.lookup_accepted > 2 * s.lookup_rounds  # ... accepted past gamma (lookups of 2 accept at most 2)
    assert s.drafted == sum(s.drafted_at) + s.lookup_drafted and s.lookups.startswith("lookup ")
    assert asked and set(asked) <= {1, 2}  # the model drafter's rounds stay at gamma (or the tokens left)
    assert (drafter.longest(2), drafter.longest(7)) == (5, 7)  # what warm_up runs up to
    with pytest.raises(ValueError, match="tokens >= 1"):
        LookupFirst(NgramDrafter(3), tokens=0)


def naive_lookup(seq: list[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup by scanning the whole sequence: the latest earlier occurrence of the last n
    tokens (n from max_ngram down) with gamma tokens after it, else the earliest; what followed it."""
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        begins = [s + n for s in range(L - n) if seq[s : s + n] == seq[L - n :]]
        if begins:
            full = [b for b in begins if b + gamma <= L]
            begin = full[-1] if full else begins[0]
            return seq[begin : begin + gamma]
    return []


@pytest.mark.parametrize("max_ngram, min_ngram", [(3, 1), (3, 2), (4, 4)])
def test_ngram_lookup_indexes_the_sequence_as_it_grows_and_finds_what_a_scan_finds(max_ngram, min_ngram):
    """NgramDrafter's index, fed a sequence a few tokens at a time (as rounds grow it), drafts what
    scanning the whole sequence drafts, at every length and gamma; start() and a shorter sequence
    than the one indexed begin afresh."""
    gen = torch.Generator().manual_seed(0)
    drafter, found = NgramDrafter(max_ngram, min_ngram), 0
    for trial in range(6):
        seq = torch.randint(0, 4 + 2 * trial, (160,), generator=gen)  # small vocabularies: many matches
        L = int(torch.randint(1, 5, (1,), generator=gen))
        if trial % 2:
            drafter.start(seq[:L], 200)
        while L <= len(seq):
            gamma = int(torch.randint(1, 7, (1,), generator=gen))
            want = naive_lookup(seq[:L].tolist(), gamma, max_ngram, min_ngram)
            assert drafter.draft(seq[:L], gamma, Sampler()).tokens.tolist() == want
            found += bool(want)
            L += int(torch.randint(1, 6, (1,), generator=gen))
    assert found > 10  # rounds whose lookup matched: 311, 187 and 15 of 327


def test_stats_count_lookup_rounds_apart_and_add_up():
    """A lookup round goes to the lookup counts, not to the drafter's positions; totals and the
    dict round trip keep them; tau and the acceptance rate count every round."""
    a, b = GenerationStats(new_tokens=9), GenerationStats(new_tokens=4)
    a.record_round(2, 1)
    a.record_round(4, 4, lookup=True)
    a.record_round(4, 0, lookup=True)
    b.record_round(2, 2)
    b.record_round(0, 0)
    t = GenerationStats.total([a, GenerationStats.from_dict(b.to_dict())])
    assert t.drafted_at == [2, 2] and t.accepted_at == [2, 1] and t.acceptance_per_position == [1.0, 0.5]
    assert (t.lookup_rounds, t.lookup_drafted, t.lookup_accepted) == (2, 8, 4)
    assert t.acceptance_rate == 7 / 12 and t.target_forwards == 5 and t.tau == 13 / 5
    assert t.lookups == "lookup 50% of rounds, 2.0 of 4.0 accepted" and b.lookups == ""
    assert GenerationStats.from_dict(a.to_dict()) == a


def test_adaptive_gamma_ignores_rounds_longer_than_gamma():
    """Adaptive gamma follows the drafter's own rounds: a draft longer than gamma (a lookup) neither
    grows nor shrinks it."""
    asked = []

    class Long(OracleDrafter):
        def draft(self, ids, gamma, sampler):
            asked.append(gamma)
            return super().draft(ids, 6, sampler)

    table = bigram_table(50, seed=3)
    out = generate(BigramStub(table), [4], Long(table, None), max_new_tokens=30, gamma=3, adaptive_gamma=True)
    assert out.tokens == bigram_greedy(table, 4, 30)
    assert asked[:3] == [3, 3, 3]


def test_cut_keeps_a_chains_first_tokens_with_their_distributions_and_residual_rows():
    from specdec_runtime.generate import cut

    d = Draft(torch.arange(5), torch.rand(5, 7), torch.rand(1, 6, 3), resume_layer=2)
    c = cut(d, 3)
    assert c.tokens.tolist() == [0, 1, 2] and torch.equal(c.probs, d.probs[:3])
    assert torch.equal(c.residual, d.residual[:, :4]) and c.resume_layer == 2  # the root's row + 3


BATCH_PROMPTS = [[1, 5, 9], [1, 7, 7, 7, 30, 12, 40, 41, 42, 43, 44, 45], [1, 4], [1, 20, 21, 22, 23], [3]]


@pytest.mark.parametrize(
    "kind, overrides",
    [("llama", {}), ("llama", {"num_key_value_heads": 4}), ("qwen2", {"tie_word_embeddings": True}),
     ("mistral", {"sliding_window": 8})],  # the window slides over the padding too
    ids=["llama", "llama-mha", "qwen2-tied", "mistral-window"],
)  # fmt: skip
def test_generate_batch_rows_equal_each_prompt_decoded_alone(kind, overrides):
    """Left-padded rows decode exactly as each prompt alone (generate, itself tested against
    transformers), rows cut after their first stop token while the others go on."""
    target = tiny_decoder(kind, seed=3, **overrides)
    free = [generate(target, p, max_new_tokens=14).tokens for p in BATCH_PROMPTS]
    stop = free[1][4]  # row 1 stops at its 5th token (maybe others too)
    alone = [generate(target, p, max_new_tokens=14, stop_ids={stop}).tokens for p in BATCH_PROMPTS]
    assert len(alone[1]) == 5 and any(len(a) == 14 for a in alone)
    assert generate_batch(target, BATCH_PROMPTS, Sampler(), max_new_tokens=14, stop_ids={stop}, pad_id=0) == alone
    assert generate(target, BATCH_PROMPTS[0], max_new_tokens=14).tokens == free[0]  # left_pad undone for batch 1


def test_generate_batch_samples_each_padded_row_from_the_targets_distribution():
    """Short prompts padded beside a long one: their first two sampled tokens follow the exact joint
    of the target's warped distribution (chi-square over the 9 pairs of top-3 tokens)."""
    hf = tiny_hf_model(seed=4)
    target = runtime_from_hf(hf)
    short, long = [1, 5, 9], [1, 7, 7, 7, 30, 12, 40, 41, 42, 43]
    rows = generate_batch(target, [long] + [short] * 799, Sampler(1.0, top_k=3, seed=0), max_new_tokens=2)

    def next_logits(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1]

    assert_sequences_follow(rows[1:], sequence_joint(next_logits, short, 2, temperature=1.0, top_k=3))


def test_left_padded_batches_refuse_the_fast_path():
    target = tiny_decoder(seed=0)
    target.compile(backend="aot_eager")
    with pytest.raises(SpecdecError, match="eagerly"):
        target.left_pad(torch.tensor([2, 0]))
