#!/usr/bin/env bash
# Set everything up, then run speculative decoding on the bundled target and print its statistics:
# the smoke prompts decoded autoregressively and with the n-gram (prompt lookup) drafter, side by
# side, with tau, acceptance, speedup and greedy losslessness.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
mkdir -p runs/quickstart
specdec generate --target smollm2-135m-instruct --drafter ngram --baseline \
  --max-new-tokens 128 --gamma 4 --output runs/quickstart/ngram.jsonl "$@"
echo "outputs: runs/quickstart/ngram.jsonl"
