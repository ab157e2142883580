"""Captured steps: a forward with static input and output buffers, replayed as one CUDA graph.

    step = CapturedStep(fn, {"x": ids, "start": torch.tensor(7), ...})   # warms up, then captures
    out = step(x=new_ids, start=8)      # copies the inputs into the static buffers, replays
    out.logits                          # a static output buffer: valid until `step` runs again

This is how the Decoder's fast path keeps buffer lifetimes explicit (model.py): every step (a
role and a token count T) owns its inputs, its outputs and a private CUDA memory pool, so a
graph's output can only be overwritten by a replay of the same graph, never by another one.
Whoever keeps an output past that copies it (the drafters and the generate loop do). Inputs are
copied in with one small kernel each (a Python int with `fill_`, so nothing waits on the host).

Off CUDA the same object reruns `fn` on its static inputs and copies the result into its static
outputs: the same lifetimes, so the CPU tests catch an output kept across steps by accident.
`captures` counts the graphs recorded in this process (a warmed-up run must not add any).
A step made with host_reads=False fails where its function reads a tensor's value on the host
(`.item()`, `.tolist()`, `if tensor:`, indexing with a 0-dim tensor or a boolean mask): on CUDA such
a read cannot be captured, and off CUDA the emulation raises on it (NoHostReads, under inference
mode too), so the CPU tests catch it. The drafters' steps are made so; the target's are compiled,
and torch.compile refuses a dispatch mode, so the CPU test that counts every host read of a round
checks them instead (test_fast_path).
A step made with a `compile` backend runs fn compiled by torch.compile (fullgraph, static shapes:
its small ops fused into fewer kernels). Compiled code can read a value on the host without a sign
(dynamo traces `.item()` into the graph), so off CUDA such a step first runs fn once uncompiled
under NoHostReads. `dynamic` names input dimensions that differ between steps of one function (a
drafter's catch-up rows, 1-16): those are compiled once with the dimension symbolic (2 and up; a
size of 1 gets its own static version) and captured per size, rather than compiled per size.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

captures = 0  # CUDA graphs recorded (or emulated steps set up) in this process


def _clone(out: Any) -> Any:
    """A structure of tensors (tuple / NamedTuple / dict / None) with every tensor cloned."""
    if isinstance(out, Tensor):
        return out.clone()
    if isinstance(out, dict):
        return {k: _clone(v) for k, v in out.items()}
    if isinstance(out, tuple):
        items = [_clone(o) for o in out]
        return type(out)(*items) if hasattr(out, "_fields") else tuple(items)
    return out


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, Tensor):
        dst.copy_(src)
    elif isinstance(dst, tuple):
        for d, s in zip(dst, src):
            _copy_into(d, s)
    elif isinstance(dst, dict):
        for k, d in dst.items():
            _copy_into(d, src[k])


class HostRead(RuntimeError):
    pass


class NoHostReads(TorchDispatchMode):
    """Raises HostRead on any tensor-to-Python read inside it: the scalar reads every one of them
    dispatches to (`_local_scalar_dense`: item, bool, int, float, index), and tolist / numpy, which
    read a CPU tensor's memory without dispatching anything. Under inference mode (where drafting
    runs) the scalar reads skip the dispatch mode, so they are also refused where Python calls them
    (_RefuseReads): the conversions, and indexing with a 0-dim integer tensor or a boolean mask."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise HostRead("a captured step read a tensor's value on the host (item / bool / int / indexing)")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.saved = Tensor.tolist, Tensor.numpy
        Tensor.tolist = Tensor.numpy = _refuse  # type: ignore[method-assign]
        self.calls = _RefuseReads()
        self.calls.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        Tensor.tolist, Tensor.numpy = self.saved  # type: ignore[method-assign]
        self.calls.__exit__(*exc)
        return super().__exit__(*exc)


def _refuse(self, *args, **kwargs):
    raise HostRead("a captured step read a tensor's values on the host (tolist / numpy)")


