"""The compiled CPU kernels (specdec_runtime/cpu/kernel.py). Products of a few rows: against the
float64 product, row for row independent of the other rows and of the thread count, used by
linear() exactly where they should be, refused with a reason where they cannot be built. Whole
sublayers (layers.c): against the decoder in float64, as close as torch's fp32 path, a verify
step's rows bitwise its decode steps', used exactly where they should be."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec_runtime.cpu import build
from specdec_runtime.cpu import kernel as cpu_kernel
from specdec_runtime.layers import Weights, linear
from specdec_runtime.model import LayerSkip
from specdec_runtime.tree import Tree

needs_kernel = pytest.mark.skipif(
    cpu_kernel.library() is None, reason="the CPU kernel cannot be built here (the reason is printed above)"
)


def packed(wt, bias=None):
    """Weights of W^T [N, K] (+ bias) with the kernel's packed copy."""
    return Weights.from_matrix(wt.t().contiguous(), bias, cpu_copy=True)


@pytest.mark.parametrize("width", [16, 32])
def test_pack_layout(width):
    """W [K, N] in panels of `width` output columns (the kernel's panel()), each [K, width], N
    padded to a multiple of width with zero columns."""
    K, N = 3, width + 5  # one whole panel and a part of one
    w = torch.arange(K * N, dtype=torch.float32).view(K, N)
    p = cpu_kernel.pack(w, width=width)
    assert p.shape == (2, K, width)
    for k in range(K):
        assert p[0, k].tolist() == w[k, :width].tolist()
        assert p[1, k].tolist() == w[k, width:].tolist() + [0.0] * (width - 5)


def product64(x, wt, bias=None, residual=None):
    y = x.double() @ wt.double().t()
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y


@needs_kernel
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 16, 25, 128])
@pytest.mark.parametrize("K,N", [(64, 96), (72, 61), (576, 960), (9, 5), (16, 1), (44, 6), (27, 7)])
def test_against_float64(M, K, N):
    """Every row count (one pass of up to 6 or 12 rows, several passes of equal rows), N not a
    multiple of the panels' 16 or 32 columns (a last panel of 1-31 real columns), K small and large;
    with bias and residual (also one row
    broadcast to every row, which the kernel reads from a copy it must keep alive)."""
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    x, wt = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    bias, residual = torch.randn(N, generator=g), torch.randn(M, N, generator=g)
    broadcast = torch.randn(1, N, generator=g).expand(M, N)
    with torch.inference_mode():
        for b, r in [(None, None), (bias, None), (None, residual), (bias, residual), (bias, broadcast)]:
            y = cpu_kernel.matmul(x, packed(wt, b), r)
            assert y.shape == (M, N) and y.dtype == torch.float32
            torch.testing.assert_close(y.double(), product64(x, wt, b, r), rtol=1e-5, atol=1e-5 * K**0.5)


@needs_kernel
@pytest.mark.parametrize("M", [1, 4, 7])
@pytest.mark.parametrize("K,N", [(72, 61), (576, 960), (9, 5)])
def test_bf16_weights_are_the_rounded_weights_widened_exactly(M, K, N):
    """A bf16-packed weight (a drafter's) gives the product of the same weight rounded to bf16, as
    exactly as an fp32 product (against float64), at half the bytes; N with and without a part
    panel."""
    g = torch.Generator().manual_seed(K + N + M)
    x, w = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    bias, residual = torch.randn(N, generator=g), torch.randn(M, N, generator=g)
    half = Weights.from_matrix(w, bias, cpu_copy=True, bf16=True)
    assert half.packed.dtype == torch.bfloat16
    assert half.packed.shape == cpu_kernel.pack(w).shape
    rounded = w.bfloat16().float()
    with torch.inference_mode():
        y = cpu_kernel.matmul(x, half, residual).double()
    tol = dict(rtol=1e-5, atol=1e-5 * K**0.5)
    torch.testing.assert_close(y, product64(x, rounded.t(), bias, residual), **tol)
    with pytest.raises(AssertionError):  # the rounding is visible: not the fp32 weight's product
        torch.testing.assert_close(y, product64(x, w.t(), bias, residual), **tol)


