#!/usr/bin/env bash
# Set everything up, then train an EAGLE-3 drafter for the bundled target (SmolLM2-135M-Instruct),
# validate it on specdec_runtime (tau, speedup over autoregressive, greedy losslessness) and
# export it in the speculators format vLLM and SGLang load: runs/quickstart/export. EAGLE-3 is the
# drafter that measured best in this budget (docs/recipes/eagle3.md). Extra arguments are
# Hydra overrides, e.g. ./scripts/quickstart.sh trainer.max_steps=50. Running it again resumes
# (cached responses and states, the last checkpoint) instead of starting over.
#
# The whole job is planned to end within 15 minutes of this script's start on a slower machine
# too: training ends by 12 minutes in (trainer.train_until, fewer steps where the setup and the data
# took longer; said), leaving 3 for validation and export. trainer.train_until=null lifts that.
set -euo pipefail
started=$(date +%s)
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
python -m recipes.eagle3 experiment=eagle3_quickstart output_dir=runs/quickstart \
    "trainer.train_until=$((started + 12 * 60))" "$@"
echo "More data is what raises this drafter's tau (docs/log/eagle3.md). On a GPU:"
echo "  python -m recipes.eagle3 experiment=eagle3_gpu output_dir=runs/eagle3-gpu"
