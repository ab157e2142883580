"""Building and loading the CPU kernel (csrc/: skinny.c, layers.c, argmax.c).

It is compiled on first use (`cc -O3 -march=native -fopenmp`, about a second) into
$SPECDEC_CACHE/kernels and loaded with ctypes (library()). Where it cannot be built or used (not
Linux, no C compiler, torch not on OpenMP, or loading it would start a second OpenMP runtime) the
runtime keeps torch's ops, and one line says why. SPECDEC_CPU_KERNEL=0 turns it off.
SPECDEC_CPU_MARCH builds it for another instruction set than this CPU's (e.g. x86-64-v3: AVX2 and
FMA, no AVX-512), to measure how a CPU without AVX-512 would run.
"""

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

from specdec_runtime.paths import cache_root

# The most rows a call takes: past them MKL's GEMM (and SDPA, which skips masked slots) win
# (docs/log/cpu-kernel.md; scripts/bench_cost.py --rows). max_rows() is this build's. A longer
# prompt runs in chunks of PREFILL_CHUNK rows, each attending only to the slots up to its own
# last row.
MAX_ROWS, WIDE_MAX_ROWS = 128, 512
# A prompt longer than the kernel takes in one call is prefilled this many tokens a call
# (model.Decoder.prefill, an EAGLE-3 drafter's first catch-up): the fastest chunk tried, all well
# under torch's one pass (docs/log/cpu-kernel.md).
PREFILL_CHUNK = 128
CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "skinny.c", CSRC / "layers.c", CSRC / "argmax.c")
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
OFF = "SPECDEC_CPU_KERNEL"
MARCH = "SPECDEC_CPU_MARCH"  # the compiler's -march (default native)


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
    if not sys.platform.startswith("linux"):
        raise Unavailable(f"built only on Linux, not {sys.platform}")
    if "OpenMP" not in torch.__config__.parallel_info():
        raise Unavailable("torch does not run its threads on OpenMP")
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise Unavailable("no C compiler (install gcc, or set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    cpu = Path("/proc/cpuinfo").read_text().partition("flags")[2].partition("\n")[0]
    texts = [p.read_text() for p in sorted(CSRC.iterdir()) if p.suffix in (".c", ".h")]
    flags = (*FLAGS, f"-march={os.environ.get(MARCH) or 'native'}")
    key = hashlib.sha256("\0".join([*texts, version, cpu, *flags]).encode()).hexdigest()[:16]
    out = cache_root() / "kernels" / f"skinny-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise Unavailable(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled library (its functions typed), or None where it is off or cannot be used (said
    once, on stderr)."""
    if os.environ.get(OFF, "1") == "0":
        return None
    try:
        before = _openmp_runtimes()
        lib = ctypes.CDLL(str(_build()))
        if _openmp_runtimes() - before:
            raise Unavailable("it would run on a second OpenMP runtime beside torch's")
    except (Unavailable, OSError) as e:
        print(f"specdec: CPU kernel not used ({e}); torch's ops instead ({OFF}=0 hides this)", file=sys.stderr)
        return None
    P, N, F, Int = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
    gather = [P, P, *[N] * 4]  # decoder_layers' tokens, embed, ep, es0, es1, es2
    attend = [P, N, P, P, N, N, P, P, N, N]  # kv .. bound
    head = [P, P, Int, P, Int, P, N, N, P, P]  # norm, head, head_bf16, screen, pairs, norms, V, keep, logits, best
    signatures = {  # pointers, longs, floats, ints in layers.c / skinny.c order
        "skinny_matmul": [P, N, N, P, Int, N, P, P, P, Int],
        "stream_sum": [P, N, Int],
        "argmax_rows": [P, N, N, N, P, Int],
        "skinny_panel": [],
        "skinny_wide": [],
        "skinny_pairs": [],
        "attention_block": [P, N, N, P, F, P, P, Int, P, N, N, N, P, P, N, P, P, N, P, N, P, P, N, N, P, Int],
        "mlp_block": [P, N, N, P, F, P, Int, P, N, P, P, P, Int],
        "decoder_layers": [P, *gather, *[N] * 4, P, Int, P, F, *[N] * 4, *attend, P, P, N, *head, Int],
        "head_rows": [P, N, N, P, F, P, Int, N, P, Int],
        "eagle3_rows": [P, N, P, N, N, N, N, P, N, P, P, Int, Int, F, *[N] * 7, P, P, N, P, N, P, P, N, N, P, P, Int],
        "eagle3_draft": [P, N, P, N, N, P, *[N] * 4, P, Int, Int, F, *[N] * 6, P, P, N, P, N, P, Int, Int, Int, P, Int],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        restypes = {"skinny_matmul": None, "argmax_rows": None, "stream_sum": ctypes.c_float, "eagle3_draft": N}
        fn.argtypes, fn.restype = args, restypes.get(name, Int)
    return lib


def max_rows() -> int:
    """The most rows a step runs in the kernel: WIDE_MAX_ROWS where its fp32 passes of 7-12 rows run
    in 512-bit registers (skinny.c, AVX-512), else MAX_ROWS."""
    lib = library()
    return WIDE_MAX_ROWS if lib is not None and lib.skinny_wide() else MAX_ROWS


def panel() -> int:
    """The columns of a panel, the unit the kernel reads a packed weight in (kernel.pack()): 32 where it is
    built for AVX-512 (two 16-lane vectors), else 16 (16 where it is not built)."""
    lib = library()
    return 16 if lib is None else lib.skinny_panel()


def pairs() -> bool:
    """Whether the kernel multiplies bf16 pairs (built for a CPU with AVX512-BF16: kernel.pack(pairs=True))."""
    lib = library()
    return lib is not None and bool(lib.skinny_pairs())