@needs_kernel
def test_rows_do_not_depend_on_the_other_rows_or_threads():
    """A verify step's products give, row for row, bitwise what a decode step gives: each row of a
    40-row product (four passes of 10 rows) equals that row alone, and any block of rows containing
    it (one pass or several, of other sizes), with 1 or 2 threads."""
    g = torch.Generator().manual_seed(0)
    x, wt = torch.randn(40, 576, generator=g), packed(torch.randn(1000, 576, generator=g))
    threads = torch.get_num_threads()
    with torch.inference_mode():
        full = cpu_kernel.matmul(x, wt)
        for i in range(40):
            assert torch.equal(cpu_kernel.matmul(x[i : i + 1], wt), full[i : i + 1])
        for lo, hi in [(0, 5), (3, 9), (7, 16), (2, 4), (0, 13), (5, 30)]:
            assert torch.equal(cpu_kernel.matmul(x[lo:hi], wt), full[lo:hi])
        try:
            torch.set_num_threads(1)
            assert torch.equal(cpu_kernel.matmul(x, wt), full)
        finally:
            torch.set_num_threads(threads)


@needs_kernel
def test_linear_uses_it_only_for_few_fp32_rows_without_autograd():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 48, generator=g)  # [in, out]
    params = Weights.from_matrix(w, torch.randn(48, generator=g), cpu_copy=True)
    calls = []
    real = cpu_kernel.matmul

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    cpu_kernel.matmul = counting
    try:
        with torch.inference_mode():
            for M in (1, 5, 16, cpu_kernel.max_rows(), cpu_kernel.max_rows() + 1):
                x = torch.randn(M, 64, generator=g)
                torch.testing.assert_close(linear(x, params), x @ w + params.bias)
            with cpu_kernel.disabled():
                linear(torch.randn(3, 64), params)
            linear(torch.randn(2, 64, dtype=torch.float64), Weights.from_matrix(w.double(), params.bias.double(), True))
        x = torch.randn(2, 64, requires_grad=True)
        linear(x, params).sum().backward()  # autograd: torch's products
        assert x.grad is not None
    finally:
        cpu_kernel.matmul = real
    assert calls == [1, 5, 16, cpu_kernel.max_rows()]


