"""The GPU fast path on CPU: fixed-shape forwards (tensor starts, whole-cache attention under a
mask) equal the default path; the compiled graphs trace whole (aot_eager); one host sync per round.
Only CUDA can run CUDA graphs: that test skips elsewhere and says so."""

import warnings

import pytest
import torch

from specdec_runtime.drafters import ModelDrafter, NgramDrafter
from specdec_runtime.generate import generate
from specdec_runtime.medusa import MedusaDrafter
from specdec_runtime.model import LayerSkip
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree
from tests.conftest import tiny_decoder
from tests.runtime.test_medusa import PATHS, random_heads

PROMPT = list(range(5, 17))


def pair(kind: str = "llama", **overrides):
    """The same tiny target twice: default path, fixed-shape path."""
    a = tiny_decoder(kind, 0, num_hidden_layers=3, **overrides)
    b = tiny_decoder(kind, 0, num_hidden_layers=3, **overrides)
    b.fixed_shapes = True
    return a, b


DRAFTERS = {
    "autoregressive": lambda m: None,
    "truncate": lambda m: ModelDrafter(m, exit_layer=2, shares_target_cache=True),
    "layer skip": lambda m: ModelDrafter(m, skip=LayerSkip(attn={1}, mlp={2}), shares_target_cache=True),
    "stand-alone model": lambda m: ModelDrafter(tiny_decoder("llama", 1, num_hidden_layers=1)),
    "ngram": lambda m: NgramDrafter(),
    "medusa tree": lambda m: MedusaDrafter(random_heads(64, 256), m, Tree.from_paths(PATHS)),
}


@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 8})])
def test_forwards_equal_the_default_path(kind, overrides):
    """Decode, chain-verify and tree-verify logits at the same slots, stale slots in the cache."""
    a, b = pair(kind, **overrides)
    for m in (a, b):
        m.setup_cache(1, 64)
        with torch.inference_mode():
            m.cache.kv.normal_()  # stale entries from "earlier prompts" must be masked out
        m(torch.tensor([PROMPT]), 0)
    step = torch.tensor([[7]])
    torch.testing.assert_close(b(step, b.slot(12)).logits, a(step, 12).logits, atol=1e-5, rtol=1e-5)
    chain = torch.tensor([[7, 9, 11, 3]])
    torch.testing.assert_close(b(chain, b.slot(13)).logits, a(chain, 13).logits, atol=1e-5, rtol=1e-5)
    tree = Tree.from_paths(PATHS).on("cpu")
    nodes = torch.randint(0, 256, (1, len(tree["depth"])))
    outs = [
        m(nodes, start, positions=tree["depth"] + start, tree_mask=tree["ancestor"]).logits
        for m, start in ((a, 17), (b, b.slot(17)))
    ]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.cache.kv[..., :26, :], a.cache.kv[..., :26, :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_generate_equals_the_default_path(drafter):
    a, b = pair()
    for sampler in (lambda: Sampler(), lambda: Sampler(0.8, seed=1)):
        ra = generate(a, PROMPT, DRAFTERS[drafter](a), sampler(), max_new_tokens=30, gamma=3)
        rb = generate(b, PROMPT, DRAFTERS[drafter](b), sampler(), max_new_tokens=30, gamma=3)
        assert rb.tokens == ra.tokens and rb.stats.target_forwards == ra.stats.target_forwards


SYNCS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def test_one_host_sync_per_round(monkeypatch):
    """Every Tensor -> Python conversion is counted: one per target forward (the prefill's first
    token, then one per round), for autoregressive and speculative decoding."""
    _, target = pair()
    count = {"n": 0}
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count["n"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for drafter in ("autoregressive", "truncate", "medusa tree", "stand-alone model"):
        d = DRAFTERS[drafter](target)
        count["n"] = 0
        out = generate(target, PROMPT, d, max_new_tokens=30, gamma=3)
        assert count["n"] == out.stats.target_forwards, drafter


@pytest.mark.parametrize("drafter", ["autoregressive", "truncate", "medusa tree", "stand-alone model"])
def test_compiled_graphs_trace_whole_and_equal_eager(drafter):
    """torch.compile(fullgraph=True) with the aot_eager backend: dynamo captures each step whole
    (a graph break would fail, and the fallback warning is an error here) and gives the same tokens."""
    a, b = pair()
    b.compile(backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        standalone = DRAFTERS[drafter](b)
        if isinstance(standalone, ModelDrafter) and not standalone.shares_target_cache:
            standalone.model.compile(backend="aot_eager")
        rb = generate(b, PROMPT, standalone, max_new_tokens=24, gamma=3)
    assert rb.tokens == generate(a, PROMPT, DRAFTERS[drafter](a), max_new_tokens=24, gamma=3).tokens


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs (torch.compile mode reduce-overhead) need a CUDA GPU"
)
def test_cuda_graphs_bf16_equal_eager_and_sync_once_per_round():
    a, b = (tiny_decoder("llama", 0, num_hidden_layers=3).to("cuda", torch.bfloat16) for _ in range(2))
    a.fixed_shapes = True
    b.compile()
    for drafter in ("autoregressive", "truncate", "medusa tree"):
        ra = generate(a, PROMPT, DRAFTERS[drafter](a), max_new_tokens=40, gamma=3)
        generate(b, PROMPT, DRAFTERS[drafter](b), max_new_tokens=40, gamma=3)  # compiles and records
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rb = generate(b, PROMPT, DRAFTERS[drafter](b), max_new_tokens=40, gamma=3)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert rb.tokens == ra.tokens, drafter
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) <= rb.stats.target_forwards, drafter
