"""Searching for the sublayers a self-speculative draft skips (Draft & Verify, Zhang et al. 2023).

    space = SearchSpace(num_layers=30, keep_first=1, keep_last=1, max_skip_fraction=0.5)
    cal = calibrate(target, prompts, max_new_tokens=64, stop_ids=stop_ids)   # AR outputs and speed
    evaluate = Evaluator(target, cal, objective="speedup", gamma=8, exit_settings=..., cost=cost)
    study = open_study(storage, "layerskip", sampler="gp", seed=0, meta=...)
    search(study, space, evaluate, n_trials=100, seed=0, n_startup=10)
    best = best_trial(study)

The search space is 2L binary choices (skip layer i's attention, skip its MLP), minus the layers
kept by keep_first / keep_last, with at least one and at most max_skip_fraction of all 2L
sublayers skipped. Two
objectives:

- speedup: self-speculative greedy decoding of the calibration prompts, timed, over the
  autoregressive time of the same prompts measured in this process (re-timed every
  `baseline_every` trials); every output is checked against the autoregressive one.
- proxy: no decoding and no timing. One forward of each calibration sequence (prompt + the
  target's greedy output) with the sublayers skipped gives, teacher-forced, what the draft would
  propose at every position and how sure it is; the rounds of speculative decoding (draft exit
  included) are then replayed on those arrays, giving tau and the draft lengths, and a cost model
  turns them into an estimated speedup. It costs one prefill per prompt instead of a decode of
  every token, and it is deterministic. It is exact for drafts whose tokens do not depend on the
  context's keys (tested with a bigram drafter); for a real skip set it differs because the
  runtime's draft attends to the target's own keys for the verified context, not to its own
  skipped computation (the proxy is then pessimistic). Use it for large targets, where timing a
  decode per trial is expensive, and confirm the winner with the measured speedup (the recipe
  always validates the best set for real).

Both samplers start with the same `n_startup` random feasible sets (a uniform number of skipped
sublayers, then which ones uniformly; seeded), so BO and random search are compared on paired
starts. Gaussian-process BO is optuna's GPSampler with the skipped-fraction bound as a
constraint; random search keeps drawing feasible sets the same way. The study lives in an optuna
RDB storage (SQLite in the run folder by default): a search resumes where it stopped, and several
machines can share one study.
"""

import math
import random
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from specdec_runtime.drafters.protocol import DraftExit
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.model import Decoder, LayerSkip

SAMPLERS = ("gp", "random")
OBJECTIVES = ("speedup", "proxy")
COST_MODELS = ("measured", "params")


@dataclass(frozen=True)
class SearchSpace:
    num_layers: int
    keep_first: int = 1  # layers 0..keep_first-1 are never skipped
    keep_last: int = 1  # nor the last keep_last layers
    max_skip_fraction: float = 0.5  # of all 2 * num_layers sublayers

    def problems(self) -> list[str]:
        """What is wrong with these settings (empty when they are usable)."""
        out = []
        for key in ("keep_first", "keep_last"):
            v = getattr(self, key)
            if not isinstance(v, int) or v < 0:
                out.append(f"search.{key}={v} must be an integer >= 0")
        if not out and self.keep_first + self.keep_last >= self.num_layers:
            out.append(
                f"search.keep_first + search.keep_last = {self.keep_first + self.keep_last} leaves no layer to "
                f"skip: the target has {self.num_layers} layers"
            )
        if not 0 < self.max_skip_fraction <= 1:
            out.append(f"search.max_skip_fraction={self.max_skip_fraction} must be in (0, 1]")
        elif self.max_skipped < 1:
            out.append(
                f"search.max_skip_fraction={self.max_skip_fraction} allows no sublayer of "
                f"{2 * self.num_layers}: raise it"
            )
        return out

    @property
    def layers(self) -> range:
        """The layers whose sublayers may be skipped."""
        return range(self.keep_first, self.num_layers - self.keep_last)

    @property
    def names(self) -> list[str]:
        return [f"{kind}_{i}" for i in self.layers for kind in ("attn", "mlp")]

    @property
    def max_skipped(self) -> int:
        return min(math.floor(self.max_skip_fraction * 2 * self.num_layers + 1e-9), len(self.names))

    def skip_of(self, params: dict[str, Any]) -> LayerSkip:
        on = [n for n in self.names if params.get(n)]
        return LayerSkip(
            attn={int(n[5:]) for n in on if n.startswith("attn_")}, mlp={int(n[4:]) for n in on if n.startswith("mlp_")}
        )

    def suggest(self, trial: Any) -> LayerSkip:
        return self.skip_of({n: trial.suggest_categorical(n, (False, True)) for n in self.names})

    def skipped(self, skip: LayerSkip) -> int:
        return len(skip.attn) + len(skip.mlp)

    def violation(self, skip: LayerSkip) -> int:
        """How far a set is outside 1..max_skipped skipped sublayers (<= 0: feasible). Skipping
        nothing is not a drafter: the target would draft for itself at full cost."""
        k = self.skipped(skip)
        return max(k - self.max_skipped, 1 - k)

    def random_params(self, rng: random.Random) -> dict[str, bool]:
        """A random feasible set: a size k uniform in 1..max_skipped, then k sublayers uniformly.
        (Uniform over sets would put nearly every draw at the largest sizes, where drafts are
        rarely accepted; uniform sizes cover sparse and dense sets alike.)"""
        k = rng.randint(1, self.max_skipped)
        chosen = set(rng.sample(self.names, k))
        return {name: name in chosen for name in self.names}


