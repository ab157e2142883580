"""The phrase table: built like the naive walk over every occurrence, drafted by LookupFirst
between prompt lookup and the model, lossless greedy and sampled."""

import random
import sys
from collections import Counter

import pytest
import torch

from specdec_runtime.drafters.lookup import LookupFirst
from specdec_runtime.drafters.phrases import PhraseTable
from specdec_runtime.drafters.protocol import Draft, Drafter
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.generate import generate
from specdec_runtime.sampling import Sampler
from tests.conftest import BigramStub, assert_follows, bigram_table, exact_joint, tiny_decoder


def as_dict(table: PhraseTable) -> dict[tuple[int, ...], list[int]]:
    return {k: table.chains[row, :g].tolist() for k, (row, g) in table.rows.items()}


def naive(seqs, n=4, longest=8, shortest=3, support=2, share=0.5):
    """Every n-gram's occurrences found by scanning, then the majority walk over them."""
    out = {}
    grams = {tuple(s[i - n : i]) for s in seqs for i in range(n, len(s))}
    for key in grams:
        alive = [(s, i) for s in seqs for i in range(n, len(s)) if tuple(s[i - n : i]) == key]
        if len(alive) < support:
            continue
        chain = []
        for j in range(longest):
            counts = Counter(s[i + j] for s, i in alive if i + j < len(s))
            if not counts:
                break
            token, c = max(counts.items(), key=lambda kv: (kv[1], -list(counts).index(kv[0])))
            if c < support or c < share * len(alive):
                break
            chain.append(token)
            alive = [(s, i) for s, i in alive if i + j < len(s) and s[i + j] == token]
        if len(chain) >= shortest:
            out[key] = chain
    return out


def test_a_phrase_is_continued_as_most_of_its_occurrences_go_on():
    seqs = [
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
        [1, 2, 3, 4, 5, 6, 7, 0],  # leaves at the 4th token: 8 still has 2 of 3
        [9, 9, 1, 2, 3, 4, 5, 6],  # ends after 6
        [7, 7, 7, 7, 1],  # (7, 7, 7, 7) once: no support
    ]
    table = as_dict(PhraseTable.build(seqs))
    assert table[(1, 2, 3, 4)] == [5, 6, 7, 8, 9]  # 4/4, 4/4, 3/4, then 2 of 3, 2 of 2
    assert table[(2, 3, 4, 5)] == [6, 7, 8, 9]
    assert (3, 4, 5, 6) in table and table[(3, 4, 5, 6)] == [7, 8, 9]
    assert (4, 5, 6, 7) not in table  # [8, 9]: shorter than 3 is left to the model
    assert (7, 7, 7, 7) not in table


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_equals_the_naive_walk(seed):
    rng = random.Random(seed)
    motifs = [[rng.randrange(6) for _ in range(rng.randrange(5, 12))] for _ in range(4)]
    seqs = []
    for _ in range(30):  # repeated motifs with noise: phrases that recur, mostly alike
        seq = []
        for _ in range(rng.randrange(1, 4)):
            seq += [t if rng.random() > 0.1 else rng.randrange(6) for t in rng.choice(motifs)]
        seqs.append(seq)
    table = PhraseTable.build(seqs)
    assert as_dict(table) == naive(seqs) and len(table) > 5


def test_save_load_and_get(tmp_path):
    table = PhraseTable.build([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]] * 2)
    table.save(tmp_path / PhraseTable.FILE)
    loaded = PhraseTable.load(tmp_path / PhraseTable.FILE)
    assert as_dict(loaded) == as_dict(table)
    assert loaded.get([0, 1, 2, 3, 4]).tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert loaded.get([0, 1, 2, 3, 4], limit=3).tolist() == [5, 6, 7]
    assert loaded.get([4, 3, 2, 1]) is None and loaded.get([1, 2]) is None


class Counting(PhraseTable):
    def __init__(self, table):
        super().__init__(table.keys, table.chains)
        self.hits = 0

    def get(self, seq, limit=None):
        chain = super().get(seq, limit)
        self.hits += chain is not None
        return chain


