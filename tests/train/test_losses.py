"""Divergences against naive float64 loops over the vocabulary."""

import math

import pytest
import torch

from train import losses
from train.losses import Teacher


def naive(kind: str, p: list[float], q: list[float], beta: float = 0.5) -> float:
    """The textbook formula, token by token, with 0 log 0 = 0."""
    kl = lambda a, b: sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)
    if kind == "fkl":
        return kl(p, q)
    if kind == "rkl":
        return kl(q, p)
    if kind == "jsd":
        m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    return 0.5 * sum(abs(x - y) for x, y in zip(p, q))


def logits(seed: int, n: int = 5, v: int = 11) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("kind", losses.KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_dense_divergences_match_naive(kind, temperature):
    s, t = logits(0), logits(1)
    got = losses.divergence(kind, s, Teacher.dense(t), beta=0.3, temperature=temperature)
    p, q = (t.double() / temperature).softmax(-1), (s.double() / temperature).softmax(-1)
    want = [naive(kind, p[i].tolist(), q[i].tolist(), beta=0.3) for i in range(len(s))]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["fkl", "jsd", "tvd"])
def test_sparse_teacher_is_the_renormalized_top_k_distribution(kind):
    s, t, k = logits(2), logits(3), 4
    got = losses.divergence(kind, s, Teacher.top_k(t, k), beta=0.5)
    q = s.double().softmax(-1)
    want = []
    for i in range(len(t)):
        top = t[i].topk(k).indices
        p = torch.zeros_like(q[i])
        p[top] = t[i, top].double().softmax(-1)  # zero outside the top-k
        want.append(naive(kind, p.tolist(), q[i].tolist()))
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_sparse_with_k_equal_vocab_is_dense():
    s, t = logits(4), logits(5)
    for kind in ("fkl", "jsd", "tvd"):
        dense = losses.divergence(kind, s, Teacher.dense(t))
        torch.testing.assert_close(losses.divergence(kind, s, Teacher.top_k(t, t.shape[1])), dense)


def test_zero_when_equal_and_gradients_flow():
    t = logits(6)
    for kind in losses.KINDS:
        assert losses.divergence(kind, t, Teacher.dense(t)).abs().max() < 1e-6
    s = logits(7).requires_grad_()
    losses.divergence("fkl", s, Teacher.dense(t)).sum().backward()
    # d KL(p||q) / d student logits = q - p
    torch.testing.assert_close(s.grad, s.detach().softmax(-1) - t.softmax(-1), rtol=1e-5, atol=1e-6)


def test_one_minus_tvd_is_the_acceptance_rate():
    """Leviathan et al.: P(accept a draft x ~ q) = sum_x min(p, q) = 1 - TVD(p, q)."""
    s, t = logits(8), logits(9)
    accept = torch.minimum(s.softmax(-1), t.softmax(-1)).sum(-1)
    torch.testing.assert_close(1 - losses.total_variation(s, Teacher.dense(t)), accept)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown loss"):
        losses.check_loss("kl", 0.5, False)
    with pytest.raises(ValueError, match="0 < beta < 1"):
        losses.check_loss("jsd", 1.0, False)
    with pytest.raises(ValueError, match="top_k=0"):
        losses.check_loss("rkl", 0.5, True)
    with pytest.raises(ValueError, match="dense"):
        losses.reverse_kl(logits(0), Teacher.top_k(logits(1), 3))
