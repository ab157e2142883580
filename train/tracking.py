"""Metric logging: a log.jsonl in the run folder always, Weights & Biases when asked (rank 0 only).

    tracker = Tracker(accelerator, out, kind="wandb", project="specdec", run_name="distill", config=resolved)
    tracker.log({"train/loss": 1.2}, step=10)
    tracker.log_artifact(out / "export", "distill-drafter", metadata={"tau": 2.1})
    tracker.finish()

W&B goes through accelerate's tracker; WANDB_MODE=offline writes the run under out/wandb with no
network (sync it later with `wandb sync`). The run id is derived from the run folder, so a
resumed run continues the same W&B run.
"""

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

KINDS = ("none", "wandb")


class Tracker:
    def __init__(
        self,
        accelerator: Any,
        output_dir: Path,
        *,
        kind: str,
        project: str,
        run_name: str,
        config: dict[str, Any],
        entity: str | None = None,
        tags: list[str] | None = None,
    ):
        if kind not in KINDS:
            raise ValueError(f"tracking='{kind}': use none or wandb")
        self.accelerator, self.main = accelerator, accelerator.is_main_process
        self.file = output_dir / "log.jsonl"
        self.kind = kind
        if kind == "wandb":
            run_id = hashlib.sha1(str(output_dir.resolve()).encode()).hexdigest()[:12]
            init = {"name": run_name, "dir": str(output_dir), "id": run_id, "resume": "allow", "tags": tags or []}
            if entity:
                init["entity"] = entity
            accelerator.init_trackers(project, config=config, init_kwargs={"wandb": init})

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.main:
            return
        with self.file.open("a") as f:
            f.write(json.dumps({"step": step, "time": round(time.time(), 3), **metrics}) + "\n")
        if self.kind != "none":
            self.accelerator.log(metrics, step=step)

    def log_artifact(self, folder: Path, name: str, kind: str = "model", metadata: dict[str, Any] | None = None):
        """Rank 0: upload a folder (the exported drafter) as a W&B artifact of this run."""
        if not self.main or self.kind != "wandb":
            return
        import wandb

        artifact = wandb.Artifact(re.sub(r"[^\w.-]", "-", name), type=kind, metadata=metadata)
        artifact.add_dir(str(folder))
        self.accelerator.get_tracker("wandb", unwrap=True).log_artifact(artifact)

    def finish(self) -> None:
        """Every rank, at the end of a run: wait for the others (rank 0 exports), then end the run (the
        W&B run finished, the process group destroyed). In that order: end_training destroys the
        group, and the barrier the recipes ran after it raised under 2 processes ("Default process
        group has not been initialized")."""
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