def key_of(skip: LayerSkip) -> str:
    return f"attn={sorted(skip.attn)} mlp={sorted(skip.mlp)}"


# --- what decoding costs ------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Time of a draft step and of verification, in units of one autoregressive decode step.

    A draft step costs `fixed` (embedding, final norm, lm_head, per-step overhead) plus the shares
    of the sublayers it runs; verifying n tokens costs 1 + (n - 1) * verify_extra. The speedup of a
    run with `forwards` target forwards (prefill included) that drafted `drafted` tokens in all and
    produced `tokens` is tokens / (forwards + drafted * (draft_cost + verify_extra)).
    """

    fixed: float  # a step with every sublayer skipped
    attn_share: float  # one layer's attention
    mlp_share: float  # one layer's MLP
    verify_extra: float  # each extra verified token
    num_layers: int
    source: str = "measured"

    def draft_cost(self, skip: LayerSkip) -> float:
        n = self.num_layers
        return self.fixed + (n - len(skip.attn)) * self.attn_share + (n - len(skip.mlp)) * self.mlp_share

    def speedup(self, skip: LayerSkip, tokens: int, forwards: int, drafted: int) -> float:
        return tokens / (forwards + drafted * (self.draft_cost(skip) + self.verify_extra))

    @classmethod
    def from_params(cls, model: Decoder) -> "CostModel":
        """Shares of the weights a decode step reads: what bounds batch-1 decoding on a GPU
        (memory bandwidth). Verifying a few more tokens reads no more weights: verify_extra 0."""
        block, n = model.layers[0], model.config.num_layers
        attn = block.qkv.weight.numel() + block.o.weight.numel()
        mlp = sum(b.mlp_params_read for b in model.layers) / n  # (a mixture of experts: the chosen ones)
        head = model.lm_head.weight.numel()
        total = n * (attn + mlp) + head
        return cls(head / total, attn / total, mlp / total, 0.0, n, "params")

    @classmethod
    def measure(cls, model: Decoder, gamma: int, context: int = 64, repeats: int = 15) -> "CostModel":
        """Time decode steps on this device (medians of `repeats` after a `context`-token prefix):
        every sublayer, none, no attention, no MLP, and a verification of gamma + 1 tokens. The
        layers' share 1 - fixed is split between attention and MLP as their measured savings."""
        n = model.config.num_layers
        every = set(range(n))
        ids = torch.randint(0, model.config.vocab_size, (1, context + gamma + 1), device=model.device)
        model.setup_cache(1, ids.shape[1])
        model.prefill(ids[:, :context])

        def timed(x: torch.Tensor, skip: LayerSkip | None) -> float:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                model(x, context, skip=skip)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]

        one = ids[:, context : context + 1]
        timed(one, None)  # warm-up
        full, bare = timed(one, None), timed(one, LayerSkip(attn=every, mlp=every))
        attn_saved = max(full - timed(one, LayerSkip(attn=every)), 1e-9)
        mlp_saved = max(full - timed(one, LayerSkip(mlp=every)), 1e-9)
        verify = timed(ids[:, context:], None)
        fixed = min(bare / full, 1.0)
        layers = (1 - fixed) / (attn_saved + mlp_saved)  # scale the savings to the layers' share
        return cls(
            fixed,
            attn_saved * layers / n,
            mlp_saved * layers / n,
            max(verify - full, 0.0) / (gamma * full) if gamma else 0.0,
            n,
            "measured",
        )


