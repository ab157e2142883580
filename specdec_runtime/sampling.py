"""Turning logits into tokens: greedy, or temperature / top-k / top-p sampling.

    sampler = Sampler(temperature=0.7, top_p=0.9, seed=0)
    probs = sampler.probs(logits)      # [N, V], the warped distribution both models are judged by
    token = sampler.sample(probs)      # [N]

The same `Sampler` warps the target's and the drafter's logits, so speculative sampling compares
the two distributions the user asked for (Leviathan et al. 2023, Chen et al. 2023).
"""

import torch
from torch import Tensor

from specdec_runtime import cpu
from specdec_runtime.errors import SpecdecError


def argmax(logits: Tensor) -> Tensor:
    """logits.argmax(-1), the greedy choice per row: in the CPU kernel where it takes them (fp32
    on a CPU: cpu.argmax, one pass), torch's elsewhere. The same index either way."""
    best = cpu.argmax(logits)
    return best if best is not None else logits.argmax(-1)


def warp(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Probabilities [..., V] from logits [..., V] after temperature, top-k and top-p."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


class Sampler:
    """Sampling settings plus their random generator; temperature 0 means greedy."""

    def __init__(
        self,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
    ):
        if temperature < 0:
            raise SpecdecError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise SpecdecError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise SpecdecError(f"top_k must be >= 0 (0 = off), got {top_k}")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.seed = seed if seed is not None else torch.seed()
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """This sampler's random stream on `device`, seeded on first use there: the caller's
        Sampler() follows the tensors it samples onto a GPU (a CPU generator cannot draw there)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: Tensor) -> Tensor:
        """The warped distribution [..., V] (one-hot of the argmax when greedy)."""
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return warp(logits, self.temperature, self.top_k, self.top_p)

    def sample(self, probs: Tensor) -> Tensor:
        """One token per row of probs [..., V] (weights >= 0, normalized or not): the cumulative
        weights in float64 inverted at one uniform draw per row. Exact up to float64 rounding, never
        a token of weight 0, no host sync, and one random draw a row instead of V exponentials
        (argmax of p / Exp(1)), which cost a CPU a tenth of a decode step (docs/log/drafters.md)."""
        cdf = probs.double().cumsum(-1)  # [..., V]
        total = cdf[..., -1:]
        u = torch.rand(total.shape, dtype=torch.float64, device=probs.device, generator=self.generator(probs.device))
        # u * total may round up to total, past the last token of weight > 0: keep it below
        x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, x, right=True).squeeze(-1)  # the first token whose cdf exceeds x

    def uniform(self, n: int, device: torch.device) -> Tensor:
        """n draws from U[0, 1) for the acceptance test."""
        return torch.rand(n, device=device, generator=self.generator(device))

    def next_token(self, logits: Tensor) -> Tensor:
        """Greedy argmax or a sample from the warped logits [..., V]."""
        return argmax(logits) if self.greedy else self.sample(self.probs(logits))
