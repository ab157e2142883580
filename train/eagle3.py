"""Training EAGLE-3 drafters: the target's features, the training-time test, a warm start.

    states = target_states(aux_layers=(2, 15, 27))           # for train.hidden_cache: taps [B, T, 3H], final [B, T, H]
    model = Eagle3Training(drafter, embed_weight, head_rows, steps=4, decay=0.8)
    loss, n, metrics = model(input_ids, attention_mask, target_mask, taps, final)   # sums over response tokens
    tau = tau_estimate([0.8, 0.6, 0.5, 0.4])                 # tokens per target forward of a chain of 4

The training-time test (EAGLE-3's "TTT") unrolls `steps` draft steps in training, each fed the
drafter's own previous output as at run time. Row p of step 0 reads the target's features at p and
the token at p + 1; row p of step k reads step k-1's output at p and the token at p + 1 + k, sits
at rope position p + k and predicts the token at p + k + 2. It attends to step 0's rows 0..p (the
positions whose features came from the target) and to its own earlier steps at p, which is
exactly what the runtime drafter's row p + k sees after drafting k tokens past position p.

The loss of step k is the forward KL from the target's next-token distribution restricted to the
draft vocabulary (softmax over those logits) to the drafter's, at every response position whose
token is in the draft vocabulary, weighted by decay^k and summed over tokens. Per step it logs the
drafter's top-1 agreement with the target (conditional on the earlier steps' tokens being right,
as a chain's acceptance is), from which tau_estimate predicts the tokens per target forward.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from specdec_runtime.drafters.eagle3_model import Eagle3Model, grouped


def target_states(aux_layers: Sequence[int]) -> Callable[[Any, Tensor, Tensor], dict[str, Tensor]]:
    """A train.hidden_cache states function: the residual streams after the aux layers,
    concatenated ("taps" [B, T, 3H]), and the final-norm hidden state ("final" [B, T, H])."""

    def states(target: Any, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        out = target.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        hs = out.hidden_states  # [embeddings, after layer 1, ..., after the last layer + final norm]
        return {"taps": torch.cat([hs[k] for k in aux_layers], dim=-1), "final": out.last_hidden_state}

    return states


def shifted(x: Tensor, k: int, fill: float | int = 0) -> Tensor:
    """x [B, T, ...] moved k positions earlier (x[:, k:]), padded at the end with `fill` to length T."""
    pad = x.new_full((x.shape[0], k, *x.shape[2:]), fill)
    return torch.cat([x[:, k:], pad], dim=1)


class TTTAttention:
    """Attention of the training-time test: step 0 is causal over step 0's rows (within its
    document where sequences are packed); step k's row p also sees its own earlier steps' keys at p
    (one extra key per step).

    One scaled_dot_product_attention a step over the keys of steps 0..k side by side
    [B, h, (k+1)T, D], under an additive mask [1, 1, T, steps T] made once in the queries' dtype
    (its first T columns causal, each later block the diagonal) and sliced per step, so the
    backward keeps the mask once, the keys, the output and a log-sum-exp a row: no [T, T] matrix
    per head (the naive attention kept B x h x T x (T + k) fp32 a step: 45 GB at 2k tokens,
    micro-batch 8, issue 60). Packed rows attend a document per row (`Documents`: one call per
    group of similar lengths), so the rest of the layer runs on the packed tokens and the
    attention costs no more than the unpacked batch's. A checkpointed step recomputes its own
    keys in the backward (`step` names the step the next call belongs to; later steps' keys are
    not read again)."""

    def __init__(self, length: int, device: torch.device, steps: int, documents: Tensor | None = None):
        self.documents = None if documents is None else Documents(documents)
        self.steps, self.step, self.device = steps, 0, device
        self.keys: list[list[Tensor]] = []  # [step][group] (one group where nothing is packed)
        self.values: list[list[Tensor]] = []
        self.masks: dict[tuple[torch.dtype, int], Tensor] = {}

    def mask(self, dtype: torch.dtype, T: int) -> Tensor:
        """The additive mask [1, 1, T, steps T] in the queries' dtype, made on first use."""
        if (dtype, T) not in self.masks:
            causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
            diagonal = torch.eye(T, dtype=torch.bool, device=self.device)
            allowed = torch.cat([causal, *[diagonal] * (self.steps - 1)], dim=-1)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            self.masks[dtype, T] = mask.masked_fill_(~allowed, float("-inf"))[None, None]
        return self.masks[dtype, T]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        split = self.documents.split if self.documents is not None else lambda x: [x]
        qs = split(q)
        self.keys[self.step :] = [split(k)]  # a recomputed (checkpointed) step replaces its own keys
        self.values[self.step :] = [split(v)]
        h, n = q.shape[1], self.step + 1
        out = []
        for g, q in enumerate(qs):
            keys, values = (grouped(torch.cat([x[g] for x in xs[:n]], dim=2), h) for xs in (self.keys, self.values))
            T = q.shape[2]
            out.append(F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask(q.dtype, T)[..., : n * T]))
        return out[0] if self.documents is None else self.documents.join(out)


