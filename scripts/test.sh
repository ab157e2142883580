#!/usr/bin/env bash
# Set everything up, then lint and run the tests (CPU only, no network). Extra args go to pytest,
# e.g. ./scripts/test.sh -m slow for the slow tests.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
ruff check .
python -m pytest "$@"