@needs_kernel
@pytest.mark.parametrize("V", [1, 7, 31, 32, 33, 100, 4099])
def test_argmax_is_torchs(V):
    """Greedy decoding's choice per row (sampling.argmax, verify): torch.argmax's index exactly,
    on ties (the first), rows of -inf, NaN (the first NaN), a maximum in the tail past the 32-lane
    blocks, strided rows, 1-D and 3-D logits, any thread count; torch's own for other dtypes."""
    from specdec_runtime.sampling import argmax

    g = torch.Generator().manual_seed(V)
    x = torch.randint(-3, 4, (6, V), generator=g).float()  # many ties
    x[1] = float("-inf")
    x[2, V // 2] = x[2, V - 1] = float("nan")
    x[3, -1] = 100.0
    x[4] = torch.randn(V, generator=g)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert cpu_kernel.serves_argmax(x)
            assert torch.equal(argmax(x), x.argmax(-1))
            assert torch.equal(argmax(x[::2]), x[::2].argmax(-1))  # rows 2V apart
            assert argmax(x[4]).dim() == 0 and torch.equal(argmax(x[4]), x[4].argmax(-1))
            assert torch.equal(argmax(x.view(2, 3, V)), x.view(2, 3, V).argmax(-1))
    finally:
        torch.set_num_threads(threads)
    assert not cpu_kernel.serves_argmax(x.double()) and torch.equal(argmax(x.double()), x.double().argmax(-1))


@needs_kernel
def test_stream_sum_is_the_sum():
    """The plain read that bench_cost holds decode steps to sums every element once, on any thread count."""
    x = torch.rand(1 << 16, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert cpu_kernel.stream_sum(x) == pytest.approx(x.double().sum().item(), rel=1e-5)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_kernel.stream_sum(x[:33])


@needs_kernel
def test_its_row_limit_is_the_builds():
    """Passes of up to 12 rows in 512-bit registers are built exactly where the compiler targets
    AVX-512, and products of bf16 pairs where it targets AVX512-BF16 too (the compiler's own macros
    for the build's -march); with the passes the kernel takes steps (prefills) of up to
    WIDE_MAX_ROWS rows, without them MAX_ROWS."""
    march = os.environ.get(build.MARCH) or "native"
    cmd = [os.environ.get("CC", "cc"), f"-march={march}", "-dM", "-E", "-x", "c", "/dev/null"]
    macros = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    wide, pairs = "__AVX512F__" in macros, "__AVX512F__" in macros and "__AVX512BF16__" in macros
    assert cpu_kernel.library().skinny_wide() == int(wide) and cpu_kernel.pairs() == pairs
    assert cpu_kernel.max_rows() == (build.WIDE_MAX_ROWS if wide else build.MAX_ROWS)


def mapping_of(ptr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address ptr."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(a, 16) for a in head.split("-"))
            if inside:
                break
            inside = start <= ptr < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_on_huge_pages_copies_side_by_side_where_linux_gives_huge_pages(monkeypatch):
    """Copies equal to the tensors (their dtypes, shapes, odd sizes), side by side at 4 KiB boundaries
    in one mapping that starts at a 2 MiB boundary and that Linux may back with huge pages (smaps:
    THPeligible, unless THP is off on this machine); the tensors themselves where that cannot help
    (under a page in all) or SPECDEC_HUGE_PAGES=0."""
    ts = [torch.randn(1000, 577), torch.randn(3, 5).bfloat16(), torch.randn(700, 301)]
    copies = cpu_kernel.on_huge_pages(ts)
    for c, t in zip(copies, ts):
        assert c is not t and c.dtype == t.dtype and torch.equal(c, t) and c.is_contiguous()
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1
    assert [c.data_ptr() % 4096 for c in copies] == [0, 0, 0] and copies[0].data_ptr() % cpu_kernel.HUGE_PAGE == 0
    assert copies[1].data_ptr() - copies[0].data_ptr() == -(-1000 * 577 * 4 // 4096) * 4096
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert mapping_of(copies[0].data_ptr()).get("THPeligible") == "1"
    assert cpu_kernel.on_huge_pages(ts[1:2]) == ts[1:2]  # 30 bytes: as they are
    monkeypatch.setenv(cpu_kernel.HUGE, "0")
    assert cpu_kernel.on_huge_pages(ts) == ts


@needs_kernel
def test_a_models_packed_weights_run_from_huge_pages_bitwise_as_from_torchs_memory(monkeypatch):
    """Decoder.keep_cpu_copies puts every packed weight in one mapping on huge pages: its logits are
    bitwise those of the same model with the packs in torch's memory (SPECDEC_HUGE_PAGES=0)."""
    from tests.conftest import tiny_decoder

    big = dict(hidden_size=256, head_dim=64, intermediate_size=1024)  # ~7 MiB of packs: more than a huge page
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    logits = []
    for huge in ("1", "0"):
        monkeypatch.setenv(cpu_kernel.HUGE, huge)
        model = tiny_decoder(**big)
        packs = [m.weight_packed for m in model.modules() if hasattr(m, "weight_packed")]
        storages = {p.untyped_storage().data_ptr() for p in packs}
        assert len(storages) == (1 if huge == "1" else 2 * 4 + 1)  # one, or one per Linear (4 a layer, lm_head)
        model.setup_cache(1, 16)
        logits.append(torch.cat([model(ids[:, :6], 0).logits, model(ids[:, 6:7], 6).logits], 1))
    assert torch.equal(*logits)


def test_rows_off_the_cpu_never_load_the_library(monkeypatch):
    """A GPU's rows (the meta device stands in) are refused before the library is asked anything:
    building it on a GPU machine would cost a compile, and a stderr line where it cannot be built."""
    monkeypatch.setattr(cpu_kernel, "library", lambda: pytest.fail("the library was loaded for rows off the CPU"))
    with torch.inference_mode():
        assert not cpu_kernel.usable(torch.empty(1, 8, device="meta"))
        assert not cpu_kernel.stack_usable(torch.empty(600, 8, device="meta"))


def test_refused_with_a_reason(monkeypatch, tmp_path, capsys):
    """No compiler: torch's products, and one line on stderr saying why and how to hide it."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    cpu_kernel.library.cache_clear()
    try:
        assert cpu_kernel.library() is None
        err = capsys.readouterr().err
        assert "CPU kernel not used" in err and "SPECDEC_CPU_KERNEL=0" in err
        with torch.inference_mode():
            assert not cpu_kernel.usable(torch.randn(1, 8))
        monkeypatch.setenv("SPECDEC_CPU_KERNEL", "0")
        cpu_kernel.library.cache_clear()
        assert cpu_kernel.library() is None and capsys.readouterr().err == ""
    finally:
        cpu_kernel.library.cache_clear()
    assert not list(tmp_path.glob("kernels/*.so"))


@needs_kernel
def test_built_once_per_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    first = build._build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert build._build() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind


@needs_kernel
@pytest.mark.skipif(
    "avx512vl" not in Path("/proc/cpuinfo").read_text(), reason="this CPU's own build is already its AVX2 path"
)
@pytest.mark.slow  # (a second build and a pytest of its own, ~22 s: AVX2 machines run that path by default)
def test_the_avx2_build_passes_the_same_checks(tmp_path):
    """CPUs without AVX-512 run the kernel's other path (16 vector registers: panels of 16 columns,
    passes of up to 6 rows). Built here for x86-64-v3 (SPECDEC_CPU_MARCH), it passes this file's checks against float64
    and of rows, threads and stacks bitwise, in a process of its own (the kernel loads once)."""
    env = os.environ | {"SPECDEC_CPU_MARCH": "x86-64-v3", "SPECDEC_CACHE": str(tmp_path)}
    checks = "float64 or rounded or other_rows or accurate or bitwise or argmax"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", checks]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout
    assert len(list(tmp_path.glob("kernels/skinny-*.so"))) == 1  # its own build, not this process's


@needs_kernel
def test_a_weight_it_cannot_read_is_refused():
    x = torch.randn(2, 16)
    w = torch.randn(16, 8)
    for bad in (packed(torch.randn(8, 12)), Weights.from_matrix(w), Weights.from_matrix(w.double(), cpu_copy=True)):
        with pytest.raises(ValueError, match="need packed float32"):
            cpu_kernel.matmul(x, bad)
    assert Weights.from_matrix(w.double(), cpu_copy=True).t is not None  # fp64: MKL's W^T instead


def wide_decoder(head_dim: int, **over):
    """A tiny decoder whose heads are as wide as real ones (64: the kernel's 8-register path; 80:
    that path plus 16 dims past it), GQA 4:2, weights kept packed (on a CPU)."""
    from tests.conftest import tiny_decoder

    return tiny_decoder(hidden_size=4 * head_dim, head_dim=head_dim, intermediate_size=200, **over)


def decode_and_verify(model, ids, start: int, tree=None):
    """Logits of ids[start:] run as one verify step, and as one decode step each (tree: verify only)."""
    model.setup_cache(1, ids.shape[1] + 8)
    model(ids[:, :start], 0)
    verify = model(ids[:, start:], start, tree=tree).logits[0]
    if tree is not None:
        return verify, None
    model(ids[:, :start], 0)
    return verify, torch.cat([model(ids[:, t : t + 1], t).logits[0] for t in range(start, ids.shape[1])])


def assert_as_close_as_torchs(ours, torchs, exact):
    """ours (the kernel's fp32 logits) are no further from the float64 logits `exact` than twice
    torch's fp32 logits are (the sums run in other orders: neither is bitwise the other)."""
    ours_err, torch_err = (ours.double() - exact).abs().max(), (torchs.double() - exact).abs().max()
    assert ours_err <= 2 * torch_err + 1e-6, f"kernel off by {ours_err:.2e}, torch's fp32 by {torch_err:.2e}"


def in_float64(model):
    exact = copy.deepcopy(model).double()
    exact.cache = None
    return exact


@needs_kernel
@pytest.mark.parametrize(
    "head_dim,over,length,start",
    [
        (64, {}, 21, 14),
        (80, {}, 21, 14),
        (16, {"attention_bias": True, "mlp_bias": True}, 21, 14),
        (64, {"num_key_value_heads": 4}, 21, 14),
        (64, {}, 163, 150),
        (80, {"num_key_value_heads": 1}, 163, 150),
    ],
)
def test_sublayers_are_as_accurate_as_torchs(head_dim, over, length, start):
    """Decode and verify steps in the kernel's sublayers (layers.c) against the same decoder in
    float64, as close as torch's fp32 sublayers; a verify step's rows are bitwise its decode steps'.

    The last two: attention reads the cache in blocks of keys (128 at head_dim 64, 96 at 80) that
    every query of a segment (up to 24 of one key/value head) takes in turn, the threads splitting
    the queries in equal runs: 150 cached slots (blocks and a tail past a multiple of 8) and a
    verify step of 13 rows (26-52 queries a head: split into segments and across threads)."""
    model = wide_decoder(head_dim, **over)
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(head_dim))
    verify, decode = decode_and_verify(model, ids, start)
    with cpu_kernel.disabled():
        torch_verify, torch_decode = decode_and_verify(model, ids, start)
    exact, _ = decode_and_verify(in_float64(model), ids, start)
    assert_as_close_as_torchs(verify, torch_verify, exact)
    assert_as_close_as_torchs(decode, torch_decode, exact)
    assert torch.equal(verify, decode)


@needs_kernel
def test_a_prompt_longer_than_a_kernel_call_is_prefilled_in_chunks(monkeypatch):
    """A prompt of more rows than the kernel takes in one call runs in chunks of PREFILL_CHUNK
    rows (each attending to the slots before it), not through torch's ops: its logits (all of them,
    or the last few across chunks), taps and KV cache are bitwise one kernel call's, and as close
    to float64 as torch's prefill."""
    from specdec_runtime import cpu

    model = wide_decoder(64)
    ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(5))
    T = ids.shape[1]

    def prefill(m, **kw):
        m.setup_cache(1, T)
        out = m.prefill(ids, **kw)
        return out, m.cache.kv[..., :T, :].clone()

    whole = {keep: prefill(model, logits_to_keep=keep, taps=(0, 1, 2)) for keep in (0, 1, 7)}
    with cpu_kernel.disabled():
        torchs, _ = prefill(model)
    exact, _ = prefill(in_float64(model))
    calls = []
    layers = cpu_kernel.decoder_layers
    monkeypatch.setattr(cpu_kernel, "decoder_layers", lambda s, x, *a: calls.append(len(x)) or layers(s, x, *a))
    monkeypatch.setattr(cpu_kernel, "max_rows", lambda: 8)
    monkeypatch.setattr(cpu, "PREFILL_CHUNK", 5)
    for keep, (want, want_kv) in whole.items():
        calls.clear()
        got, got_kv = prefill(model, logits_to_keep=keep, taps=(0, 1, 2))
        assert calls == [5, 5, 5, 5, 3]
        assert got.logits.shape == want.logits.shape and torch.equal(got.logits, want.logits)
        assert torch.equal(got.hidden, want.hidden) and torch.equal(got_kv, want_kv)
    got, _ = prefill(model)
    assert_as_close_as_torchs(got.logits[0], torchs.logits[0], exact.logits[0])


@needs_kernel
def test_sublayers_under_masks_are_as_accurate_as_torchs():
    """A token tree and a sliding window (masks the kernel reads row by row), against float64."""
    model = wide_decoder(64)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    t = Tree.from_paths([(0,), (1,), (0, 0), (1, 0), (1, 1)]).tensors  # root + 5 nodes over 3 levels
    tree = (t["depth"], t["ancestor"])
    got, _ = decode_and_verify(model, ids, 10, tree)
    with cpu_kernel.disabled():
        want, _ = decode_and_verify(model, ids, 10, tree)
    assert_as_close_as_torchs(got, want, decode_and_verify(in_float64(model), ids, 10, tree)[0])
    window = wide_decoder(64, sliding_window=5)
    verify, decode = decode_and_verify(window, ids, 9)
    with cpu_kernel.disabled():
        torch_verify, _ = decode_and_verify(window, ids, 9)
    assert_as_close_as_torchs(verify, torch_verify, decode_and_verify(in_float64(window), ids, 9)[0])
    assert torch.equal(verify, decode)


@needs_kernel
def test_sublayers_run_in_it_only_where_they_should(monkeypatch):
    """One sequence's few fp32 rows run the whole layer stack in the kernel in one call, a batch's
    few rows their MLPs; more than max_rows() rows, a batch's attention, and anything under autograd
    run in torch."""
    model = wide_decoder(64)
    calls = []
    for name in ("attention", "mlp", "decoder_layers"):
        real = getattr(cpu_kernel, name)
        monkeypatch.setattr(cpu_kernel, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    rows = cpu_kernel.max_rows() // 2 + 1
    model.setup_cache(2, rows + 8)
    model(torch.randint(0, 256, (2, rows)), 0)  # a prefill of 2 x rows: more than max_rows()
    assert calls == []
    model(torch.randint(0, 256, (2, 1)), rows)  # a batch of 2: the MLP's rows only
    assert calls == ["mlp"] * 2
    calls.clear()
    model(torch.randint(0, 256, (1, 3)), rows + 1)
    assert calls == ["decoder_layers"]
    calls.clear()
    monkeypatch.setattr(cpu_kernel, "stack_takes", lambda *a: False)  # sublayer by sublayer
    model(torch.randint(0, 256, (1, 3)), rows + 1)
    assert calls == ["attention", "mlp"] * 2


@needs_kernel
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_stack_in_one_call_is_bitwise_the_sublayer_calls(monkeypatch, kind):
    """decoder_layers (a whole layer stack in one call) gives bitwise the logits, taps and cache of
    the same layers run sublayer by sublayer (tested above against float64), with skipped
    sublayers, taps, an early exit and a verification resuming at a layer; and the stack is
    rebuilt when the weights are replaced."""
    model = wide_decoder(64, kind=kind, num_hidden_layers=4)
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(3))
    skip = LayerSkip(attn=frozenset({1}), mlp=frozenset({2}))

    def run():
        model.cache = None  # a fresh cache
        model.setup_cache(1, 32)
        model(ids[:, :10], 0)
        out = [model(ids[:, 10:13], 10, taps=(0, 2, 4)), model(ids[:, 13:], 13, skip=skip)]
        early = model(ids[:, 10:12], 10, exit_layer=2, taps=(2,), head=False)
        out += [early, model(early.hidden, 10, first_layer=2)]
        fields = [o.logits for o in out] + [o.hidden for o in out] + [o.greedy for o in out]  # greedy last
        return [t for t in fields if t is not None], model.cache.kv.clone()

    one_call = run()
    monkeypatch.setattr(cpu_kernel, "stack_takes", lambda *a: False)
    by_sublayer = run()
    assert len(one_call[0]) == 8 and len(by_sublayer[0]) == 5  # 3 logits, 2 taps (+ 3 argmax in one call)
    assert all(torch.equal(a, b) for a, b in zip(one_call[0][:5], by_sublayer[0]))
    assert torch.equal(one_call[1], by_sublayer[1])  # the caches
    monkeypatch.undo()
    stack = model.native().stack
    model.keep_cpu_copies()  # new packed tensors: a new stack
    assert model.native().stack is not stack and model.native().stack is not None


@needs_kernel
@needs_kernel
@pytest.mark.parametrize("lm_head", ["random", "all equal", "a NaN late", "NaNs early and late"])
def test_the_stacks_head_gives_head_rows_logits_and_torchs_argmax(monkeypatch, lm_head):
    """The final norm and lm_head in the layer stack's call (decoder_layers' head): bitwise the
    logits of head_rows (a forward whose layers ran apart), and beside them their argmax as
    torch.argmax gives it: the first of equal maxima across the threads' spans of a row, the first
    NaN (sampling.argmax's rules, test_argmax_is_torchs), with 1 and 2 threads."""
    model = wide_decoder(64, num_hidden_layers=2)
    V = model.config.vocab_size
    with torch.no_grad():
        w = model.lm_head.weight  # [H, V]
        if lm_head != "random":
            w.copy_(w[:, :1].expand_as(w))  # every logit of a row equal: the first index
        if "NaN" in lm_head:
            w[:, V - 3] = float("nan")
        if "early" in lm_head:
            w[:, 5] = float("nan")
    model.keep_cpu_copies()
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            model.setup_cache(1, 16)
            model(ids[:, :5], 0)
            one_call = [model(ids[:, 5:8], 5), model(ids[:, 8:], 8)]  # a verify of 3 rows, a decode step
            with monkeypatch.context() as m:
                m.setattr(cpu_kernel, "stack_takes", lambda *a: False)
                model.setup_cache(1, 16)
                model(ids[:, :5], 0)
                apart = [model(ids[:, 5:8], 5), model(ids[:, 8:], 8)]
            for a, b in zip(one_call, apart):
                assert b.greedy is None
                torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0, equal_nan=True)  # bitwise
                assert torch.equal(a.greedy, a.logits.argmax(-1))
    finally:
        torch.set_num_threads(threads)
    expected = {"random": None, "all equal": 0, "a NaN late": V - 3, "NaNs early and late": 5}[lm_head]
    assert expected is None or (one_call[0].greedy == expected).all()


@needs_kernel
@pytest.mark.parametrize("case", ["bf16 flips the order", "a tie across panels", "a NaN in the rows", "random"])
def test_the_screened_head_gives_torchs_argmax_of_the_exact_logits(case):
    """argmax_only: the kernel reads the head in bf16 and only the panels that can hold a row's
    largest logit in fp32 (layers.c: head_part), and still gives torch.argmax of the exact fp32
    logits, with 1 and 2 threads. The oracle cases: two outputs whose order bf16 rounding flips
    (A's weights round up, B's down, B's exact logit the larger: a bound of 0 would answer A); two
    equal maxima in different panels (the first); a NaN in the rows (every panel computed, the
    first NaN); random logits over several rows."""
    from tests.conftest import tiny_decoder

    model = tiny_decoder(hidden_size=64, head_dim=16, intermediate_size=96, vocab_size=160, tie_word_embeddings=False)
    V, H, u = 160, 64, 2.0**-7  # u: bf16's spacing in [1, 2)
    with torch.no_grad():
        w, e = model.lm_head.weight, model.embed.weight  # [H, V], [V, H]
        w.normal_(0, 0.01, generator=torch.Generator().manual_seed(0))
        model.norm.fill_(1.0)
        e[7] = 1.0  # token 7's row normalizes to ~1 everywhere: its logits are about its column's sum
        if case == "bf16 flips the order":
            w[:, 3] = torch.tensor([1 + 0.55 * u, 1.0]).repeat(H // 2)  # bf16: sum 64 + 32 u, exact 64 + 17.6 u
            w[:, 70] = 1 + 0.3 * u  # bf16: sum 64, exact 64 + 19.2 u: the argmax
        if case == "a tie across panels":
            w[:, 10] = w[:, 100] = 1.0
        if case == "a NaN in the rows":
            e[7, 5] = float("nan")
    model.keep_cpu_copies()
    generator = torch.Generator().manual_seed(1)
    ids = torch.tensor([[7, 7, 7]]) if case != "random" else torch.randint(0, V, (1, 9), generator=generator)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            model.setup_cache(1, 16)
            full = model(ids, 0, exit_layer=0 if case != "random" else None)
            model.setup_cache(1, 16)
            screened = model(ids, 0, exit_layer=0 if case != "random" else None, argmax_only=True)
            assert screened.logits is None and full.logits is not None
            assert torch.equal(screened.greedy, full.logits.argmax(-1)), (n, screened.greedy, full.logits.argmax(-1))
    finally:
        torch.set_num_threads(threads)
    expected = {"bf16 flips the order": 70, "a tie across panels": 10, "a NaN in the rows": 0, "random": None}[case]
    assert expected is None or (screened.greedy == expected).all()
    if case == "bf16 flips the order":  # the bf16 head alone would have answered 3
        bf16 = model.lm_head.weight.bfloat16().float().sum(0)
        assert bf16[3] > bf16[70] and bf16.argmax() == 3


def test_loading_new_weights_refreshes_what_the_kernel_reads():
    """load_state_dict copies new weights in: the packed copies and the stack follow, so a decode
    step gives bitwise what a model built with those weights gives."""
    model, other = wide_decoder(64), wide_decoder(64, seed=1)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    for m in (model, other):
        m.setup_cache(1, 16)
    model(ids, 0)  # builds its stack from the first weights
    model.load_state_dict(other.state_dict(), strict=False)
    assert torch.equal(model(ids, 0).logits, other(ids, 0).logits)


@needs_kernel
def test_a_bf16_model_runs_its_bf16_weights_with_fp32_activations():
    """dtype=bf16 on a CPU: the checkpoint's bf16 weights, held as fp32 values and packed in bf16
    (half the bytes a step reads), with fp32 activations. Its logits are those of the fp32 model of
    the same bf16 checkpoint packed in fp32 to fp32 rounding (the kernel widens bf16 exactly; its
    bf16 chunks may be wider than fp32's, so its sums run in another order), which is transformers'
    fp32 arithmetic on it; so an fp32 model whose weights are all bf16 values packs them in bf16
    too; a verify step's rows are bitwise its decode steps'; new weights loaded into it are rounded
    as its own are; inside disabled() it is torch's bf16 model."""
    from specdec_runtime.config import DecoderConfig
    from specdec_runtime.model import Decoder
    from tests.conftest import tiny_hf_model

    def build(hf, dtype, sd=None):
        return Decoder.from_hf_state_dict(DecoderConfig.from_hf(hf.config), sd or hf.state_dict(), dtype=dtype)

    shape = dict(hidden_size=256, head_dim=64, intermediate_size=200)
    wide = tiny_hf_model("qwen2", seed=1, **shape)  # (qkv bias)
    with torch.no_grad():
        for p in wide.parameters():  # transformers' fp32 model of a bf16 checkpoint
            p.copy_(p.bfloat16())
    ckpt = {k: v.bfloat16() for k, v in wide.state_dict().items()}  # the checkpoint
    model = build(wide, torch.bfloat16, ckpt)
    assert model.bf16_weights and model.dtype == torch.float32 and model.weight_dtype == torch.bfloat16
    assert all(torch.equal(p, p.bfloat16().float()) for p in model.parameters())
    assert {m.weight_packed.dtype for m in model.modules() if hasattr(m, "weight_packed")} == {torch.bfloat16}
    cfg = DecoderConfig.from_hf(wide.config)
    fp32 = Decoder.from_hf_state_dict(cfg, wide.state_dict(), cpu_copies=False)
    fp32.keep_cpu_copies()  # the fp32 model of the same weights, packed in fp32
    assert fp32.layers[0].qkv.weight_packed.dtype == torch.float32 and not fp32.bf16_weights
    # In fp32 from weights that are all bf16 values, a model packs them in bf16 by itself.
    assert build(wide, torch.float32).bf16_weights
    assert not build(tiny_hf_model("qwen2", **shape), torch.float32).bf16_weights
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(0))
    verify, decode = decode_and_verify(model, ids, 9)
    assert torch.equal(verify, decode)
    torch.testing.assert_close(verify, decode_and_verify(fp32, ids, 9)[0], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(verify, wide(ids).logits[0, 9:], atol=1e-4, rtol=1e-5)

    other = tiny_hf_model("qwen2", seed=2, **shape)  # fp32 weights, not bf16 values
    model.load_state_dict(build(other, torch.float32).state_dict())
    assert torch.equal(decode_and_verify(model, ids, 9)[0], decode_and_verify(build(other, torch.bfloat16), ids, 9)[0])
    with cpu_kernel.disabled():
        torch_bf16 = build(wide, torch.bfloat16, ckpt)
    assert torch_bf16.dtype == torch.bfloat16 and not torch_bf16.bf16_weights
