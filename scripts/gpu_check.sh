#!/usr/bin/env bash
# The GPU check, one command on a CUDA machine: the tests marked gpu, then scripts/bench_gpu.py:
# the Llama-3.1-8B shape with a random EAGLE-3 drafter at forced acceptance (tau ~4: the runtime's
# round cost against its bound, host syncs per round), then the Llama-3.2-1B shape with truncate:2
# (bf16 honesty and the fp32 identity check). Tables printed and kept in ${OUT:-runs/gpu_check}/.
# transformers' generate is left out of the 8B run (minutes of eager decoding at that size) and its
# static-cache generate out of both (its compilation).
#
# What a bare CUDA machine with PyTorch, transformers, accelerate, peft, safetensors, tqdm, rich,
# numpy, scipy and pytest lacks (all pure Python), as wheels in .whl/ (git-ignored):
#   hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3   (recipes: the Medusa-2 CUDA test)
#   gguf==0.19.0     (converting the bundled SmolLM2's GGUF, for recipes on it: experiment=eagle3_gpu)
# Fetch them where a package registry is reachable, then carry .whl/ to the GPU machine:
#   ./scripts/gpu_check.sh --fetch-wheels
# On the GPU machine, from the repository root:
#   ./scripts/gpu_check.sh            # gpu tests + both bench shapes
#   ./scripts/gpu_check.sh --profile  # the same, with a torch.profiler trace of a few 8B rounds in $OUT/profile
#   ./scripts/gpu_check.sh --tests    # the gpu tests only
#   ./scripts/gpu_check.sh --batch    # batched decoding alone: its gpu tests, then scripts/bench_gpu_batch.py
#                                     # (8B shape, EAGLE-3 chains at forced acceptance, batch 1-64)
#   ./scripts/gpu_check.sh --products # the 8B decode step's weight products alone, per layout and kernel
#                                     # (scripts/bench_gpu_products.py: which the runtime should take)
#   ./scripts/gpu_check.sh --ab       # --products, then the 8B EAGLE-3 round's step costs (bench_gpu.py
#                                     # --costs-only) as they are, with the drafter's steps compiled, with
#                                     # inductor's one-row products, with our weights [out, in], with both: one log
#   ./scripts/gpu_check.sh --all      # one call for a whole 15-minute lease: the gpu tests, the batched tables
#                                     # (8B chains, SmolLM2 shape, 8B trees), the 8B EAGLE-3 bench, then two A/B
#                                     # runs, in that order under one deadline (GPU_CHECK_SECONDS, default 560):
#                                     # each step gets at most its cap of what is left; four logs come back
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHEELS="hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 gguf==0.19.0"

if [ "${1:-}" = "--fetch-wheels" ]; then
  # shellcheck disable=SC2086
  python3 -m pip wheel -q --no-deps -w .whl $WHEELS && ls .whl  # sdists are built into pure-Python wheels here
  exit
fi

