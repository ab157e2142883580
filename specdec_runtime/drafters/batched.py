"""Drafters for batched decoding (specdec_runtime.batched), each row at slots of its own: prompt
lookup for every row, on the host; a stand-alone model batched like the target; the target itself
cut short or with sublayers skipped; EAGLE-3 chains and trees (drafters/eagle3_rows.py); Medusa
chains and trees and MTP heads; lookup first before any of them.

    rows = batch_drafter(drafter)     # a Row* drafter, or None: a kind that decodes a prompt at a time
"""


import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from specdec_runtime.cache import KVCache
from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.eagle3_rows import RowEagle3
from specdec_runtime.drafters.lookup import LookupFirst, NgramDrafter
from specdec_runtime.drafters.medusa import MedusaDrafter
from specdec_runtime.drafters.mtp import MTPDrafter
from specdec_runtime.drafters.protocol import Drafter, RowDrafter
from specdec_runtime.drafters.standalone import ModelDrafter, in_target_vocab
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import left_padded
from specdec_runtime.layers import rms_norm
from specdec_runtime.model import Decoder
from specdec_runtime.rows import keep_rows, move_rows, one_row, prefill
from specdec_runtime.sampling import Sampler, argmax


class RowLookup(RowDrafter):
    """Prompt lookup (NgramDrafter) for every row, on the host."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, device: torch.device | str = "cpu"):
        self.max_ngram, self.min_ngram, self.device = max_ngram, min_ngram, torch.device(device)
        self.name = f"ngram:{max_ngram}"
        self.rows: list[NgramDrafter] = []

    def start(self, prompts: list[list[int]], row_start: list[int], capacity: int) -> None:
        self.rows = [NgramDrafter(self.max_ngram, self.min_ngram) for _ in prompts]
        for row, prompt in zip(self.rows, prompts, strict=True):
            row.observe_tokens(prompt)

    def refill(self, b: int, prompt: list[int]) -> None:
        self.rows[b] = NgramDrafter(self.max_ngram, self.min_ngram)
        self.rows[b].observe_tokens(prompt)

    def observe_tokens(self, b: int, tokens: list[int]) -> None:
        self.rows[b].observe_tokens(tokens)

    def keep(self, rows: list[int]) -> bool:
        self.rows = [self.rows[b] for b in rows]
        return True

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], None]:
        drafts = [row.continuation(g) if g else [] for row, g in zip(self.rows, gammas, strict=True)]
        lengths = [len(d) for d in drafts]
        tokens = torch.tensor([d + [0] * (max(lengths) - len(d)) for d in drafts], dtype=torch.long)
        return tokens.view(len(drafts), -1).to(self.device, non_blocking=True), lengths, None

    def alone(self) -> Drafter:
        return NgramDrafter(self.max_ngram, self.min_ngram)


class RowLookupFirst(RowDrafter):
    """LookupFirst for every row: a row whose last tokens occurred before (n-grams of min_ngram..
    max_ngram tokens) drafts what followed them, else the phrase table's chain where it has one,
    else the model's draft. The model drafts every row every round all the same (its rows are one
    batched step, and it keeps up with every row's tokens and states); a looked-up row's draft
    replaces its row, unmerged with the model's nodes. Beside chains a lookup drafts no more than
    the round's gamma (a longer one would widen the verify step); beside trees (EAGLE-3's, Medusa's)
    it drafts as one sequence's does, up to the tree's nodes, as a chain in its row's tree
    (chain_rows): the other rows keep their trees."""

    def __init__(self, first: LookupFirst, drafter: RowDrafter):
        """first: the runtime drafter (a batch of one decodes with it); drafter: its model's rows."""
        self.first, self.d, self.table = first, drafter, first.table
        self.lookup = RowLookup(first.lookup.max_ngram, first.lookup.min_ngram)
        self.name = f"{drafter.name}+lookup" + ("+phrases" if first.table is not None else "")
        self.hidden_layers, self.tree_nodes = drafter.hidden_layers, drafter.tree_nodes
        self.lookup_rows: frozenset[int] = frozenset()
        self.tree: dict[str, Tensor] | None = None

    def start(self, prompts: list[list[int]], row_start: list[int], capacity: int) -> None:
        self.lookup.start(prompts, row_start, capacity)
        self.d.start(prompts, row_start, capacity)

    def refill(self, b: int, prompt: list[int]) -> None:
        self.lookup.refill(b, prompt)
        self.d.refill(b, prompt)

    def observe_tokens(self, b: int, tokens: list[int]) -> None:
        self.lookup.observe_tokens(b, tokens)
        self.d.observe_tokens(b, tokens)

    def observe(self, b: int, hidden: Tensor) -> None:
        self.d.observe(b, hidden)

    def keep(self, rows: list[int]) -> bool:
        return self.d.keep(rows) and self.lookup.keep(rows)

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], Tensor | None]:
        tokens, lengths, q = self.d.draft(gammas, sampler)
        self.tree = self.d.tree
        longest = self.first.tokens  # (the match one sequence's lookup takes: cut to the round's gamma beside
        # chains, to the tree's nodes beside a tree)
        cuts = [(min(max(g, longest), tokens.shape[1]) if g else 0) if self.tree is not None else g for g in gammas]
        found = [row.continuation(max(g, longest))[:cut] for row, g, cut in
                 zip(self.lookup.rows, gammas, cuts, strict=True)]  # fmt: skip
        if self.table is not None:
            found = [f or (self.table.chain_ids(row.seq, cut) if cut else []) for f, row, cut in
                     zip(found, self.lookup.rows, cuts, strict=True)]  # fmt: skip
        self.lookup_rows = frozenset(b for b, f in enumerate(found) if f)
        if not self.lookup_rows:
            return tokens, lengths, q
        for b in self.lookup_rows:
            self.d.pass_row(b)
        if self.tree is not None:
            tokens, self.tree = chain_rows(tokens, self.tree, found)
            return tokens, [len(f) or n for f, n in zip(found, lengths, strict=True)], q
        B, W = len(found), max(tokens.shape[1], *map(len, found))
        chains = torch.tensor([f + [0] * (W - len(f)) for f in found])
        looked = torch.tensor([bool(f) for f in found])  # (host tensors, copied without waiting)
        chains, looked = chains.to(tokens.device, non_blocking=True), looked.to(tokens.device, non_blocking=True)
        tokens = torch.where(looked[:, None], chains, F.pad(tokens, (0, W - tokens.shape[1])))
        lengths = [len(f) if f else n for f, n in zip(found, lengths, strict=True)]
        if q is not None:  # a lookup's token is certain: a one-hot q is the deterministic draft's rule
            q = torch.where(looked[:, None, None], 0.0, F.pad(q, (0, 0, 0, W - q.shape[1])))
            q.scatter_add_(2, chains[..., None], looked[:, None, None].to(q.dtype).expand(B, W, 1))
        return tokens.view(B, W), lengths, q

    def alone(self) -> Drafter:
        return self.first


