"""Verification over host lists: the rules of verify.py for a CPU's rounds, where the device is the
host and a dozen small tensor ops, cold after the target's weight stream, cost more than Python
lists (docs/log/cpu-kernel.md). The generate loop decides a CPU's rounds with them
(generate.decide_on_host); every other device keeps verify.py's device rules.

    path, new = greedy_on_host(tree, tokens, choice)           # the greedy rules over host lists
    path, new = sample_on_host(tree, tokens, logits, sampler)  # sampling's, warping only the rows it walks
"""

import torch
from torch import Tensor

from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree


def walk_on_host(tree: Tree, chosen: Tensor) -> tuple[Tensor, Tensor]:
    """verify._walk on a CPU: (path [D+1], accept_len) of the deepest node whose ancestors are all chosen."""
    path, n = deepest(tree, chosen.tolist())
    return torch.tensor(path), torch.tensor(n)


def deepest(tree: Tree, ok: list) -> tuple[list[int], int]:
    """_walk over host lists: ok [N+1] whether each node is chosen (the root's entry is not read)."""
    parent, depth = tree.structure
    reached, last = [True] + [False] * len(tree), 0
    for i in range(1, len(reached)):  # parents come before their children
        reached[i] = bool(ok[i]) and reached[parent[i]]
        if reached[i] and depth[i] > depth[last]:
            last = i
    n = depth[last]
    path = [0] * (tree.depth + 1)
    for d in range(n, 0, -1):
        path[d], last = last, parent[last]
    return path, n


def greedy_on_host(tree: Tree | None, tokens: list[int], choice: list[int]) -> tuple[list[int], list[int]]:
    """Greedy verification on the host, where the target's forward computed its argmax on a CPU:
    the draft's tokens [N] (a chain, or the nodes of `tree`) and the target's choice after the
    root and after each of them [N + 1], as lists. Returns (path, new): the accepted branch as
    node indices per depth, root first (as Verdict.path, entries past the accepted length
    pointing at the root), and its accepted tokens followed by the target's own.
    verify_greedy's and verify_tree_greedy's rule, over Python lists: on a CPU the device is the
    host, and the rule's and the loop's dozen tensor ops, cold after the target's weight stream,
    cost more than the lists (docs/log/cpu-kernel.md)."""
    if tree is None:
        n = 0
        while n < len(tokens) and tokens[n] == choice[n]:
            n += 1
        return list(range(len(tokens) + 1)), tokens[:n] + [choice[n]]
    parent = tree.structure[0]
    path, n = deepest(tree, [True] + [tokens[i - 1] == choice[parent[i]] for i in range(1, len(parent))])
    return path, [tokens[i - 1] for i in path[1 : n + 1]] + [choice[path[n]]]


def sample_on_host(
    tree: Tree | None, tokens: list[int], logits: Tensor, sampler: Sampler
) -> tuple[list[int], list[int]]:
    """Lossless verification of a deterministic draft for a sampler on a CPU: the draft's tokens
    [N] (a chain, or the nodes of `tree`) and the target's logits after the root and after each of
    them [N + 1, V]. verify_tree_sample's rule (for a chain, verify_sample's with a one-hot
    proposal), walked from the root: at each node, its children are tried best-first, child c
    accepted with probability p(c) / (1 - the mass of the siblings rejected before it); where all
    are rejected, or at a leaf, the next token is drawn from p less the rejected children. Only the
    rows the walk reaches are warped, where the device rules warp every row and run a dozen [N + 1,
    V] tensor ops (docs/log/cpu-kernel.md). Returns (path, new): the accepted nodes, root first, and their tokens
    followed by the target's."""
    parent = tree.structure[0] if tree is not None else list(range(-1, len(tokens)))
    # u[c]: node c's acceptance draw, drawn as the device rules draw them (a tree: one a node, the
    # root's unused; a chain: one a token), so that a seed samples the same tokens either way
    u = sampler.uniform(len(tokens) + (tree is not None), logits.device).tolist()
    u = u if tree is not None else [0.0] + u
    path = [0]
    while True:
        node = path[-1]
        p = sampler.probs(logits[node])
        children = [c for c in range(node + 1, len(parent)) if parent[c] == node]  # best-first: ranks ascend
        tried = 0.0
        for c, p_c in zip(children, p[[tokens[c - 1] for c in children]].tolist() if children else ()):
            if u[c] * max(1.0 - tried, 0.0) < p_c:  # u < p(c) / (1 - tried) without dividing
                path.append(c)
                break
            tried += p_c
        else:
            if children:  # each was tried and rejected: the residual (p entirely on them: probability 0)
                rest = p.index_fill(0, torch.tensor([tokens[c - 1] for c in children]), 0.0)
                p = rest if rest.sum() > 0 else p
            return path, [tokens[c - 1] for c in path[1:]] + [int(sampler.sample(p))]
