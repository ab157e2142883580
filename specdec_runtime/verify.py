"""Accepting drafts: exact greedy matching, lossless rejection sampling, Medusa's typical acceptance.

    v = verify(draft, root, target_logits, sampler)        # any draft: chain, tree, or none
    v.path, v.accept_len, v.token
    v = verify_greedy(draft_tokens, target_logits)         # the rules it dispatches to
    v = verify_sample(draft_tokens, draft_probs, target_probs, sampler)
    v = verify_tree_greedy(tree, nodes, target_logits)
    v = verify_tree_sample(tree, nodes, target_probs, sampler)
    v = verify_tree_typical(tree, nodes, target_probs, sampler, threshold=0.09, alpha=0.3)   # LOSSY

Every rule returns a Verdict: the accepted branch as node indices per depth (root first: path[:n + 1]
is accepted, a chain's path is 0..g), the accepted length n and the target's own next token after
it. The target's logits / probabilities have one row per node: the root (the newest token, which
the target has chosen but not cached) and every draft token. Everything stays on the device, so
the caller syncs with the host once per round. On a CPU the device is the host: greedy rounds read
the argmax the forward computed beside the logits with the draft at once and decide with the same
rules over host lists (cpu/host_rules.py: greedy_on_host; sampled rounds of deterministic drafts,
sample_on_host).
"""

from typing import NamedTuple

import torch
from torch import Tensor

from specdec_runtime.cpu.host_rules import walk_on_host
from specdec_runtime.drafters.protocol import Draft
from specdec_runtime.sampling import Sampler, argmax
from specdec_runtime.tree import Tree


class Verdict(NamedTuple):
    path: Tensor  # [D + 1] node index per depth, root first; entries past accept_len are not accepted
    accept_len: Tensor  # 0-dim: accepted draft tokens n
    token: Tensor  # 0-dim: the target's own token after them (a bonus token when everything was accepted)


def verify(
    draft: Draft | None,
    root: Tensor,
    logits: Tensor | None,
    sampler: Sampler,
    typical: tuple[float, float] | None = None,
    greedy: Tensor | None = None,
) -> Verdict:
    """The rule for this draft and sampler. logits [N + 1, V]: the target's after the root and after
    every draft token; greedy [N + 1]: their argmax where the forward computed it (DecoderOutput),
    read instead of computing it again (for a greedy sampler the logits may then be None).
    typical=(posterior_threshold, alpha) selects Medusa's typical acceptance for sampling, which is
    LOSSY."""
    if draft is None or not draft.tokens.numel():  # a plain decode step
        path = chain_path(0, root.device)
        token = greedy[0] if sampler.greedy and greedy is not None else sampler.next_token(logits[0])
        return Verdict(path, path[0], token)
    tree = draft.tree
    if tree is None and (sampler.greedy or typical is None):
        if sampler.greedy:
            return verify_greedy(draft.tokens, logits, greedy)
        return verify_sample(draft.tokens, draft.probs, sampler.probs(logits), sampler)
    tree = tree or Tree.chain(draft.tokens.shape[0])
    nodes = torch.cat([root.view(1), draft.tokens])
    if sampler.greedy:
        return verify_tree_greedy(tree, nodes, logits, greedy)
    probs = sampler.probs(logits)
    if typical is not None:
        return verify_tree_typical(tree, nodes, probs, sampler, threshold=typical[0], alpha=typical[1])
    return verify_tree_sample(tree, nodes, probs, sampler)


_CHAIN_PATHS: dict[tuple[int, torch.device], Tensor] = {}


def pick(x: Tensor, i: Tensor) -> Tensor:
    """x[i] for a 0-dim index tensor i, on the device: indexing with x[i] reads i on the host first
    (a sync a round on a GPU; the tests run every rule on meta tensors, which have no values to read)."""
    return x.index_select(0, i.view(1)).squeeze(0)


def chain_path(g: int, device: torch.device) -> Tensor:
    """0, 1, ..., g on the device (cached: a chain's path never changes)."""
    key = (g, torch.device(device))
    if key not in _CHAIN_PATHS:
        _CHAIN_PATHS[key] = torch.arange(g + 1, device=device)
    return _CHAIN_PATHS[key]


def accepted_prefix(ok: Tensor) -> Tensor:
    """Length of the leading run of True in ok [g] (a 0-dim long tensor)."""
    return ok.long().cumprod(dim=0).sum()