def chain_rows(tokens: Tensor, tree: dict[str, Tensor], chains: list[list[int]]) -> tuple[Tensor, dict[str, Tensor]]:
    """A batch's tree draft (node tokens [B, N], the tree's tensors a row) where each row with a
    chain (chains[b], at most N tokens) drafts that chain instead: its nodes first, one a depth, the
    row's other nodes dead (tree["alive"] False: verification never accepts them, and they are no
    node's earlier siblings). The other rows keep their trees."""
    B, N = tokens.shape
    device = tokens.device
    lengths = torch.tensor([len(c) for c in chains]).to(device, non_blocking=True)  # (from the host: no wait)
    padded = torch.tensor([c + [0] * (N - len(c)) for c in chains]).to(device, non_blocking=True)
    looked = (lengths > 0)[:, None]  # [B, 1]
    i = torch.arange(N + 1, device=device)  # node index, the root 0
    on = i <= lengths[:, None]  # [B, N + 1] the root and the chain's nodes
    j = i[None, None, :]
    chain = {
        "parent": torch.where(on, (i - 1).clamp(min=0), 0),
        "depth": torch.where(on, i, 1),  # (a dead node: a child of the root, never reached)
        "rank": torch.where(on, 0, i),
        "ancestor": (on[..., None] & (j <= i[:, None])) | (j == i[:, None]) | (j == 0),
        "earlier": torch.zeros(B, N + 1, N + 1, dtype=torch.bool, device=device),
    }
    out = {k: torch.where(looked.view(B, *[1] * (v.dim() - 1)), v, tree[k]) for k, v in chain.items()}
    out["alive"] = on | ~looked  # (a drafter's own trees have no dead nodes: the loop's _idle marks some after)
    depth = max(tree["levels"].shape[0] - 1, *map(len, chains))
    out["levels"] = tree["levels"] if depth < tree["levels"].shape[0] else torch.arange(depth + 1, device=device)
    return torch.where(looked, padded, tokens), out


