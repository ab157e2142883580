"""Sampling and verification math against oracles: transformers' warpers, exact distributions."""

import pytest
import torch

from specdec_runtime.cpu.host_rules import greedy_on_host
from specdec_runtime.errors import SpecdecError
from specdec_runtime.sampling import Sampler, warp
from specdec_runtime.tree import Tree
from specdec_runtime.verify import (
    verify_greedy,
    verify_rows_sample,
    verify_rows_tree_sample,
    verify_sample,
    verify_tree_greedy,
    verify_tree_sample,
    verify_tree_typical,
)
from tests.conftest import assert_follows, assert_not_follows


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.6, 10, 0.9)]
)
def test_warp_matches_transformers_logits_processors(temperature, top_k, top_p):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    procs = [TemperatureLogitsWarper(temperature)]
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        procs.append(TopPLogitsWarper(top_p))
    expected = LogitsProcessorList(procs)(None, logits.clone()).softmax(-1)
    torch.testing.assert_close(warp(logits, temperature, top_k, top_p), expected)


def test_sampler_draws_follow_the_distribution():
    """One row, and rows of unnormalized weights (a residual max(0, p - q) is sampled as it is) with
    zero weights first, inside and last: draws follow each row's distribution, never a zero."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    sampler = Sampler(1.0, seed=0)
    draws = [int(sampler.sample(probs)) for _ in range(8000)]
    assert_follows(draws, probs)
    assert_not_follows(draws, torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2]))
    weights = torch.tensor([[0.0, 0.3, 0.0, 0.05, 0.15, 0.0], [0.02, 0.0, 0.0, 0.0, 0.01, 0.0]])  # [2, V]
    rows = torch.stack([sampler.sample(weights) for _ in range(8000)])  # [8000, 2]
    assert rows.shape == (8000, 2)
    for r in range(2):
        assert_follows(rows[:, r].tolist(), weights[r])


def test_sampler_rejects_bad_settings():
    for kwargs, msg in [({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k")]:
        with pytest.raises(SpecdecError, match=msg):
            Sampler(**kwargs)


def one_hot_logits(tokens: list[int], V: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float() * 5


@pytest.mark.parametrize(
    "draft, target_choice, n, bonus",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted, bonus from the last position
        ([1, 2, 3], [7, 2, 3, 4], 0, 7),  # first wrong: the target's own token instead
        ([1, 2, 3], [1, 2, 9, 4], 2, 9),  # partly right
        ([5], [5, 6], 1, 6),
    ],
)
def test_verify_greedy(draft, target_choice, n, bonus):
    path, got_n, got_token = verify_greedy(torch.tensor(draft), one_hot_logits(target_choice))
    assert (int(got_n), int(got_token)) == (n, bonus)
    # the rule on host lists (a CPU's greedy rounds): the same path, the accepted tokens and the target's
    assert greedy_on_host(None, draft, target_choice) == (path.tolist(), draft[:n] + [bonus])


def test_verify_greedy_accepts_only_a_prefix():
    """A later match after a mismatch must not count (the output would not be the target's)."""
    _, n, token = verify_greedy(torch.tensor([1, 9, 3]), one_hot_logits([1, 2, 3, 4]))
    assert (int(n), int(token)) == (1, 2)
    assert greedy_on_host(None, [1, 9, 3], [1, 2, 3, 4]) == ([0, 1, 2, 3], [1, 2])


def test_greedy_on_host_without_a_draft_takes_the_targets_token():
    assert greedy_on_host(None, [], [7]) == ([0], [7])


def speculative_first_token(p: torch.Tensor, q: torch.Tensor | None, trials: int, seed: int) -> tuple[list[int], float]:
    """First token emitted by one speculative round with a one-token draft from q (None: always
    token 0, a deterministic drafter). Returns the tokens and the acceptance rate."""
    sampler = Sampler(1.0, seed=seed)
    out, accepted = [], 0
    for _ in range(trials):
        draft = sampler.sample(q)[None] if q is not None else torch.tensor([0])
        _, n, token = verify_sample(draft, None if q is None else q[None], torch.stack([p, p]), sampler)
        out.append(int(draft[0]) if int(n) == 1 else int(token))
        accepted += int(n)
    return out, accepted / trials


@pytest.mark.parametrize("case", ["skewed", "disjoint-support", "deterministic-drafter"])
def test_rejection_sampling_output_follows_the_target(case):
    p = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1, 0.0])
    q = {
        "skewed": torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1]),
        "disjoint-support": torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5]),  # overlaps only on token 4
        "deterministic-drafter": None,
    }[case]
    tokens, rate = speculative_first_token(p, q, trials=6000, seed=1)
    assert_follows(tokens, p)
    if q is not None:
        assert_not_follows(tokens, q)
        # Leviathan et al.: the acceptance rate is sum_x min(p(x), q(x)).
        assert abs(rate - torch.minimum(p, q).sum().item()) < 0.03


