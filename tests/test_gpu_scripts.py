"""The GPU benches (scripts/bench_gpu*.py) end to end on the tiny shape on a CPU, the captured steps
emulated: a GPU lease is 15 minutes, and a script that fails where the CPU could have shown it
costs one of its calls (bench_gpu_batch's batch of one did, 2026-11-28: docs/log/gpu.md). Each
run's results.json is read back: forced acceptance raises tau above 1, and nothing is compiled or
captured inside the timed runs."""

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run_script(name: str, *args: str, out: Path) -> dict:
    """scripts/<name> run in this process with these arguments (tiny shape, CPU), its results.json."""
    argv, path = sys.argv, list(sys.path)  # (the scripts put their folder on the path)
    sys.argv = [name, "--shape", "tiny", "--device", "cpu", *args, "--output-dir", str(out)]
    try:
        runpy.run_path(str(SCRIPTS / name), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize(
    "drafting",
    [
        pytest.param([], id="chains"),
        pytest.param(["--tree-budget", "4", "--top-k", "2", "--gamma", "3"], id="trees"),
    ],
)
def test_the_batched_bench_runs_every_batch_size_on_captured_steps(drafting, tmp_path):
    """scripts/bench_gpu_batch.py: batch 1 (generate with the drafter itself) and a batch of 2."""
    common = ["--compile", "on", "--batch-sizes", "1,2", "--max-new-tokens", "6", "--prompts-per-row", "1"]
    results = run_script("bench_gpu_batch.py", *common, "--prompt-len", "12", *drafting, out=tmp_path)
    rows = results["results"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["tau"] > 1 and r["spec_tok_s"] > 0 and r["ar_tok_s"] > 0
        assert r["timed_compiles_captures"] == [0, 0]


@pytest.mark.parametrize(
    "variant",
    [
        ["--compile-drafter"],
        # (9 s: -m slow, the default run stays under 10 minutes; flex attention is off by default)
        pytest.param(["--attention", "flex", "--live-lengths", "100,300"], marks=pytest.mark.slow),
        ["--layout", "out-in", "--costs-only"],
    ],
    ids=["whole", "flex", "out-in costs"],
)
def test_the_eagle3_bench_runs_at_forced_acceptance(variant, tmp_path):
    """scripts/bench_gpu.py with a random EAGLE-3 drafter's trees: the whole run with the drafter's
    steps compiled (gpu_check.sh --all's second step: nothing compiled inside the timed prompts, the
    shallower trees near their budget included), the whole run with flex attention and a decode step
    by live length in each attention (--all's fourth), and --costs-only with the weights stored [out,
    in] (the A/B runs of gpu_check.sh --ab)."""
    args = ["--compile", "on", "--drafter", "eagle3", "--tree-budget", "4", "--top-k", "2", "--gamma", "3",
            "--accept-rate", "0.8", "--no-hf", "--prompts", "1", "--max-new-tokens", "12"]  # fmt: skip
    results = run_script("bench_gpu.py", *args, *variant, out=tmp_path)
    assert results["tau"] > 1 and all(ms > 0 for ms in results["step_ms"].values())
    if "--compile-drafter" in variant:
        assert results["drafter_steps_compiled"] and results["timed_compiles_captures"] == [0, 0]
    if "flex" in variant:
        assert results["attention"] == "flex" and results["timed_compiles_captures"] == [0, 0]
        live = results["decode_ms_by_live_length"]
        assert set(live) == {"100", "300"}
        assert all(set(v) == {"sdpa_whole", "sdpa_span", "flex"} and min(v.values()) > 0 for v in live.values())


def test_the_products_bench_times_every_product(tmp_path):
    """scripts/bench_gpu_products.py: each of the step's five products in each variant, and the step."""
    results = run_script("bench_gpu_products.py", out=tmp_path)
    assert set(results["us"]) == {"qkv", "o", "gate_up", "down", "head"}
    assert all(ms > 0 for ms in results["step_ms"].values())


def test_the_moe_bench_times_each_way_and_says_which_moe_takes(tmp_path):
    """scripts/bench_moe.py (gpu_check.sh --all's last step) on small experts: the gathered weights
    up to experts / top-k rows, then the loop over experts on a CPU (no grouped products there), every
    way timed where it runs (torch's grouped products run on a CPU too)."""
    argv, path = sys.argv, list(sys.path)
    shape = ["--experts", "8", "--top-k", "2", "--hidden", "64", "--intermediate", "32", "--rows", "1,4,40"]
    sys.argv = ["bench_moe.py", "--device", "cpu", "--dtype", "float32", *shape, "--runs", "1"]
    sys.argv += ["--output-dir", str(tmp_path)]
    try:
        runpy.run_path(str(SCRIPTS / "bench_moe.py"), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["rows"], r["takes"]) for r in rows] == [(1, "gathered"), (4, "gathered"), (40, "by expert")]
    assert all(r["grouped_ms"] > 0 and r["by_expert_ms"] > 0 for r in rows)
    assert [r["gathered_ms"] is not None for r in rows] == [True, True, False]  # (40 x 2 > 4 x 8: not timed)