class RowModel(RowDrafter):
    """A stand-alone draft model for every row: its own cache, a row a sequence at the target's
    slots, catching up on each row's unseen tokens (one or two) in one forward, then drafting
    max(gammas) tokens for all rows (each row keeps its own gamma's)."""

    def __init__(self, model: Decoder, vocab_size: int | None = None, name: str = "model"):
        self.model, self.name = model, name
        self.vocab_size = vocab_size or model.config.vocab_size
        self.vocab_ids = getattr(model, "vocab_ids", None)

    def start(self, prompts: list[list[int]], row_start: list[int], capacity: int) -> None:
        context = self.model.config.max_position_embeddings
        if capacity > context:
            raise SpecdecError(f"drafter '{self.name}' has a context of {context} tokens, shorter than {capacity}")
        device = self.model.device
        self.model.setup_cache(len(prompts), capacity)
        self.model.left_pad(torch.tensor(row_start).to(device, non_blocking=True), per_row=True)
        self.row_start = list(row_start)
        self.seqs = [list(p) for p in prompts]
        ids, _ = left_padded(prompts, 0)
        prefill(self.model, ids.to(device, non_blocking=True), logits_to_keep=1)
        self.seen = [len(p) for p in prompts]  # each row's tokens in the drafter's cache

    def refill(self, b: int, prompt: list[int]) -> None:
        """The prompt prefilled into row b alone (at slot 0)."""
        with one_row(self.model, b):
            prefill(self.model, torch.tensor([prompt]).to(self.model.device, non_blocking=True), logits_to_keep=1)
        self.row_start[b], self.seqs[b], self.seen[b] = 0, list(prompt), len(prompt)

    def observe_tokens(self, b: int, tokens: list[int]) -> None:
        self.seqs[b] += tokens

    def keep(self, rows: list[int]) -> bool:
        if self.model.compiled:  # (its steps are captured for the batch's size)
            return False
        keep_rows(self.model, rows)
        self.row_start, self.seqs, self.seen = ([x[b] for b in rows] for x in (self.row_start, self.seqs, self.seen))
        return True

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], Tensor | None]:
        device, B, g = self.model.device, len(self.seqs), max(gammas)
        seen = [min(s, len(seq) - 1) for s, seq in zip(self.seen, self.seqs, strict=True)]  # past a rejection: stale
        unseen = [seq[s:] for s, seq in zip(seen, self.seqs, strict=True)]
        width = max(map(len, unseen))
        starts = [r + s for r, s in zip(self.row_start, seen, strict=True)]
        last = [len(u) - 1 for u in unseen]
        if self.model.compiled:  # a token a step, as one sequence's drafter catches up: one step shape (T = 1)
            for j in range(width):
                at = [min(j, k) for k in last]  # (a row with fewer runs its newest again: the same K/V)
                x = torch.tensor([[u[a]] for u, a in zip(unseen, at, strict=True)]).to(device, non_blocking=True)
                logits = self.model(x, [s + a for s, a in zip(starts, at, strict=True)], logits_to_keep=1).logits[:, -1]
        else:
            x = torch.tensor([u + u[-1:] * (width - len(u)) for u in unseen]).to(device, non_blocking=True)  # padded
            logits = self.model(x, starts, logits_to_keep=0).logits  # [B, width, V']
            logits = logits[torch.arange(B, device=device), torch.tensor(last).to(device, non_blocking=True)]  # newest
        starts = [s + k + 1 for s, k in zip(starts, last, strict=True)]
        tokens, probs = [], []
        for i in range(g):
            logits = in_target_vocab(logits, self.vocab_size, self.vocab_ids)
            token, q = drawn(logits, sampler)
            tokens.append(token)
            if q is not None:  # (sampled: the draft's q)
                probs.append(q)
            if i + 1 < g:
                logits = self.model(token[:, None], [s + i for s in starts], logits_to_keep=1).logits[:, -1]
        self.seen = [len(seq) + g - 1 for seq in self.seqs]  # the drafts but the last are cached
        return torch.stack(tokens, 1), list(gammas), torch.stack(probs, 1) if probs else None

    def pass_row(self, b: int) -> None:
        self.seen[b] = len(self.seqs[b])  # (its own drafts, cached past the sequence, are not what comes next)

    def alone(self) -> Drafter:
        return ModelDrafter(self.model, vocab_size=self.vocab_size, name=self.name)


