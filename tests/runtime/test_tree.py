"""Token trees: construction, the tree-attention forward, and tree verification (greedy, sampled, typical)."""

import itertools
import sys

import pytest
import torch

from specdec_runtime.cpu.host_rules import greedy_on_host
from specdec_runtime.drafters.protocol import Draft, Drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree
from specdec_runtime.verify import verify_tree_greedy, verify_tree_sample, verify_tree_typical
from tests.conftest import (
    BigramStub,
    assert_follows,
    assert_not_follows,
    bigram_greedy,
    bigram_table,
    exact_joint,
    runtime_from_hf,
    tiny_hf_model,
)

generate_module = sys.modules["specdec_runtime.generate"]  # the package exports the function under its name

PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)]


def test_paths_are_ordered_and_indexed_and_bad_trees_are_refused():
    tree = Tree.from_paths([(1, 0), (0,), (1,), (0, 0)])
    assert tree.paths == ((0,), (1,), (0, 0), (1, 0))
    t = tree.tensors
    assert t["parent"].tolist() == [0, 0, 0, 1, 2] and t["depth"].tolist() == [0, 1, 1, 2, 2]
    assert t["ancestor"][4].tolist() == [True, False, True, False, True]
    assert t["earlier"].nonzero().tolist() == [[2, 1]]  # (1,) comes after its sibling (0,)
    assert tree.top_k == [2, 1] and tree.depth == 2
    assert tree.truncated(1).paths == ((0,), (1,))
    with pytest.raises(SpecdecError, match="no parent"):
        Tree.from_paths([(0,), (1, 0)])
    with pytest.raises(SpecdecError, match="at least one node"):
        Tree.from_paths([])


def test_tree_from_accuracies_is_the_best_tree_of_its_budget():
    """Greedy construction against brute force over every prefix-closed node set of the budget."""
    acc = torch.tensor([[0.6, 0.25, 0.1], [0.45, 0.2, 0.1], [0.3, 0.15, 0.1]])
    budget = 5
    every = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    best = 0.0
    for nodes in itertools.combinations(every, budget):
        if all(len(p) == 1 or p[:-1] in nodes for p in nodes):
            best = max(best, Tree.expected_tau(nodes, acc))
    tree = Tree.from_accuracies(acc, budget)
    assert len(tree) == budget
    assert Tree.expected_tau(tree.paths, acc) == pytest.approx(best)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_tree_forward_equals_running_each_branch_as_a_sequence(kind):
    hf = tiny_hf_model(kind, seed=1, num_hidden_layers=2)
    model = runtime_from_hf(hf)
    tree = Tree.from_paths(PATHS)
    prefix = torch.tensor([5, 9, 2, 7, 11, 3])
    g = torch.Generator().manual_seed(0)
    nodes = torch.cat([prefix[-1:], torch.randint(0, 256, (len(tree),), generator=g)])
    model.setup_cache(1, 64)
    model(prefix[None, :-1], 0)
    t = tree.tensors
    P = prefix.shape[0] - 1
    logits = model(nodes[None], P, tree=(t["depth"], t["ancestor"])).logits[0]  # [N+1, V]
    for i in range(len(tree) + 1):
        branch = nodes[t["ancestor"][i]]  # root..node i
        with torch.no_grad():
            ref = hf(torch.cat([prefix[:-1], branch])[None]).logits[0, -1]
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)


