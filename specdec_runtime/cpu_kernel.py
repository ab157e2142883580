"""A compiled kernel for the products of a few rows on a CPU: decode, verify and draft steps.

A decode step multiplies one row by every weight matrix, so it is bound by reading the weights.
MKL computes a one-row fp32 product on one core (16.6 GB/s on the developers' 2-core EPYC, with 1
thread or 2, where two cores stream 28-34 GB/s), and its products of 2-16 rows re-read the weight
for every few rows. `csrc/skinny.c` streams each weight once, split over torch's own OpenMP threads,
for 1 to MAX_ROWS rows, and sums every output in one fixed order whatever the row count: row for
row, a verify step's products are bitwise those of a decode step. scripts/bench_cost.py measures it
against torch's products.

It is compiled on first use (`cc -O3 -march=native -fopenmp`, about a second) into
$SPECDEC_CACHE/kernels and loaded with ctypes. Where it cannot be built or used (not Linux, no C
compiler, torch not on OpenMP, or loading it would start a second OpenMP runtime) linear() keeps
torch's products, and one line says why. SPECDEC_CPU_KERNEL=0 turns it off.
"""

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

MAX_ROWS = 16  # more rows (a prefill) are a compute-bound GEMM: MKL's
SOURCE = Path(__file__).with_name("csrc") / "skinny.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
OFF = "SPECDEC_CPU_KERNEL"
_enabled = True  # see disabled()


class Unavailable(RuntimeError):
    """Why the kernel is not used here (printed once)."""


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtimes mapped into this process (by file)."""
    names = ("libgomp", "libiomp", "libomp")
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if any(n in line for n in names)}
    return {os.path.realpath(p) for p in paths if p.startswith("/")}


def _build() -> Path:
    """The compiled kernel, built once per source, compiler and CPU (atomically: concurrent
    processes each compile to a temporary file and rename it into place)."""
    from specdec_runtime.loading import cache_root  # loading imports the model, which imports this

    if not sys.platform.startswith("linux"):
        raise Unavailable(f"built only on Linux, not {sys.platform}")
    if "OpenMP" not in torch.__config__.parallel_info():
        raise Unavailable("torch does not run its threads on OpenMP")
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise Unavailable("no C compiler (install gcc, or set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    cpu = Path("/proc/cpuinfo").read_text().partition("flags")[2].partition("\n")[0]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, cpu, *FLAGS]).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"skinny-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise Unavailable(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


@functools.cache
def kernel():
    """The kernel's C function, or None where it is off or cannot be used (said once, on stderr)."""
    if os.environ.get(OFF, "1") == "0":
        return None
    try:
        before = _openmp_runtimes()
        lib = ctypes.CDLL(str(_build()))
        if _openmp_runtimes() - before:
            raise Unavailable("it would run on a second OpenMP runtime beside torch's")
    except (Unavailable, OSError) as e:
        print(f"specdec: CPU kernel not used ({e}); torch's products instead ({OFF}=0 hides this)", file=sys.stderr)
        return None
    fn = lib.skinny_matmul
    ptr, n = ctypes.c_void_p, ctypes.c_long
    fn.argtypes = [ptr, n, n, ptr, n, ptr, ptr, ptr, ctypes.c_int]
    fn.restype = None
    return fn


@contextlib.contextmanager
def disabled():
    """torch's products inside this block (benchmarks and tests compare the two)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def _serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel computes products of this device and dtype here: fp32 on a CPU, on and built."""
    return _enabled and torch.device(device).type == "cpu" and dtype == torch.float32 and kernel() is not None


def usable(x: Tensor) -> bool:
    """Whether linear() hands x's product to the kernel: few rows it serves (_serves), no autograd,
    not under torch.compile (which traces torch's ops)."""
    return (
        x.shape[0] <= MAX_ROWS
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and _serves(x.device, x.dtype)
    )


def products(device: torch.device, dtype: torch.dtype) -> str:
    """Which products a model on device/dtype runs for its decode and verify steps (benchmarks
    record it): "kernel" or "torch"."""
    return "kernel" if _serves(device, dtype) else "torch"


def matmul(x: Tensor, weight_t: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight_t [N, K]^T (+ bias [N]) (+ residual [M, N]), fp32 on a CPU (usable(x))."""
    x = x.contiguous()
    M, K = x.shape
    N = weight_t.shape[0]
    if weight_t.shape[1] != K or not weight_t.is_contiguous() or weight_t.dtype != torch.float32:
        got = f"{weight_t.dtype} {tuple(weight_t.shape)}"
        raise ValueError(f"weight_t must be a contiguous float32 [N, {K}] tensor, got {got}")
    if residual is not None:
        residual = residual.expand(M, N).contiguous()
    y = torch.empty(M, N, dtype=torch.float32)
    bias_ptr = None if bias is None else bias.data_ptr()
    res_ptr = None if residual is None else residual.data_ptr()
    kernel()(x.data_ptr(), M, K, weight_t.data_ptr(), N, bias_ptr, res_ptr, y.data_ptr(), torch.get_num_threads())
    return y