class RowSelf(RowDrafter):
    """The target itself cut short (truncate:K) or with sublayers skipped (a layer-skip set) for every
    row: each draft step is the target's forward of every row's newest token with exit_layer /
    skip, at the slot after that row's last, writing K/V into slots the verification overwrites
    (ModelDrafter with shares_target_cache, batched). Unlike one sequence's, the verification
    runs every layer again: a batch's first layers are not handed over."""

    def __init__(self, drafter: ModelDrafter):
        self.d, self.name = drafter, drafter.name

    def start(self, prompts: list[list[int]], row_start: list[int], capacity: int) -> None:
        self.row_start, self.seqs = list(row_start), [list(p) for p in prompts]

    def refill(self, b: int, prompt: list[int]) -> None:
        self.row_start[b], self.seqs[b] = 0, list(prompt)

    def observe_tokens(self, b: int, tokens: list[int]) -> None:
        self.seqs[b] += tokens

    def keep(self, rows: list[int]) -> bool:  # (its cache is the target's, which the loop keeps)
        self.row_start, self.seqs = [self.row_start[b] for b in rows], [self.seqs[b] for b in rows]
        return True

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], Tensor | None]:
        d, device = self.d, self.d.model.device
        starts = [r + len(seq) - 1 for r, seq in zip(self.row_start, self.seqs, strict=True)]  # each newest's slot
        x = torch.tensor([[seq[-1]] for seq in self.seqs]).to(device, non_blocking=True)
        tokens, probs = [], []
        for i in range(max(gammas)):
            out = d.model(x, [s + i for s in starts], exit_layer=d.exit_layer, skip=d.skip, logits_to_keep=1)
            logits = d._logits(out.logits[:, -1])
            token, q = drawn(logits, sampler)
            tokens.append(token)
            if q is not None:  # (sampled: the draft's q)
                probs.append(q)
            x = token[:, None]
        return torch.stack(tokens, 1), list(gammas), torch.stack(probs, 1) if probs else None

    def alone(self) -> Drafter:
        return self.d


