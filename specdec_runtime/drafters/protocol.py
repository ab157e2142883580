"""The Drafter protocol: what the generate loop asks of a drafter, and the Draft it gets back
(the package's docstring says how drafters are used; one module per family beside this one)."""

from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from specdec_runtime.errors import SpecdecError
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import DeviceTree, Tree


class Draft(NamedTuple):
    tokens: Tensor  # [g] proposed ids, 0 <= g <= gamma (LookupFirst's lookups: <= max(gamma, tokens))
    probs: Tensor | None  # [g, V] the distributions they were sampled from; None if deterministic
    # Drafters that share the target (truncate, layer-skip) have already run its first
    # `resume_layer` layers, exactly, on every token the target will verify (ids[L-1] and the g
    # drafts): their residual stream [1, g + 1, H] lets verification resume at that layer.
    residual: Tensor | None = None
    resume_layer: int = 0
    # A token tree (Medusa): tokens are its nodes after the root, verified in one forward with
    # tree attention; the loop keeps the accepted branch's KV entries.
    tree: Tree | DeviceTree | None = None
    lookup: bool = False  # drafted by LookupFirst's prompt lookup, not its model (stats count it apart)
    # SpecTr (drafters/multi.py): k i.i.d. sequences merged into `tree`, each one's node per depth
    # [k, g]; sampled verification then selects among them (specdec_runtime.spectr)
    chains: Tensor | None = None

    @property
    def depth(self) -> int:
        """The most tokens verification can accept from it: a tree's depth, a chain's length."""
        return self.tree.depth if self.tree is not None else self.tokens.shape[0]


class Drafter(Protocol):
    """What the generate loop asks of a drafter. Drafters subclass it to inherit the defaults of
    its optional members (a plain drafter only writes `draft`)."""

    name: str = "drafter"
    gamma: int | None = None  # the draft length it was tuned for (a CLI default), if any
    tree_nodes: int = 0  # KV slots a tree draft writes past the sequence (the loop reserves them)
    hidden_layers: tuple[int, ...] = ()  # the target's residual streams it reads (see observe)
    lookup_merge: int = 0  # nodes of its own a lookup round merges by default (LookupFirst: cheap drafters)
    source: Path | None = None  # the folder it was loaded from, if any (online adaptation saves an adapted copy)

    def start(self, prompt: Tensor, capacity: int) -> None:
        """Reset for a new prompt [P]; sequences will not exceed `capacity` tokens."""

    def observe_tokens(self, tokens: list[int]) -> None:
        """The tokens the sequence gained, on the host (the prompt and first token after start(),
        then each round's): drafters that read tokens on the host take them here instead of reading
        ids back from the device (a sync a round on a GPU)."""

    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        """Propose up to gamma tokens to follow ids [L]. A chain may be longer where it costs nothing
        to draft (LookupFirst's lookups); the loop keeps what fits the tokens left to generate."""
        raise NotImplementedError

    def samples(self, ids: Tensor, gamma: int, sampler: Sampler, k: int) -> list[Draft]:
        """k chains sampled independently from the same state (SpecTr: drafters/multi.py). By
        default k calls of draft, for drafters whose draft can be repeated (a stand-alone model
        drafts again from the sequence's end); a drafter that consumes state in draft overrides it."""
        return [self.draft(ids, gamma, sampler) for _ in range(k)]

    def longest(self, gamma: int) -> int:
        """The longest chain draft asks for gamma tokens can return (warm_up captures up to it)."""
        return gamma

    def draft_best(self, ids: Tensor, gamma: int, sampler: Sampler, nodes: int) -> Draft:
        """At most `nodes` of its likeliest nodes, at most gamma deep, deterministic whatever the
        sampler (LookupFirst merges them with a lookup's chain). Drafters that rank a tree's nodes
        keep their best; by default, the greedy chain of that many tokens."""
        return self.draft(ids, min(gamma, nodes), Sampler())

    def observe(self, hidden: Tensor) -> None:
        """The target's residual streams after `hidden_layers` layers, concatenated [k, n * H], at
        the k positions just accepted (after the prefill: every prompt position)."""

    def pass_round(self) -> None:
        """This round's draft came from another drafter (LookupFirst): the next `draft` may be
        several rounds of tokens further on."""


def empty_draft(device: torch.device) -> Draft:
    return Draft(torch.empty(0, dtype=torch.long, device=device), None)