@pytest.mark.parametrize("whose", ["the target's", "a garbled"])
def test_lookup_first_drafts_the_table_where_the_prompt_does_not_match_and_stays_lossless(whose):
    """A table of the target's own greedy continuation of the prompt (twice), or of that
    continuation with every 5th token changed: LookupFirst drafts from it (the prompt has no
    repeats to look up at first), the model where neither matches, and the output is the target's
    greedy output either way."""
    target = tiny_decoder("llama", seed=0, num_hidden_layers=2)
    prompt = [5, 6, 11, 13]
    ar = generate(target, prompt, max_new_tokens=60)
    said = prompt + [t if i % 5 or whose == "the target's" else t + 1 for i, t in enumerate(ar.tokens)]
    table = Counting(PhraseTable.build([said, said]))
    drafter = LookupFirst(ModelDrafter(tiny_decoder("llama", seed=1)), table=table)
    out = generate(target, prompt, drafter, max_new_tokens=60, gamma=2)
    assert out.tokens == ar.tokens and drafter.name == "model+lookup+phrases"
    assert table.hits > 0 and drafter.lookups >= table.hits
    if whose == "the target's":  # every round from the table, every chain right (autoregressive: 60 forwards)
        assert out.stats.target_forwards <= 10
    else:
        assert out.stats.rounds_with_draft > drafter.lookups  # the model drafted the rest


def test_table_drafts_follow_the_target_distribution_when_sampling():
    """Three sampled tokens after [0, 1, 2, 0] from a bigram target: after the first, the table
    proposes a fixed chain (a point mass; the prompt has no 3-token repeat to look up), and the
    output's joint distribution is still the target's (chi-square over all 27 sequences)."""
    V = 3
    t_table, d_table = bigram_table(V, seed=10, scale=1.5), bigram_table(V, seed=11, scale=1.5)
    keys = torch.tensor([[1, 2, 0, x] for x in range(V)])
    table = Counting(PhraseTable(keys, torch.tensor([[1, 2, 0], [0, 0, 1], [2, 1, 2]])))
    samples = []
    for seed in range(3000):
        drafter = LookupFirst(ModelDrafter(BigramStub(d_table)), min_ngram=3, table=table)
        out = generate(BigramStub(t_table), [0, 1, 2, 0], drafter, Sampler(1.0, seed=seed), max_new_tokens=3, gamma=2)
        a, b, c = out.tokens
        samples.append(a * V * V + b * V + c)
    assert table.hits == 3000
    assert_follows(samples, exact_joint(t_table, 0, 3, temperature=1.0, top_k=0, top_p=1.0))


class Guess(Drafter):
    """A deterministic model drafter: the same chain every round (probs None, as an EAGLE-3 tree's)."""

    name = "guess"

    def __init__(self, chain: list[int]):
        self.chain, self.calls = torch.tensor(chain), 0

    def draft(self, ids, gamma, sampler):
        self.calls += 1
        return Draft(self.chain[:gamma], None)


@pytest.mark.parametrize("host_rules", [True, False])
def test_merged_table_and_model_drafts_follow_the_target_distribution_when_sampling(host_rules, monkeypatch):
    """As above, with the model's 2 tokens merged into the table's chain (one tree of two branches
    from the root, LookupFirst(merge=2)), on the host's and the device's rules: the joint
    distribution of the three sampled tokens is still the target's."""
    monkeypatch.setattr(sys.modules["specdec_runtime.generate"], "HOST_RULES", host_rules)
    V = 3
    t_table = bigram_table(V, seed=10, scale=1.5)
    keys = torch.tensor([[1, 2, 0, x] for x in range(V)])
    table = Counting(PhraseTable(keys, torch.tensor([[1, 2, 0], [0, 0, 1], [2, 1, 2]])))
    samples, model = [], Guess([2, 1])
    for seed in range(3000):
        drafter = LookupFirst(model, min_ngram=3, table=table, merge=2)
        out = generate(BigramStub(t_table), [0, 1, 2, 0], drafter, Sampler(1.0, seed=seed), max_new_tokens=3, gamma=2)
        a, b, c = out.tokens
        samples.append(a * V * V + b * V + c)
    assert table.hits == 3000 and model.calls == 3000  # every second round merged
    assert_follows(samples, exact_joint(t_table, 0, 3, temperature=1.0, top_k=0, top_p=1.0))
