"""Layer-skip sets: self-speculative decoding with the target's own layers (Draft & Verify).

    skipset = SkipSet(attn=[3, 5], mlp=[7], num_layers=30, target="smollm2-135m-instruct")
    skipset.save("runs/layerskip/skipset.json")
    drafter = skip_drafter(target, SkipSet.load("runs/layerskip/skipset.json"))
    # or: specdec generate --drafter runs/layerskip/skipset.json

The drafter is the target itself with the listed attention / MLP sublayers bypassed. It reads the
target's KV cache and writes its guesses into the slots that verification then recomputes with
every layer, so the cache after a round is exactly the target's. The layers before the first
skipped one are the target's own computation and are handed to verification (not recomputed).
Drafting stops after an unsure token; the threshold adapts to recent acceptance (DraftExit).
recipes.layerskip searches for the set; the file records what it measured.
"""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec_runtime.drafters.protocol import DraftExit
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.loading import LoadedModel
from specdec_runtime.model import LayerSkip

FORMAT = "specdec-layerskip"


@dataclass
class SkipSet:
    """Which sublayers a self-speculative draft skips, for which target, and what it measured."""

    attn: list[int]
    mlp: list[int]
    num_layers: int
    target: str = ""  # the model it was found for (name or path)
    hidden_size: int | None = None
    tau: float | None = None  # measured on validation prompts (greedy), bonus token included
    speedup: float | None = None  # over autoregressive, measured in the same process
    # DraftExit settings: initial threshold, adaptive, target_acceptance; gamma = max draft length.
    draft: dict[str, Any] = field(default_factory=lambda: {"threshold": 0.5, "adaptive": True, "gamma": 8})
    search: dict[str, Any] = field(default_factory=dict)  # how it was found (sampler, trials, objective, ...)

    def __post_init__(self) -> None:
        self.attn, self.mlp = sorted(set(map(int, self.attn))), sorted(set(map(int, self.mlp)))
        bad = [i for i in self.attn + self.mlp if not 0 <= i < self.num_layers]
        if bad:
            raise SpecdecError(f"skip set: layer indices {bad} are outside 0..{self.num_layers - 1}")

    @property
    def layer_skip(self) -> LayerSkip:
        return LayerSkip(attn=set(self.attn), mlp=set(self.mlp))

    @property
    def skipped_fraction(self) -> float:
        """Skipped sublayers over all 2 * num_layers."""
        return (len(self.attn) + len(self.mlp)) / (2 * self.num_layers)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": 1, **asdict(self)}

    def save(self, path: str | Path) -> Path:
        """Write the JSON atomically (a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SkipSet":
        path = Path(path).expanduser()
        if not path.is_file():
            raise SpecdecError(f"skip set '{path}' does not exist: give the skipset.json a layerskip run wrote")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise SpecdecError(f"skip set '{path}' is not valid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise SpecdecError(f'\'{path}\' is not a layer-skip set (no "format": "{FORMAT}")')
        missing = [k for k in ("attn", "mlp", "num_layers") if k not in d]
        if missing:
            raise SpecdecError(f"skip set '{path}' lacks {', '.join(missing)}")
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


def is_skipset_file(path: str | Path) -> bool:
    """Whether `path` names a JSON file meant as a skip set (its content is checked on load)."""
    return str(path).endswith(".json")


def check_fits_target(skipset: SkipSet, target: LoadedModel, where: str = "skip set") -> None:
    """Refuse a skip set found for a differently shaped target (a name mismatch alone is allowed:
    the same model may be loaded by alias, path or Hub id)."""
    cfg = target.config
    if skipset.num_layers != cfg.num_layers or (skipset.hidden_size not in (None, cfg.hidden_size)):
        raise SpecdecError(
            f"{where} was found for '{skipset.target}' ({skipset.num_layers} layers, hidden "
            f"{skipset.hidden_size}); the target '{target.name}' has {cfg.num_layers} layers, hidden "
            f"{cfg.hidden_size}: run recipes.layerskip for this target"
        )


def skip_drafter(target: LoadedModel, skipset: SkipSet, *, confidence: float = 0.0, name: str = "") -> ModelDrafter:
    """The self-speculative drafter of a skip set (confidence > 0: a fixed exit threshold instead
    of the set's adaptive one)."""
    check_fits_target(skipset, target)
    d = skipset.draft
    if confidence > 0:
        draft_exit = DraftExit(confidence, adaptive=False)
    else:
        draft_exit = DraftExit(
            float(d.get("threshold", 0.5)),
            adaptive=bool(d.get("adaptive", True)),
            target_acceptance=float(d.get("target_acceptance", 0.9)),
        )
    return ModelDrafter(
        target.model,
        skip=skipset.layer_skip,
        shares_target_cache=True,
        draft_exit=draft_exit,
        gamma=int(d["gamma"]) if d.get("gamma") else None,
        name=name or f"layerskip(attn={len(skipset.attn)}, mlp={len(skipset.mlp)})",
    )