def test_rejection_sampling_when_draft_equals_target_accepts_everything():
    p = torch.tensor([0.1, 0.6, 0.3])
    _, rate = speculative_first_token(p, p.clone(), trials=500, seed=2)
    assert rate == 1.0


class Scripted(Sampler):
    """Uniform draws from a script, in order; a draw of the next token records the (normalized)
    distribution it is drawn from and returns its argmax."""

    def __init__(self, draws: torch.Tensor):
        super().__init__(1.0)
        self.draws, self.rows = draws, []

    def uniform(self, n, device):
        out, self.draws = self.draws[:n], self.draws[n:]
        return out

    def sample(self, probs):
        self.rows.append(probs / probs.sum(-1, keepdim=True))
        return probs.argmax(-1)


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-drafts", "deterministic-drafts"])
def test_a_batchs_rows_decide_as_each_row_alone(deterministic):
    """verify_rows_sample against verify_sample row by row, with the same uniform draws: the same
    accepted lengths, and the same distribution for the token after them (ragged lengths, a row
    that accepts its whole draft, a row rejected at its first token, a row that drafted nothing)."""
    torch.manual_seed(0)
    B, g, V = 6, 4, 7
    lengths = [4, 2, 0, 3, 4, 1]
    p = torch.rand(B, g + 1, V).pow(3).softmax(-1)
    q = None if deterministic else torch.rand(B, g, V).pow(3).softmax(-1)
    drafts = torch.randint(V, (B, g))
    u = torch.rand(B, g)
    u[0] = 0.0  # row 0: every draft token accepted (p > 0 everywhere)
    u[4, 0] = 1.0 - 1e-7  # row 4: u * q < p fails where q >= p ...
    if q is not None:
        q[4, 0] = 0.0
        q[4, 0, drafts[4, 0]] = 1.0  # ... which it is here (q one-hot at the token, p below 1)
    batch = Scripted(u.flatten())
    n, _ = verify_rows_sample(drafts, torch.tensor(lengths), q, p, batch)
    for b, k in enumerate(lengths):
        alone = Scripted(u[b, :k])
        verdict = verify_sample(drafts[b, :k], None if q is None else q[b, :k], p[b, : k + 1], alone)
        assert int(n[b]) == int(verdict.accept_len), b
        torch.testing.assert_close(batch.rows[0][b], alone.rows[0], rtol=0, atol=1e-6)
    assert int(n[0]) == 4 and int(n[2]) == 0 and (int(n[4]) == 0 or deterministic)


def test_a_batchs_trees_decide_as_each_tree_alone():
    """verify_rows_tree_sample against verify_tree_sample row by row, with the same uniform draws:
    the same accepted lengths and branches, and the same distribution for the token after them, for
    rows with trees of different shapes (and depths) whose nodes are their parents' top tokens, so
    that rounds end at every depth, on a rejected root, a rejected inner node and a whole branch."""
    shapes = [
        [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)],
        [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 1), (0, 0, 1)],
        [(0,), (1,), (2,), (0, 0), (1, 0), (2, 0)],
    ]
    trees = [Tree.from_paths(paths) for paths in shapes]
    T, D, V, B = 7, max(t.depth for t in trees), 9, len(trees)
    batch_tree = {k: torch.stack([t.tensors[k] for t in trees]) for k in ("parent", "depth", "ancestor", "earlier")}
    batch_tree["levels"] = torch.arange(D + 1)
    seen = set()
    for trial in range(40):
        gen = torch.Generator().manual_seed(trial)
        probs = (torch.randn(B, T, V, generator=gen) * (1 + trial % 4)).softmax(-1)  # flat to peaked
        nodes = torch.zeros(B, T, dtype=torch.long)
        for b, tree in enumerate(trees):  # each node: its parent's rank-th likeliest token (siblings distinct)
            parent, rank = tree.tensors["parent"], tree.tensors["rank"]
            for i in range(1, T):
                nodes[b, i] = probs[b, parent[i]].argsort(descending=True)[rank[i]]
        u = torch.rand(B, T, generator=gen)
        batch = Scripted(u.flatten())
        n, _, path = verify_rows_tree_sample(nodes, batch_tree, probs, batch)
        for b, tree in enumerate(trees):
            alone = Scripted(u[b])
            verdict = verify_tree_sample(tree, nodes[b], probs[b], alone)
            k = int(verdict.accept_len)
            assert int(n[b]) == k, (trial, b)
            assert path[b, : k + 1].tolist() == verdict.path[: k + 1].tolist(), (trial, b)
            torch.testing.assert_close(batch.rows[0][b], alone.rows[0], rtol=0, atol=1e-6)
            seen.add((b, k))
    assert {k for _, k in seen} >= {0, 1, 2, 3}, seen  # rounds ended at every depth


