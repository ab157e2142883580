"""Distillation divergences between a teacher (the target) and a student (the drafter), per token.

    teacher = Teacher.dense(target_logits)                  # [N, V] logits of the response tokens
    teacher = Teacher.top_k(target_logits, k=64)            # sparse: top-k renormalized, saves memory
    per_token = divergence("jsd", drafter_logits, teacher, beta=0.5, temperature=1.0)   # [N]
    loss = per_token.sum() / n_tokens_in_the_whole_optimizer_step
    acceptance = 1 - total_variation(drafter_logits, teacher).mean()   # DistillSpec's estimate

With p the teacher and q the student (both at `temperature`):
    fkl  KL(p || q)                        mass-covering (what next-token training does)
    rkl  KL(q || p)                        mode-seeking
    jsd  beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q
    tvd  1/2 sum |p - q|                   1 - TVD is the expected acceptance rate of a draft token
A sparse teacher keeps only its top-k tokens (renormalized). fkl, jsd and tvd stay exact for that
distribution (the student's mass outside the top-k enters in closed form); rkl would be infinite
there, so it needs the dense teacher.
"""

import math
from typing import NamedTuple

import torch
from torch import Tensor

KINDS = ("fkl", "rkl", "jsd", "tvd")


class Teacher(NamedTuple):
    """The teacher's log-probabilities: dense [N, V] (idx None) or sparse top-k [N, K] with ids idx [N, K]."""

    logits: Tensor
    idx: Tensor | None = None

    @classmethod
    def dense(cls, logits: Tensor) -> "Teacher":
        return cls(logits)

    @classmethod
    def top_k(cls, logits: Tensor, k: int) -> "Teacher":
        values, idx = logits.topk(min(k, logits.shape[-1]), dim=-1)  # [N, K]
        return cls(values, idx)

    def log_probs(self, temperature: float = 1.0) -> Tensor:
        """log p [N, V] or [N, K] (the sparse one renormalized over its top-k)."""
        return torch.log_softmax(self.logits.float() / temperature, dim=-1)


def check_loss(kind: str, beta: float, sparse: bool) -> None:
    """Refuse invalid loss settings before any work starts."""
    if kind not in KINDS:
        raise ValueError(f"unknown loss '{kind}': choose one of {', '.join(KINDS)}")
    if kind == "jsd" and not 0.0 < beta < 1.0:
        raise ValueError(f"jsd needs 0 < beta < 1, got beta={beta}")
    if kind == "rkl" and sparse:
        raise ValueError("rkl is infinite against a top-k teacher (it has zeros): set loss.top_k=0 or use fkl/jsd/tvd")


def _student(student_logits: Tensor, teacher: Teacher, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """log p, log q on the teacher's support [N, S], and the student's mass outside it [N]."""
    log_p = teacher.log_probs(temperature)
    log_q_all = torch.log_softmax(student_logits.float() / temperature, dim=-1)  # [N, V]
    if teacher.idx is None:
        return log_p, log_q_all, torch.zeros_like(log_q_all[:, 0])
    log_q = log_q_all.gather(-1, teacher.idx)  # [N, K]
    outside = (1 - log_q.exp().sum(-1)).clamp_min(0)  # [N]
    return log_p, log_q, outside


def forward_kl(student_logits: Tensor, teacher: Teacher, temperature: float = 1.0) -> Tensor:
    """KL(p || q) per token [N]."""
    log_p, log_q, _ = _student(student_logits, teacher, temperature)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def reverse_kl(student_logits: Tensor, teacher: Teacher, temperature: float = 1.0) -> Tensor:
    """KL(q || p) per token [N]; dense teacher only."""
    if teacher.idx is not None:
        raise ValueError("reverse KL needs the dense teacher distribution")
    log_p, log_q, _ = _student(student_logits, teacher, temperature)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def jsd(student_logits: Tensor, teacher: Teacher, beta: float = 0.5, temperature: float = 1.0) -> Tensor:
    """beta KL(p || m) + (1 - beta) KL(q || m) with m = beta p + (1 - beta) q, per token [N]."""
    log_p, log_q, outside = _student(student_logits, teacher, temperature)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))  # [N, S]
    kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
    # Off the teacher's support p = 0 and m = (1 - beta) q, so q log(q / m) = -q log(1 - beta).
    kl_qm = kl_qm - outside * math.log1p(-beta)
    return beta * kl_pm + (1 - beta) * kl_qm


def total_variation(student_logits: Tensor, teacher: Teacher, temperature: float = 1.0) -> Tensor:
    """1/2 sum |p - q| per token [N]."""
    log_p, log_q, outside = _student(student_logits, teacher, temperature)
    return 0.5 * ((log_p.exp() - log_q.exp()).abs().sum(-1) + outside)


def divergence(
    kind: str, student_logits: Tensor, teacher: Teacher, *, beta: float = 0.5, temperature: float = 1.0
) -> Tensor:
    """The chosen divergence per token [N] between student logits [N, V] and the teacher."""
    if kind == "fkl":
        return forward_kl(student_logits, teacher, temperature)
    if kind == "rkl":
        return reverse_kl(student_logits, teacher, temperature)
    if kind == "jsd":
        return jsd(student_logits, teacher, beta, temperature)
    if kind == "tvd":
        return total_variation(student_logits, teacher, temperature)
    raise ValueError(f"unknown loss '{kind}': choose one of {', '.join(KINDS)}")