class Documents:
    """Packed rows' documents laid out a document per row for the attention, in groups of
    similar lengths (each document at least 2/3 of its group's longest): `split` takes
    [R, h, L, d] (rows of packed tokens) to a [n, h, T, d] per group (document d's tokens at
    0..len - 1, T the group's longest; the slots after a document's end hold copies of a real
    token, which no real token attends: the mask is causal), `join` takes them back (what a
    packed row holds after its last document is a copy of a real token's output, read by nothing
    that has a loss)."""

    def __init__(self, documents: Tensor, similar: float = 2 / 3):
        R, L = documents.shape
        where = (documents.flatten() >= 0).nonzero().squeeze(1)  # packed tokens, documents contiguous
        ids, row = documents.flatten()[where], where // L
        starts = F.pad((ids[1:] != ids[:-1]) | (row[1:] != row[:-1]), (1, 0), value=True)
        document = starts.cumsum(0) - 1
        lengths = torch.bincount(document).tolist()
        self.groups: list[tuple[int, int]] = []  # (documents, longest)
        base = [0] * len(lengths)  # where each document's first token goes in the split layout
        at = 0
        for d in sorted(range(len(lengths)), key=lambda d: -lengths[d]):
            if not self.groups or lengths[d] < similar * self.groups[-1][1]:
                self.groups.append((0, lengths[d]))
            n, longest = self.groups[-1]
            self.groups[-1] = (n + 1, longest)
            base[d], at = at, at + longest
        slot = torch.tensor(base, device=where.device)[document] + positions_in_documents(documents).flatten()[where]
        self.gather = where.new_zeros(at).index_copy_(0, slot, where)
        self.scatter = where.new_zeros(R * L).index_copy_(0, where, slot)
        self.rows = (R, L)

    def split(self, x: Tensor) -> list[Tensor]:
        h, d = x.shape[1], x.shape[3]
        flat = x.transpose(1, 2).reshape(-1, h, d)[self.gather]
        parts = flat.split([n * longest for n, longest in self.groups])
        return [p.view(n, longest, h, d).transpose(1, 2) for p, (n, longest) in zip(parts, self.groups, strict=True)]

    def join(self, parts: list[Tensor]) -> Tensor:
        h, d = parts[0].shape[1], parts[0].shape[3]
        flat = torch.cat([p.transpose(1, 2).reshape(-1, h, d) for p in parts])[self.scatter]
        return flat.view(*self.rows, h, d).transpose(1, 2)


