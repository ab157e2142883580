"""Measuring a drafter on prompts: tau, speedup over autoregressive, losslessness.

    report = measure(target, drafter, [ids, ...], sampler=lambda: Sampler(), baseline=True,
                     max_new_tokens=128, gamma=4, stop_ids=target.stop_ids)
    report.total().tau, report.speedup(), report.lossless_rate()

With baseline=True each prompt is decoded autoregressively right before the speculative run, so
both see the same machine state (what a noisy shared machine needs for a fair ratio). The
training recipes validate their drafters with this function.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec_runtime.drafters import Drafter
from specdec_runtime.generate import Generation, generate
from specdec_runtime.model import Decoder
from specdec_runtime.sampling import Sampler
from specdec_runtime.stats import GenerationStats


@dataclass
class Report:
    spec: list[Generation] = field(default_factory=list)
    baseline: list[Generation] = field(default_factory=list)  # empty unless measured
    greedy: bool = True

    def total(self, which: str = "spec", idx: Sequence[int] | None = None) -> GenerationStats:
        runs = self.spec if which == "spec" else self.baseline
        return GenerationStats.total([runs[i].stats for i in (idx if idx is not None else range(len(runs)))])

    def speedup(self, idx: Sequence[int] | None = None) -> float | None:
        """Tokens/s of speculative over autoregressive decoding (None without a baseline)."""
        if not self.baseline:
            return None
        ar = self.total("baseline", idx).tokens_per_s
        return self.total("spec", idx).tokens_per_s / ar if ar else None

    def lossless_rate(self, idx: Sequence[int] | None = None) -> float | None:
        """Fraction of prompts whose greedy speculative output equals the autoregressive one."""
        if not self.baseline or not self.greedy:
            return None
        idx = list(idx if idx is not None else range(len(self.spec)))
        return sum(self.spec[i].tokens == self.baseline[i].tokens for i in idx) / len(idx)


def measure(
    target: Decoder,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    *,
    sampler: Callable[[], Sampler],
    baseline: bool = False,
    warmup: bool = True,
    progress: Callable | None = None,
    on_result: Callable[[int, Generation, Generation | None], None] | None = None,
    **generate_kwargs,
) -> Report:
    """Decode every prompt with the drafter (and autoregressively first, when baseline).

    on_result(i, spec, baseline_or_None) is called as each prompt finishes (to stream outputs).
    """
    if warmup:  # first calls pay for allocations and lazy init; keep them out of the numbers
        short = {**generate_kwargs, "max_new_tokens": min(8, generate_kwargs.get("max_new_tokens", 8))}
        for d in ([None] if baseline else []) + [drafter]:
            generate(target, prompts[0], d, sampler(), **short)
    report = Report(greedy=sampler().greedy)
    for i, ids in enumerate(progress(prompts) if progress else prompts):
        if baseline:
            report.baseline.append(generate(target, ids, None, sampler(), **generate_kwargs))
        report.spec.append(generate(target, ids, drafter, sampler(), **generate_kwargs))
        if on_result:
            on_result(i, report.spec[-1], report.baseline[-1] if baseline else None)
    return report
