"""SpecTr's drafts (Sun et al. 2023): k sequences sampled independently by one drafter, merged into
one tree for one target forward; sampled verification selects among them level by level
(specdec_runtime.spectr). Greedy decoding, and k = 1, draft as the drafter alone.

    drafter = MultiDraft(eagle3_drafter, k=4)       # specdec generate --drafts 4 --temperature 1
"""

import torch
from torch import Tensor

from specdec_runtime.drafters.protocol import Draft, Drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree

MAX_DEPTH = 16  # the deepest sequence the target's cache reserves slots for


class MultiDraft(Drafter):
    """k i.i.d. draft sequences of a sampling drafter (Drafter.samples) as one tree (module docstring)."""

    def __init__(self, drafter: Drafter, k: int):
        if k < 1:
            raise SpecdecError(f"--drafts must be >= 1 (sequences drafted a round), got {k}")
        if drafter.tree_nodes and type(drafter).samples is Drafter.samples:
            raise SpecdecError(f"--drafts {k}: '{drafter.name}' drafts trees; SpecTr draws chains (--tree chain)")
        self.drafter, self.k = drafter, k
        self.name, self.gamma = f"{drafter.name} x{k}", drafter.gamma
        self.hidden_layers = drafter.hidden_layers
        # the sequences' nodes, written past the sequence (or the drafter's own tree: Medusa's)
        self.tree_nodes = max(k * MAX_DEPTH if k > 1 else 0, drafter.tree_nodes)

    def start(self, prompt: Tensor, capacity: int) -> None:
        self.drafter.start(prompt, capacity)

    def observe(self, hidden: Tensor) -> None:
        self.drafter.observe(hidden)

    def observe_tokens(self, tokens: list[int]) -> None:
        self.drafter.observe_tokens(tokens)

    def pass_round(self) -> None:
        self.drafter.pass_round()

    def longest(self, gamma: int) -> int:
        return self.drafter.longest(gamma)

    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        if sampler.greedy or self.k == 1:
            return self.drafter.draft(ids, gamma, sampler)
        return merge_sequences(self.drafter.samples(ids, min(gamma, MAX_DEPTH), sampler, self.k))


def merge_sequences(drafts: list[Draft]) -> Draft:
    """One tree of k sampled chains (cut to the shortest): a node per distinct prefix, siblings in
    the order the sequences first reach them; probs [N, V] the distribution each node was drawn
    from; chains [k, g] each sequence's node per depth (one host read of the tokens)."""
    g = min(d.tokens.shape[0] for d in drafts)
    if g == 0 or any(d.probs is None for d in drafts):  # (a deterministic drafter's k drafts are one)
        return drafts[0]
    host = torch.stack([d.tokens[:g] for d in drafts]).tolist()
    ranks: dict[tuple[int, ...], tuple[int, ...]] = {(): ()}  # token prefix -> rank path
    children: dict[tuple[int, ...], int] = {}
    first: dict[tuple[int, ...], tuple[int, int]] = {}  # token prefix -> (sequence, depth) that drew it first
    for j, seq in enumerate(host):
        for d in range(1, g + 1):
            prefix = tuple(seq[:d])
            if prefix not in ranks:
                up = ranks[prefix[:-1]]
                ranks[prefix] = up + (children.get(up, 0),)
                children[up] = children.get(up, 0) + 1
                first[prefix] = (j, d - 1)
    tree = Tree.from_paths([r for p, r in ranks.items() if p])
    node = {path: i + 1 for i, path in enumerate(tree.paths)}
    prefixes = sorted(first, key=lambda p: node[ranks[p]])  # in the tree's node order
    device = drafts[0].tokens.device
    probs = torch.stack([d.probs[:g] for d in drafts])  # [k, g, V]
    seq_of, depth_of = zip(*(first[p] for p in prefixes), strict=True)
    chains = [[node[ranks[tuple(seq[: d + 1])]] for d in range(g)] for seq in host]
    return Draft(
        torch.tensor([p[-1] for p in prefixes], device=device),
        probs[list(seq_of), list(depth_of)],
        tree=tree,
        chains=torch.tensor(chains, device=device),
    )
