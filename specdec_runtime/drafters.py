"""Drafters: what proposes tokens for the target to verify.

    drafter = ModelDrafter(draft_model)                                   # a small stand-alone model
    drafter = ModelDrafter(target, exit_layer=6, shares_target_cache=True)  # truncate:6
    drafter = NgramDrafter(max_ngram=3)                                     # prompt lookup
    drafter = LookupFirst(eagle3_drafter)               # prompt lookup where it matches, the model elsewhere
    drafter = LookupFirst(eagle3_drafter, table=PhraseTable.load(path))  # ... the target's phrases before the model
    drafter.start(prompt, capacity)
    draft = drafter.draft(ids, gamma=4, sampler=sampler)   # Draft(tokens [g], probs [g, V] | None)

(`specdec_runtime.drafter_spec.build_drafter("truncate:6", target)` builds any drafter from its
command-line spec.) The protocol is `start` and `draft`. `start` is called once per prompt, after
the target's prefill. `draft` receives the whole sequence so far, ids [L]: the target has verified
ids[:L-1] into its KV cache and ids[L-1] is the newest token; it returns up to gamma tokens that
should follow (or a token tree at most gamma deep; LookupFirst's lookups up to max(gamma,
tokens)). A drafter that reads the target's hidden states (Medusa, MTP heads, EAGLE-3) names the
layers in `hidden_layers` and receives, through `observe`, after every target forward, the
residual streams after those layers at the positions the loop accepted, in order, the last one
being the position that produced the newest token (after the prefill: every prompt position).
"""

import bisect
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from specdec_runtime.errors import SpecdecError
from specdec_runtime.model import Decoder, LayerSkip
from specdec_runtime.phrases import PhraseTable
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import DeviceTree, Tree


class Draft(NamedTuple):
    tokens: Tensor  # [g] proposed ids, 0 <= g <= gamma (LookupFirst's lookups: <= max(gamma, tokens))
    probs: Tensor | None  # [g, V] the distributions they were sampled from; None if deterministic
    # Drafters that share the target (truncate, layer-skip) have already run its first
    # `resume_layer` layers, exactly, on every token the target will verify (ids[L-1] and the g
    # drafts): their residual stream [1, g + 1, H] lets verification resume at that layer.
    residual: Tensor | None = None
    resume_layer: int = 0
    # A token tree (Medusa): tokens are its nodes after the root, verified in one forward with
    # tree attention; the loop keeps the accepted branch's KV entries.
    tree: Tree | DeviceTree | None = None
    lookup: bool = False  # drafted by LookupFirst's prompt lookup, not its model (stats count it apart)

    @property
    def depth(self) -> int:
        """The most tokens verification can accept from it: a tree's depth, a chain's length."""
        return self.tree.depth if self.tree is not None else self.tokens.shape[0]


class Drafter(Protocol):
    """What the generate loop asks of a drafter. Drafters subclass it to inherit the defaults of
    its optional members (a plain drafter only writes `draft`)."""

    name: str = "drafter"
    gamma: int | None = None  # the draft length it was tuned for (a CLI default), if any
    tree_nodes: int = 0  # KV slots a tree draft writes past the sequence (the loop reserves them)
    hidden_layers: tuple[int, ...] = ()  # the target's residual streams it reads (see observe)
    lookup_merge: int = 0  # nodes of its own a lookup round merges by default (LookupFirst: cheap drafters)

    def start(self, prompt: Tensor, capacity: int) -> None:
        """Reset for a new prompt [P]; sequences will not exceed `capacity` tokens."""

    def observe_tokens(self, tokens: list[int]) -> None:
        """The tokens the sequence gained, on the host (the prompt and first token after start(),
        then each round's): drafters that read tokens on the host take them here instead of reading
        ids back from the device (a sync a round on a GPU)."""

    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        """Propose up to gamma tokens to follow ids [L]. A chain may be longer where it costs nothing
        to draft (LookupFirst's lookups); the loop keeps what fits the tokens left to generate."""
        raise NotImplementedError

    def longest(self, gamma: int) -> int:
        """The longest chain draft asks for gamma tokens can return (warm_up captures up to it)."""
        return gamma

    def draft_best(self, ids: Tensor, gamma: int, sampler: Sampler, nodes: int) -> Draft:
        """At most `nodes` of its likeliest nodes, at most gamma deep, deterministic whatever the
        sampler (LookupFirst merges them with a lookup's chain). Drafters that rank a tree's nodes
        keep their best; by default, the greedy chain of that many tokens."""
        return self.draft(ids, min(gamma, nodes), Sampler())

    def observe(self, hidden: Tensor) -> None:
        """The target's residual streams after `hidden_layers` layers, concatenated [k, n * H], at
        the k positions just accepted (after the prefill: every prompt position)."""

    def pass_round(self) -> None:
        """This round's draft came from another drafter (LookupFirst): the next `draft` may be
        several rounds of tokens further on."""


