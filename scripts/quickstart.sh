#!/usr/bin/env bash
# Set everything up, then distill a drafter for the bundled target (SmolLM2-135M-Instruct),
# validate it on specdec_runtime (tau, speedup over autoregressive, greedy losslessness) and
# export it as a Hugging Face model folder: runs/quickstart/export. Extra arguments are Hydra
# overrides, e.g. ./scripts/quickstart.sh trainer.max_steps=50. Running it again resumes
# (cached responses, the last checkpoint) instead of starting over.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python -m recipes.distill experiment=quickstart output_dir=runs/quickstart "$@"