def verify_forced(
    draft: Draft, logits: Tensor | None, greedy: Tensor | None, rate: float, generator: torch.Generator
) -> Verdict:
    """For measuring the runtime's mechanics only (generate's accept_rate), NOT lossless: each depth's
    drafted token (a tree's first child there: no earlier sibling) is accepted with probability
    `rate` whatever its value, as SGLang's simulated acceptance; the target then adds its argmax."""
    tokens = draft.tokens
    choice = argmax(logits) if greedy is None else greedy
    # depth d's draw u[d]; as many every round (a tree's depth is not always known on the host)
    u = torch.rand(max(64, draft.depth + 1), device=tokens.device, generator=generator) < rate
    if draft.tree is None:
        n = accepted_prefix(u[1 : tokens.shape[0] + 1])
        return Verdict(chain_path(tokens.shape[0], tokens.device), n, pick(choice, n))
    t = draft.tree.tensors_on(tokens.device)
    chosen = ~t["earlier"].any(dim=1) & u[t["depth"]]
    path, n = _walk_on_device(t, chosen)
    return Verdict(path, n, pick(choice, pick(path, n)))


def verify_greedy(draft: Tensor, target_logits: Tensor, greedy: Tensor | None = None) -> Verdict:
    """Accept the longest draft prefix equal to the target's argmax; the target then adds one token.

    draft [g] token ids; target_logits [g + 1, V] (greedy: their argmax, where it is known). The
    output equals the target's own greedy decoding, token for token.
    """
    choice = argmax(target_logits) if greedy is None else greedy  # [g + 1]
    n = accepted_prefix(choice[:-1] == draft)
    return Verdict(chain_path(draft.shape[0], draft.device), n, pick(choice, n))


def verify_sample(draft: Tensor, draft_probs: Tensor | None, target_probs: Tensor, sampler: Sampler) -> Verdict:
    """Leviathan/Chen speculative sampling: accept draft token i with prob min(1, p_i(x) / q_i(x)).

    draft [g]; draft_probs q [g, V] (None for a deterministic drafter, i.e. q is one-hot);
    target_probs p [g + 1, V]. At the first rejection the next token is drawn from
    normalize(max(0, p - q)); if all are accepted it is drawn from p at the bonus position.
    The returned tokens are distributed exactly as samples from p.
    """
    g = draft.shape[0]
    rows = torch.arange(g, device=draft.device)
    p_draft = target_probs[rows, draft]  # [g]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        q = torch.zeros_like(target_probs[:g]).scatter_(1, draft[:, None], 1.0)  # [g, V] one-hot
    else:
        q_draft = draft_probs[rows, draft]
        q = draft_probs
    ok = sampler.uniform(g, draft.device) * q_draft < p_draft  # u < p / q without dividing
    n = accepted_prefix(ok)
    residual = torch.cat([(target_probs[:g] - q).clamp_(min=0), target_probs[g:]])  # [g + 1, V]
    row = pick(residual, n)
    # p == q on a row leaves no residual mass; rejection there has probability 0, so p is used.
    row = torch.where(row.sum() > 0, row, pick(target_probs, n))
    return Verdict(chain_path(g, draft.device), n, sampler.sample(row))  # sampling normalizes implicitly


def verify_rows_sample(
    drafts: Tensor, lengths: Tensor, draft_probs: Tensor | None, target_probs: Tensor, sampler: Sampler
) -> tuple[Tensor, Tensor]:
    """verify_sample for every row of a batch at once (batched.generate_many): a few kernels a round
    whatever the batch size, where a rule a row launches them B times. drafts [B, g], row b's first
    lengths[b] [B] real (the rest padding); draft_probs q [B, g, V] or None (deterministic drafts);
    target_probs p [B, g + 1, V]. Returns (the accepted lengths n [B], the tokens after them [B]),
    each row as verify_sample decides it: the residual max(0, p - q) at its first rejection, p
    after a draft accepted whole."""
    B, g = drafts.shape
    if g == 0:
        return lengths * 0, sampler.sample(target_probs[:, 0])
    real = torch.arange(g, device=drafts.device) < lengths[:, None]  # [B, g]
    p_draft = target_probs[:, :g].gather(2, drafts[..., None]).squeeze(-1)  # [B, g]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(2, drafts[..., None]).squeeze(-1)
    ok = sampler.uniform(B * g, drafts.device).view(B, g) * q_draft < p_draft  # u < p / q without dividing
    n = (ok & real).long().cumprod(dim=1).sum(dim=1)  # [B]
    V = target_probs.shape[-1]
    p_n = target_probs.gather(1, n[:, None, None].expand(B, 1, V)).squeeze(1)  # [B, V]
    at = n.clamp(max=g - 1)[:, None]  # (a row accepted whole reads p alone)
    if draft_probs is None:  # a one-hot q: the rejected token's mass removed
        residual = p_n.scatter(1, drafts.gather(1, at), 0.0)
    else:
        residual = (p_n - draft_probs.gather(1, at[..., None].expand(B, 1, V)).squeeze(1)).clamp_(min=0)
    row = torch.where((n < lengths)[:, None], residual, p_n)
    # p == q on a row leaves no residual mass; rejection there has probability 0, so p is used.
    row = torch.where(row.sum(-1, keepdim=True) > 0, row, p_n)
    return n, sampler.sample(row)