def empty_draft(device: torch.device) -> Draft:
    return Draft(torch.empty(0, dtype=torch.long, device=device), None)


class DraftExit:
    """When a drafter stops early: right after a draft token whose probability is below `threshold`.

    With adaptive=True the threshold follows recent acceptance, as in Draft & Verify (Zhang et al.
    2023): after each verified draft the smoothed acceptance a <- beta1 * a + (1 - beta1) * accepted
    / drafted is compared with `target_acceptance`, and the threshold moves by (1 - beta2) * epsilon
    (epsilon, smoothed by beta2): up when a is below it (drafts run too long), down otherwise. A
    draft that used the whole gamma budget leaves the threshold as it is.
    """

    def __init__(
        self,
        threshold: float = 0.5,
        *,
        adaptive: bool = True,
        target_acceptance: float = 0.9,
        beta1: float = 0.5,
        beta2: float = 0.9,
        epsilon: float = 0.01,
    ):
        if not 0 <= threshold < 1 or not 0 < target_acceptance <= 1 or not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise SpecdecError(
                "draft exit: need 0 <= threshold < 1, 0 < target_acceptance <= 1 and 0 <= beta1, beta2 < 1 "
                f"(got {threshold}, {target_acceptance}, {beta1}, {beta2})"
            )
        self.threshold, self.adaptive, self.target_acceptance = threshold, adaptive, target_acceptance
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon
        self.acceptance = 0.0  # smoothed accepted / drafted

    def update(self, accepted: int, drafted: int, full: bool) -> None:
        """Record one verified draft: `accepted` of its `drafted` tokens; full: it used all of gamma."""
        if not self.adaptive or drafted == 0:
            return
        self.acceptance = self.beta1 * self.acceptance + (1 - self.beta1) * accepted / drafted
        step = 0.0 if full else (self.epsilon if self.acceptance <= self.target_acceptance else -self.epsilon)
        self.threshold = min(max(self.threshold + (1 - self.beta2) * step, 0.0), 1.0)

    def stop(self, p: float) -> bool:
        return p < self.threshold


