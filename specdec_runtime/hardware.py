"""Hardware choices, made once a process: the dtype (bf16 only where this device multiplies it
measurably faster than fp32), the device, and the CPU threads decoding and training run on.

    dtype = resolve_dtype("fast", device)   # bf16 where fast_bf16(device) says so, else fp32
    choice = cpu_threads("decode")          # the thread count decoding's work runs fastest on here
"""

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec_runtime.errors import SpecdecError
from specdec_runtime.layers import Weights, linear


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' (or None) is float32 on CPU and bfloat16 on CUDA; 'fast' is bfloat16 where this
    device multiplies bf16 matrices measurably faster than fp32 (fast_bf16), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "fast":
        return torch.bfloat16 if fast_bf16(device).fast else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise SpecdecError(f"unknown dtype '{dtype}': use auto, fast, float32, bfloat16 or float16")
    return table[dtype]


@dataclass(frozen=True)
class Bf16Speed:
    """What fast_bf16 measured: bf16 matmul time / fp32 matmul time on a device, and the verdict."""

    device: str
    ratio: float  # < 1: bf16 is faster
    fast: bool
    threads: int = 0  # a CPU's: torch's threads it was timed with (its default: one per physical core)

    def __str__(self) -> str:
        verdict = "using bf16" if self.fast else "using fp32"
        threads = f" with {self.threads} thread{'s' * (self.threads > 1)}" if self.threads else ""
        return f"bf16 matmuls take {self.ratio:.2f}x the time of fp32 on this {self.device}{threads}: {verdict}"


@functools.cache
def _bf16_speed(device_type: str) -> Bf16Speed:
    if device_type == "cuda":
        return Bf16Speed("GPU", 0.0, torch.cuda.is_bf16_supported())
    from torch.utils import benchmark

    a = torch.randn(256, 1024)
    b = torch.randn(1024, 1024)
    times = {}
    for dt in (torch.float32, torch.bfloat16):
        x, w = a.to(dt), b.to(dt)
        timer = benchmark.Timer("x @ w", globals={"x": x, "w": w}, num_threads=torch.get_num_threads())
        times[dt] = timer.blocked_autorange(min_run_time=0.2).median
    ratio = times[torch.bfloat16] / times[torch.float32]
    return Bf16Speed("CPU", ratio, ratio < 0.8, torch.get_num_threads())


def fast_bf16(device: torch.device) -> Bf16Speed:
    """Whether bf16 pays on this device: on CUDA, if the GPU supports it; on a CPU, a 256 x 1024 x
    1024 matmul timed in both dtypes (~0.5 s, once per process): bf16 must take under 0.8x of
    fp32's time (CPUs with AMX or AVX512-BF16 take ~0.3x; without them bf16 is emulated, ~5-20x)."""
    return _bf16_speed(torch.device(device).type)


@dataclass(frozen=True)
class ThreadChoice:
    """How many CPU threads a kind of work runs on (cpu_threads), and what decided it."""

    work: str  # "decode" (the runtime's steps: products of a few rows) or "train" (matmuls)
    threads: int
    timed: tuple[tuple[int, float], ...] = ()  # (threads, median seconds) per candidate; () if none was timed
    why: str = ""  # why nothing was timed

    def __str__(self) -> str:
        return self.describe({"decode": "decoding", "train": "training"}[self.work])

    def describe(self, what: str) -> str:
        """The choice said for `what` runs on it (several kinds of work where they share it)."""
        on = f"{what} on {self.threads} CPU thread{'s' * (self.threads > 1)}"
        if not self.timed:
            return f"{on} ({self.why})"
        return f"{on}: its timed work took " + ", ".join(f"{1e3 * t:.2f} ms with {n}" for n, t in self.timed)


def _cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPUs a cgroup's quota grants this process (cgroup v2 cpu.max, v1 cfs quota), rounded
    up, or None where there is no quota: containers often see every core of the host."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            fields = (root / quota_file).read_text().split()
            if period_file:
                fields.append((root / period_file).read_text().strip())
        except OSError:
            continue
        if len(fields) == 2 and fields[0] not in ("max", "-1") and int(fields[1]) > 0:
            return max(1, -(-int(fields[0]) // int(fields[1])))
        return None
    return None


def thread_candidates() -> tuple[list[int], str]:
    """The thread counts worth timing on this CPU, and why there is only one where there is:
    torch's default (one per physical core) and every CPU this process may use (SMT siblings
    included), neither above a cgroup's quota. OMP_NUM_THREADS, where set, is the user's choice."""
    if os.environ.get("OMP_NUM_THREADS"):
        return [torch.get_num_threads()], "OMP_NUM_THREADS"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_cpus()
    cap = min(usable, quota) if quota else usable
    default = torch.get_num_threads()
    candidates = sorted({min(default, cap), cap})
    if len(candidates) > 1:
        return candidates, ""
    if quota is not None and quota < default:
        return candidates, f"the cgroup's quota: {quota} CPUs of the {default} cores torch would use"
    return candidates, f"one per core: {usable} usable CPUs, no SMT siblings to try"


def _decode_work() -> Any:
    """A decode and a verify step's kind of product (1 and 3 rows of a 64 MB fp32 weight) as the
    runtime runs them: the CPU kernel where it is built, else MKL. Bound by memory bandwidth."""
    w = Weights.from_matrix(torch.randn(2048, 8192) * 0.02, None, cpu_copy=True)
    x1, x3 = torch.randn(1, 2048), torch.randn(3, 2048)

    def run() -> None:
        with torch.inference_mode():
            linear(x1, w), linear(x3, w)

    return run


def _train_work() -> Any:
    """A training step's kind of product (fp32 256 x 1024 x 1024 matmul). Bound by compute."""
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    return lambda: a @ b


@contextlib.contextmanager
def using_threads(threads: int | None) -> Iterator[int]:
    """torch's CPU threads set to `threads` (None: left as they are) inside the block, and back to
    what they were after it; yields the count in effect."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _median_times(work: Any, candidates: list[int], repeats: int = 7) -> dict[int, float]:
    """Median seconds of work() with each thread count, the counts alternated within each repeat
    (a machine's speed drifts over seconds), after one warm-up run each."""
    times = {n: [] for n in candidates}
    for i in range(repeats + 1):
        for n in candidates if i % 2 else candidates[::-1]:
            with using_threads(n):
                start = time.perf_counter()
                work()
                if i:
                    times[n].append(time.perf_counter() - start)
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}


@functools.cache
def cpu_threads(work: str) -> ThreadChoice:
    """The thread count `work` ("decode" or "train") runs fastest on here, measured once per
    process where there is a choice (thread_candidates): a count other than torch's default
    must be at least 5% faster than it to be taken (~0.5 s of timing)."""
    if work not in ("decode", "train"):
        raise ValueError(f"cpu_threads: work is 'decode' or 'train', got {work!r}")
    candidates, why = thread_candidates()
    if len(candidates) == 1:
        return ThreadChoice(work, candidates[0], why=why)
    median = _median_times(_decode_work() if work == "decode" else _train_work(), candidates)
    default = min(torch.get_num_threads(), candidates[-1])
    best = min(median, key=median.get)
    chosen = best if median[best] < 0.95 * median.get(default, float("inf")) else default
    return ThreadChoice(work, chosen, tuple(sorted(median.items())))


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto' (or None) is cuda when available, else cpu."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise SpecdecError(f"unknown device '{device}': use auto, cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise SpecdecError(f"device '{device}': specdec_runtime runs on cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecdecError("device 'cuda' was asked for but no CUDA GPU is available: use --device cpu")
    return device
