"""Token trees for Medusa-style drafting: the tree, its attention mask, and tree verification.

    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])     # Medusa's medusa_choices
    tree = Tree.from_accuracies(acc, budget=32)     # acc [heads, top_k]: measured top-k accuracy per head
    tree.candidates(root, topk_ids)                 # node tokens [N + 1] from the heads' top-k

Node 0 is the root: the newest token, which the target has chosen but not cached yet. Every other
node is a path (r_1, ..., r_d): the rank-r_1 candidate of head 1, then the rank-r_2 candidate of
head 2 under it, and so on; node tokens come from the heads' top-k at the root's position. Nodes
are ordered by depth, then by ranks, so siblings are tried best-first and ancestors come first.
One target forward over the N + 1 nodes (each sees its ancestors: `mask`, at rope position
start + depth) gives the target's prediction after every node; verification (verify.py) walks
from the root.
"""

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
from torch import Tensor

from specdec_runtime.errors import SpecdecError


@dataclass(frozen=True)
class Tree:
    """A candidate tree given by its node paths (root excluded), sorted by depth then ranks."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "Tree":
        """A tree from Medusa-style choices; every prefix of a path must be a path too."""
        nodes = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if not nodes:
            raise SpecdecError("a Medusa tree needs at least one node, e.g. [[0]]")
        have = set(nodes)
        for p in nodes:
            if not p or min(p) < 0:
                raise SpecdecError(f"tree path {list(p)}: paths are non-empty lists of ranks >= 0")
            if len(p) > 1 and p[:-1] not in have:
                raise SpecdecError(f"tree path {list(p)} has no parent {list(p[:-1])}: add it to the tree")
        return cls._interned(tuple(nodes))

    @classmethod
    @lru_cache(maxsize=1024)
    def _interned(cls, nodes: tuple[tuple[int, ...], ...]) -> "Tree":
        """One object per shape: a dynamic tree's shapes recur round after round (an EAGLE-2 tree of
        5 nodes has a few dozen), and each object builds its index tensors (and moves them to a
        device) once instead of every round."""
        return cls(nodes)

    @classmethod
    @lru_cache(maxsize=64)
    def chain(cls, depth: int) -> "Tree":
        """The top-1 candidate of each head in a row (no branching)."""
        return cls.from_paths([(0,) * d for d in range(1, depth + 1)])

    @classmethod
    def from_accuracies(cls, accuracy: Tensor | Sequence[Sequence[float]], budget: int) -> "Tree":
        """The tree of at most `budget` nodes with the highest expected accepted length.

        accuracy[k][r]: measured probability that head k+1's rank-r candidate is the right token.
        A node's value is the product of its path's accuracies (heads taken as independent, as in
        the Medusa paper); expected tokens per forward = 1 + sum of node values. Adding nodes
        greedily by value is optimal here because a child is never worth more than its parent.
        """
        acc = torch.as_tensor(accuracy, dtype=torch.float64)
        if acc.dim() != 2 or budget < 1:
            raise SpecdecError(f"need accuracies [heads, top_k] and budget >= 1 (got {tuple(acc.shape)}, {budget})")
        heads, top_k = acc.shape
        frontier = [(-float(acc[0, r]), (r,)) for r in range(top_k)]
        heapq.heapify(frontier)
        chosen: list[tuple[int, ...]] = []
        while frontier and len(chosen) < budget:
            neg, path = heapq.heappop(frontier)
            chosen.append(path)
            if len(path) < heads:
                for r in range(top_k):
                    heapq.heappush(frontier, (neg * float(acc[len(path), r]), path + (r,)))
        return cls.from_paths(chosen)

    @staticmethod
    def expected_tau(paths: Sequence[Sequence[int]], accuracy: Tensor | Sequence[Sequence[float]]) -> float:
        """1 + the summed path probabilities: tokens per target forward if heads were independent."""
        acc = torch.as_tensor(accuracy, dtype=torch.float64)
        return 1.0 + sum(float(torch.prod(torch.stack([acc[d, r] for d, r in enumerate(p)]))) for p in paths)

    def __len__(self) -> int:
        return len(self.paths)  # nodes, root excluded

    @cached_property
    def depth(self) -> int:
        return len(self.paths[-1])

    @cached_property
    def top_k(self) -> list[int]:
        """Candidates needed per head: 1 + the largest rank used at each depth."""
        return [1 + max(p[-1] for p in self.paths if len(p) == d) for d in range(1, self.depth + 1)]

    @cached_property
    def structure(self) -> tuple[list[int], list[int]]:
        """(parent, depth) of the N + 1 nodes as lists, root first (root: parent 0, depth 0): the
        host's walk of a tree (verify._walk)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return [0] + [index.get(p[:-1], 0) for p in self.paths], [0] + [len(p) for p in self.paths]

    def truncated(self, depth: int) -> "Tree":
        """The nodes up to `depth` (the loop never drafts past max_new_tokens), the same object each
        time: its tensors then move to a device once (on()), not every round (a host sync each)."""
        if depth >= self.depth:
            return self
        if depth not in self._truncations:
            self._truncations[depth] = Tree._interned(tuple(p for p in self.paths if len(p) <= depth))
        return self._truncations[depth]

    @cached_property
    def _truncations(self) -> dict[int, "Tree"]:
        return {}

    @cached_property
    def tensors(self) -> dict[str, Tensor]:
        """Index tensors (CPU) for the N + 1 nodes, root first.

        parent [N+1] (root: 0), depth [N+1], rank [N+1], ancestor [N+1, N+1] (ancestor-or-self,
        the attention mask), earlier [N+1, N+1] (j is a sibling ranked before i), levels [D+1]
        (0..D, so that no depth has to come back from the device).
        """
        parents, depths = self.structure
        n = len(parents)
        mask = [[False] * n for _ in range(n)]
        for i in range(n):  # ancestor-or-self: i, its parent, ... up to the root
            j = i
            while True:
                mask[i][j] = True
                if j == 0:
                    break
                j = parents[j]
        parent, depth = torch.tensor(parents), torch.tensor(depths)
        rank = torch.tensor([0] + [p[-1] for p in self.paths])
        ancestor = torch.tensor(mask)
        earlier = (parent[:, None] == parent[None, :]) & (rank[None, :] < rank[:, None])
        earlier[0], earlier[:, 0] = False, False  # the root is nobody's sibling
        levels = torch.arange(self.depth + 1)
        return {
            "parent": parent,
            "depth": depth,
            "rank": rank,
            "ancestor": ancestor,
            "earlier": earlier,
            "levels": levels,
        }

    def tensors_on(self, device: torch.device) -> dict[str, Tensor]:
        """`tensors` on a device (cached per device)."""
        cache = self.__dict__.setdefault("_on", {})
        if device not in cache:
            cache[device] = {k: v.to(device) for k, v in self.tensors.items()}
        return cache[device]

    def candidates(self, root: Tensor, topk_ids: Tensor) -> Tensor:
        """Node tokens [N + 1]: the root token, then topk_ids[depth - 1, rank] per node.

        root: 0-dim token id; topk_ids [heads, k] the heads' candidates, best first.
        """
        t = self.tensors_on(topk_ids.device)
        d, r = t["depth"][1:] - 1, t["rank"][1:]
        return torch.cat([root.view(1), topk_ids[d, r]])


