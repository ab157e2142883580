"""Whether each engine an export is for will load it: `specdec check-export DIR`, also run at the end
of every recipe's export (train.export) and before `specdec push`.

    report = check_export(Path("runs/eagle3/export"))
    print(report.text()); report.ok            # False: an engine the folder claims would fail to load it
    specdec check-export runs/eagle3/export    # the same; exit 2 where a claimed engine would fail
    specdec check-export DIR --engine sglang   # one engine, claimed or not

An export says which engines it is for, and as what, in specdec_export.json (write_manifest); for
an older export the claims are read off its files (infer_claims). Each claim is checked against that
engine's loader (specdec_runtime.engines), with what the manifest records of the target (its
layers, vocabulary, context) where a rule needs it.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec_runtime.engines import CHECKS, ENGINES, Folder, Verdict
from specdec_runtime.errors import SpecdecError

MANIFEST = "specdec_export.json"
ROLES = {"eagle3": "an EAGLE-3 drafter", "draft_model": "a draft model", "model": "a model", "medusa": "Medusa heads"}
KINDS = {"standalone": "a stand-alone drafter", "eagle3": "an EAGLE-3 drafter", "medusa": "Medusa heads",
         "mtp": "an MTP model", "layerskip": "a layer-skip set"}  # fmt: skip


@dataclass(frozen=True)
class Claim:
    """An engine loads the export's `folder` (relative; "." the export itself) as `role` (ROLES)."""

    engine: str
    folder: str
    role: str


def target_facts(config: dict[str, Any], hub_id: str | None) -> dict[str, Any]:
    """What the engines' rules need of the target, from its config.json."""
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return {
        "hub_id": hub_id,
        "model_type": text.get("model_type", config.get("model_type")),
        "architectures": config.get("architectures"),
        "vocab_size": text.get("vocab_size"),
        "hidden_size": text.get("hidden_size"),
        "num_hidden_layers": text.get("num_hidden_layers"),
        "max_position_embeddings": text.get("max_position_embeddings"),
        "rope_type": rope.get("rope_type", rope.get("type", "default")),
    }


def write_manifest(
    folder: Path, kind: str, target: dict[str, Any] | None, claims: list[Claim], unclaimed: dict[str, str]
) -> None:
    """specdec_export.json: the export's kind, its target, the engines it is for, and why not others."""
    manifest = {"kind": kind, "target": target, "claims": [asdict(c) for c in claims], "not_claimed": unclaimed}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def infer_claims(folder: Path) -> tuple[str, list[Claim]]:
    """(kind, claims) read off an export's files: what an export of specdec's lays out for whom."""
    f = Folder(folder)
    c = f.json() or {}
    if (folder / "skipset.json").is_file():
        return "layerskip", []
    if c.get("speculators_model_type") == "eagle3":
        claims = [Claim("vllm", ".", "eagle3")]
        if (folder / "sglang" / "config.json").is_file():
            claims.append(Claim("sglang", "sglang", "eagle3"))
        return "eagle3", claims
    if "medusa_num_heads" in c or c.get("model_type") == "medusa":
        root = Claim("faster_decoding", ".", "medusa") if "medusa_num_heads" in c else Claim("vllm", ".", "medusa")
        claims = [root]
        if (folder / "vllm" / "config.json").is_file():
            claims.append(Claim("vllm", "vllm", "medusa"))
        if (folder / "target" / "config.json").is_file():
            claims += [Claim("transformers", "target", "model"), Claim("vllm", "target", "model")]
        return "medusa", claims
    if "model_type" in c:
        from specdec_runtime.drafters.mtp import read_mtp_config

        role = "model" if read_mtp_config(folder) is not None else "draft_model"
        kind = "mtp" if role == "model" else "standalone"
        return kind, [Claim("transformers", ".", role), Claim("vllm", ".", role)]
    raise SpecdecError(f"{folder} holds no export specdec knows (no config.json of a model, drafter or heads)")


@dataclass
class Report:
    """check_export's verdicts on one export."""

    folder: Path
    kind: str
    target: dict[str, Any] | None
    verdicts: list[Verdict]
    unclaimed: dict[str, str] = field(default_factory=dict)
    inferred: bool = False  # no manifest: the claims were read off the files

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    def text(self, name: str | Path | None = None) -> str:
        """What each engine will do with it, and why not where it will not."""
        whence = "claims read off its files (no specdec_export.json)" if self.inferred else MANIFEST
        hub = (self.target or {}).get("hub_id")
        lines = [f"{name or self.folder}: {KINDS[self.kind]}" + (f" for {hub}" if hub else "") + f" ({whence})"]
        for v in self.verdicts:
            where = "" if v.folder == "." else f" from {v.folder}/"
            state = "loads" if v.ok else "WILL NOT LOAD RIGHT"
            lines.append(f"  {ENGINES[v.engine].name} as {ROLES[v.role]}{where}: {state}")
            lines += [f"    - {p}" for p in v.problems] + [f"    note: {n}" for n in v.notes]
        lines += [f"  {ENGINES[e].name}: not claimed: {why}" for e, why in self.unclaimed.items()]
        if not self.verdicts:
            lines.append("  no serving engine loads this kind of export (specdec_runtime runs it)")
        return "\n".join(lines)

    def card(self) -> str:
        """The model card's section: which engines were checked, how, and what they said."""
        rows = ["| engine | loads | as | folder |", "|---|---|---|---|"]
        for v in self.verdicts:
            loads = "yes" if v.ok else "**no**: " + "; ".join(v.problems)
            rows.append(f"| {ENGINES[v.engine].name} | {loads} | {ROLES[v.role]} | `{v.folder}` |")
        rows += [f"| {ENGINES[e].name} | not claimed: {why} | | |" for e, why in self.unclaimed.items()]
        engines = dict.fromkeys(v.engine for v in self.verdicts)
        sources = "; ".join(f"{ENGINES[e].name}: {ENGINES[e].source}" for e in engines)
        how = (
            "Checked by `specdec check-export` when it was exported: each engine's loader rules, read from its "
            f"source ({sources}), applied to the configs and the weights' names, shapes and dtypes"
        )
        return "\n".join(rows) + "\n\n" + how + ". Run it again after editing the folder.\n"


def check_export(folder: str | Path, engines: list[str] | None = None) -> Report:
    """Every engine the export claims (engines: just these, claimed or read off its files), checked."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SpecdecError(f"{folder} is not a folder: give an export folder (a run's export/)")
    unknown = sorted(set(engines or ()) - set(ENGINES))
    if unknown:
        raise SpecdecError(f"unknown engine {', '.join(unknown)}: use {', '.join(ENGINES)}")
    manifest = Folder(folder).json(MANIFEST)
    if manifest is not None:
        kind, target = manifest["kind"], manifest.get("target")
        claims, unclaimed = [Claim(**c) for c in manifest["claims"]], dict(manifest.get("not_claimed") or {})
    else:
        (kind, claims), target, unclaimed = infer_claims(folder), None, {}
    if engines:
        possible = claims + [c for c in infer_claims(folder)[1] if c not in claims]
        claims = [c for c in possible if c.engine in engines]
        unclaimed = {e: why for e, why in unclaimed.items() if e in engines and e not in {c.engine for c in claims}}
    verdicts = []
    for c in claims:
        v = CHECKS[c.engine, c.role](Folder(folder / c.folder), target)
        v.folder = c.folder
        verdicts.append(v)
    return Report(folder, kind, target, verdicts, unclaimed, inferred=manifest is None)
