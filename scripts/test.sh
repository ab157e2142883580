#!/usr/bin/env bash
# Set everything up, then lint and run the tests (CPU only, no network). Extra args go to pytest,
# e.g. ./scripts/test.sh -m slow for the slow tests.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# speculators, the vLLM project's reference implementation of the EAGLE-3 format, is a test
# dependency: tests/train/test_speculators.py loads our exports with its own classes. Its pins
# (transformers<=5.19, datasets<=5.1, torchvision, torchaudio, openai, ...) conflict with ours, so it
# goes in --no-deps with only what `import speculators.models.eagle3` needs: hs-connectors (its
# dependencies, torch and safetensors, are ours) and openai; pydantic and datasets are ours already.
if ! python -c "import importlib.metadata as m, sys; sys.exit(m.version('speculators') != '0.9.0')" 2>/dev/null; then
  python -m pip install -q --no-compile --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
  python -m pip install -q --no-compile "openai>=2,<4" -c <(echo "torch==2.13.0")
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
ruff check .
python -m pytest "$@"