_SCALAR_READS = {Tensor.item, Tensor.__bool__, Tensor.__int__, Tensor.__float__, Tensor.__index__}


def _reads_index(index: Any) -> bool:
    """Whether indexing with `index` reads it on the host: a 0-dim integer tensor (x[n]) or a boolean
    mask (its count of True) anywhere in it."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, Tensor) and (i.dtype == torch.bool or i.dim() == 0) for i in parts)


class _RefuseReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SCALAR_READS:
            raise HostRead(f"a captured step read a tensor's value on the host ({func.__name__})")
        if func in (Tensor.__getitem__, Tensor.__setitem__) and _reads_index(args[1]):
            raise HostRead("a captured step indexed with a 0-dim tensor or a boolean mask (a host read)")
        return func(*args, **(kwargs or {}))


class CapturedStep:
    """fn(**inputs) with static inputs and outputs, recorded once (see the module docstring)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        inputs: dict[str, Tensor],
        warmup: int = 2,
        host_reads: bool = True,
        compile: str | None = None,
        dynamic: dict[str, int] | None = None,
    ):
        global captures
        self.inputs = {k: v.clone() for k, v in inputs.items()}  # the static input buffers
        device = next(iter(self.inputs.values())).device
        if compile is not None:  # (torch.compile refuses NoHostReads' dispatch mode: checked once, uncompiled)
            if not host_reads:
                _guarded(fn)(**self.inputs)
            allow_many_compiles()
            marked = {k: d for k, d in (dynamic or {}).items() if self.inputs[k].shape[d] > 1}  # (a 1 is specialized)
            for name, dim in marked.items():  # (dynamic=False keeps every other dimension and int static)
                torch._dynamo.mark_dynamic(self.inputs[name], dim)
            fn, host_reads = torch.compile(fn, fullgraph=True, dynamic=False, backend=compile), True
        self.fn = fn if host_reads else _guarded(fn)
        self.graph: torch.cuda.CUDAGraph | None = None
        if device.type == "cuda":
            # Warm up on a side stream (compilation, cuBLAS handles, lazy init), then record.
            # A warm-up writes the same K/V to the same cache slots as the replay will: harmless.
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    fn(**self.inputs)
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # a private memory pool: see the module docstring
                self.outputs = fn(**self.inputs)
        else:
            self.outputs = _clone(self.fn(**self.inputs))  # (guarded from the first run)
        captures += 1

    def __call__(self, **inputs: Tensor | int | list[int]) -> Any:
        """Copy the inputs in (a list of host ints: from the host, without waiting for the device),
        run the step, return its static outputs."""
        for name, value in inputs.items():
            if isinstance(value, int):
                self.inputs[name].fill_(value)
            elif isinstance(value, list):
                self.inputs[name].copy_(torch.tensor(value), non_blocking=True)
            else:
                self.inputs[name].copy_(value)
        if self.graph is not None:
            self.graph.replay()
        else:
            _copy_into(self.outputs, self.fn(**self.inputs))
        return self.outputs


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn run under NoHostReads off CUDA (on CUDA the capture itself refuses a host read)."""

    def run(**inputs: Tensor) -> Any:
        if next(iter(inputs.values())).device.type == "cuda":
            return fn(**inputs)
        with NoHostReads():
            return fn(**inputs)

    return run


def allow_many_compiles() -> None:
    """Room for one compiled entry per step shape (rows x T, a drafter's kinds and spans) and model,
    more than dynamo's defaults, which fullgraph=True turns from a fallback into an error."""
    config = torch._dynamo.config
    for name, floor in [("recompile_limit", 256), ("cache_size_limit", 256), ("accumulated_recompile_limit", 4096),
                        ("accumulated_cache_size_limit", 4096)]:  # fmt: skip
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), floor))


def compile_counts() -> tuple[int, int]:
    """(graphs dynamo has compiled, steps captured) so far in this process: after a warm-up, a run
    adds neither (the fast-path tests assert it; scripts/bench_gpu.py prints it)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], captures