PY=python3
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/specdec-site .whl/*.whl \
    || { echo "gpu_check: could not install the wheels in .whl/"; exit 1; }
  export PYTHONPATH="/tmp/specdec-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT"
$PY - <<'EOF' || exit 1
import torch, transformers
assert torch.cuda.is_available(), "gpu_check: no CUDA GPU is visible"
print(f"gpu_check: {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
status=0
SECONDS=0
if [ "${1:-}" = "--ab" ]; then
  # (one log under $OUT: the device machine returns at most 8 files; each run's tables also in runs/ab/)
  {  # (a pipeline's group runs in a subshell: its status comes back through pipefail)
    failed=0
    $PY scripts/bench_gpu_products.py --shape 8b --output-dir runs/ab/products || failed=1
    common=(--shape 8b --drafter eagle3 --tree-budget 8 --top-k 4 --gamma 5 --accept-rate 0.83 --no-hf --costs-only
            --prompts 1 --max-new-tokens 256)
    $PY scripts/bench_gpu.py "${common[@]}" --output-dir runs/ab/base || failed=1
    $PY scripts/bench_gpu.py "${common[@]}" --compile-drafter --output-dir runs/ab/drafter_compiled || failed=1
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 $PY scripts/bench_gpu.py "${common[@]}" --output-dir runs/ab/cdt || failed=1
    $PY scripts/bench_gpu.py "${common[@]}" --layout out-in --output-dir runs/ab/out_in || failed=1
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 $PY scripts/bench_gpu.py "${common[@]}" --layout out-in \
      --output-dir runs/ab/out_in_cdt || failed=1
    exit $failed
  } 2>&1 | tee "$OUT/ab.log" || status=1
  echo "gpu_check: the A/B runs took ${SECONDS}s"
  exit $status
fi
if [ "${1:-}" = "--all" ]; then
  deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-560}))
  step() {  # step CAP LOG COMMAND...: COMMAND under min(CAP, the time left), appended to $OUT/LOG
    local cap=$1 log="$OUT/$2" left=$((deadline - SECONDS)); shift 2
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 30 ]; then echo "gpu_check: no time left for: $*" | tee -a "$log"; return 1; fi
    echo "=== $* (at most ${cap}s; $((deadline - SECONDS))s left)" | tee -a "$log"
    local t0=$SECONDS
    timeout -k 10 "$cap" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "=== took $((SECONDS - t0))s, exit $rc" | tee -a "$log"
    return "$rc"
  }
  batch=(--batch-sizes 1,4,16,64 --accept-rate 0.8 --prompts-per-row 2 --max-new-tokens 128)
  eagle=(--shape 8b --drafter eagle3 --tree-budget 8 --top-k 4 --gamma 5 --accept-rate 0.83 --no-hf)
  ab=("${eagle[@]}" --costs-only --prompts 1 --max-new-tokens 256)
  step 240 gpu_tests.log $PY -m pytest -m gpu -v -p no:cacheprovider --durations=12 tests || status=1
  step 150 batch.log $PY scripts/bench_gpu_batch.py --shape 8b "${batch[@]}" --gamma 4 --output-dir runs/all/8b_chains || status=1
  step 90 batch.log $PY scripts/bench_gpu_batch.py --shape smollm2 "${batch[@]}" --gamma 4 --output-dir runs/all/smollm2 || status=1
  step 150 batch.log $PY scripts/bench_gpu_batch.py --shape 8b "${batch[@]}" --tree-budget 8 --top-k 4 --gamma 5 \
    --output-dir runs/all/8b_trees || status=1
  step 120 bench.log $PY scripts/bench_gpu.py "${eagle[@]}" --prompts 4 --max-new-tokens 256 --output-dir runs/all/8b_eagle3 || status=1
  # (the products alone, 2026-11-28: [out, in] through inductor's one-row reduction was the fastest; each alone, not)
  step 80 ab.log env TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 $PY scripts/bench_gpu.py "${ab[@]}" --layout out-in \
    --output-dir runs/all/out_in_cdt || status=1
  step 180 ab.log $PY scripts/bench_gpu.py "${ab[@]}" --compile-drafter --output-dir runs/all/drafter_compiled || status=1
  echo "gpu_check: --all took ${SECONDS}s"
  exit $status
fi
if [ "${1:-}" = "--products" ]; then
  $PY scripts/bench_gpu_products.py --shape 8b --output-dir "$OUT/products" 2>&1 | tee "$OUT/products.log"
  exit
fi
if [ "${1:-}" = "--batch" ]; then
  $PY -m pytest -m gpu -q -p no:cacheprovider tests/runtime/test_batched.py 2>&1 | tee "$OUT/gpu_tests_batched.log" \
    || status=1
  echo "gpu_check: batched gpu tests took ${SECONDS}s"
  SECONDS=0
  $PY scripts/bench_gpu_batch.py --shape 8b --batch-sizes 1,4,16,64 --accept-rate 0.8 --gamma 4 --prompts-per-row 2 \
    --max-new-tokens 128 --output-dir "$OUT/8b_batch" 2>&1 | tee "$OUT/bench_8b_batch.log" || status=1
  echo "gpu_check: 8B batch bench took ${SECONDS}s"
  exit $status
fi
$PY -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" || status=1
echo "gpu_check: gpu tests took ${SECONDS}s"
if [ "${1:-}" != "--tests" ]; then
  profile=()
  [ "${1:-}" = "--profile" ] && profile=(--profile "$OUT/profile")
  SECONDS=0
  $PY scripts/bench_gpu.py --shape 8b --drafter eagle3 --tree-budget 8 --top-k 4 --gamma 5 --accept-rate 0.83 \
    --prompts 4 --max-new-tokens 256 --no-hf --live-lengths 256,1024,2048,4000 "${profile[@]}" \
    --output-dir "$OUT/8b_eagle3" 2>&1 \
    | tee "$OUT/bench_8b_eagle3.log" || status=1
  echo "gpu_check: 8B EAGLE-3 bench took ${SECONDS}s"
  SECONDS=0
  $PY scripts/bench_gpu.py --shape 1b --k 2 --prompts 2 --max-new-tokens 128 --no-hf-static --fp32-check \
    --output-dir "$OUT/1b" 2>&1 | tee "$OUT/bench_1b.log" || status=1
  echo "gpu_check: 1B bench took ${SECONDS}s"
fi
exit $status