def naive_greedy(tree: Tree, nodes: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
    """Per-path greedy verification: the longest branch whose every token is the argmax after its parent."""
    t = tree.tensors
    best = (0, [0])
    for i in range(1, len(tree) + 1):
        branch = t["ancestor"][i].nonzero().flatten().tolist()
        if all(int(logits[branch[j - 1]].argmax()) == int(nodes[branch[j]]) for j in range(1, len(branch))):
            if len(branch) - 1 > best[0]:
                best = (len(branch) - 1, branch)
    return best[1], int(logits[best[1][-1]].argmax())


@pytest.mark.parametrize("seed", range(20))
def test_tree_greedy_verification_equals_naive_per_path_verification(seed):
    g = torch.Generator().manual_seed(seed)
    tree = Tree.from_paths(PATHS)
    N, V = len(tree) + 1, 6
    logits = torch.randn(N, V, generator=g)
    t = tree.tensors
    # Candidates: siblings distinct; about half of them the parent's argmax.
    nodes = torch.zeros(N, dtype=torch.long)
    for i in range(1, N):
        target = int(logits[t["parent"][i]].argmax())
        rank = int(t["rank"][i])
        nodes[i] = (target + rank + (1 if torch.rand(1, generator=g) < 0.4 else 0)) % V
    path, n, token = verify_tree_greedy(tree, nodes, logits)
    branch, nxt = naive_greedy(tree, nodes, logits)
    assert int(n) == len(branch) - 1
    assert path[: int(n) + 1].tolist() == branch and int(token) == nxt
    # the rule on host lists (a CPU's greedy rounds): the same path, the branch's tokens and the target's
    host_path, new = greedy_on_host(tree, nodes[1:].tolist(), logits.argmax(-1).tolist())
    assert host_path == path.tolist() and new == nodes[branch[1:]].tolist() + [nxt]


@pytest.mark.parametrize("seed", range(5))
def test_the_host_walk_is_the_device_walk(seed):
    """verify._walk on a CPU walks the tree's lists (host_rules.walk_on_host), elsewhere its tensors
    (_walk_on_device, what a GPU runs): the same path and length for every choice of nodes, on
    trees of several shapes (ties between equally deep branches: the first in node order)."""
    from specdec_runtime.cpu.host_rules import walk_on_host
    from specdec_runtime.verify import _walk_on_device

    g = torch.Generator().manual_seed(seed)
    for tree in (Tree.from_paths(PATHS), Tree.chain(4), Tree.from_accuracies(torch.rand(3, 3, generator=g), 9)):
        t = tree.tensors
        for _ in range(40):
            chosen = torch.rand(len(tree) + 1, generator=g) < 0.6
            host, device = walk_on_host(tree, chosen), _walk_on_device(t, chosen)
            assert host[0].tolist() == device[0].tolist() and int(host[1]) == int(device[1])
            assert host[0].dtype == device[0].dtype and host[1].dtype == device[1].dtype


class TreeStubDrafter(Drafter):
    """Medusa-like stub: head d's ranked candidates depend only on the newest token (fixed tables)."""

    def __init__(self, tables: list[torch.Tensor], tree: Tree):
        self.tables, self.tree, self.name = tables, tree, "tree-stub"
        self.tree_nodes = len(tree)

    def draft(self, ids, gamma, sampler):
        tree = self.tree.truncated(gamma)
        topk = torch.stack([tab[ids[-1]].argsort(descending=True) for tab in self.tables[: tree.depth]])
        return Draft(tree.candidates(ids[-1], topk)[1:], None, tree=tree)


def test_tree_drafts_are_lossless_greedy_and_accept_more_than_a_chain():
    table = bigram_table(30, seed=4)
    # Head 1 ranks the true successor second half the time; head 2 is noisy.
    noisy = table + torch.randn(30, 30, generator=torch.Generator().manual_seed(1)) * 1.5
    two_step = table.softmax(-1) @ table.softmax(-1)
    tree = Tree.from_paths(PATHS)
    target = BigramStub(table)
    out = generate(target, [3], TreeStubDrafter([noisy, two_step.log(), noisy], tree), max_new_tokens=60, gamma=3)
    assert out.tokens == bigram_greedy(table, 3, 60)
    chain = generate(
        target, [3], TreeStubDrafter([noisy, two_step.log(), noisy], Tree.chain(3)), max_new_tokens=60, gamma=3
    )
    assert chain.tokens == out.tokens and out.stats.tau > chain.stats.tau


@pytest.mark.parametrize("host_rules", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_tree_rejection_sampling_follows_the_target_distribution(monkeypatch, temperature, top_p, host_rules):
    """Four tokens from a bigram target with a branching tree (siblings tried in turn): the joint
    distribution of the output is the target's (chi-square over all 81 sequences), whether the
    rule walks host lists (host_rules.sample_on_host, a CPU's rounds) or runs on the device
    (verify_tree_sample, a GPU's)."""
    monkeypatch.setattr(generate_module, "HOST_RULES", host_rules)
    V = 3
    t_table, d_table = bigram_table(V, seed=10, scale=1.5), bigram_table(V, seed=11, scale=1.5)
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    drafter, target = TreeStubDrafter([d_table, d_table], tree), BigramStub(t_table)
    samples, accepted = [], 0
    for seed in range(4000):
        out = generate(target, [0], drafter, Sampler(temperature, 0, top_p, seed=seed), max_new_tokens=4, gamma=2)
        samples.append(sum(tok * V ** (3 - i) for i, tok in enumerate(out.tokens)))
        accepted += out.stats.accepted
    assert accepted > 2000  # the tree is exercised, rejections included
    w = dict(temperature=temperature, top_p=top_p)
    assert_follows(samples, exact_joint(t_table, 0, 4, **w))
    assert_not_follows(samples, exact_joint(d_table, 0, 4, **w))


class ChainStubDrafter(TreeStubDrafter):
    """The stub's top-1 chain as a plain chain draft (no tree), as prompt lookup drafts."""

    def draft(self, ids, gamma, sampler):
        return super().draft(ids, gamma, sampler)._replace(tree=None)


@pytest.mark.parametrize("kind", ["tree", "chain"])
def test_sampled_rounds_decided_on_the_host_sample_the_device_rules_tokens(monkeypatch, kind):
    """sample_on_host (a CPU's sampled rounds) draws from the sampler's stream as verify_tree_sample
    and verify_sample do: a seed samples the same tokens either way, draft after draft, rejections
    and residual draws included (a rule that differed anywhere would part them within a few seeds)."""
    table = bigram_table(30, seed=4)
    noisy = table + torch.randn(30, 30, generator=torch.Generator().manual_seed(1)) * 1.5
    drafter = (
        TreeStubDrafter([noisy] * 3, Tree.from_paths(PATHS))
        if kind == "tree"
        else ChainStubDrafter([noisy] * 3, Tree.chain(3))
    )
    target, accepted = BigramStub(table), 0
    for seed in range(20):
        runs = []
        for host_rules in (True, False):
            monkeypatch.setattr(generate_module, "HOST_RULES", host_rules)
            runs.append(generate(target, [3], drafter, Sampler(0.8, seed=seed), max_new_tokens=40, gamma=3))
        assert runs[0].tokens == runs[1].tokens
        accepted += runs[0].stats.accepted
    assert 0 < accepted < 20 * 39  # drafts were accepted and rejected


def test_typical_acceptance_accepts_above_the_entropy_scaled_threshold():
    """Root: confident (low entropy), node 1: flat (high entropy). threshold 0.09, alpha 0.3."""
    tree = Tree.from_paths([(0,), (1,), (0, 0)])
    V = 10
    probs = torch.full((4, V), 0.1)  # rows: root, (0,), (1,), (0, 0); flat = entropy log(10)
    probs[0] = torch.tensor([0.5, 0.3, 0.05, 0.05, 0.02, 0.02, 0.02, 0.02, 0.01, 0.01])
    entropy = lambda p: float(-(p * p.log()).sum())  # noqa: E731
    bar_root = min(0.09, 0.3 * torch.exp(torch.tensor(-entropy(probs[0]))).item())  # ~0.09 (confident)
    bar_flat = min(0.09, 0.3 * 0.1)  # 0.03: a flat distribution lowers the bar
    assert bar_root > 0.05 and bar_flat == pytest.approx(0.03)
    sampler = Sampler(1.0, seed=0)
    # (0,) = token 2 (p 0.05 < bar): rejected; (1,) = token 1 (0.3): accepted; (0,0) unreachable.
    path, n, _ = verify_tree_typical(tree, torch.tensor([7, 2, 1, 4]), probs, sampler, threshold=0.09, alpha=0.3)
    assert int(n) == 1 and path[1] == 2
    # (0,) = token 0 (0.5): accepted; under it token 4 has p 0.1 > 0.03 under a flat row: accepted.
    path, n, _ = verify_tree_typical(tree, torch.tensor([7, 0, 1, 4]), probs, sampler, threshold=0.09, alpha=0.3)
    assert int(n) == 2 and path.tolist() == [0, 1, 3]
    # Both depth-1 candidates pass and neither has children accepted: the better-ranked one wins.
    probs[1, 4] = 0.01
    path, n, _ = verify_tree_typical(tree, torch.tensor([7, 1, 0, 4]), probs, sampler, threshold=0.09, alpha=0.3)
    assert int(n) == 1 and path[1] == 1
    # An exact sampler would have rejected the low-probability branch that typical acceptance keeps.
    accepts = sum(
        int(verify_tree_sample(tree, torch.tensor([7, 8, 9, 4]), probs, Sampler(1.0, seed=s))[1]) for s in range(200)
    )
    assert accepts < 20  # p(8) + p(9) after the root is 0.02


def test_typical_acceptance_is_lossy_and_only_applies_when_sampling():
    table = bigram_table(20, seed=3)
    target = BigramStub(table)
    tree = Tree.from_paths(PATHS)
    drafter = TreeStubDrafter([table, table, table], tree)
    greedy = generate(target, [1], drafter, max_new_tokens=30, gamma=3, typical=(0.09, 0.3))
    assert greedy.tokens == bigram_greedy(table, 1, 30)  # greedy stays exact


@pytest.mark.parametrize("bad", [[(0,), (0, 0, 0)], [(-1,)]])
def test_invalid_paths(bad):
    with pytest.raises(SpecdecError):
        Tree.from_paths(bad)


def test_a_truncated_tree_is_one_object_so_its_tensors_move_once():
    """Near max_new_tokens a Medusa drafter truncates its tree every round; on a GPU each new Tree's
    tensors were copied there again, a host sync each (the H200's sync count found them)."""
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    assert tree.truncated(3) is tree and tree.truncated(2) is tree.truncated(2)
    assert tree.truncated(2).paths == ((0,), (1,), (0, 0), (0, 1)) and tree.truncated(1).paths == ((0,), (1,))
    meta = torch.device("meta")
    assert tree.truncated(2).tensors_on(meta) is tree.truncated(2).tensors_on(meta)