def _walk(tree: Tree, t: dict[str, Tensor], chosen: Tensor) -> tuple[Tensor, Tensor]:
    """The deepest node whose ancestors are all chosen (first in node order on ties).

    chosen [N+1] bool (the root counts as chosen). Returns (path [D+1], accept_len): the node per
    depth, root first; entries past accept_len point at the root. On a CPU the device is the host,
    so the tree's own lists are walked (host_rules.walk_on_host: a dozen small tensor ops, cold after the
    target's weight stream, cost more there: docs/log/cpu-kernel.md); elsewhere it stays on the
    device (_walk_on_device), so that the loop syncs once a round.
    """
    return walk_on_host(tree, chosen) if chosen.device.type == "cpu" else _walk_on_device(t, chosen)


def _walk_on_device(t: dict[str, Tensor], chosen: Tensor) -> tuple[Tensor, Tensor]:
    chosen = chosen | (t["depth"] == 0)  # the root counts as chosen (chosen[0] = True would sync on CUDA)
    reached = ~(t["ancestor"] & ~chosen[None, :]).any(dim=1)  # [N+1]
    n_nodes = chosen.shape[0]
    score = torch.where(reached, t["depth"] * n_nodes + (n_nodes - 1 - torch.arange(n_nodes, device=chosen.device)), -1)
    last = score.argmax()
    n = pick(t["depth"], last)
    on_path = pick(t["ancestor"], last)  # [N+1] the branch root..last
    by_depth = on_path[:, None] & (t["depth"][:, None] == t["levels"][None, :])  # [N+1, D+1]
    return by_depth.to(torch.uint8).argmax(dim=0), n  # [D+1]; entries past n point at the root


def verify_tree_greedy(tree: Tree, tokens: Tensor, logits: Tensor, greedy: Tensor | None = None) -> Verdict:
    """Accept the branch the target's argmax follows; exact, so the output is the target's greedy output.

    tokens [N+1] node tokens (root first); logits [N+1, V] the target's logits after each node
    (greedy: their argmax, where it is known).
    """
    t = tree.tensors_on(tokens.device)
    choice = argmax(logits) if greedy is None else greedy  # [N+1]
    chosen = tokens == choice[t["parent"]]  # siblings are distinct, so at most one matches
    path, n = _walk(tree, t, chosen)
    return Verdict(path, n, pick(choice, pick(path, n)))


def verify_tree_sample(tree: Tree, tokens: Tensor, probs: Tensor, sampler: Sampler) -> Verdict:
    """Lossless tree verification for sampling (SpecInfer's multi-candidate rejection sampling).

    probs [N+1, V]: the target's warped distributions after each node. At a node with target
    distribution p, its children (distinct, deterministic candidates) are tried best-first; child c
    is accepted with probability p'(c), where p' is p with the rejected earlier siblings removed
    and renormalized. When every child is rejected the next token is drawn from that residual.
    Each step is a speculative-sampling step with a one-hot draft, so tokens follow p exactly.
    """
    t = tree.tensors_on(tokens.device)
    p_tok = probs[t["parent"], tokens]  # [N+1] p_parent(token)
    tried_mass = t["earlier"].to(probs.dtype) @ p_tok  # [N+1] mass of earlier siblings
    u = sampler.uniform(tokens.shape[0], tokens.device)
    ok = u * (1 - tried_mass).clamp_(min=0) < p_tok  # u < p(c) / (1 - tried) without dividing
    first_ok = ok & ~(t["earlier"] & ok).any(-1)  # no earlier sibling accepted (CUDA has no integer matmul)
    path, n = _walk(tree, t, first_ok)
    last = pick(path, n)
    p_last = pick(probs, last)
    children = (t["parent"] == last) & (torch.arange(tokens.shape[0], device=tokens.device) > 0)
    # every child of the last node was tried and rejected (a mask over the vocabulary: tokens[children]
    # would read the mask on the host)
    tried = torch.zeros_like(p_last).index_put_((tokens,), children.to(p_last.dtype), accumulate=True)
    row = torch.where(tried > 0, 0.0, p_last)
    row = torch.where(row.sum() > 0, row, p_last)  # p entirely on rejected children: probability 0
    return Verdict(path, n, sampler.sample(row))