class RowDrafter(Protocol):
    """What batched.generate_many asks of a drafter: a draft per row a round (drafters/batched.py)."""

    name: str = "drafter"
    hidden_layers: tuple[int, ...] = ()  # the target's residual streams it reads (see observe)
    lookup_rows: frozenset[int] = frozenset()  # the rows whose last draft was a lookup's (RowLookupFirst)
    tree: dict[str, Tensor] | None = None  # the last draft's token trees, a row each (Tree.tensors' keys, [B, ...])
    tree_nodes: int = 0  # the most nodes a tree it drafts has (the cache makes room for them)

    def start(self, prompts: list[list[int]], row_start: list[int], capacity: int) -> None:
        """Reset for these prompts (left-padded: row b's tokens begin at slot row_start[b])."""

    def refill(self, b: int, prompt: list[int]) -> None:
        """Row b starts over with this prompt, at slot 0 (batched decoding's queue): its first token
        and the target's features of the prompt follow, as after start()."""

    def observe_tokens(self, b: int, tokens: list[int]) -> None:
        """Row b's new tokens (its first token after start() or refill(), then each round's)."""

    def observe(self, b: int, hidden: Tensor) -> None:
        """Row b's target residual streams after `hidden_layers` layers [k, n * H] at the k positions
        just accepted (after the prefill: every prompt position), as Drafter.observe."""

    def draft(self, gammas: list[int], sampler: Sampler) -> tuple[Tensor, list[int], Tensor | None]:
        """(tokens [B, g] padded, each row's draft length <= gammas[b], the distributions [B, g, V]
        they were sampled from or None where the drafts are deterministic). A drafter of trees sets
        `tree` to this draft's (None for chains): tokens [B, N] are then every row's N nodes, each
        row's length its tree's depth (0 where gammas[b] is 0), and a tree may reach past gammas[b]
        (the loop keeps the tokens that fit)."""
        raise NotImplementedError

    def keep(self, rows: list[int]) -> bool:
        """Keep only these rows, ascending (rows.move_rows), as its first (the batch's others are done,
        nothing is queued): whether it did (a drafter that cannot, the default, leaves the batch as it is)."""
        return False

    def pass_row(self, b: int) -> None:
        """Row b's last draft was replaced by another drafter's (RowLookupFirst): what it cached of
        its own draft does not hold the tokens verified next."""

    def alone(self) -> Drafter:
        """The runtime drafter a batch of one decodes with (generate)."""
        raise NotImplementedError


class DraftExit:
    """When a drafter stops early: right after a draft token whose probability is below `threshold`.

    With adaptive=True the threshold follows recent acceptance, as in Draft & Verify (Zhang et al.
    2023): after each verified draft the smoothed acceptance a <- beta1 * a + (1 - beta1) * accepted
    / drafted is compared with `target_acceptance`, and the threshold moves by (1 - beta2) * epsilon
    (epsilon, smoothed by beta2): up when a is below it (drafts run too long), down otherwise. A
    draft that used the whole gamma budget leaves the threshold as it is.
    """

    def __init__(
        self,
        threshold: float = 0.5,
        *,
        adaptive: bool = True,
        target_acceptance: float = 0.9,
        beta1: float = 0.5,
        beta2: float = 0.9,
        epsilon: float = 0.01,
    ):
        if not 0 <= threshold < 1 or not 0 < target_acceptance <= 1 or not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise SpecdecError(
                "draft exit: need 0 <= threshold < 1, 0 < target_acceptance <= 1 and 0 <= beta1, beta2 < 1 "
                f"(got {threshold}, {target_acceptance}, {beta1}, {beta2})"
            )
        self.threshold, self.adaptive, self.target_acceptance = threshold, adaptive, target_acceptance
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon
        self.acceptance = 0.0  # smoothed accepted / drafted

    def update(self, accepted: int, drafted: int, full: bool) -> None:
        """Record one verified draft: `accepted` of its `drafted` tokens; full: it used all of gamma."""
        if not self.adaptive or drafted == 0:
            return
        self.acceptance = self.beta1 * self.acceptance + (1 - self.beta1) * accepted / drafted
        step = 0.0 if full else (self.epsilon if self.acceptance <= self.target_acceptance else -self.epsilon)
        self.threshold = min(max(self.threshold + (1 - self.beta2) * step, 0.0), 1.0)

    def stop(self, p: float) -> bool:
        return p < self.threshold