class DeviceTree:
    """A token tree whose structure stays on the device: what a drafter that builds its tree there
    hands over (Eagle3Drafter on a GPU), so that no round reads it back to the host. It gives what
    verification and the generate loop read of a Tree: `on()` (its index tensors, as
    Tree.tensors), `depth` (the most levels it can have, known on the host), len (its nodes, the
    root excluded), and `reached` (0-dim: the depth its nodes reach, read with the round's one
    sync). `structure`, for the host rules on a CPU, reads it back."""

    def __init__(self, tensors: dict[str, Tensor], levels: int, reached: Tensor):
        self.tensors, self.depth, self.reached = tensors, levels, reached

    def __len__(self) -> int:
        return self.tensors["parent"].shape[0] - 1

    def tensors_on(self, device: torch.device) -> dict[str, Tensor]:
        return {k: v.to(device) for k, v in self.tensors.items()}  # (no copy on its own device)

    @property
    def structure(self) -> tuple[list[int], list[int]]:
        return self.tensors["parent"].tolist(), self.tensors["depth"].tolist()  # a host read: CPU rules only

    def truncated(self, depth: int) -> "DeviceTree":
        if depth < self.depth:  # its drafter builds no more levels than the loop asks for (draft gamma)
            raise ValueError(f"a device tree of {self.depth} levels cannot be cut to {depth} on the host")
        return self
