"""The fast path (model.py): captured steps with static buffers running the compiled layers.

On CPU the steps are emulated with the same buffers and lifetimes and the layers are traced whole
by torch.compile with the aot_eager backend: logits and tokens equal the eager path for every
drafter kind, nothing is compiled or captured again after warm-up, the KV cache is allocated once,
and a round syncs with the host once. The tests marked gpu run the same on CUDA with real CUDA
graphs (and the bf16 honesty check); elsewhere they skip and say so.
"""

import warnings

import pytest
import torch

from specdec_runtime import graphs
from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model
from specdec_runtime.drafters.lookup import LookupFirst, NgramDrafter
from specdec_runtime.drafters.medusa import MedusaDrafter
from specdec_runtime.drafters.mtp import MTPDrafter, MTPHeads
from specdec_runtime.drafters.phrases import PhraseTable
from specdec_runtime.drafters.protocol import Draft, Drafter
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.generate import generate
from specdec_runtime.measure import divergences, measure, warm_up
from specdec_runtime.model import LayerSkip
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree
from tests.conftest import runtime_from_hf, tiny_hf_model
from tests.runtime.test_medusa import PATHS, random_heads

PROMPT = list(range(5, 17))


def mtp_drafter(target, hf) -> MTPDrafter:
    """MTP heads 1 and 2 on a 4-layer target (trunk: 3 layers, head 0: layer 3), with the weights
    of the target's layers 2 and 3 (any weights do: what is checked is exactness)."""
    sd = {
        f"heads.{i}.{k.removeprefix(f'model.layers.{i + 1}.')}": v
        for i in (1, 2)
        for k, v in hf.state_dict().items()
        if k.startswith(f"model.layers.{i + 1}.")
    }
    heads = MTPHeads.from_hf_state_dict(target.config, sd, 3, 3, target.device, target.dtype)
    return MTPDrafter(heads, target)


def eagle3_tree(
    target, hf, budget: int = 5, on_device: bool | None = None, compile_steps: bool = False
) -> Eagle3Drafter:
    """An EAGLE-3 drafter (random weights) on the default taps (1, 2, 3): trees of 5 nodes (budget
    0: chains); on_device: drafting in captured steps (None: on a GPU only), compiled as the
    target's layers are where compile_steps."""
    cfg = Eagle3Config.for_target(target.config, aux_layers=None, draft_vocab_size=200)
    torch.manual_seed(1)
    model = Eagle3Model(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model.set_draft_vocab(torch.arange(200))
    return Eagle3Drafter(
        model.to(target.device), target, tree_budget=budget, top_k=3, on_device=on_device, compile_steps=compile_steps
    )


DRAFTERS = {
    "autoregressive": lambda m, hf: None,
    "truncate": lambda m, hf: ModelDrafter(m, exit_layer=2, shares_target_cache=True),
    "layer skip": lambda m, hf: ModelDrafter(m, skip=LayerSkip(attn={1}, mlp={2}), shares_target_cache=True),
    "stand-alone model": lambda m, hf: ModelDrafter(standalone(m)),
    "stand-alone + lookup": lambda m, hf: LookupFirst(ModelDrafter(standalone(m))),
    "ngram": lambda m, hf: NgramDrafter(),
    "medusa tree": lambda m, hf: MedusaDrafter(random_heads(64, 256).to(m.device), m, Tree.from_paths(PATHS)),
    "mtp": mtp_drafter,
    "eagle3 tree": eagle3_tree,
    "eagle3 tree on device": lambda m, hf: eagle3_tree(m, hf, on_device=True),  # captured steps (a GPU's default)
    "eagle3 chain on device": lambda m, hf: eagle3_tree(m, hf, budget=0, on_device=True),
    "eagle3 tree, compiled steps": lambda m, hf: eagle3_tree(m, hf, on_device=True, compile_steps=True),
    "eagle3 chain, compiled steps": lambda m, hf: eagle3_tree(m, hf, budget=0, on_device=True, compile_steps=True),
    "eagle3 tree on device + lookup": lambda m, hf: LookupFirst(eagle3_tree(m, hf, on_device=True), merge=0),
    "eagle3 tree on device + lookup + phrases": lambda m, hf: LookupFirst(
        eagle3_tree(m, hf, on_device=True), table=phrases(m, hf), merge=0
    ),
    # lookups verify chains, the model trees (merge=0); merged: its 2 best nodes beside a lookup, trees of up to 10
    "eagle3 tree + lookup": lambda m, hf: LookupFirst(eagle3_tree(m, hf), merge=0),
    "eagle3 tree + lookup + phrases": lambda m, hf: LookupFirst(eagle3_tree(m, hf), table=phrases(m, hf), merge=0),
    "eagle3 tree + lookup, merged": lambda m, hf: LookupFirst(eagle3_tree(m, hf), merge=2),  # (a GPU's default: 0)
}


def phrases(target, hf) -> PhraseTable:
    """A phrase table of transformers' greedy continuation of PROMPT (twice), on the target's device:
    right chains on that prompt, wrong ones where sampling leaves it."""
    said = hf.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False)[0].tolist()
    return PhraseTable.build([said, said], device=target.device)