# --- calibration and evaluation -----------------------------------------------------------------


@dataclass
class Calibration:
    prompts: list[list[int]]
    outputs: list[list[int]]  # the target's greedy outputs (the oracle for losslessness)
    ar_tokens_per_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def decode_autoregressive(
    target: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: frozenset[int]
) -> tuple[list[list[int]], float]:
    """The target's greedy outputs for the prompts, and its tokens/s over them."""
    outputs, tokens, seconds = [], 0, 0.0
    for p in prompts:
        g = generate(target, list(p), None, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        outputs.append(g.tokens)
        tokens, seconds = tokens + g.stats.new_tokens, seconds + g.stats.total_s
    return outputs, tokens / seconds


def calibrate(
    target: Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: frozenset[int]
) -> Calibration:
    """The target's greedy outputs for the prompts, and its autoregressive speed on them (one
    timed pass after a short warm-up)."""
    generate(target, list(prompts[0]), None, max_new_tokens=min(8, max_new_tokens))  # warm-up
    outputs, tokens_per_s = decode_autoregressive(target, prompts, max_new_tokens, stop_ids)
    return Calibration([list(p) for p in prompts], outputs, tokens_per_s)


@dataclass(frozen=True)
class ExitSettings:
    """How drafting stops early (a fresh DraftExit per evaluation, so trials do not share state)."""

    threshold: float = 0.5
    adaptive: bool = True
    target_acceptance: float = 0.9

    def new(self) -> DraftExit:
        return DraftExit(self.threshold, adaptive=self.adaptive, target_acceptance=self.target_acceptance)


@dataclass
class RoundCounts:
    tokens: int = 0
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def tau(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def add(self, other: "RoundCounts") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


def replay_rounds(agree: Sequence[bool], confidence: Sequence[float], gamma: int, draft_exit: DraftExit) -> RoundCounts:
    """Speculative rounds over a known output of n = len(agree) + 1 tokens, as generate() runs them.

    agree[j] / confidence[j]: whether the draft made after output token j (teacher-forced) is the
    next output token, and the probability the draft gave its own choice there. The prefill
    produces token 0; each round drafts until the exit rule fires or the budget ends, accepts the
    leading agreements and adds the target's token.
    """
    n = len(agree) + 1
    counts = RoundCounts(tokens=n, forwards=1)
    done, last = 1, None
    while done < n:
        budget = min(gamma, n - done - 1)
        counts.forwards += 1
        if budget == 0:
            done += 1
            continue
        if last is not None:
            draft_exit.update(*last)
        d = 0
        while d < budget:
            d += 1
            if draft_exit.stop(confidence[done - 1 + d - 1]):
                break
        a = 0
        while a < d and agree[done - 1 + a]:
            a += 1
        counts.drafted, counts.accepted = counts.drafted + d, counts.accepted + a
        last = (a, d, d == budget)
        done += a + 1
    return counts


class Evaluator:
    """Scores a skip set on the calibration prompts: the measured speedup, or the proxy's estimate."""

    def __init__(
        self,
        target: Decoder,
        cal: Calibration,
        *,
        objective: str,
        gamma: int,
        exit_settings: ExitSettings,
        cost: CostModel | None,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        baseline_every: int = 20,
    ):
        if objective not in OBJECTIVES:
            raise SpecdecError(f"search.objective='{objective}': use speedup or proxy")
        if objective == "proxy" and cost is None:
            raise ValueError("the proxy objective needs a cost model")
        self.target, self.cal, self.objective, self.gamma = target, cal, objective, gamma
        self.exit, self.cost, self.max_new_tokens, self.stop_ids = exit_settings, cost, max_new_tokens, stop_ids
        self.baseline_every, self.evaluated = baseline_every, 0

    def __call__(self, skip: LayerSkip) -> dict[str, Any]:
        """{'value': the objective, 'tau', 'speedup' or 'est_speedup', 'lossless', ...}."""
        self.evaluated += 1
        return self.measured(skip) if self.objective == "speedup" else self.proxy(skip)

    def drafter(self, skip: LayerSkip) -> ModelDrafter:
        return ModelDrafter(self.target, skip=skip, shares_target_cache=True, draft_exit=self.exit.new())

    def measured(self, skip: LayerSkip) -> dict[str, Any]:
        if self.baseline_every and self.evaluated % self.baseline_every == 0:  # the machine may have drifted
            outputs, self.cal.ar_tokens_per_s = decode_autoregressive(
                self.target, self.cal.prompts, self.max_new_tokens, self.stop_ids
            )
            if outputs != self.cal.outputs:
                raise RuntimeError("autoregressive decoding is not deterministic on this device")
        drafter, counts, seconds, lossless = self.drafter(skip), RoundCounts(), 0.0, True
        for p, expected in zip(self.cal.prompts, self.cal.outputs):
            g = generate(
                self.target, p, drafter, max_new_tokens=self.max_new_tokens, gamma=self.gamma, stop_ids=self.stop_ids
            )
            s = g.stats
            counts.add(RoundCounts(s.new_tokens, s.target_forwards, s.drafted, s.accepted))
            seconds += s.total_s
            lossless &= g.tokens == expected
        speedup = counts.tokens / seconds / self.cal.ar_tokens_per_s
        return {"value": speedup, "speedup": speedup, "tau": counts.tau, "lossless": lossless, **self._rates(counts)}

    @torch.inference_mode()
    def proxy(self, skip: LayerSkip) -> dict[str, Any]:
        counts = RoundCounts()
        draft_exit = self.exit.new()
        for p, out in zip(self.cal.prompts, self.cal.outputs):
            seq = torch.tensor(p + out, device=self.target.device)
            self.target.setup_cache(1, seq.shape[0])
            P = len(p)
            logits = self.target.prefill(seq[None, :-1], skip=skip).logits[0, P:].float()  # after output tokens 0..n-2
            probs = logits.softmax(-1)
            conf, choice = probs.max(-1)
            agree = (choice == seq[P + 1 :]).tolist()
            counts.add(replay_rounds(agree, conf.tolist(), self.gamma, draft_exit))
        est = self.cost.speedup(skip, counts.tokens, counts.forwards, counts.drafted)
        return {"value": est, "est_speedup": est, "tau": counts.tau, **self._rates(counts)}

    @staticmethod
    def _rates(c: RoundCounts) -> dict[str, float]:
        return {
            "acceptance": c.accepted / c.drafted if c.drafted else 0.0,
            "drafted_per_forward": c.drafted / c.forwards if c.forwards else 0.0,
        }


# --- the optuna study ---------------------------------------------------------------------------


def open_study(storage: str, name: str, *, sampler: str, seed: int, n_startup: int, meta: dict[str, Any]) -> Any:
    """Create or resume a maximizing study. `meta` (search space, objective, sampler, target) is
    stored with a new study and must match when resuming, so one study never mixes two searches."""
    import optuna

    if sampler not in SAMPLERS:
        raise SpecdecError(f"search.sampler='{sampler}': use gp (Bayesian optimization) or random")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if sampler == "gp":  # the skipped-fraction bound reaches it as each trial's constraint
            chosen = optuna.samplers.GPSampler(
                seed=seed, n_startup_trials=n_startup, deterministic_objective=meta.get("objective") == "proxy"
            )
        else:
            chosen = optuna.samplers.RandomSampler(seed=seed)  # every trial is enqueued (feasible draws)
    try:  # a trial whose worker died (no heartbeat for 90 s) is marked failed and retried once
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            rdb = optuna.storages.RDBStorage(
                storage,
                heartbeat_interval=30,
                grace_period=90,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
            )
    except Exception as e:  # a bad URL or an unreachable database: say so before any work
        raise SpecdecError(f"search.storage='{storage}': optuna cannot open it ({e})") from None
    study = optuna.create_study(storage=rdb, sampler=chosen, study_name=name, direction="maximize", load_if_exists=True)
    stored = study.user_attrs.get("meta")
    if stored is None:
        study.set_user_attr("meta", meta)
    elif stored != meta:
        changed = sorted(k for k in set(stored) | set(meta) if stored.get(k) != meta.get(k))
        raise SpecdecError(
            f"study '{name}' in {storage} was made with different settings ({', '.join(changed)}): "
            "use another search.study_name or output_dir, or the settings it was made with"
        )
    return study


def finished(study: Any) -> list[Any]:
    import optuna

    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def search(
    study: Any,
    space: SearchSpace,
    evaluate: Callable[[LayerSkip], dict[str, Any]],
    *,
    n_trials: int,
    sampler: str,
    seed: int,
    n_startup: int,
    on_trial: Callable[[Any], None] | None = None,
    progress: Callable[[int, int], Any] | None = None,
) -> None:
    """Run trials until the study holds n_trials complete ones (every worker's count)."""
    known: dict[str, dict[str, Any]] = {}
    for t in finished(study):  # a resumed study: identical sets are not evaluated again
        if "key" in t.user_attrs and "duplicate_of" not in t.user_attrs:
            known.setdefault(t.user_attrs["key"], {"trial": t.number, "value": t.value, **t.user_attrs})

    def objective(trial: Any) -> float:
        skip = space.suggest(trial)
        over = space.violation(skip)
        trial.set_constraint("skipped_outside_bounds", over)  # <= 0: feasible
        trial.set_user_attr("constraint", float(over))
        trial.set_user_attr("skipped", space.skipped(skip))
        trial.set_user_attr("key", key_of(skip))
        if over > 0:  # infeasible: not evaluated; the GP learns the bound from the constraint
            return 0.0
        if key_of(skip) in known:
            old = known[key_of(skip)]
            trial.set_user_attr("duplicate_of", old["trial"])
            return old["value"]
        result = evaluate(skip)
        for k, v in result.items():
            if k != "value":
                trial.set_user_attr(k, v)
        known[key_of(skip)] = {"trial": trial.number, **result}
        return result["value"]

    done = len(finished(study))
    bar = progress(done, n_trials) if progress else None
    while done < n_trials:
        if sampler == "random" or done < n_startup:
            rng = random.Random(f"{seed}-{done}")  # the same draws for gp and random at a given seed
            study.enqueue_trial(space.random_params(rng), skip_if_exists=False)
        study.optimize(objective, n_trials=1, callbacks=[lambda _, t: on_trial(t)] if on_trial else None)
        now = len(finished(study))
        if bar is not None:
            bar.update(now - done)
        done = now
    if bar is not None:
        bar.close()


def best_trial(study: Any) -> Any | None:
    """The best complete trial that respects the bound and (measured) decoded losslessly."""
    ok = [
        t
        for t in finished(study)
        if t.user_attrs.get("constraint", 0.0) <= 0 and t.user_attrs.get("lossless", True) and t.value is not None
    ]
    return max(ok, key=lambda t: t.value) if ok else None


def best_so_far(values: Sequence[float]) -> list[float]:
    out, best = [], -math.inf
    for v in values:
        best = max(best, v)
        out.append(best)
    return out


def plot_traces(runs: dict[str, list[list[float]]], path: Any, *, ylabel: str, title: str) -> None:
    """Objective per trial (dots) and best so far (line) for each label; several runs per label
    (seeds) are drawn as their median best-so-far with a min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for (label, seeds), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        n = min(len(v) for v in seeds)
        if n == 0:
            continue
        curves = np.array([best_so_far(v[:n]) for v in seeds])
        x = np.arange(1, n + 1)
        for v in seeds:
            ax.scatter(x, v[:n], s=7, alpha=0.35, color=color)
        label += " best so far" + (" (median)" if len(seeds) > 1 else "")
        ax.plot(x, np.median(curves, axis=0), color=color, label=label)
        if len(seeds) > 1:
            ax.fill_between(x, curves.min(axis=0), curves.max(axis=0), color=color, alpha=0.15)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("trial")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