def test_a_batchs_rows_follow_the_target():
    """Sampled rows through verify_rows_sample: each row's first token (a draft token, accepted, or
    the target's own) follows that row's target distribution (chi-square), for rows whose drafters
    disagree with it in different ways."""
    p = torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1, 0.0], [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]])
    q = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.1, 0.1], [0.0, 0.0, 0.0, 0.0, 0.5, 0.5]])
    sampler, trials = Sampler(1.0, seed=3), 4000
    drafts = sampler.sample(q[:, None].expand(2, trials, -1)).T  # [trials, 2]
    firsts = [[], []]
    for t in range(trials):
        d = drafts[t][:, None]  # [2, 1]
        n, token = verify_rows_sample(d, torch.tensor([1, 1]), q[:, None], p[:, None].expand(2, 2, -1), sampler)
        for b in range(2):
            firsts[b].append(int(d[b, 0]) if int(n[b]) == 1 else int(token[b]))
    for b in range(2):
        assert_follows(firsts[b], p[b])


class NoGenerator(Sampler):
    """Draws from torch's default stream: meta tensors have no generator of their own."""

    def generator(self, device):
        return None


def test_no_rule_reads_a_value_on_the_host():
    """The generate loop syncs with the host once a round, after verification; every rule keeps its
    values on the device until then (on an H200, x[n] with a 0-dim tensor n cost a sync a round).
    Meta tensors have shapes and no values, so any read on the host raises: x[n], a boolean mask,
    .item(), .tolist(). A verdict with the right shapes is all a rule can return here."""
    meta, V, g = torch.device("meta"), 50, 3
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    N = len(tree)
    sampler = NoGenerator(0.8)
    logits, probs = torch.empty(N + 1, V, device=meta), torch.empty(N + 1, V, device=meta)
    chain, nodes = torch.empty(g, dtype=torch.long, device=meta), torch.empty(N + 1, dtype=torch.long, device=meta)
    verdicts = [
        verify_greedy(chain, logits[: g + 1]),
        verify_sample(chain, None, probs[: g + 1], sampler),
        verify_sample(chain, probs[:g], probs[: g + 1], sampler),
        verify_tree_greedy(tree, nodes, logits),
        verify_tree_sample(tree, nodes, probs, sampler),
        verify_tree_typical(tree, nodes, probs, sampler, threshold=0.09, alpha=0.3),
    ]
    for v, depth in zip(verdicts, [g] * 3 + [tree.depth] * 3):
        assert v.path.shape == (depth + 1,) and v.accept_len.shape == () and v.token.shape == ()
    B, lengths = 4, torch.empty(4, dtype=torch.long, device=meta)
    rows = torch.empty(B, g, dtype=torch.long, device=meta)
    for q in (None, torch.empty(B, g, V, device=meta)):
        n, token = verify_rows_sample(rows, lengths, q, torch.empty(B, g + 1, V, device=meta), sampler)
        assert n.shape == token.shape == (B,)
    row_tree = {k: v.to(meta).expand(B, *v.shape) for k, v in tree.tensors.items() if k != "levels"}
    row_tree["levels"] = tree.tensors["levels"].to(meta)
    row_nodes = torch.empty(B, N + 1, dtype=torch.long, device=meta)
    n, token, path = verify_rows_tree_sample(row_nodes, row_tree, torch.empty(B, N + 1, V, device=meta), sampler)
    assert n.shape == token.shape == (B,) and path.shape == (B, tree.depth + 1)