def standalone(target):
    """A 1-layer stand-alone draft model, compiled like its target."""
    model = runtime_from_hf(tiny_hf_model("llama", 1, num_hidden_layers=1)).to(target.device, target.dtype)
    if target.compiled:
        model.compile(backend=COMPILE_BACKEND[target.device.type])
    return model


COMPILE_BACKEND = {"cpu": "aot_eager", "cuda": "inductor"}


def pair(kind: str = "llama", device: str = "cpu", dtype=torch.float32, layers: int = 4, attention: str = "sdpa",
         **overrides):  # fmt: skip
    """The same tiny target twice, eager and compiled (with this attention), and its transformers
    model (4 layers: EAGLE-3 taps 3 distinct ones)."""
    hf = tiny_hf_model(kind, 0, num_hidden_layers=layers, **overrides)
    eager, fast = (runtime_from_hf(hf).to(device, dtype) for _ in range(2))
    fast.compile(backend=COMPILE_BACKEND[device], attention=attention)
    return eager, fast, hf


KINDS = [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 8})]
# flex attention (off by default) on Llama in the default run, the rest with -m slow: the default stays under 10 minutes
FLEX_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kind,overrides,attention",
    [(*k, "sdpa") for k in KINDS]
    + [(*KINDS[0], "flex")]
    + [pytest.param(*k, "flex", marks=FLEX_SLOW) for k in KINDS[1:]],
)
def test_forwards_equal_the_eager_path(kind, overrides, attention):
    """Decode, chain-verify and tree-verify logits at the same slots, stale slots in the cache (SDPA
    over the span that holds them, or flex attention's mask over the whole cache: aot_eager ignores
    its block counts, which check_live_blocks checks)."""
    a, b, _ = pair(kind, layers=3, attention=attention, **overrides)
    for m in (a, b):
        m.setup_cache(1, 300)  # (the fast path's: 512 slots, two spans or four blocks)
        with torch.inference_mode():
            m.cache.kv.normal_()  # stale entries from "earlier prompts" must be masked out
        m.prefill(torch.tensor([PROMPT]))
    step = torch.tensor([[7]])
    torch.testing.assert_close(b(step, 12).logits, a(step, 12).logits, atol=1e-5, rtol=1e-5)
    chain = torch.tensor([[7, 9, 11, 3]])
    torch.testing.assert_close(b(chain, 13).logits, a(chain, 13).logits, atol=1e-5, rtol=1e-5)
    t = Tree.from_paths(PATHS).tensors_on("cpu")
    nodes = torch.randint(0, 256, (1, len(t["depth"])))
    outs = [m(nodes, 17, tree=(t["depth"], t["ancestor"])).logits for m in (a, b)]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.cache.kv[..., :26, :], a.cache.kv[..., :26, :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_generate_equals_the_eager_path(drafter):
    """Every drafter kind, greedy and sampled; the compiled layers are traced whole (a graph break
    fails fullgraph=True, and any warning is an error here)."""
    a, b, hf = pair()
    for sampler in (lambda: Sampler(), lambda: Sampler(0.8, seed=1)):
        ra = generate(a, PROMPT, DRAFTERS[drafter](a, hf), sampler(), max_new_tokens=30, gamma=3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rb = generate(b, PROMPT, DRAFTERS[drafter](b, hf), sampler(), max_new_tokens=30, gamma=3)
        assert rb.tokens == ra.tokens and rb.stats.target_forwards == ra.stats.target_forwards


def test_compiling_drops_an_eager_cache_the_fast_path_cannot_span():
    """A cache of 300 slots set up eagerly, then compile(attention="flex"), whose blocks of 128 slots
    need the fast path's sizes (multiples of 256): the next setup_cache sizes it anew (256 slots here),
    and generate gives the eager path's tokens."""
    hf = tiny_hf_model("llama", 0, num_hidden_layers=2)
    a, b = runtime_from_hf(hf), runtime_from_hf(hf)
    b.setup_cache(1, 300)
    b.compile(COMPILE_BACKEND["cpu"], attention="flex")
    assert b.cache is None
    assert generate(b, PROMPT, None, max_new_tokens=10).tokens == generate(a, PROMPT, None, max_new_tokens=10).tokens
    assert b.cache.size == 256


@FLEX_SLOW
@pytest.mark.parametrize("drafter", ["truncate", "medusa tree"])
def test_flex_attention_generates_as_the_eager_path(drafter):
    """attention="flex" (layers.attend_live): one span, the whole cache, and the eager path's tokens
    for decode steps, an exit layer's drafts, chains and trees verified, greedy and sampled."""
    a, b, hf = pair(attention="flex")
    for sampler in (lambda: Sampler(), lambda: Sampler(0.8, seed=1)):
        ra = generate(a, PROMPT, DRAFTERS[drafter](a, hf), sampler(), max_new_tokens=30, gamma=3, capacity=256)
        rb = generate(b, PROMPT, DRAFTERS[drafter](b, hf), sampler(), max_new_tokens=30, gamma=3, capacity=256)
        assert rb.tokens == ra.tokens and rb.stats.target_forwards == ra.stats.target_forwards
    assert b.spans() == [b.cache.size] and {key[-1] for key in b.steps} == {b.cache.size}  # (256 or 512)


def check_live_blocks(device: str, B: int, T: int, group: int = 3) -> None:
    """attend_live compiled by inductor on `device`: with NaN in every block of the cache past each
    row's newest slot's (the rows' newest slots in different blocks), the output is attend()'s over
    the clean cache (a block it read would put NaN in the output). group * T queries of 128 or more
    take flex attention's kernel for many rows, fewer its decoding kernel."""
    from specdec_runtime.layers import attend, attend_live

    torch.manual_seed(0)
    Hkv, S, D = 2, 512, 16
    q, kv = torch.randn(B, Hkv, group * T, D, device=device), torch.randn(B, 2 * Hkv, S, D, device=device)
    start = torch.tensor([200, 60][:B], device=device)
    slots = start[:, None] + torch.arange(T, device=device)  # [B, T]
    mask = torch.arange(S, device=device) <= slots.repeat(1, group)[..., None]  # [B, group * T, S]
    mask, slots = (mask[:, None], slots) if B > 1 else (mask[0], slots[0])
    want = attend(q, kv, mask, S)
    for b, newest in enumerate(start.tolist()):
        kv[b, :, (newest + T - 1) // 128 * 128 + 128 :] = float("nan")
    live = torch.compile(attend_live, fullgraph=True, dynamic=False, backend="inductor")
    got = live(q, *kv.split(Hkv, dim=1), mask, slots)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # (inductor's CPU kernels: ~15 s each; on a GPU, test_cuda_flex_attention_reads_only_the_live_blocks)
@pytest.mark.parametrize("B,T", [(1, 4), (2, 2), (2, 44)], ids=["one sequence", "rows", "rows, 132 queries"])
def test_flex_attention_reads_only_the_live_blocks(B, T):
    check_live_blocks("cpu", B, T)


def warm_then_rerun(target, hf, drafters, capacity: int):
    """Warm up on one prompt, then rerun with prompts of other lengths and every draft length (and
    one that repeats itself, where LookupFirst's lookups leave its model behind by several tokens):
    returns the compile counts after warm-up and after the reruns, and the cache's addresses."""
    prompts = [PROMPT, PROMPT[:7], PROMPT + [3, 1, 4, 1, 5], PROMPT + PROMPT[:4]]
    kw = dict(max_new_tokens=40, capacity=capacity)
    made = {name: DRAFTERS[name](target, hf) for name in drafters}
    for d in made.values():  # the runtime's warm-up: every step shape a drafter can produce at gamma 3
        warm_up(target, d, PROMPT, Sampler, max_new_tokens=40, gamma=3, capacity=capacity)
    warm, address = graphs.compile_counts(), target.cache.kv.data_ptr()
    for d in made.values():
        for p in prompts:
            for s in (Sampler(), Sampler(1.0, seed=3)):
                generate(target, p, d, s, gamma=3, **kw)
    for d in made.values():  # a lookup's 8 tokens warmed up, but no model step deeper than gamma 3 made
        steps = getattr(getattr(d, "drafter", d), "steps", {})
        assert all(key[1] <= 3 for key in steps if key[0] in ("tree", "chain")), list(steps)
    return warm, graphs.compile_counts(), (address, target.cache.kv.data_ptr())


# ~40 s on a 2-core CPU, which kept the default run past 10 minutes: -m slow here; on a GPU,
# test_cuda_nothing_compiles_or_records_again_and_one_sync_per_round checks most of the same drafters
@pytest.mark.slow
def test_nothing_compiles_or_captures_again_after_warm_up_and_the_cache_stays():
    """Across rounds, drafts of every length, prompts of different lengths, greedy and sampled, and
    repeated generate calls: no new compiled graph, no new captured step, the same KV cache."""
    _, target, hf = pair()
    drafters = ["autoregressive", "truncate", "layer skip", "medusa tree", "mtp", "stand-alone model"]
    drafters += ["stand-alone + lookup"]  # its model catches up on the tokens lookup drafted
    drafters += ["eagle3 tree + lookup"]  # chains of every length verified, though its model drafts trees
    drafters += ["eagle3 tree + lookup + phrases"]  # the table's chains: lookups' lengths
    drafters += ["eagle3 tree + lookup, merged"]  # lookups merged with 2 of the model's nodes: trees of 2-11 rows
    drafters += ["eagle3 tree on device + lookup", "eagle3 chain on device"]  # the drafter's own captured steps
    drafters += ["eagle3 tree on device + lookup + phrases"]  # its model drafts no round of the warm-up prompt
    drafters += ["eagle3 tree, compiled steps"]  # the drafter's steps compiled too
    warm, after, (before_ptr, after_ptr) = warm_then_rerun(target, hf, drafters, capacity=64)
    assert after == warm and before_ptr == after_ptr
    trees = {1 + len(Tree.from_paths(PATHS).truncated(d)) for d in (1, 2, 3)}
    steps = {key[0][1] for key in target.steps}  # T: decode, chains of 1-3, lookups' of up to 8 (+ 2 merged), the trees
    assert steps <= set(range(1, 2 + LookupFirst(NgramDrafter()).tokens + 2)) | trees
    assert any(key[2] and key[0][1] > 9 for key in target.steps)  # merged trees past a lookup's 8 + 1 rows


class SometimesLong(Drafter):
    """Drafts gamma tokens, or 5 once the sequence is past 20 tokens (as a lookup of 5 at gamma 2
    does where the output starts to repeat): the short warm-up of one prompt never sees it."""

    name = "sometimes long"

    def longest(self, gamma: int) -> int:
        return max(gamma, 5)

    def draft(self, ids, gamma, sampler):
        return Draft(ids[-(5 if ids.numel() > 20 else gamma) :].flip(0).clone(), None)  # any tokens do


def test_measure_warms_up_every_draft_length_before_timing():
    """measure()'s warm-up runs every draft length the drafter can return (up to longest(gamma)),
    so no verify shape is compiled or captured inside a timed prompt; outputs stay the target's."""
    eager, target, _ = pair()
    timed_from = []

    def progress(prompts):  # measure() iterates this once its warm-up is done
        timed_from.append(graphs.compile_counts())
        yield from prompts

    prompts = [PROMPT, PROMPT + [3, 1, 4, 1, 5, 9, 2, 6, 5]]
    report = measure(target, SometimesLong(), prompts, sampler=Sampler, baseline=True, max_new_tokens=20, gamma=2,
                     progress=progress)  # fmt: skip
    assert graphs.compile_counts() == timed_from[0]
    assert 6 in {key[0][1] for key in target.steps}  # drafts of 5 were verified
    assert sum(r.stats.drafted_at[4] for r in report.spec) > 0
    for ids, run in zip(prompts, report.spec):
        assert run.tokens == generate(eager, ids, None, max_new_tokens=20).tokens


@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference-mode"])
def test_an_emulated_step_refuses_every_host_read(inference):
    """graphs.NoHostReads (the steps made with host_reads=False, off CUDA): each way of reading a
    value on the host raises HostRead, under inference mode too (where drafting runs, and where the
    scalar reads skip the dispatch mode); indexing that stays on the device does not."""
    x = torch.arange(5.0)
    reads = {
        "item": lambda t: t.item(), "int": lambda t: int(t), "bool": lambda t: bool(t), "float": lambda t: float(t),
        "x[t]": lambda t: x[t], "x[mask]": lambda t: x[x > t], "x[t] = 1": lambda t: x.clone().__setitem__(t, 1),
        "tolist": lambda t: t.tolist(), "range(t)": lambda t: range(t),
    }  # fmt: skip
    fine = {
        "x[t[None]]": lambda t: x[t[None]],
        "index_select": lambda t: x.index_select(0, t.view(1)),
        "x[1:3]": lambda t: x[1:3],
    }
    with torch.inference_mode(inference):
        t = torch.tensor(3)
        for name, read in reads.items():
            with pytest.raises(graphs.HostRead):
                graphs.CapturedStep(lambda t, read=read: read(t) and t, {"t": t}, host_reads=False)
                pytest.fail(f"{name} was not refused")
        for ok in fine.values():
            graphs.CapturedStep(lambda t, ok=ok: ok(t), {"t": t}, host_reads=False)


def test_a_drafters_compiled_steps_are_compiled_once_and_refuse_host_reads(monkeypatch):
    """compile_steps: the EAGLE-3 drafter's captured steps are compiled with the target's backend, once
    and none again on later prompts: the catch-up twice for its 5 row counts (1, and the rest with
    the rows symbolic), each tree once (trees cut near the end: a shape each); a host read inside one
    fails as in the steps it does not compile (off CUDA each runs once uncompiled under NoHostReads
    first: compiled code reads a value without a sign)."""
    torch._dynamo.reset()  # (an earlier test's drafter of the same shapes leaves compiled steps to reuse)
    _, target, hf = pair()
    generate(target, PROMPT, eagle3_tree(target, hf, on_device=True), max_new_tokens=20, gamma=3)  # the target's
    counts = []
    for compile_steps in (False, True):
        d = eagle3_tree(target, hf, on_device=True, compile_steps=compile_steps)
        before = graphs.compile_counts()[0]
        generate(target, PROMPT, d, max_new_tokens=20, gamma=3)
        counts.append(graphs.compile_counts()[0] - before)
    trees = [key for key in d.steps if key[0] == "tree"]
    assert len(trees) >= 2 and counts == [0, 2 + len(trees)], (counts, list(d.steps))
    before = graphs.compile_counts()
    generate(target, PROMPT[:7] + [1, 2], d, max_new_tokens=20, gamma=3)
    assert graphs.compile_counts() == before
    tree = Eagle3Drafter._tree_on_device
    read = lambda self, **k: tree(self, **k) + (k["start"].item(),)  # noqa: E731  (steps take keywords)
    monkeypatch.setattr(Eagle3Drafter, "_tree_on_device", read)
    with pytest.raises(graphs.HostRead):
        generate(target, PROMPT, eagle3_tree(target, hf, on_device=True, compile_steps=True), max_new_tokens=8)


def test_steps_attend_over_the_span_that_holds_the_live_slots():
    """A cache of 1,024 slots: a step at slot p attends over the smallest span of 256, 512, 1,024
    that holds p + T, every span of a step captured at once (the ones that end before p at their
    own last slots, whose K/V are put back), so generating across the spans captures nothing new,
    leaves every live slot as the eager path writes it, and gives the eager path's tokens, for a
    chain drafter, a tree drafter and none."""
    eager, fast, hf = pair(max_position_embeddings=1024)
    assert [fast.spans() for _ in [fast.setup_cache(1, 1024)]][0] == [256, 512, 1024]
    fast.live_spans = False
    assert fast.spans() == [1024]
    fast.live_spans = True
    prompt = torch.randint(0, 256, (480,), generator=torch.Generator().manual_seed(0)).tolist()
    for name in ("autoregressive", "truncate", "eagle3 tree on device"):
        want = generate(eager, prompt, DRAFTERS[name](eager, hf), max_new_tokens=60, gamma=3, capacity=1024)
        d = DRAFTERS[name](fast, hf)
        warm_up(fast, d, prompt[:200], Sampler, max_new_tokens=40, gamma=3, capacity=1024)  # captured in span 256
        before = graphs.compile_counts()
        got = generate(fast, prompt, d, max_new_tokens=60, gamma=3, capacity=1024)  # 480..540: spans 512, 1,024
        assert got.tokens == want.tokens, name
        assert graphs.compile_counts() == before, name  # the wider spans were captured with the first
        torch.testing.assert_close(fast.cache.kv[..., :539, :], eager.cache.kv[..., :539, :], atol=1e-4, rtol=1e-4)
    assert {key[-1] for key in fast.steps} == set(fast.spans()) == {256, 512, 1024, 1280}  # (a tree's 5 slots more)

    # A step first seen past the smallest span: that span is captured at its own last slots, which
    # hold live K/V and are put back; a shorter prompt later replays it without capturing.
    _, fresh, _ = pair(max_position_embeddings=1024)
    want = generate(eager, prompt, None, max_new_tokens=60, capacity=1024)
    assert generate(fresh, prompt, None, max_new_tokens=60, capacity=1024).tokens == want.tokens
    # (1e-4 as above: 60 steps of the CPU kernel's sums against torch's; a slot not put back is off by O(1))
    torch.testing.assert_close(fresh.cache.kv[..., :539, :], eager.cache.kv[..., :539, :], atol=1e-4, rtol=1e-4)
    before = graphs.compile_counts()
    short = generate(fresh, prompt[:100], None, max_new_tokens=20, capacity=1024).tokens
    assert short == generate(eager, prompt[:100], None, max_new_tokens=20).tokens
    assert graphs.compile_counts() == before


def test_a_steps_outputs_live_until_that_step_runs_again():
    """The lifetime rule of model.py: a captured step's outputs are its static buffers, rewritten
    by its own next run and by no other step's."""
    _, m, _ = pair()
    m.setup_cache(1, 32)
    m.prefill(torch.tensor([PROMPT]))
    first = m(torch.tensor([[7]]), 12).logits
    kept = first.clone()
    m(torch.tensor([[7, 8]]), 12)  # another step (T = 2): first is untouched
    assert torch.equal(first, kept)
    second = m(torch.tensor([[9]]), 12).logits  # the same step again: the same buffer, new values
    assert second is first and not torch.equal(second, kept)


SYNCS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@pytest.mark.parametrize("compiled", [False, True])
def test_one_host_sync_per_round(monkeypatch, compiled):
    """Every Tensor -> Python conversion is counted: one per target forward (the prefill's first
    token, then one per round), for autoregressive and speculative decoding. Eager, greedy rounds
    read the CPU kernel's argmax and the draft at once and decide on the host (greedy_on_host);
    compiled, as on a GPU, they verify on the device, and a token tree is walked there too (on a
    CPU verify walks it in Python lists instead: test_tree checks the two walks agree)."""
    from specdec_runtime import verify

    monkeypatch.setattr(verify, "_walk", lambda tree, t, chosen: verify._walk_on_device(t, chosen))
    eager, fast, hf = pair()
    target = fast if compiled else eager
    names = ("autoregressive", "truncate", "layer skip", "medusa tree", "stand-alone model", "mtp")
    names += ("ngram", "eagle3 tree on device", "eagle3 chain on device", "eagle3 tree on device + lookup")
    names += ("eagle3 tree, compiled steps",)
    for name in names + ("eagle3 tree on device + lookup + phrases",):
        d = DRAFTERS[name](target, hf)
        generate(target, PROMPT, d, max_new_tokens=30, gamma=3)  # warm-up (captures outside the count)
        count = {"n": 0}
        with monkeypatch.context() as patched:
            for sync in SYNCS:
                original = getattr(torch.Tensor, sync)

                def counted(self, *args, _original=original, _count=count, **kwargs):
                    _count["n"] += 1
                    return _original(self, *args, **kwargs)

                patched.setattr(torch.Tensor, sync, counted)
            out = generate(target, PROMPT, d, max_new_tokens=30, gamma=3)
        assert count["n"] == out.stats.target_forwards, name


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_cuda_fp32_greedy_equals_autoregressive_for_every_drafter(drafter):
    """Real CUDA graphs in fp32: the speculative output is the target's own greedy output."""
    _, target, hf = pair(device="cuda")
    ar = generate(target, PROMPT, None, max_new_tokens=40)
    spec = generate(target, PROMPT, DRAFTERS[drafter](target, hf), max_new_tokens=40, gamma=3)
    assert spec.tokens == ar.tokens
    assert graphs.captures > 0 and all(s.graph is not None for s in target.steps.values())


@pytest.mark.gpu
def test_cuda_flex_attention_reads_only_the_live_blocks():
    """attention="flex" in real CUDA graphs, fp32: with NaN in every slot of the cache past the first
    block (which the prompt and 40 new tokens stay in), the output is the target's own greedy output
    (a block past the newest slot's that its kernel read would put NaN in every logit), for
    autoregressive decoding and trees verified; one span, one step per shape."""
    eager, target, hf = pair(device="cuda", attention="flex")
    ar = generate(eager, PROMPT, None, max_new_tokens=40)
    for name in ("autoregressive", "medusa tree"):
        target.setup_cache(1, 512)
        with torch.inference_mode():
            target.cache.kv[..., 128:, :] = float("nan")
        out = generate(target, PROMPT, DRAFTERS[name](target, hf), max_new_tokens=40, gamma=3, capacity=512)
        assert out.tokens == ar.tokens, name
    assert target.spans() == [512] and all(s.graph is not None for s in target.steps.values())
    for B, T in ((1, 4), (2, 2), (2, 44)):  # attend_live alone: its decoding kernel, and its kernel for many queries
        check_live_blocks("cuda", B, T)


@pytest.mark.gpu
def test_cuda_nothing_compiles_or_records_again_and_one_sync_per_round():
    _, target, hf = pair(device="cuda", dtype=torch.bfloat16)
    drafters = ["autoregressive", "truncate", "layer skip", "medusa tree", "mtp", "stand-alone model"]
    drafters += ["eagle3 tree + lookup", "eagle3 tree + lookup + phrases", "eagle3 chain on device"]
    warm, after, (before_ptr, after_ptr) = warm_then_rerun(target, hf, drafters, capacity=64)
    assert after == warm and before_ptr == after_ptr
    every = ("autoregressive", "truncate", "layer skip", "medusa tree", "mtp", "stand-alone model", "ngram")
    over = {}  # every drafter kind's extra syncs, where it has any
    for name in every + ("eagle3 tree", "eagle3 chain on device", "eagle3 tree + lookup"):
        d = DRAFTERS[name](target, hf)
        generate(target, PROMPT, d, max_new_tokens=40, gamma=3, capacity=64)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = generate(target, PROMPT, d, max_new_tokens=40, gamma=3, capacity=64)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        if len(syncs) > out.stats.target_forwards:
            over[name] = (len(syncs), out.stats.target_forwards, sorted(set(syncs)))
    assert not over, over


@pytest.mark.gpu
def test_cuda_bf16_divergences_are_near_ties():
    """bf16 speculative vs autoregressive greedy output: every first divergence is a near-tie
    (measure.divergences: the top-two gap of the reference is within twice the bf16 error there)."""
    _, target, hf = pair(device="cuda", dtype=torch.bfloat16)
    reference = runtime_from_hf(hf).to("cuda")  # fp32
    prompts = [[(7 * i + j) % 256 for j in range(10 + i)] for i in range(8)]
    for name in ("truncate", "medusa tree", "stand-alone model"):
        d = DRAFTERS[name](target, hf)
        pairs = [
            (p, generate(target, p, None, max_new_tokens=48).tokens, generate(target, p, d, max_new_tokens=48).tokens)
            for p in prompts
        ]
        for report in divergences(target, reference, pairs):
            assert report["near_tie"], (name, report)
