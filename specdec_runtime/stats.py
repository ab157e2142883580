"""Statistics of speculative generation, per call and aggregated.

stats = generate(target, prompt, drafter).stats
stats.tau, stats.acceptance_per_position, stats.tokens_per_s
total = GenerationStats.total([g.stats for g in generations])
"""

from dataclasses import asdict, dataclass, field, fields


@dataclass
class GenerationStats:
    """Counts and timings of one or more generate calls.

    tau is the mean number of tokens produced per target forward, the bonus token included; the
    prefill counts as a forward (it produces the first token), so autoregressive decoding has tau 1.
    """

    new_tokens: int = 0
    target_forwards: int = 0
    rounds_with_draft: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position: rounds that drafted it
    accepted_at: list[int] = field(default_factory=list)  # per draft position: rounds that accepted it
    # LookupFirst's prompt-lookup rounds, counted apart from its model's (the positions above): a
    # lookup drafts 4 tokens where the model drafts 2, and is right or wrong for other reasons.
    lookup_rounds: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0  # drafting
    target_s: float = 0.0  # the target's verify forwards alone (exact on a GPU only with generate(timed=True))
    verify_s: float = 0.0  # the target's verify forwards + acceptance and bookkeeping
    total_s: float = 0.0
    calls: int = 0

    def record_round(self, drafted: int, accepted: int, lookup: bool = False) -> None:
        """Count one target forward that checked `drafted` tokens and accepted `accepted` of them
        (lookup: drafted by LookupFirst's prompt lookup)."""
        self.target_forwards += 1
        if drafted:
            self.rounds_with_draft += 1
        if lookup:
            self.lookup_rounds += 1
            self.lookup_drafted += drafted
            self.lookup_accepted += accepted
            return
        grow = drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(drafted):
            self.drafted_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def drafted(self) -> int:
        return sum(self.drafted_at) + self.lookup_drafted

    @property
    def accepted(self) -> int:
        return sum(self.accepted_at) + self.lookup_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens over all positions."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft position i accepted | it was drafted), for i = 0, 1, ..., over the drafter's own
        rounds (a LookupFirst's lookups are in `lookups`)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def lookups(self) -> str:
        """LookupFirst's lookup rounds in words ("" without any): their share of the drafted
        rounds and the tokens accepted of those drafted, per round."""
        if not self.lookup_rounds:
            return ""
        n = self.lookup_rounds
        return (
            f"lookup {n / self.rounds_with_draft:.0%} of rounds, "
            f"{self.lookup_accepted / n:.1f} of {self.lookup_drafted / n:.1f} accepted"
        )

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second, prefill included."""
        return self.new_tokens / self.total_s if self.total_s else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("tau", "acceptance_rate", "acceptance_per_position", "lookups", "tokens_per_s"):
            d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "GenerationStats":
        """The inverse of to_dict (derived fields are recomputed)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def total(cls, parts: list["GenerationStats"]) -> "GenerationStats":
        """Sum of several calls' statistics (ratios are then token-weighted)."""
        out = cls()
        for s in parts:
            for name in SUMMED:
                setattr(out, name, getattr(out, name) + getattr(s, name))
            out.drafted_at = _add(out.drafted_at, s.drafted_at)
            out.accepted_at = _add(out.accepted_at, s.accepted_at)
        return out


SUMMED = (
    "new_tokens",
    "target_forwards",
    "rounds_with_draft",
    "lookup_rounds",
    "lookup_drafted",
    "lookup_accepted",
    "prefill_s",
    "draft_s",
    "target_s",
    "verify_s",
    "total_s",
    "calls",
)


def _add(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists of possibly different lengths."""
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]
