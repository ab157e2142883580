"""Accepting draft tokens: exact greedy matching and lossless rejection sampling.

    accept_len, next_token = verify_greedy(draft, target_logits)
    accept_len, next_token = verify_sample(draft, draft_probs, target_probs, sampler)

Both take gamma draft tokens and the target's gamma + 1 predictions (one per draft position plus
the bonus position) and return tensors, so the caller decides when to sync with the host.
"""

import torch
from torch import Tensor

from specdec_runtime.sampling import Sampler


def accepted_prefix(ok: Tensor) -> Tensor:
    """Length of the leading run of True in ok [g] (a 0-dim long tensor)."""
    return ok.long().cumprod(dim=0).sum()


def verify_greedy(draft: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Accept the longest draft prefix equal to the target's argmax; the target then adds one token.

    draft [g] token ids; target_logits [g + 1, V]. Returns (accept_len, next_token), 0-dim tensors.
    The output equals the target's own greedy decoding, token for token.
    """
    choice = target_logits.argmax(dim=-1)  # [g + 1]
    n = accepted_prefix(choice[:-1] == draft)
    return n, choice[n]


def verify_sample(
    draft: Tensor, draft_probs: Tensor | None, target_probs: Tensor, sampler: Sampler
) -> tuple[Tensor, Tensor]:
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
    row = residual[n]
    # p == q on a row leaves no residual mass; rejection there has probability 0, so p is used.
    row = torch.where(row.sum() > 0, row, target_probs[n])
    return n, sampler.sample(row)  # sampling normalizes implicitly