def positions_in_documents(documents: Tensor) -> Tensor:
    """[B, T] each position's offset from the start of its document (documents [B, T]: contiguous ids)."""
    T = documents.shape[1]
    index = torch.arange(T, device=documents.device).expand_as(documents)
    starts = F.pad(documents[:, 1:] != documents[:, :-1], (1, 0), value=True)
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def pack(
    lengths: Sequence[int], budget: int, input_ids: Tensor, target_mask: Tensor, taps: Tensor, final: Tensor
) -> dict[str, Tensor]:
    """Right-padded rows (their `lengths`) packed first-fit into rows of at most `budget` tokens:
    input_ids, target_mask (False at each document's last token: its next token is another's),
    taps, final, and documents [R, L] (an id per packed row segment, -1 after the last)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for b in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
        r = next((r for r in range(len(rows)) if room[r] >= lengths[b]), None)
        if r is None:
            rows.append([])
            room.append(budget)
            r = len(rows) - 1
        rows[r].append(b)
        room[r] -= lengths[b]
    L = max(budget - r for r in room)
    target_mask = F.pad(target_mask, (0, input_ids.shape[1] - target_mask.shape[1]))  # [B, T]
    out = {
        "input_ids": input_ids.new_zeros(len(rows), L),
        "target_mask": target_mask.new_zeros(len(rows), L),
        "taps": taps.new_zeros(len(rows), L, taps.shape[-1]),
        "final": final.new_zeros(len(rows), L, final.shape[-1]),
        "documents": input_ids.new_full((len(rows), L), -1),
    }
    for r, members in enumerate(rows):
        at = 0
        for b in members:
            n = lengths[b]
            for key, x in (("input_ids", input_ids), ("taps", taps), ("final", final)):
                out[key][r, at : at + n] = x[b, :n]
            out["target_mask"][r, at : at + n - 1] = target_mask[b, : n - 1]
            out["documents"][r, at : at + n] = b
            at += n
    return out


class Eagle3Training(nn.Module):
    """The trained drafter with what it reads from the frozen target (kept out of its parameters:
    checkpoints and DDP carry the drafter only); forward returns the TTT loss."""

    def __init__(
        self,
        drafter: Eagle3Model,
        embed: Tensor,
        head_rows: Tensor,
        *,
        steps: int,
        decay: float,
        ranks: int = 1,
        checkpoint_steps: bool = False,
    ):
        super().__init__()
        self.drafter, self.steps, self.decay, self.ranks = drafter, steps, decay, ranks
        self.checkpoint_steps = checkpoint_steps  # recompute each unrolled step's layer in the backward
        self.hits: list[Tensor] | None = None  # set to [] to record each step's top-1 hits [B, T] (replay_chain)
        self._frozen = [
            embed,
            head_rows,
        ]  # the target's embeddings [V, H_t] and lm_head rows of the draft vocab [N, H_t]

    def _layer_step(self, embeds: Tensor, feature: Tensor, positions: Tensor, k: int, attend: TTTAttention) -> Tensor:
        attend.step = k  # (again when a checkpointed step is recomputed in the backward)
        return self.drafter.layer_step(embeds, feature, positions + k, attend)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        target_mask: Tensor,
        taps: Tensor,
        final: Tensor,
        documents: Tensor | None = None,
    ) -> tuple[Tensor, int, dict[str, Tensor]]:
        """(loss summed over tokens and steps, response tokens, {step{k}/...: sums}); target_mask[b, t]
        says input_ids[b, t + 1] is a response token. taps, final: the target's states [B, T, *].
        documents [B, T]: packed rows (`pack`): each position's document; rope positions restart
        at each, and nothing attends or predicts across them."""
        d = self.drafter
        embed, head_rows = self._frozen
        T, dev = input_ids.shape[1], input_ids.device
        target_mask = F.pad(target_mask, (0, T - target_mask.shape[1]))  # [B, T]
        in_vocab = d.t2d[input_ids]  # [B, T]: the (target-chosen) token is in the draft vocabulary
        if documents is None:
            positions = torch.arange(T, device=dev)
        else:
            positions = positions_in_documents(documents)
            in_vocab = in_vocab & (documents >= 0)
        attend = TTTAttention(T, dev, self.steps, documents)
        feature = d.project(taps.to(d.fc.weight.dtype))  # [B, T, H]
        loss = feature.new_zeros((), dtype=torch.float32)
        metrics: dict[str, Tensor] = {}
        # Step k's row p predicts the token at p + k + 2, which the target predicts at position
        # p + k + 1: logits only where that token is a response token in the draft vocabulary. The
        # target's log-probabilities there are computed once, at every position any step needs.
        valid = [shifted(target_mask, k + 1, False) & shifted(in_vocab, k + 2, False) for k in range(self.steps)]
        if documents is not None:  # the predicted token in the row's own document
            valid = [v & (shifted(documents, k + 2, -1) == documents) for k, v in enumerate(valid)]
        with torch.no_grad():
            needed = torch.zeros_like(target_mask)  # [B, T] target positions some step reads
            for k, v in enumerate(valid):
                needed[:, k + 1 :] |= v[:, : T - k - 1]
            at = torch.full(needed.shape, -1, dtype=torch.long, device=dev)
            at[needed] = torch.arange(int(needed.sum()), device=dev)  # position -> row of target_logp
            target_logp = (final[needed] @ head_rows.to(final.dtype).t()).float().log_softmax(-1)  # [m, N]
        for k in range(self.steps):
            tokens = shifted(input_ids, 1 + k)  # row p: the token at p + 1 + k
            embeds = F.embedding(tokens, embed).to(feature.dtype)
            if self.checkpoint_steps and torch.is_grad_enabled():
                feature = checkpoint(self._layer_step, embeds, feature, positions, k, attend, use_reentrant=False)
            else:
                feature = self._layer_step(embeds, feature, positions, k, attend)
            logp = d.head(feature[valid[k]]).float().log_softmax(-1)  # [n, N]
            t_logp = target_logp[shifted(at, k + 1, -1)[valid[k]]]  # [n, N]
            kl = (t_logp.exp() * (t_logp - logp)).sum(-1)  # [n]
            loss = loss + self.decay**k * kl.sum()
            with torch.no_grad():  # how often the target's token is the drafter's rank-r choice, r < ranks
                ranked = logp.topk(self.ranks, dim=-1).indices == t_logp.argmax(-1)[:, None]  # [n, R]
                if self.hits is not None:
                    self.hits.append(torch.zeros_like(valid[k]).masked_scatter_(valid[k], ranked[:, 0]))
                hits = ranked.float().sum(0)  # [R]
                metrics |= {f"step{k}/kl": kl.sum().detach(), f"step{k}/top1": hits[0]}
                metrics |= {f"step{k}/rank{r}": hits[r] for r in range(1, self.ranks)}
                metrics[f"step{k}/count"] = torch.tensor(float(kl.numel()), device=dev)
        return loss, int(target_mask.sum()), metrics


def accuracies(stats: dict[str, float], steps: int, ranks: int) -> list[list[float]]:
    """acc[k][r]: how often step k's rank-r candidate was the target's token (per_group_rates'd stats)."""
    return [[stats[f"step{k}/top1" if r == 0 else f"step{k}/rank{r}"] for r in range(ranks)] for k in range(steps)]


def replay_chain(hits: Sequence[Tensor], first: int, end: int, gamma: int) -> tuple[int, int]:
    """(tokens, target forwards) of greedy chain decoding of one sequence from the training-time
    test's hits (hits[k][p]: step k of row p drafts the target's token p + k + 2), replayed as the
    runtime decodes: the prefill makes the token at `first`; a round whose newest token is at q
    drafts from row q - 1 and accepts its leading hits, then the target adds one; until `end`
    (exclusive: the tokens generated, at most the generation budget)."""
    q, forwards = first, 1
    while q + 1 < end:
        accepted = 0
        for k in range(min(gamma, end - q - 2, len(hits))):  # drafts stop before the budget's last token
            if not hits[k][q - 1]:
                break
            accepted += 1
        q += accepted + 1
        forwards += 1
    return end - first, forwards


def tau_estimate(accuracies: Sequence[float]) -> float:
    """Tokens per target forward of a greedy chain drafting len(accuracies) tokens, when draft k
    is right with probability accuracies[k] given the ones before it were: 1 (the target's own
    token) + the expected accepted length, sum_j prod_{i<j} acc_i."""
    tau, run = 1.0, 1.0
    for a in accuracies:
        run *= a
        tau += run
    return tau


@torch.no_grad()
def warm_start(model: Eagle3Model, target: Any, draft_ids: Tensor) -> None:
    """Start the output side from the target: lm_head = the target's rows of the draft vocabulary,
    the final norm = the target's (the drafter's states then live in the target's final space from
    the first step); fc and the layer keep their random initialization. (Copying the target's last
    layer as well is no help: with the feature of position p it predicts the token at p + 1, which
    the drafter already reads; it must predict p + 2.)"""
    if model.config.layer.hidden_size != model.config.target_hidden_size:
        return  # a narrower drafter has no target weights to copy
    model.lm_head.weight.copy_(target.get_output_embeddings().weight[draft_ids.to(model.lm_head.weight.device)])
    model.norm.weight.copy_(target.model.norm.weight)
