"""Prompt lookup (NgramDrafter) and lookup first, a model drafter elsewhere (LookupFirst).

    drafter = NgramDrafter(max_ngram=3)                                  # prompt lookup alone
    drafter = LookupFirst(eagle3_drafter)                                # lookup where it matches, the model elsewhere
    drafter = LookupFirst(eagle3_drafter, table=PhraseTable.load(path))  # ... the target's phrases before the model
"""

import bisect

import torch
from torch import Tensor

from specdec_runtime.drafters.phrases import PhraseTable
from specdec_runtime.drafters.protocol import Draft, Drafter, empty_draft
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree


class NgramDrafter(Drafter):
    """Prompt lookup decoding: find an earlier occurrence of the last n tokens and propose what
    followed it (n from max_ngram down to min_ngram). Needs no model; it pays off when the output
    copies from the prompt or repeats itself (summaries, extraction, code edits).

    The sequence's n-grams are indexed as it grows (a host dict: n-gram -> the positions right
    after each occurrence, in order), so a round reads only its new tokens and looks its suffix up
    instead of scanning the sequence with a dozen small tensor ops (a few percent of a CPU's decode
    step: docs/log/drafters.md). start() begins a new
    sequence; a shorter one than the indexed is indexed afresh. The generate loop hands it the new
    tokens on the host (observe_tokens); a caller that does not, has them read from ids."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.name = max_ngram, min_ngram, f"ngram:{max_ngram}"
        self.seq: list[int] = []  # the tokens indexed so far
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions right after it, ascending

    def start(self, prompt: Tensor, capacity: int) -> None:
        self.seq, self.ends = [], {}

    def observe_tokens(self, tokens: list[int]) -> None:
        seq, ends = self.seq, self.ends
        for token in tokens:
            seq.append(token)
            i = len(seq)
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                ends.setdefault(tuple(seq[i - n : i]), []).append(i)

    def _index(self, ids: Tensor) -> None:
        """Index ids[len(seq):] where nobody handed them over (observe_tokens)."""
        L = ids.shape[0]
        if L < len(self.seq):
            self.start(ids, L)
        if len(self.seq) < L:
            self.observe_tokens(ids[len(self.seq) : L].tolist())  # host copy of the new tokens (a device sync on GPU)

    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        self._index(ids)
        begin = self._match(gamma)
        return empty_draft(ids.device) if begin is None else Draft(ids[begin : begin + gamma], None)

    def continuation(self, gamma: int) -> list[int]:
        """The draft of up to gamma tokens after the tokens observed so far, as host ids (RowLookup)."""
        begin = self._match(gamma)
        return [] if begin is None else self.seq[begin : begin + gamma]

    def _match(self, gamma: int) -> int | None:
        """Where the draft begins in the sequence (None: no earlier occurrence of its suffix)."""
        L, seq = len(self.seq), self.seq
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            begins = self.ends.get(tuple(seq[L - n :]), ())
            earlier = len(begins) - 1  # the last entry is the suffix itself (it ends at L)
            if earlier > 0:
                # The latest match that still has gamma tokens after it, else the earliest one.
                full = bisect.bisect_right(begins, L - gamma, 0, earlier)
                return begins[full - 1] if full else begins[0]
        return None


class LookupFirst(Drafter):
    """Prompt lookup where it matches, a model drafter elsewhere: a round drafts what followed an
    earlier occurrence of the last n >= min_ngram tokens (n from max_ngram down) when there is
    one, and asks the model drafter otherwise. Lookup's drafts cost nothing and are long and right
    where the output copies (extraction, summaries, code edits: where a trained drafter is
    weakest); one-token matches are left to the model, which guesses better than they do.

    A lookup drafts `tokens` tokens where the round's gamma is shorter: its tokens cost nothing to
    draft and little to verify (a CPU verifies 5 tokens in ~1.2 decode steps and, with 512-bit
    products, 9 in ~1.3; a GPU many more), and a copy that matched goes on being right: longer
    lookups raised tau and the speedup on every EAGLE-3 drafter tried (docs/log/eagle3.md).

    With a phrase table (specdec_runtime.drafters.phrases: what the target's training responses agree
    follows the last 4 tokens), a round the prompt does not match drafts the table's chain where it
    has one, and the model only where neither has.

    The model drafter still observes every accepted position; its next draft runs the rows it
    missed (a stand-alone model catches up on the tokens, EAGLE-3 on the pending features).

    merge > 0 (default: the drafter's lookup_merge, 2 for EAGLE-3 on a CPU, else 0): a round that a
    lookup drafts asks the model too, for its `merge` likeliest nodes (Drafter.draft_best), and
    verifies both in one tree (merged()): the lookup's chain where the output copies, the model's
    guess where the copy breaks off at once, which it does in ~30% of lookup rounds. The model's nodes
    are its greedy choices when sampling too (deterministic drafts stay lossless under sampled
    verification); drafts that carry residual streams (truncate, layer skip) are not merged.
    """

    def __init__(
        self,
        drafter: Drafter,
        max_ngram: int = 3,
        min_ngram: int = 2,
        tokens: int = 8,
        table: PhraseTable | None = None,
        merge: int | None = None,
    ):
        merge = drafter.lookup_merge if merge is None else merge
        if tokens < 1 or merge < 0:
            raise ValueError(f"LookupFirst needs tokens >= 1 and merge >= 0, got {tokens} and {merge}")
        self.drafter, self.lookup, self.tokens = drafter, NgramDrafter(max_ngram, min_ngram), tokens
        self.table, self.merge = table, merge
        self.name = f"{drafter.name}+lookup" + ("+phrases" if table is not None else "")
        self.gamma = drafter.gamma
        # A merged tree: the lookup's chain and the model's nodes, each written past the sequence.
        self.tree_nodes = max(drafter.tree_nodes, tokens + merge) if merge else drafter.tree_nodes
        self.hidden_layers = drafter.hidden_layers
        self.lookups = 0  # rounds drafted by lookup

    def start(self, prompt: Tensor, capacity: int) -> None:
        self.lookup.start(prompt, capacity)
        self.drafter.start(prompt, capacity)

    def observe(self, hidden: Tensor) -> None:
        self.drafter.observe(hidden)

    def observe_tokens(self, tokens: list[int]) -> None:
        self.lookup.observe_tokens(tokens)
        self.drafter.observe_tokens(tokens)

    def longest(self, gamma: int) -> int:
        return max(self.drafter.longest(gamma), self.tokens)

    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        longest = max(gamma, self.tokens)
        found = self.lookup.draft(ids, longest, sampler)
        if not found.tokens.numel() and self.table is not None:  # the lookup indexed ids: its host copy serves
            chain = self.table.get(self.lookup.seq, longest)
            found = found if chain is None else Draft(chain, None)
        if not found.tokens.numel():
            return self.drafter.draft(ids, gamma, sampler)
        self.lookups += 1
        found = found._replace(lookup=True)
        chain = found.tokens
        best = None
        if self.merge and chain.shape[0] <= self.tokens:  # (a longer chain, at a gamma above tokens: no slots for more)
            best = self.drafter.draft_best(ids, gamma, sampler, self.merge)
        self.drafter.pass_round()  # (a draft exit learns only from rounds its drafter drafted alone)
        if best is None or best.probs is not None or best.residual is not None or not best.tokens.numel():
            return found
        return merged(chain, best)._replace(lookup=True)


def merged(chain: Tensor, other: Draft) -> Draft:
    """One tree of a chain and another deterministic draft (a chain or a tree): nodes with the same
    tokens from the root are one node, and `chain` is every node's first child (rank 0), the other
    draft's nodes after it in their own order. Greedy verification accepts the longer of the two
    matches; sampled verification (a deterministic tree's rule) stays lossless. One host read of
    both drafts' tokens (on a GPU, a sync: lookups sync anyway)."""
    host = torch.cat([chain, other.tokens]).tolist()
    c, tokens = host[: chain.shape[0]], host[chain.shape[0] :]
    if other.tree is None:
        parents = list(range(len(tokens)))  # node i + 1's parent is node i (0: the root)
    else:
        parents = other.tree.structure[0][1:]
    ranks: dict[tuple[int, ...], tuple[int, ...]] = {(): ()}  # token path -> rank path
    children: dict[tuple[int, ...], int] = {}  # rank path -> children so far
    token_paths: list[tuple[int, ...]] = [tuple(c[: d + 1]) for d in range(len(c))]
    by_node: list[tuple[int, ...]] = [()]
    for t, parent in zip(tokens, parents):
        by_node.append(by_node[parent] + (t,))
    for path in token_paths + by_node[1:]:
        if path not in ranks:
            up = ranks[path[:-1]]
            ranks[path] = up + (children.get(up, 0),)
            children[up] = children.get(up, 0) + 1
    token_of = {r: p[-1] for p, r in ranks.items() if p}
    tree = Tree.from_paths(list(token_of))
    ids = torch.tensor([token_of[r] for r in tree.paths], device=chain.device)
    return Draft(ids, None, tree=tree)