class RowMedusa(RowDrafter):
    """Medusa heads for every row, reading the final-norm state of each row's newest token: the
    heads alone, for every row at once. With a chain (Tree.chain), as vLLM serves them: head i's top
    token (sampled: a draw from head i's distribution there, which is that token's q, as in
    MedusaDrafter.samples). With a tree, its candidates for every row (each row's heads' top-k),
    the whole tree each round (one verify shape), verified as MedusaDrafter's are."""

    def __init__(self, drafter: MedusaDrafter):
        self.d, self.hidden_layers = drafter, drafter.hidden_layers
        chain = max(drafter.tree.top_k) == 1
        self.name = f"{drafter.name} (chains)" if chain else drafter.name
        self.tree_nodes = 0 if chain else len(drafter.tree)
        self.tree = None

    def start(self, prompts: list[list[int]], row_start: list[int], capacity: int) -> None:
        self.newest: list[Tensor | None] = [None] * len(prompts)  # each row's last residual stream [H]

    def refill(self, b: int, prompt: list[int]) -> None:
        self.newest[b] = None

    def observe(self, b: int, hidden: Tensor) -> None:
        self.newest[b] = hidden[-1]

    def keep(self, rows: list[int]) -> bool:
        self.newest = [self.newest[b] for b in rows]
        return True

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], Tensor | None]:
        d, heads = self.d, self.d.heads.num_heads
        hidden = rms_norm(torch.stack(self.newest), d.target.norm, d.target.config.rms_norm_eps)  # [B, H]
        if self.tree_nodes:
            return self._tree(hidden, gammas)
        g = min(max(gammas), heads)
        logits = d.heads(hidden, d.target.lm_head, count=g).transpose(0, 1)  # [B, g, V]
        lengths = [min(k, heads) for k in gammas]
        tokens, q = drawn(logits, sampler)
        return tokens, lengths, q

    def _tree(self, hidden: Tensor, gammas: list[int]) -> tuple[Tensor, list[int], None]:
        """The tree's node tokens [B, N] (Tree.candidates for every row) and its tensors a row each."""
        tree, B = self.d.tree, hidden.shape[0]
        logits = self.d.heads(hidden, self.d.target.lm_head, count=tree.depth)  # [depth, B, V]
        top = logits.topk(max(tree.top_k), dim=-1).indices  # [depth, B, k]
        t = tree.tensors_on(hidden.device)
        tokens = top[t["depth"][1:] - 1, :, t["rank"][1:]].T  # [B, N]
        self.tree = {k: v if k == "levels" else v.expand(B, *v.shape) for k, v in t.items()}
        return tokens, [tree.depth if g else 0 for g in gammas], None

    def alone(self) -> Drafter:
        return self.d


