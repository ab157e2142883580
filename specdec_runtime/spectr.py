"""SpecTr (Sun et al. 2023): k i.i.d. draft sequences verified in one target forward, each level
choosing among the drafts still alive with k-sequential selection, which keeps the output exactly
the target's distribution while accepting more often than one draft can.

    v = verify_spectr(draft, logits, sampler)          # draft.chains [k, g]: each sequence's node per depth
    rho, beta = selection_rate(p, q, k)                # P(a level accepts a draft) = 1 - (1 - beta)^k
    token, i = k_sequential(p, q, draws, sampler)      # one level: the first draw accepted, or the residual

k-sequential selection at a node (the paper's K-SEQ): the drafts alive there drew their next tokens
x_1..x_k i.i.d. from the drafter's q; draw i is accepted with probability min(1, p(x_i) / (rho
q(x_i))), in the order the drafts were sampled, the first accepted one is kept. A draw is accepted
as x with probability m(x) = min(q(x), p(x) / rho), one of them with beta = sum m, so x comes out
with probability m(x) (1 - (1 - beta)^k) / beta; when all k are rejected the token is drawn from
the residual p - that, normalized, which is a distribution when rho >= (1 - (1 - beta)^k) / beta:
rho* is the smallest such (found on the device: selection_rate). At k = 1, rho* = 1 and
this is standard speculative sampling. After an accepted token the drafts whose token it was go
on to the next level (their continuations are i.i.d. given that prefix), the others drop out; a
rejection ends the round with the residual's token, and a draft accepted to its end gets the
target's bonus token.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec_runtime.drafters.protocol import Draft
from specdec_runtime.sampling import Sampler
from specdec_runtime.verify import Verdict

GRID, PASSES = 32, 3  # rho* to within (k - 1) / 32^3


def _needed(beta: Tensor, k: int) -> Tensor:
    """(1 - (1 - beta)^k) / beta, its limit k where beta is 0."""
    return torch.where(beta > 0, (1 - (1 - beta) ** k) / beta.clamp_min(1e-30), torch.full_like(beta, float(k)))


def selection_rate(p: Tensor, q: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(rho*, beta(rho*)) of k draws from q where the target's distribution is p ([V] each): the
    smallest rho >= 1 whose residual is a distribution. P(the level accepts) = 1 - (1 - beta)^k.

    beta(rho) = sum over p/q <= rho of p / rho, plus q over the rest: with the ratios sorted once,
    any rho's beta is a search and two sums, so PASSES grids of GRID rhos narrow [1, k] down
    (rho - needed(beta(rho)) rises with rho: <= 0 at 1, >= 0 at k) in a few ops, on the device."""
    p, q = p.double(), q.double()
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.full_like(p, float("inf")))
    order = ratio.argsort()
    ratios = ratio[order]
    below_p = F.pad(p[order].cumsum(0), (1, 0))  # [V + 1] p summed over the i smallest ratios
    above_q = q.sum() - F.pad(q[order].cumsum(0), (1, 0))  # q summed over the rest

    def beta(rho: Tensor) -> Tensor:
        i = torch.searchsorted(ratios, rho, right=True)
        return below_p[i] / rho + above_q[i]

    lo, hi = p.new_ones(()), p.new_full((), float(k))
    if k > 1:
        steps = torch.linspace(0, 1, GRID + 1, dtype=p.dtype, device=p.device)[1:]
        for _ in range(PASSES):
            grid = lo + (hi - lo) * steps  # (lo, hi]: its last point holds
            first = (grid >= _needed(beta(grid), k)).int().argmax()
            lo, hi = torch.where(first > 0, grid[(first - 1).clamp(min=0)], lo), grid[first]
    return hi, beta(hi.view(1))[0]


def k_sequential(p: Tensor, q: Tensor, draws: Tensor, sampler: Sampler) -> tuple[Tensor, Tensor]:
    """One level's selection among draws [k] (token ids, i.i.d. from q, in the order drawn): (the
    token, the index of the accepted draw or k when all were rejected and the token is the
    residual's), both 0-dim on the device."""
    k = draws.shape[0]
    rho, beta = selection_rate(p, q, k)
    p64, q64 = p.double(), q.double()
    accept = sampler.uniform(k, p.device).double() * rho * q64[draws] < p64[draws]  # min(1, p / (rho q))
    first = torch.where(accept.any(), accept.int().argmax(), torch.tensor(k, device=p.device))
    residual = (p64 - _needed(beta.view(1), k)[0] * torch.minimum(q64, p64 / rho)).clamp_min(0)
    residual = torch.where(residual.sum() > 0, residual, p64)  # (rounding: p itself where nothing is left)
    token = torch.where(accept.any(), draws[first.clamp(max=k - 1)], sampler.sample(residual))
    return token, first


def verify_spectr(draft: Draft, logits: Tensor, sampler: Sampler) -> Verdict:
    """The round's Verdict (verify.Verdict) for k draft sequences merged into draft.tree: walk from
    the root, each level k-sequential selection among the sequences alive there (draft.chains [k, g]:
    sequence j's node at depth d + 1; draft.probs [N, V]: the distribution each node was drawn
    from), until a rejection (the residual's token) or a sequence's end (the bonus token). One host
    read of the sequences' nodes a round, and one of each level's outcome."""
    target = sampler.probs(logits)  # [N + 1, V]
    tokens = torch.cat([draft.tokens.new_zeros(1), draft.tokens])  # node -> token (the root's unused)
    chains = draft.chains.tolist()
    alive, node, path = list(range(len(chains))), 0, [0]
    g = len(chains[0])
    for d in range(g):
        nodes = [chains[j][d] for j in alive]
        draws = tokens[torch.tensor(nodes, device=tokens.device)]
        token, first = k_sequential(target[node], draft.probs[nodes[0] - 1], draws, sampler)
        i = int(first)
        if i == len(nodes):  # every draft rejected: the residual's token ends the round
            return _verdict(path, g, token)
        node = nodes[i]
        path.append(node)
        alive = [j for j in alive if chains[j][d] == node]
    return _verdict(path, g, sampler.sample(target[node]))


def _verdict(path: list[int], g: int, token: Tensor) -> Verdict:
    n = len(path) - 1
    padded = torch.tensor(path + [0] * (g - n), device=token.device)
    return Verdict(padded, torch.tensor(n, device=token.device), token)