def verify_rows_tree_sample(
    nodes: Tensor, tree: dict[str, Tensor], probs: Tensor, sampler: Sampler
) -> tuple[Tensor, Tensor, Tensor]:
    """verify_tree_sample for every row of a batch at once (batched.generate_many's token trees): a
    few kernels a round whatever the batch size. nodes [B, N + 1] each row's root and nodes; tree the
    tensors of a tree a row (parent, depth, ancestor, earlier with a row dimension, and optionally
    alive: nodes never tried where False; levels [D + 1] shared); probs [B, N + 1, V] the target's
    warped distributions after each node. Returns (the accepted lengths n [B], the tokens after
    them [B], the accepted branches [B, D + 1]), each row as verify_tree_sample decides it with the
    same uniform draws (to rounding: the sums of earlier siblings' mass run in another order)."""
    B, T = nodes.shape
    rows = torch.arange(B, device=nodes.device)
    p_tok = probs[rows[:, None], tree["parent"], nodes]  # [B, N + 1] p_parent(token)
    tried_mass = (tree["earlier"].to(probs.dtype) @ p_tok[..., None]).squeeze(-1)  # earlier siblings' mass
    u = sampler.uniform(B * T, nodes.device).view(B, T)
    ok = u * (1 - tried_mass).clamp_(min=0) < p_tok
    if "alive" in tree:  # (dead nodes, no node's earlier siblings: never tried)
        ok = ok & tree["alive"]
    first_ok = ok & ~(tree["earlier"] & ok[:, None, :]).any(-1)
    path, n = walk_rows(tree, first_ok)
    last = path.gather(1, n[:, None]).squeeze(1)  # [B]
    p_last = probs[rows, last]  # [B, V]
    children = (tree["parent"] == last[:, None]) & (torch.arange(T, device=nodes.device) > 0)
    if "alive" in tree:
        children = children & tree["alive"]
    tried = torch.zeros_like(p_last).scatter_add_(1, nodes, children.to(p_last.dtype))  # its rejected children
    row = torch.where(tried > 0, 0.0, p_last)
    row = torch.where(row.sum(-1, keepdim=True) > 0, row, p_last)  # p entirely on rejected children
    return n, sampler.sample(row), path


def walk_rows(tree: dict[str, Tensor], chosen: Tensor) -> tuple[Tensor, Tensor]:
    """verify._walk_on_device for every row: (path [B, D + 1], n [B]) of the deepest node whose
    ancestors are all chosen [B, N + 1] (first in node order on ties)."""
    depth, ancestor = tree["depth"], tree["ancestor"]
    chosen = chosen | (depth == 0)  # the root counts as chosen
    reached = ~(ancestor & ~chosen[:, None, :]).any(dim=-1)  # [B, N + 1]
    T = chosen.shape[1]
    score = torch.where(reached, depth * T + (T - 1 - torch.arange(T, device=chosen.device)), -1)
    last = score.argmax(dim=1, keepdim=True)  # [B, 1]
    on_path = ancestor.gather(1, last[..., None].expand(-1, 1, T)).squeeze(1)  # [B, N + 1] the branch root..last
    by_depth = on_path[:, :, None] & (depth[:, :, None] == tree["levels"])  # [B, N + 1, D + 1]
    return by_depth.to(torch.uint8).argmax(dim=1), depth.gather(1, last).squeeze(1)


def verify_tree_typical(
    tree: Tree, tokens: Tensor, probs: Tensor, sampler: Sampler, *, threshold: float, alpha: float
) -> Verdict:
    """Medusa's typical acceptance (LOSSY): accept a candidate whose target probability exceeds
    min(threshold, alpha * exp(-entropy)) of the distribution it is judged by; take the deepest
    accepted branch (best-ranked on ties) and sample the next token from the target there.

    Output no longer follows the target's distribution exactly; it trades fidelity for tau.
    """
    t = tree.tensors_on(tokens.device)
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(dim=-1)  # [N+1]
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    chosen = probs[t["parent"], tokens] > bar[t["parent"]]
    path, n = _walk(tree, t, chosen)
    return Verdict(path, n, sampler.sample(pick(probs, pick(path, n))))