class RowMTP(RowDrafter):
    """The target's MTP heads 1..n-1 for every row (MTPDrafter batched): their own cache a row a
    sequence, row b's position p at slot p. A round first runs each row's accepted trunk outputs
    through the heads (padded to the longest row's, the padding writing only slots past the row's
    own, which its next outputs overwrite before anything reads them), then head i's top token at
    each row's newest position is the draft's token i (sampled: a draw from head i's distribution).
    A prompt just taken from the queue runs its rows alone first."""

    def __init__(self, drafter: MTPDrafter):
        self.d, self.name, self.hidden_layers = drafter, f"{drafter.name} (rows)", drafter.hidden_layers
        self.kv_layers: list[Tensor] = []

    def start(self, prompts: list[list[int]], row_start: list[int], capacity: int) -> None:
        heads, target, B = self.d.heads, self.d.target, len(prompts)
        if not self.kv_layers or self.kv_layers[0].shape[0] != B or self.kv_layers[0].shape[2] < capacity + 1:
            self.kv_layers = []  # free the old one first
            self.kv_layers = list(KVCache(heads.cfg, B, capacity + 1, target.device, target.dtype).kv.unbind(0))
        self.seen = [0] * B  # each row's positions in the heads' cache
        self.pending: list[list[Tensor]] = [[] for _ in prompts]

    def refill(self, b: int, prompt: list[int]) -> None:
        self.seen[b], self.pending[b] = 0, []

    def observe(self, b: int, hidden: Tensor) -> None:
        self.pending[b].append(hidden)

    def keep(self, rows: list[int]) -> bool:
        for kv in self.kv_layers:  # (moved to the first rows, which _run reads: the cache keeps its size)
            move_rows(kv, rows)
        self.seen, self.pending = [self.seen[b] for b in rows], [self.pending[b] for b in rows]
        return True

    def _run(self, z: Tensor, starts: list[int], last: list[int], rows: slice) -> Tensor:
        """The heads' logits [n-1, B, V] at row b's position last[b] of z [B, T, H], row b at slots
        starts[b] onward in the cache's rows `rows`."""
        target, (B, T) = self.d.target, z.shape[:2]
        device = target.device
        start = torch.tensor(starts).to(device, non_blocking=True)
        a = target.attention_inputs(start, T, max(starts) + T, row_start=torch.zeros_like(start))
        picked = torch.tensor([b * T + k for b, k in enumerate(last)]).to(device, non_blocking=True)
        kv = [layer[rows] for layer in self.kv_layers]
        return self.d.heads.run(z.reshape(B * T, -1), B, a, kv, target, picked)

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], Tensor | None]:
        B, heads = len(self.seen), self.d.heads.num_heads - 1
        g = min(max(gammas), heads)
        z = [torch.cat(p) if p else None for p in self.pending]  # each row's newly accepted positions
        self.pending = [[] for _ in range(B)]
        for b, rows in enumerate(z):  # a prompt just taken from the queue: its rows alone, all but the last
            if rows is not None and rows.shape[0] > max(gammas) + 1:  # (a round accepts at most gamma + 1)
                self._run(rows[None, :-1], [self.seen[b]], [rows.shape[0] - 2], slice(b, b + 1))
                self.seen[b] += rows.shape[0] - 1
                z[b] = rows[-1:]
        zero = next(r for r in z if r is not None)[:1] * 0  # (a stopped row: one row of zeros, its logits unused)
        counts = [0 if r is None else r.shape[0] for r in z]
        padded = pad_sequence([zero if r is None else r for r in z], batch_first=True)  # [B, m, H]
        logits = self._run(padded, self.seen, [max(k, 1) - 1 for k in counts], slice(0, B))[:g].transpose(0, 1)
        self.seen = [s + k for s, k in zip(self.seen, counts, strict=True)]
        lengths = [min(k, heads) for k in gammas]
        tokens, q = drawn(logits, sampler)
        return tokens, lengths, q

    def alone(self) -> Drafter:
        return self.d


def drawn(logits: Tensor, sampler: Sampler) -> tuple[Tensor, Tensor | None]:
    """Draft tokens [...] from logits [..., V]: their argmax (q None: deterministic drafts), or draws
    from the sampler's warped distributions q [..., V], which verification weighs them by."""
    if sampler.greedy:
        return argmax(logits), None
    q = sampler.probs(logits)
    return sampler.sample(q), q


def batch_drafter(drafter: Drafter) -> RowDrafter | None:
    """The batched form of a runtime drafter (prompt lookup, a stand-alone model, the target cut short
    or with layers skipped, EAGLE-3 and Medusa (trees or chains), MTP heads, lookup first before
    any of them), or None for the kinds that decode a prompt at a time (draft exits)."""
    if isinstance(drafter, NgramDrafter):
        return RowLookup(drafter.max_ngram, drafter.min_ngram)
    if isinstance(drafter, LookupFirst):
        inner = batch_drafter(drafter.drafter)
        return None if inner is None else RowLookupFirst(drafter, inner)
    if isinstance(drafter, MedusaDrafter):
        return RowMedusa(drafter)
    if isinstance(drafter, MTPDrafter):
        return RowMTP(drafter)
    if isinstance(drafter, Eagle3Drafter) and drafter.draft_exit is None:
        return RowEagle3(drafter)
    if isinstance(drafter, ModelDrafter) and drafter.draft_exit is None and drafter.shares_target_cache:
        return RowSelf(drafter)
    if isinstance(drafter, ModelDrafter) and drafter.draft_exit is None:
        return RowModel(drafter.model, drafter.vocab_size, drafter.name)
    return None
