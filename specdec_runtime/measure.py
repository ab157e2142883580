"""Measuring a drafter on prompts: tau, speedup over autoregressive, losslessness.

    report = measure(target, drafter, [ids, ...], sampler=lambda: Sampler(), baseline=True,
                     max_new_tokens=128, gamma=4, stop_ids=target.stop_ids)
    report.total().tau, report.speedup(), report.lossless_rate()
    warm_up(target, drafter, ids, sampler=Sampler, gamma=4)   # what a timed run would first pay, paid before it
    warm_up_rows(target, row_drafter, prompts[:8], sampler=Sampler, gamma=4)   # the same for batches of 8
    divergences(bf16_target, fp32_target, [(prompt, ar_tokens, spec_tokens), ...])   # near-ties or bugs

With baseline=True each prompt is decoded autoregressively right beside the speculative run, so
both see the same machine state (what a noisy shared machine needs for a fair ratio), each side
first on every other prompt. The training recipes validate their drafters with this function.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdec_runtime.batched import generate_many
from specdec_runtime.drafters.lookup import LookupFirst
from specdec_runtime.drafters.protocol import Draft, Drafter, RowDrafter
from specdec_runtime.generate import Generation, generate
from specdec_runtime.model import Decoder
from specdec_runtime.sampling import Sampler
from specdec_runtime.stats import GenerationStats
from specdec_runtime.tree import Tree


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
    batch_size: int = 1,
    **generate_kwargs,
) -> Report:
    """Decode every prompt with the drafter (and autoregressively too, when baseline: first on
    even prompts, second on odd ones).

    on_result(i, spec, baseline_or_None) is called as each prompt finishes (to stream outputs).
    The caches are sized once for the longest prompt, so every call reuses them.
    batch_size > 1: `drafter` a RowDrafter (drafters/batched.py), the prompts decoded in one stream of
    batch_size rows, a prompt taking the first row another leaves (batched.generate_many; the
    baseline: autoregressive decoding the same way).
    """
    if batch_size > 1:  # generate_many's keywords, its caches sized once for every call
        kw = {k: v for k, v in generate_kwargs.items() if k in ("max_new_tokens", "gamma", "stop_ids", "accept_rate")}
        units = [[torch.as_tensor(p).tolist() for p in prompts]]
        nodes = max(kw.get("gamma", 4), getattr(drafter, "tree_nodes", 0))  # (a tree's nodes past the newest)
        kw["capacity"] = max(map(len, units[0])) + kw.get("max_new_tokens", 256) + nodes
        decode = lambda unit, d: generate_many(target, unit, d, sampler(), rows=batch_size, **kw)  # noqa: E731
        warm = lambda d: warm_up_rows(target, d, units[0][:batch_size], sampler, **kw)  # noqa: E731
    else:
        longest = max(len(p) for p in prompts) + generate_kwargs.get("max_new_tokens", 256)
        generate_kwargs = {"capacity": longest, **generate_kwargs}
        units = [[p] for p in prompts]
        decode = lambda unit, d: [generate(target, unit[0], d, sampler(), **generate_kwargs)]  # noqa: E731
        untaught = {k: v for k, v in generate_kwargs.items() if k != "teacher"}  # the warm-up teaches nothing
        warm = lambda d: warm_up(target, d, prompts[0], sampler, **untaught)  # noqa: E731
    if warmup:  # first calls pay for allocations, lazy init and compilation: keep them out of the numbers
        for d in ([None] if baseline else []) + [drafter]:
            warm(d)
    report = Report(greedy=sampler().greedy)
    # With a baseline the two runs of a prompt (a batch) alternate which goes first: whatever the
    # first leaves behind (warm caches, a drifting clock speed) favours neither side.
    sides = [(report.baseline, None), (report.spec, drafter)] if baseline else [(report.spec, drafter)]
    for i, unit in enumerate(progress(units) if progress else units):
        for runs, d in sides if i % 2 == 0 else sides[::-1]:
            runs += decode(unit, d)
        for k in range(len(report.spec) - len(unit), len(report.spec)) if on_result else ():
            on_result(k, report.spec[k], report.baseline[k] if baseline else None)
    return report


@torch.inference_mode()
def divergences(
    target: Decoder, reference: Decoder, runs: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]]
) -> list[dict]:
    """Where two greedy outputs of a half-precision target part, and whether that is a near-tie.

    runs: (prompt, autoregressive tokens, speculative tokens) per prompt, both decoded greedily by
    `target`; reference: the same weights in fp32. At each first divergence i the shared context
    prompt + tokens[:i] runs through both models. error = max |target - reference| over the
    vocabulary there: how far half precision moves these logits. Speculative and autoregressive
    decoding compute them with different kernels (a verify forward of several tokens vs a decode
    step), each off by about `error`, so when the two candidates' fp32 logits differ by at most
    2 * error, rounding alone can order them either way: a near-tie. Anything else is a bug.
    Returns one dict per divergence (prompt index, position, both tokens, the target's top-two
    gap there, the fp32 gap of the two candidates, error, near_tie).
    """
    out = []
    for k, (prompt, ar, spec) in enumerate(runs):
        i = next((j for j, (a, b) in enumerate(zip(ar, spec)) if a != b), None)
        if i is None:
            continue
        ctx = torch.tensor([list(prompt) + list(ar[:i])], device=target.device)
        logits = {}
        for name, m in (("target", target), ("reference", reference)):
            m.setup_cache(1, ctx.shape[1])
            logits[name] = m.prefill(ctx, logits_to_keep=1).logits[0, -1].float()
        top2 = logits["target"].topk(2).values
        error = (logits["target"] - logits["reference"]).abs().max()
        gap = (logits["reference"][ar[i]] - logits["reference"][spec[i]]).abs()
        out.append(
            {
                "prompt": k,
                "position": i,
                "ar_token": ar[i],
                "spec_token": spec[i],
                "top2_gap": float(top2[0] - top2[1]),
                "fp32_gap": float(gap),
                "error": float(error),
                "near_tie": bool(gap <= 2 * error),
            }
        )
    return out


def warm_up(
    target: Decoder,
    drafter: Drafter | None,
    prompt: list[int] | Tensor,
    sampler: Callable[[], Sampler],
    *,
    max_new_tokens: int = 256,
    gamma: int = 4,
    adaptive_gamma: bool = False,
    max_gamma: int = 16,
    **generate_kwargs,
) -> None:
    """Decode a few tokens of `prompt` as generate(**the same arguments) would, so that what first
    calls pay (allocations, lazy init; on the fast path compiling and capturing each step shape)
    is paid before anything is timed. On the fast path every draft length the drafter can return
    (1 up to drafter.longest(gamma), max_gamma where gamma adapts) runs once: a verify shape first
    seen inside a timed prompt would put its compilation and capture in that prompt's time (a
    lookup of 8 tokens at gamma 2 verifies 9). LookupFirst's lookups are chains of any of those
    lengths whatever its model drafts (an EAGLE-3 tree drafter's: trees), so chains of each length
    are verified too (_Chains: captured inside timed prompts, they once made EAGLE-3 + lookup slower
    than autoregressive decoding on an H200: docs/log/gpu.md); and a LookupFirst's model alone."""
    kw = dict(generate_kwargs, adaptive_gamma=False)
    if drafter is None or not target.compiled:
        generate(target, prompt, drafter, sampler(), max_new_tokens=min(8, max_new_tokens), gamma=gamma, **kw)
        return
    top = max_gamma if adaptive_gamma else gamma  # the most the loop asks a drafter for
    longest = drafter.longest(top)
    lookup_first = isinstance(drafter, LookupFirst)
    own = drafter.drafter.longest(top) if lookup_first else longest  # its model's drafts: never deeper
    merged = drafter.tokens + drafter.merge if lookup_first and drafter.merge else 0
    short = min(max_new_tokens, max(8, longest + 2, merged + 2))  # room for a full draft of every length
    for g in range(1, max(longest, merged) + 1):
        # (a LookupFirst asked for more than `top` only drafts its model deeper than any timed round:
        # lookups of every length are _Chains' below, and an EAGLE-3 model's deeper steps were
        # captured, and with compile_steps compiled, for nothing)
        if g <= own:
            generate(target, prompt, drafter, sampler(), max_new_tokens=short, gamma=g, **kw)
        if lookup_first and g <= longest:
            generate(target, prompt, _Chains(drafter), sampler(), max_new_tokens=short, gamma=g, **kw)
        if lookup_first and g <= own:
            # its model alone: where lookups or phrases draft every round of `prompt`, the model's own
            # captured steps (an EAGLE-3 tree's on a GPU) would otherwise be captured in a timed prompt
            generate(target, prompt, drafter.drafter, sampler(), max_new_tokens=short, gamma=g, **kw)
        if g <= merged:  # merged trees of g nodes (the shape of a chain's tree: a step's key is its rows)
            generate(target, prompt, _Chains(drafter, tree=True), sampler(), max_new_tokens=short, gamma=g, **kw)


def warm_up_rows(
    target: Decoder,
    drafter: RowDrafter | None,
    prompts: list[list[int]],
    sampler: Callable[[], Sampler],
    *,
    max_new_tokens: int = 256,
    gamma: int = 4,
    **many_kwargs,
) -> None:
    """warm_up for batches (generate_many(prompts, **the same arguments): the same batch size and
    capacity): a few tokens; on the fast path every draft length up to gamma, the drafter's own and
    a chain of each length for every row (_RowChains: the verify steps whatever the drafter finds),
    and none (a round where every row is one token from its budget verifies its newest alone)."""
    if drafter is None or not target.compiled:
        generate_many(target, prompts, drafter, sampler(), max_new_tokens=min(8, max_new_tokens), gamma=gamma,
                      **many_kwargs)  # fmt: skip
        return
    for g in range(gamma + 1):  # g = 0: rounds of the newest tokens alone, with the drafter's taps
        short = min(max_new_tokens, max(8, g + 2))
        for d in [drafter, _RowChains(drafter)] if g else [drafter]:
            generate_many(target, prompts, d, sampler(), max_new_tokens=short, gamma=g, **many_kwargs)


class _RowChains(RowDrafter):
    """Drafts gamma copies of each row's newest token, reading what `drafter` reads from the target
    (warm_up_rows: a verify step of every length)."""

    name = "warm-up chains"

    def __init__(self, drafter: RowDrafter):
        self.hidden_layers = drafter.hidden_layers

    def start(self, prompts: list[list[int]], row_start: list[int], capacity: int) -> None:
        self.newest = [p[-1] for p in prompts]

    def refill(self, b: int, prompt: list[int]) -> None:
        self.newest[b] = prompt[-1]

    def observe_tokens(self, b: int, tokens: list[int]) -> None:
        self.newest[b] = tokens[-1]

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], None]:
        tokens = torch.tensor([[t] * max(gammas) for t in self.newest], dtype=torch.long)
        return tokens, list(gammas), None


class _Chains(Drafter):
    """Drafts gamma copies of the newest token, reading what `drafter` reads from the target (its
    taps and tree slots): warm_up's way to verify a chain of each length as that drafter's would be
    (tree: as a tree of that many nodes, LookupFirst's merged trees)."""

    name = "warm-up chains"

    def __init__(self, drafter: Drafter, tree: bool = False):
        self.hidden_layers, self.tree_nodes, self.tree = drafter.hidden_layers, drafter.tree_nodes, tree

    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        return Draft(ids[-1:].repeat(gamma), None, tree=Tree.chain(gamma) if self.tree else None)
