"""SpecTr (specdec_runtime.spectr, drafters/multi.py) against its oracles: one level's k-sequential
selection gives tokens distributed as the target's p (chi-square) and accepts a draw as often as
the paper's closed form 1 - (1 - beta)^k says; at k = 1 it is speculative sampling; decoding with
k sampled sequences per round follows the target's distribution over whole sequences, and greedy
decoding is unchanged."""

import pytest
import torch

from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.medusa import MedusaDrafter
from specdec_runtime.drafters.multi import MultiDraft, merge_sequences
from specdec_runtime.drafters.protocol import Draft
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.generate import generate
from specdec_runtime.sampling import Sampler
from specdec_runtime.spectr import _needed, k_sequential, selection_rate
from specdec_runtime.tree import Tree
from tests.conftest import assert_follows, assert_not_follows, assert_sequences_follow, sequence_joint, tiny_decoder
from tests.runtime.test_eagle3 import tiny as eagle3_tiny
from tests.runtime.test_medusa import PATHS, random_heads

P = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05, 0.0])
Q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.2, 0.1])  # the drafter's: far from p, and proposes a token p never takes


@pytest.mark.parametrize("k", [1, 2, 4])
def test_one_level_gives_the_targets_distribution_and_accepts_as_the_closed_form_says(k):
    sampler = Sampler(1.0, seed=k)
    g = torch.Generator().manual_seed(100 + k)
    rho, beta = selection_rate(P, Q, k)
    assert float(rho) >= float(_needed(beta.view(1), k)[0]) - 1e-9  # the residual is a distribution
    if k == 1:
        assert float(rho) == 1.0 and float(beta) == pytest.approx(float(torch.minimum(P, Q).sum()))
    tokens, accepted, n = [], 0, 3000
    for _ in range(n):
        draws = torch.multinomial(Q, k, replacement=True, generator=g)
        token, first = k_sequential(P, Q, draws, sampler)
        tokens.append(int(token))
        accepted += int(first) < k
    assert_follows(tokens, P)
    expected = 1 - (1 - float(beta)) ** k
    assert abs(accepted / n - expected) < 4 * (expected * (1 - expected) / n) ** 0.5, (accepted / n, expected)
    assert_not_follows(tokens, Q)  # (the test has power)


def test_more_drafts_accept_more_often():
    rates = [1 - (1 - float(selection_rate(P, Q, k)[1])) ** k for k in (1, 2, 4, 8)]
    assert rates == sorted(rates) and rates[-1] > rates[0] + 0.2


def test_sequences_merge_into_one_tree_with_each_ones_nodes():
    V = 4
    q = torch.eye(V)
    drafts = [Draft(torch.tensor(t), q[t]) for t in ([1, 2, 3], [1, 0, 0], [2, 2, 2], [1, 2, 0])]
    d = merge_sequences(drafts)
    # nodes by depth: 1, 2 | 1-2, 1-0, 2-2 | 1-2-3, 1-0-0, 2-2-2, 1-2-0
    assert d.tokens.tolist() == [1, 2, 2, 0, 2, 3, 0, 0, 2]
    assert d.chains.tolist() == [[1, 3, 6], [1, 4, 8], [2, 5, 9], [1, 3, 7]]
    assert torch.equal(d.probs, q[d.tokens])  # each node's own draw distribution (here: one-hot of its token)


@pytest.mark.parametrize("kind", ["model", "eagle3", "medusa"])
def test_decoding_with_k_sequences_follows_the_targets_distribution(kind):
    """Three tokens after a prompt, 4 sampled sequences of 2 a round: the exact joint of the target's
    warped distribution over the 27 sequences of top-3 tokens (chi-square), greedy output unchanged."""
    if kind == "model":
        hf_target = None
        target, draft_model = tiny_decoder(seed=4, vocab_size=16), tiny_decoder(seed=5, vocab_size=16)
        drafter = MultiDraft(ModelDrafter(draft_model), 4)
    elif kind == "eagle3":
        hf_target, target, model = eagle3_tiny(vocab=16, draft_vocab=12)
        drafter = MultiDraft(Eagle3Drafter(model, target, cpu_bf16=False), 4)
    else:  # the heads' sampled paths
        target = tiny_decoder(seed=4, vocab_size=16)
        drafter = MultiDraft(MedusaDrafter(random_heads(64, 16), target, Tree.from_paths(PATHS)), 4)
    prompt = [1, 2, 3, 4]
    runs = [generate(target, prompt, drafter, Sampler(1.0, top_k=3, seed=i), max_new_tokens=3, gamma=2)
            for i in range(600)]  # fmt: skip
    assert sum(r.stats.accepted for r in runs) > 0

    def next_logits(ids):
        target.setup_cache(1, len(ids))
        return target.prefill(torch.tensor([ids])).logits[0, -1]

    assert_sequences_follow([r.tokens for r in runs], sequence_joint(next_logits, prompt, 3, temperature=1.0, top_k=3))
    greedy = generate(target, prompt, drafter, max_new_tokens=12, gamma=3)
    assert greedy.tokens == generate(target, prompt, max_new_tokens=12).tokens