class ModelDrafter(Drafter):
    """Drafts with a Decoder: a stand-alone model, or the target itself cut short / with skips.

    With shares_target_cache (truncate:K, layer-skip) the drafter is the target run with
    exit_layer / skip: it reads the target's verified cache entries and writes its guesses into
    slots the next verification overwrites, so it never re-reads the context. Its first layers up
    to the first one it exits at or skips from (`resume_layer`) are the target's own computation,
    so it hands their residual stream to verification, which then only runs layers resume_layer..
    A stand-alone model keeps its own cache and only feeds the tokens it has not seen (one or two).

    Drafting stops early after an unsure token when a DraftExit is given (`confidence` > 0 is a
    fixed threshold); an adaptive DraftExit learns from how many tokens of each draft were accepted.
    """

    def __init__(
        self,
        model: Decoder,
        *,
        vocab_size: int | None = None,
        exit_layer: int | None = None,
        skip: LayerSkip | None = None,
        shares_target_cache: bool = False,
        confidence: float = 0.0,
        draft_exit: DraftExit | None = None,
        gamma: int | None = None,
        name: str = "model",
    ):
        self.model, self.exit_layer, self.skip = model, exit_layer, skip
        self.vocab_size = vocab_size or model.config.vocab_size  # the target's vocabulary
        self.shares_target_cache, self.name = shares_target_cache, name
        self.gamma = gamma  # the draft length it was tuned for (a CLI default), if any
        self.draft_exit = draft_exit or (DraftExit(confidence, adaptive=False) if confidence > 0 else None)
        self.seen = 0  # own cache: leading positions that hold the current sequence
        self.handed: Tensor | None = None  # [1, n, H] residual streams for verification (_handed)
        self.vocab_ids = getattr(model, "vocab_ids", None)  # [N] a draft vocabulary's ids, if any
        self.last: tuple[int, int, bool] | None = None  # (L, drafted, full) of the previous draft
        # Layers run exactly as the target runs them: up to the first exit or skipped sublayer.
        stops = [model.config.num_layers, *(skip.attn | skip.mlp if skip is not None else ())]
        stops += [exit_layer] if exit_layer is not None else []
        self.resume_layer = min(stops) if shares_target_cache else 0

    def start(self, prompt: Tensor, capacity: int) -> None:
        self.last = None
        if self.shares_target_cache:
            return
        context = self.model.config.max_position_embeddings
        if capacity > context:
            raise SpecdecError(
                f"drafter '{self.name}' has a context of {context} tokens, shorter than prompt + "
                f"max_new_tokens = {capacity}: lower max_new_tokens or use a drafter with a longer context"
            )
        self.model.setup_cache(1, capacity)
        self.model.prefill(prompt[None], logits_to_keep=1)
        self.seen = prompt.shape[0]

    def pass_round(self) -> None:
        self.last = None  # the draft exit learns only from rounds this drafter drafted

    def _logits(self, logits: Tensor) -> Tensor:
        """Draft logits [V_target] from the drafter's own [V_drafter] (a draft vocabulary, or a
        vocabulary of another size, is mapped onto the target's)."""
        V = self.vocab_size
        if self.vocab_ids is not None:  # a draft vocabulary: ids outside it get probability 0
            full = logits.new_full((V,), float("-inf"))
            return full.index_copy_(0, self.vocab_ids, logits)
        if logits.shape[-1] > V:  # ids the target does not have can never be proposed
            logits = logits[:V]
        elif logits.shape[-1] < V:  # ids the drafter does not have get probability 0
            logits = torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))
        return logits

    def _handed(self, n: int) -> Tensor:
        """The buffer [1, n, H] that collects the residual streams handed to verification; the
        drafter owns it, and verification reads it before the next draft overwrites it."""
        if self.handed is None or self.handed.shape[1] < n:
            H = self.model.config.hidden_size
            self.handed = torch.empty(1, n, H, device=self.model.device, dtype=self.model.dtype)
        return self.handed

    @torch.inference_mode()
    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        L = ids.shape[0]
        if self.draft_exit is not None and self.last is not None:
            # The previous draft was verified: the sequence grew by its accepted tokens + one.
            prev_L, drafted, full = self.last
            self.draft_exit.update(min(max(L - prev_L - 1, 0), drafted), drafted, full)
        seen = L - 1 if self.shares_target_cache else min(self.seen, L - 1)
        K = self.resume_layer
        opts = dict(exit_layer=self.exit_layer, skip=self.skip, logits_to_keep=1, taps=(K,) if K else ())
        if self.model.compiled:
            # Catch up a token a step: a step of several tokens (after a fully accepted draft, or
            # rounds LookupFirst drafted) is a shape no warm-up runs, which would be compiled and
            # captured mid-generation, inside a timed prompt.
            for p in range(seen, L - 1):
                self.model(ids[p : p + 1][None], p, **opts)
            seen = L - 1
        x, pos = ids[seen:L][None], seen  # the tokens the drafter has not processed yet
        handed = self._handed(gamma + 1) if K else None
        tokens, probs = [], []
        for i in range(gamma):
            out = self.model(x, pos, **opts)
            if K:  # x is the newest token alone (a shared cache is never behind)
                handed[:, i] = out.hidden[:, -1]
            logits = self._logits(out.logits[0, -1])
            pos += x.shape[1]
            if sampler.greedy:
                token, p = logits.argmax(), None
            else:
                p = sampler.probs(logits)
                token = sampler.sample(p)
                probs.append(p)
            tokens.append(token)
            x = token.view(1, 1)
            # Draft exit (host sync per draft token, only when enabled).
            if self.draft_exit is not None:
                conf = (p if p is not None else logits.float().softmax(-1))[token]
                if self.draft_exit.stop(conf.item()):
                    break
        self.seen = pos  # ids[:L] and all drafted tokens but the last are now cached
        self.last = (L, len(tokens), len(tokens) == gamma)
        drafted, q = torch.stack(tokens), torch.stack(probs) if probs else None
        if not K:
            return Draft(drafted, q)
        # The last draft token's first K layers, which verification would otherwise recompute.
        g = len(tokens)
        handed[:, g] = self.model(x, pos, exit_layer=K, taps=(K,), head=False).hidden[:, -1]
        return Draft(drafted, q, handed[:, : g + 1], K)


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
        L, seq = len(self.seq), self.seq
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            begins = self.ends.get(tuple(seq[L - n :]), ())
            earlier = len(begins) - 1  # the last entry is the suffix itself (it ends at L)
            if earlier > 0:
                # The latest match that still has gamma tokens after it, else the earliest one.
                full = bisect.bisect_right(begins, L - gamma, 0, earlier)
                begin = begins[full - 1] if full else begins[0]
                return Draft(ids[begin : begin + gamma], None)
        return empty_draft(ids.device)


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

    With a phrase table (specdec_runtime.phrases: what the target's training responses agree
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
