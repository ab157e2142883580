"""Batched speculative decoding (specdec_runtime.batched) against each prompt decoded alone: greedy
rows equal generate()'s output (itself the target's greedy output) with every batched drafter,
rows of different prompt lengths, ragged acceptance and stops; sampled rows follow the target's
distribution (chi-square); the per-row forward equals a row decoded alone."""

import time

import pytest
import torch

from specdec_runtime import graphs, rows
from specdec_runtime.batched import _verify_trees, generate_many
from specdec_runtime.drafters.batched import (
    RowEagle3,
    RowLookup,
    RowLookupFirst,
    RowMedusa,
    RowModel,
    RowMTP,
    RowSelf,
    batch_drafter,
    chain_rows,
)
from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.lookup import LookupFirst, NgramDrafter
from specdec_runtime.drafters.medusa import MedusaDrafter
from specdec_runtime.drafters.phrases import PhraseTable
from specdec_runtime.drafters.protocol import RowDrafter
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.measure import measure
from specdec_runtime.model import LayerSkip
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree
from specdec_runtime.verify import verify_tree_sample
from tests.conftest import assert_sequences_follow, runtime_from_hf, sequence_joint, tiny_decoder, tiny_hf_model
from tests.runtime.test_eagle3 import tiny as eagle3_tiny
from tests.runtime.test_fast_path import mtp_drafter
from tests.runtime.test_medusa import PATHS, random_heads
from tests.runtime.test_verify import Scripted

PROMPTS = [[1, 5, 9, 5, 9], [1, 7, 7, 7, 30, 12, 40, 41, 42, 43, 7, 7, 7], [1, 4], [1, 20, 21, 22, 23, 20, 21], [3]]


def heads_target(kind: str = "qwen3", seed: int = 3):
    """(transformers model, our target) of 4 layers and 16 tokens: random heads' drafts hit at times."""
    hf = tiny_hf_model(kind, seed=seed, num_hidden_layers=4, vocab_size=16)
    return hf, runtime_from_hf(hf)


EAGLE3 = {"eagle3": {}, "eagle3 tree": {"tree_budget": 5, "top_k": 3}}  # chains, trees of 5 nodes
COMPILED = {"eagle3 tree, compiled steps": {"tree_budget": 5, "top_k": 3, "compile_steps": True}}  # the fast path's
OWN = ["medusa", "medusa tree", "mtp", "truncate", "layer skip"]  # drafters that read the target's states or are it
# The fast path's tests, by drafter: the kinds whose steps are the mechanisms of others (a model's, a tree's)
# run with -m slow, to keep the default run short; the gpu tests take them all.
FAST = ["none", "lookup", "model", "lookup first", *EAGLE3, "medusa tree"]
SLOW = [*OWN, *COMPILED, "eagle3 tree + lookup"]
FAST_SLOW = [pytest.param(k, marks=pytest.mark.slow) for k in SLOW if k not in FAST]


def own_drafter(kind: str, target, hf):
    """Of a 4-layer target (heads_target): three random Medusa heads drafting chains or a tree of 8
    nodes (test_medusa's), MTP heads 1 and 2 (test_fast_path's), its first 2 layers, or its layers
    with sublayers skipped."""
    if kind.startswith("medusa"):
        tree = Tree.from_paths(PATHS) if kind == "medusa tree" else Tree.chain(3)
        return MedusaDrafter(random_heads(64, target.config.vocab_size, seed=7), target, tree)
    if kind == "truncate":
        return ModelDrafter(target, exit_layer=2, shares_target_cache=True, name="truncate:2")
    if kind == "layer skip":
        return ModelDrafter(target, skip=LayerSkip(attn={1}, mlp={2}), shares_target_cache=True, name="skip")
    return mtp_drafter(target, hf)


def perturbed(model):
    """A copy of the target with noise on its weights: a drafter right often, not always."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2 * p.std())
    return model


def test_a_row_at_slots_of_its_own_computes_what_it_computes_alone():
    """Left-padded rows at their own slots: each row's logits equal the row decoded alone (prefill
    and a step of 3 tokens at different slots per row)."""
    target = tiny_decoder("qwen3", seed=1)
    prompts = [[1, 5, 9, 11], [2, 3]]
    alone = []
    for p in prompts:
        target.setup_cache(1, 16)
        first = target.prefill(torch.tensor([p])).logits[0]
        alone.append((first, target(torch.tensor([[4, 6, 8]]), len(p)).logits[0]))
    target.setup_cache(2, 16)
    target.left_pad(torch.tensor([0, 2]))
    ids = torch.tensor([[1, 5, 9, 11], [0, 0, 2, 3]])
    first = rows.prefill(target, ids).logits
    step = target(torch.tensor([[4, 6, 8], [4, 6, 8]]), [4, 4]).logits
    for b, (f, s) in enumerate(alone):
        torch.testing.assert_close(first[b, 4 - len(prompts[b]) :], f, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step[b], s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kind, overrides",
    [("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 8})],
    ids=["llama", "qwen3", "mistral-window"],
)
@pytest.mark.parametrize("drafter", ["none", "lookup", "model"])
@pytest.mark.parametrize("rows", [None, 2], ids=["one-batch", "queue"])
def test_greedy_rows_equal_each_prompt_decoded_alone(kind, overrides, drafter, rows):
    """Every prompt at once, or two rows at a time, each prompt from the queue taking the row the
    first to stop leaves (rows = 2: three prompts wait, one of them longer than the first two)."""
    target = tiny_decoder(kind, seed=3, **overrides)
    draft_model = perturbed(tiny_decoder(kind, seed=3, **overrides))
    free = [generate(target, p, max_new_tokens=20).tokens for p in PROMPTS]
    stop = free[1][6]  # row 1 stops at its 7th token (maybe others too)
    alone = [generate(target, p, max_new_tokens=20, stop_ids={stop}).tokens for p in PROMPTS]
    assert len(alone[1]) <= 7 and any(len(a) == 20 for a in alone)
    row_drafter = {"none": None, "lookup": RowLookup(), "model": RowModel(draft_model)}[drafter]
    many = generate_many(target, PROMPTS, row_drafter, max_new_tokens=20, gamma=3, stop_ids={stop}, rows=rows)
    assert [g.tokens for g in many] == alone
    assert [g.stop_reason for g in many] == ["stop_token" if a[-1] == stop else "length" for a in alone]
    if drafter == "model":  # drafts accepted, more in some rows than in others
        assert len({g.stats.accepted for g in many}) > 2, [g.stats.accepted for g in many]
    assert generate(target, PROMPTS[0], max_new_tokens=20).tokens == free[0]  # nothing left behind


@pytest.mark.parametrize(
    "kind", ["model", *EAGLE3, "medusa", "medusa tree", "mtp", "truncate", "lookup first", "lookup first, eagle3 tree"]
)
def test_sampled_rows_follow_the_targets_distribution(kind):
    """Short prompts beside a long one, a sampling drafter: their first two tokens (the second
    from speculative sampling of a draft) follow the exact joint of the target's warped
    distribution (chi-square over the 9 pairs of top-3 tokens). 700 rows: the last 100 prompts
    wait in the queue for a row."""
    if kind == "model":
        hf = tiny_hf_model(seed=4)
        target, rows, short = runtime_from_hf(hf), RowModel(perturbed(runtime_from_hf(hf))), [1, 5, 9]
    elif kind in OWN:  # (heads' draws: each head's distribution at the newest token; the target's first layers')
        hf, target = heads_target("llama", seed=5)
        rows, short = batch_drafter(own_drafter(kind, target, hf)), [1, 5, 9]
    elif kind == "lookup first":  # (most of the rows' first tokens, 5 and 7, follow a 9 in the prompt: a lookup
        # drafts a certain token there, one-hot beside the others' truncate:2 draws)
        hf, target = heads_target("llama", seed=5)
        rows, short = batch_drafter(LookupFirst(own_drafter("truncate", target, hf))), [9, 5, 9, 13, 9, 7, 1, 5, 9]
    elif kind == "lookup first, eagle3 tree":  # (two of this target's top-3 first tokens, 4 and 8, follow a 9 in
        # the prompt: those rows draft a lookup's chain in their tree, the others EAGLE-3's trees)
        hf, target, model = eagle3_tiny(vocab=16, draft_vocab=12)
        drafter = Eagle3Drafter(model, target, cpu_bf16=False, **EAGLE3["eagle3 tree"])
        rows, short = batch_drafter(LookupFirst(drafter)), [9, 4, 9, 8, 9, 10, 1, 5, 9]
        assert rows.tree_nodes == 5
    else:  # (a prompt after which its random drafts are accepted at times)
        hf, target, model = eagle3_tiny(vocab=16, draft_vocab=12)
        rows, short = RowEagle3(Eagle3Drafter(model, target, cpu_bf16=False, **EAGLE3[kind])), [1, 2, 3, 4]
    long = [1, 7, 7, 7, 3, 12, 4, 11, 2, 13]
    sampler = Sampler(1.0, top_k=3, seed=0)
    out = generate_many(target, [long] + [short] * 799, rows, sampler, max_new_tokens=3, gamma=2, rows=700)
    assert sum(g.stats.drafted for g in out) >= 799 and 0 < sum(g.stats.accepted for g in out) < 799
    assert (0 < sum(g.stats.lookup_rounds for g in out) < 799) == kind.startswith("lookup first")
    # (a row with no room left to draft accepts none of the nodes its tree has for the others' sake)
    assert all(a <= d for g in out for a, d in zip(g.stats.accepted_at, g.stats.drafted_at, strict=True))

    def next_logits(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0, -1]

    assert_sequences_follow(
        [g.tokens[:2] for g in out[1:]], sequence_joint(next_logits, short, 2, temperature=1.0, top_k=3)
    )


@pytest.mark.parametrize(
    "sampled, on_device", [(False, False), (True, False), (False, True)], ids=["greedy", "sampled", "captured"]
)
@pytest.mark.parametrize("batch", [None, 2], ids=["one-batch", "queue"])
def test_eagle3_chains_draft_for_each_row_what_they_draft_alone(sampled, on_device, batch):
    """An EAGLE-3 drafter: every row's output equals the target's greedy output, and its
    drafts were accepted exactly as often, position by position, as the same drafter's chains
    decoding that prompt alone (the drafts are the same), also where its rounds are captured steps
    (on_device, emulated); sampled, the rows are the target's distribution's (the tokens differ
    from batch 1's: the random draws are the batch's)."""
    _, target, model = eagle3_tiny(vocab=16, draft_vocab=12)  # a vocabulary small enough for random drafts to hit
    drafter = Eagle3Drafter(model, target, cpu_bf16=False)
    prompts = [[t % 16 for t in p] for p in PROMPTS]
    rows = batch_drafter(Eagle3Drafter(model, target, cpu_bf16=False, on_device=on_device))
    assert isinstance(rows, RowEagle3) and rows.hidden_layers == drafter.hidden_layers
    if sampled:
        many = generate_many(target, prompts, rows, Sampler(1.0, seed=0), max_new_tokens=24, gamma=3, rows=batch)
        assert all(len(g.tokens) == 24 for g in many) and sum(g.stats.accepted for g in many) > 0
        return
    many = generate_many(target, prompts, rows, max_new_tokens=24, gamma=3, rows=batch)
    assert bool(rows.steps) == on_device
    for p, g in zip(prompts, many, strict=True):
        alone = generate(target, p, drafter, max_new_tokens=24, gamma=3)
        assert g.tokens == alone.tokens == generate(target, p, max_new_tokens=24).tokens
        assert g.stats.accepted_at == alone.stats.accepted_at and g.stats.drafted_at == alone.stats.drafted_at
    assert sum(g.stats.accepted for g in many) > 5


@pytest.mark.parametrize("kind", OWN)
@pytest.mark.parametrize("batch", [None, 2], ids=["one-batch", "queue"])
def test_the_targets_own_drafters_draft_for_each_row_what_they_draft_alone(monkeypatch, kind, batch):
    """Medusa heads (chains and a tree), MTP heads, truncate and layer skip: every row's output
    equals the target's greedy output, and each round drafted for it the very tokens the same
    drafter drafts decoding that prompt alone (MTP's 2 heads: 2 of gamma 3; a tree: every round its
    whole tree, of which one sequence's loop cuts the levels past its budget)."""
    hf, target = heads_target()
    drafter = own_drafter(kind, target, hf)
    rows = batch_drafter(drafter)
    kinds = {"medusa": RowMedusa, "medusa tree": RowMedusa, "mtp": RowMTP, "truncate": RowSelf, "layer skip": RowSelf}
    assert isinstance(rows, kinds[kind]) and rows.hidden_layers == drafter.hidden_layers
    assert rows.tree_nodes == (len(PATHS) if kind == "medusa tree" else 0)
    prompts = [[t % 16 for t in p] for p in PROMPTS]
    drafted, row_prompt = record_drafts(monkeypatch, rows, drafter)
    many = generate_many(target, prompts, rows, max_new_tokens=24, gamma=3, rows=batch)
    for p, g in zip(prompts, many, strict=True):
        row_prompt[:] = [tuple(p)]
        alone = generate(target, p, drafter, max_new_tokens=24, gamma=3)
        assert g.tokens == alone.tokens == generate(target, p, max_new_tokens=24).tokens
        ours, theirs = drafted["rows"][tuple(p)], drafted["alone"][tuple(p)]
        if rows.tree_nodes:  # (a cut tree's nodes come first: nodes are in order of depth)
            assert len(ours) == len(theirs) and g.stats.target_forwards == alone.stats.target_forwards
            for (_, o, op), (_, t, tp) in zip(ours, theirs, strict=True):
                assert o[: len(t)] == t and op[: len(tp)] == tp  # (its last round may accept past it)
        else:
            assert ours == theirs and g.stats.accepted_at == alone.stats.accepted_at
    assert sum(g.stats.accepted for g in many) > 5


@pytest.mark.parametrize("drafter", [None, "model"], ids=["autoregressive", "model"])
def test_the_prompts_times_add_up_to_no_more_than_the_batchs_wall_time(drafter):
    """Each prompt's time is its prefill and its share of every round it ran in, so that their sum
    (GenerationStats.total: a batch's tokens/s) is what a clock around the call sees. Four rows
    that stop together refill together: each refill counts its own prefill (it counted the
    round's refills so far, and a GPU's 8B batch of 64 read 4-10x its wall time)."""
    target = tiny_decoder("qwen3", seed=3)
    row_drafter = None if drafter is None else RowModel(perturbed(tiny_decoder("qwen3", seed=3)))
    prompts = [[1 + (i + k) % 60 for k in range(120)] for i in range(12)]  # long prompts, 2 tokens each
    generate_many(target, prompts[:4], row_drafter, max_new_tokens=2, gamma=1, rows=4)  # warm-up
    start = time.perf_counter()
    many = generate_many(target, prompts, row_drafter, max_new_tokens=2, gamma=1, rows=4)
    wall = time.perf_counter() - start
    spent = sum(g.stats.total_s for g in many)
    assert all(len(g.tokens) == 2 for g in many)
    assert spent <= wall, (spent, wall)
    assert spent > 0.5 * wall, (spent, wall)  # (what is not counted: the call's own set-up)


@pytest.mark.parametrize("kind", ["none", "model", "eagle3 tree", "mtp", "lookup first"])
@pytest.mark.parametrize("batch", [None, 2], ids=["one-batch", "queue"])
def test_an_eager_batch_runs_its_live_rows_alone_once_nothing_waits(monkeypatch, kind, batch):
    """Once the queue is empty, each target forward runs only the rows still decoding (rows.keep_rows,
    RowDrafter.keep): the batch shrinks as prompts stop at different times (a stop token, budgets
    apart), and every output is still the target's greedy output for its prompt alone, in a second
    call too, which finds the cache allocated (the live rows moved within it)."""
    if kind in ("none", "model"):
        target, hf = tiny_decoder("qwen3", seed=3), None
        drafter = None if kind == "none" else RowModel(perturbed(tiny_decoder("qwen3", seed=3)))
    elif kind == "eagle3 tree":
        hf, target, model = eagle3_tiny(vocab=16, draft_vocab=12)
        drafter = RowEagle3(Eagle3Drafter(model, target, cpu_bf16=False, tree_budget=5, top_k=3))
    else:
        hf, target = heads_target()
        own = own_drafter("mtp", target, hf) if kind == "mtp" else LookupFirst(own_drafter("truncate", target, hf))
        drafter = batch_drafter(own)
    prompts = [[t % 16 for t in p] for p in PROMPTS] if hf is not None else PROMPTS
    sizes, forward = [], rows.forward

    def counted(decoder, x, *args, **kwargs):
        if verifies(decoder, target, kwargs) and not kwargs.get("eager"):  # (a round's, not a prefill's)
            sizes.append(x.shape[0])
        return forward(decoder, x, *args, **kwargs)

    monkeypatch.setattr(rows, "forward", counted)
    stop = {generate(target, prompts[0], max_new_tokens=5).tokens[-1]}  # the first prompt's 5th token, say
    alone = [generate(target, p, max_new_tokens=18, stop_ids=stop).tokens for p in prompts]
    many = generate_many(target, prompts, drafter, max_new_tokens=18, gamma=3, rows=batch, stop_ids=stop)
    assert [g.tokens for g in many] == alone
    B = batch or len(prompts)
    decoding = [s for s in sizes if s <= B]
    assert decoding[-1] < B, sizes  # the last prompts' rounds run their rows alone
    tail = decoding[decoding.index(min(s for s in decoding if s < B)) - 1 :]
    assert tail == sorted(tail, reverse=True), sizes  # (rows only leave once nothing waits)
    kv = target.cache.kv  # the live rows moved to its first rows: the next call finds the cache as it was
    again = generate_many(target, prompts, drafter, max_new_tokens=18, gamma=3, rows=batch, stop_ids=stop)
    assert [g.tokens for g in again] == alone and target.cache.kv is kv


def test_kept_rows_move_in_place_without_a_copy_of_the_cache():
    """rows.move_rows (the target's, EAGLE-3's and MTP's caches when a batch keeps its live rows):
    the rows kept equal the naive gather's, and nothing the size of more than one row is allocated
    on the way (a gather of the rows kept would allocate them all again); rows out of order refused."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    cache = torch.randn(3, 7, 2, 16, 4)  # [layers, rows, 2 Hkv, S, D], the target's
    for keep in ([1, 4, 6], [0, 1, 5], [2], list(range(7))):
        t, made = cache.clone(), []
        with Sizes():
            rows.move_rows(t, keep, dim=1)
        assert torch.equal(t[:, : len(keep)], cache[:, keep]) and torch.equal(t[:, len(keep) :], cache[:, len(keep) :])
        assert max(made, default=0) <= cache[:, 0].numel(), (keep, made)  # (views: a row's at most)
    with pytest.raises(ValueError, match="ascending"):
        rows.move_rows(cache.clone(), [3, 1])


@pytest.mark.parametrize("window", [None, 2])
def test_a_tree_in_a_row_attends_as_the_tree_of_one_sequence(window):
    """rows.attention_inputs with a token tree per row: each row's rope rows and mask equal one
    sequence's (Decoder.attention_inputs) for the same tree at the same slot, the window counting
    positions (a node's is its depth: the rank-2 branch's nodes sit at slots far past their depth)."""
    target = tiny_decoder("mistral", seed=0, sliding_window=window)
    target.setup_cache(2, 40)
    trees = [Tree.from_paths([(0,), (1,), (2,), (2, 0), (2, 1), (2, 0, 0)]), Tree.from_paths(PATHS[:6])]
    T = len(trees[0]) + 1
    t = [tree.tensors for tree in trees]
    depth, ancestor = torch.stack([x["depth"] for x in t]), torch.stack([x["ancestor"] for x in t])
    starts, bound = [5, 20], 32
    cos, sin, slots, mask, _ = rows.attention_inputs(
        target, torch.tensor(starts), T, bound, torch.zeros(2, dtype=torch.long), (depth, ancestor)
    )
    for b, s in enumerate(starts):
        alone = target.attention_inputs(target.slots[s], T, bound, (depth[b], ancestor[b]))
        torch.testing.assert_close(cos[b], alone.cos, rtol=0, atol=0)
        torch.testing.assert_close(sin[b], alone.sin, rtol=0, atol=0)
        assert torch.equal(slots[b], alone.slots) and torch.equal(mask[b, 0], alone.mask), b


def test_trees_in_rows_attend_within_a_sliding_window():
    """Medusa trees in rows of a Mistral target with a window of 3: the window counts positions, a
    node's by its depth (not its slot), and every output is the target's greedy output."""
    hf = tiny_hf_model("mistral", seed=3, num_hidden_layers=4, vocab_size=16, sliding_window=3)
    target = runtime_from_hf(hf)
    drafter = MedusaDrafter(random_heads(64, 16, seed=7), target, Tree.from_paths(PATHS))
    prompts = [[t % 16 for t in p] for p in PROMPTS]
    many = generate_many(target, prompts, batch_drafter(drafter), max_new_tokens=24, gamma=3, rows=2)
    assert [g.tokens for g in many] == [generate(target, p, max_new_tokens=24).tokens for p in prompts]
    assert sum(g.stats.accepted for g in many) > 5


def record_drafts(monkeypatch, rows: RowDrafter, drafter):
    """({"rows": {prompt: drafts}, "alone": {prompt: drafts}}, the prompt of each row): each round's
    draft (host ids) of the row drafter and of the runtime drafter, by prompt; the runtime
    drafter's cut to the round's gamma, as the loop cuts it. Set row_prompt[:] = [prompt] before
    generate() decodes one alone."""
    drafted: dict[str, dict[tuple, list]] = {"rows": {}, "alone": {}}
    row_prompt = []
    start, refill, draft_rows, draft_alone = type(rows).start, type(rows).refill, type(rows).draft, type(drafter).draft
    keep = type(rows).keep

    def on_start(self, prompts, *args):
        row_prompt[:] = [tuple(p) for p in prompts]
        return start(self, prompts, *args)

    def on_refill(self, b, prompt):
        row_prompt[b] = tuple(prompt)
        return refill(self, b, prompt)

    def on_keep(self, live):  # (the batch's done rows dropped: the live rows renumbered)
        kept = keep(self, live)
        if kept:
            row_prompt[:] = [row_prompt[b] for b in live]
        return kept

    def on_draft_rows(self, gammas, sampler):
        tokens, lengths, q = draft_rows(self, gammas, sampler)
        for b, n in enumerate(lengths):
            if not n:
                continue
            if self.tree is None or b in getattr(self, "lookup_rows", ()):  # (a lookup's chain: its live nodes)
                row = tokens[b, :n].tolist()
            else:  # (a tree: its depth, every node, their parents; beside lookups the inner drafter's own depth)
                levels = (self.d.tree if isinstance(self, RowLookupFirst) else self.tree)["levels"]
                row = (levels.shape[0] - 1, tokens[b].tolist(), self.tree["parent"][b, 1:].tolist())
            drafted["rows"].setdefault(row_prompt[b], []).append(row)
        return tokens, lengths, q

    def on_draft_alone(self, ids, gamma, sampler):
        draft = draft_alone(self, ids, gamma, sampler)
        if draft.tokens.numel():
            if not rows.tree_nodes:  # (a chain, or Medusa's chain tree)
                row = draft.tokens[:gamma].tolist()
            elif draft.lookup:  # (a lookup's chain beside trees: as long as one sequence's)
                row = draft.tokens.tolist()
            else:
                parents = draft.tree.tensors_on(draft.tokens.device)["parent"][1:].tolist()
                row = (draft.tree.depth, draft.tokens.tolist(), parents)
            drafted["alone"].setdefault(row_prompt[0], []).append(row)
        return draft

    monkeypatch.setattr(type(rows), "start", on_start)
    monkeypatch.setattr(type(rows), "keep", on_keep)
    monkeypatch.setattr(type(rows), "refill", on_refill)
    monkeypatch.setattr(type(rows), "draft", on_draft_rows)
    monkeypatch.setattr(type(drafter), "draft", on_draft_alone)
    return drafted, row_prompt


@pytest.mark.parametrize("inner", ["model", "eagle3", "mtp", "eagle3 tree", "medusa tree"])
@pytest.mark.parametrize("batch", [None, 2], ids=["one-batch", "queue"])
def test_lookup_first_drafts_for_each_row_what_it_drafts_alone(monkeypatch, inner, batch):
    """Lookup first (n-grams, then a phrase table, then the model's draft) before a stand-alone
    model, EAGLE-3 (chains or trees) or MTP or Medusa heads: every row's output is the target's
    greedy output, each round drafted for it the tokens LookupFirst drafts for that prompt alone
    (lookups as long as gamma, not merged; beside trees a chain in the row's tree, the other rows'
    trees kept: round by round while one sequence's tree is as deep, as in the trees' own test), and
    as many rounds were lookups'."""
    if inner.startswith("eagle3"):  # (trees drafted on the device: as deep as their levels, as the rows')
        _, target, model = eagle3_tiny(vocab=16, draft_vocab=12)
        model_drafter = Eagle3Drafter(model, target, cpu_bf16=False, on_device=inner == "eagle3 tree", **EAGLE3[inner])
        prompts = [[t % 16 for t in p] for p in PROMPTS]
    elif inner in ("mtp", "medusa tree"):  # (MTP's 2 heads: lookups of 3 are wider than its chains)
        hf, target = heads_target()
        model_drafter, prompts = own_drafter(inner, target, hf), [[t % 16 for t in p] for p in PROMPTS]
    else:
        target, prompts = tiny_decoder("qwen3", seed=3), PROMPTS
        model_drafter = ModelDrafter(perturbed(tiny_decoder("qwen3", seed=3)))
    seq = prompts[2] + generate(target, prompts[2], max_new_tokens=12).tokens  # (a phrase the target goes on to say)
    table = PhraseTable(torch.tensor([seq[4:8]]), torch.tensor([seq[8:11]]))
    drafter = LookupFirst(model_drafter, tokens=3, table=table, merge=0)
    rows = batch_drafter(drafter)
    assert isinstance(rows, RowLookupFirst) and rows.alone() is drafter and rows.name.endswith("+lookup+phrases")
    drafted, row_prompt = record_drafts(monkeypatch, rows, drafter)
    many = generate_many(target, prompts, rows, max_new_tokens=20, gamma=3, rows=batch)
    compared = {False: 0, True: 0}  # rounds compared: chains, trees
    for p, g in zip(prompts, many, strict=True):
        row_prompt[:] = [tuple(p)]
        alone = generate(target, p, drafter, max_new_tokens=20, gamma=3)
        assert g.tokens == alone.tokens == generate(target, p, max_new_tokens=20).tokens
        if not rows.tree_nodes:
            assert drafted["rows"][tuple(p)] == drafted["alone"][tuple(p)]
            assert (g.stats.lookup_rounds, g.stats.accepted_at) == (alone.stats.lookup_rounds, alone.stats.accepted_at)
            continue
        for ours, theirs in zip(drafted["rows"][tuple(p)], drafted["alone"][tuple(p)]):
            if isinstance(theirs, tuple) and theirs[0] < 3:  # (a tree cut near the budget)
                break
            assert ours == theirs
            compared[isinstance(theirs, tuple)] += 1
    assert sum(g.stats.lookup_rounds for g in many) > 5 and sum(g.stats.lookup_accepted for g in many) > 3
    assert not rows.tree_nodes or min(compared.values()) > 3, compared  # (lookups' chains and trees alike)


def test_a_lookups_chain_in_a_row_of_trees_is_verified_as_that_chain_alone():
    """chain_rows: row 0 keeps its tree of 6 nodes, row 1 drafts a chain of 3 in its place, its 3 other
    nodes dead (token 0, which the target likes best after the root). Sampled, with the same uniform
    draws, each row decides as verify_tree_sample does for its own tree or chain alone; greedy, row 1
    accepts its chain as far as the target agrees and never a dead node; at forced acceptance 1 it
    accepts its 3 tokens, row 0 its deepest first children. Nodes are their parents' likeliest or
    second tokens, so that rounds end at every depth."""
    tree = Tree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    N, V = 6, 9
    trees = {k: v[None].expand(2, *v.shape) for k, v in tree.tensors.items() if k != "levels"}
    trees["levels"] = tree.tensors["levels"]
    parent, rank = tree.tensors["parent"], tree.tensors["rank"]
    seen = set()
    for trial in range(40):
        gen = torch.Generator().manual_seed(trial)
        probs = (torch.randn(2, N + 1, V, generator=gen) * (1 + trial % 3)).softmax(-1)
        probs[1, 0, 0] += 2.0  # (token 0 likeliest after row 1's root: a dead node would be accepted)
        probs = probs / probs.sum(-1, keepdim=True)
        top = probs.argsort(dim=-1, descending=True)
        own = torch.tensor([[int(top[0, parent[i], rank[i]]) for i in range(1, N + 1)], [1] * N])
        chain = [int(top[1, i, int((trial + i) % 4 == 0)]) for i in range(3)]  # (row 1's nodes: replaced)
        tokens, rows = chain_rows(own, trees, [[], chain])
        assert tokens[1].tolist() == [*chain, 0, 0, 0]
        assert rows["alive"].tolist() == [[True] * 7, [True] * 4 + [False] * 3]
        nodes = torch.cat([torch.zeros(2, 1, dtype=torch.long), tokens], dim=1)  # [2, N + 1] roots first
        u = torch.rand(2, N + 1, generator=gen)
        batch = Scripted(u.flatten())
        n, _, path = _verify_trees(nodes, rows, probs.log(), batch)
        alone = [(tree, nodes[0], probs[0], u[0]), (Tree.chain(3), nodes[1, :4], probs[1, :4], u[1, :4])]
        for b, (t, x, p, draws) in enumerate(alone):
            one = Scripted(draws)
            verdict = verify_tree_sample(t, x, p, one)
            k = int(verdict.accept_len)
            assert int(n[b]) == k and path[b, : k + 1].tolist() == verdict.path[: k + 1].tolist(), (trial, b)
            torch.testing.assert_close(batch.rows[0][b], one.rows[0], rtol=0, atol=1e-6)
            seen.add((b, k))
        n, _, path = _verify_trees(nodes, rows, probs.log(), Sampler())  # greedy
        agree = int((top[1, :3, 0] == torch.tensor(chain)).long().cumprod(0).sum())
        assert int(n[1]) == agree and path[1, 1 : agree + 1].tolist() == list(range(1, agree + 1)), trial
    assert {k for b, k in seen if b == 1} >= {0, 1, 2, 3}, seen  # the chain: rejected at every depth, and whole
    n, _, path = _verify_trees(nodes, rows, probs.log(), Sampler(), forced=(1.0, torch.Generator()))
    assert n.tolist() == [3, 3] and path.tolist() == [[0, 1, 3, 6], [0, 1, 2, 3]]


@pytest.mark.parametrize("on_device", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("batch", [None, 2], ids=["one-batch", "queue"])
def test_eagle3_trees_draft_for_each_row_the_tree_one_sequence_drafts(monkeypatch, on_device, batch):
    """EAGLE-3 trees of 5 nodes, top-3, 3 levels, in rows (eagerly, or in captured steps): every
    row's output is the target's greedy output, and each round's tree (its nodes' tokens and
    parents) equals the one the drafter drafts on the device for that prompt alone, round by round
    while that one is as deep (near its budget it is cut: then rounds may differ)."""
    _, target, model = eagle3_tiny(vocab=16, draft_vocab=12)
    alone_drafter = Eagle3Drafter(model, target, cpu_bf16=False, tree_budget=5, top_k=3, on_device=True)
    rows = batch_drafter(Eagle3Drafter(model, target, cpu_bf16=False, tree_budget=5, top_k=3, on_device=on_device))
    assert isinstance(rows, RowEagle3) and rows.tree_nodes == 5 and "chains" not in rows.name
    prompts = [[t % 16 for t in p] for p in PROMPTS]
    drafted, row_prompt = record_drafts(monkeypatch, rows, alone_drafter)
    many = generate_many(target, prompts, rows, max_new_tokens=24, gamma=3, rows=batch)
    assert bool(rows.steps) == on_device
    compared = 0
    for p, g in zip(prompts, many, strict=True):
        row_prompt[:] = [tuple(p)]
        alone = generate(target, p, alone_drafter, max_new_tokens=24, gamma=3)
        assert g.tokens == alone.tokens == generate(target, p, max_new_tokens=24).tokens
        for ours, theirs in zip(drafted["rows"][tuple(p)], drafted["alone"][tuple(p)]):
            if theirs[0] < 3:
                break
            assert ours == theirs
            compared += 1
    assert compared > 10 and sum(g.stats.accepted for g in many) > 5


def test_eagle3_trees_of_rows_are_one_sequences_tree_a_row_each():
    """RowEagle3._tree on two rows at different slots against Eagle3Drafter._tree_on_device on each
    row alone over the same cache prefix: the same nodes, tensors, and K/V written for the tree's
    rows (so the same rope positions and masks)."""
    _, target, model = eagle3_tiny(vocab=16, draft_vocab=12)
    alone = Eagle3Drafter(model, target, cpu_bf16=False, tree_budget=5, top_k=3, on_device=True)
    rows = RowEagle3(Eagle3Drafter(model, target, cpu_bf16=False, tree_budget=5, top_k=3))
    alone.start(torch.tensor([1, 2]), 40)
    rows.start([[1, 2], [1, 2]], [0, 0], 40)
    S = min(alone.kv.shape[2], rows.kv.shape[2])
    g = torch.Generator().manual_seed(0)
    prefix = torch.randn(rows.kv[:, :, :S].shape, generator=g)
    rows.kv[:, :, :S] = prefix
    prenorm = torch.randn(2, model.config.layer.hidden_size, generator=g)
    logits = alone._head(prenorm)
    starts, W = [7, 12], 2 * 3  # (levels - 1) x top_k rows
    tokens, tensors = rows._tree(prenorm, logits, torch.tensor(starts), levels=3, budget=5, span=S)
    for b, s in enumerate(starts):
        alone.kv.zero_()
        alone.kv[0, :, :S] = prefix[b]
        own, _, own_tensors = alone._tree_on_device(prenorm[b], logits[b], alone.slots[s], levels=3, budget=5)
        assert torch.equal(tokens[b], own)
        for key, value in own_tensors.items():
            assert torch.equal(tensors[key] if key == "levels" else tensors[key][b], value), key
        torch.testing.assert_close(rows.kv[b, :, s : s + W], alone.kv[0, :, s : s + W], rtol=1e-5, atol=1e-5)


def test_drafters_that_decode_a_prompt_at_a_time_say_so():
    target = tiny_decoder(seed=0)
    assert isinstance(batch_drafter(NgramDrafter(4)), RowLookup)
    assert isinstance(batch_drafter(ModelDrafter(tiny_decoder(seed=1))), RowModel)
    assert isinstance(batch_drafter(LookupFirst(ModelDrafter(tiny_decoder(seed=1)))), RowLookupFirst)
    assert batch_drafter(ModelDrafter(target, exit_layer=1, shares_target_cache=True, confidence=0.5)) is None
    assert batch_drafter(ModelDrafter(tiny_decoder(seed=1), confidence=0.5)) is None  # (draft exits: a sync a token)
    assert batch_drafter(LookupFirst(ModelDrafter(tiny_decoder(seed=1), confidence=0.5))) is None
    with pytest.raises(SpecdecError, match="empty"):
        generate_many(target, [[1, 2], []])


# ---------------------------------------------------------------- the fast path (captured steps)


def test_a_batch_runs_at_a_captured_batch_size_as_vllm_captures_them():
    """vLLM's default capture sizes ([1, 2, 4] + multiples of 8 below 256 + multiples of 16 from
    256): a batch of B rows runs at the smallest one that holds it."""
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 1025, 16))
    for B in range(1, 1025):
        assert rows.captured_rows(B) == next(s for s in sizes if s >= B), B


class Copies(RowDrafter):
    """Drafts nothing until a row's sequence is past `after` tokens, then max(gammas) copies of its
    newest (as lookups do where a long prompt repeats itself)."""

    name = "copies"

    def __init__(self, after: int = 0, taps: tuple[int, ...] = ()):
        self.after, self.hidden_layers = after, taps

    def start(self, prompts, row_start, capacity):
        self.seqs = [list(p) for p in prompts]

    def refill(self, b, prompt):
        self.seqs[b] = list(prompt)

    def observe_tokens(self, b, tokens):
        self.seqs[b] += tokens

    def draft(self, gammas, sampler):
        lengths = [g if len(s) > self.after else 0 for s, g in zip(self.seqs, gammas)]
        return torch.tensor([[s[-1]] * max(lengths) for s in self.seqs], dtype=torch.long), lengths, None


def fast_target(drafter: str, device: str = "cpu", attention: str = "sdpa"):
    """(eager target, compiled target (with this attention), their row drafter, prompts): on a CPU,
    emulated captured steps. The layers are traced by aot_eager on CUDA too: real CUDA graphs,
    without inductor's minutes of compiling a dozen shapes in gpu_check (scripts/bench_gpu_batch.py
    runs inductor's batches; a drafter's steps compiled by inductor in CUDA graphs: test_fast_path's
    gpu test)."""
    compile_ = lambda m: m.to(device).compile(backend="aot_eager", attention=attention) or m  # noqa: E731
    if drafter.startswith("eagle3"):  # a vocabulary small enough for random drafts to hit
        (_, eager, model), (_, fast, _) = eagle3_tiny(vocab=16, draft_vocab=12), eagle3_tiny(vocab=16, draft_vocab=12)
        prompts = [[t % 16 for t in p] for p in PROMPTS]
        fast = compile_(fast)
        kw = (EAGLE3 | COMPILED)[drafter.removesuffix(" + lookup")]
        model_drafter = Eagle3Drafter(model.to(device), fast, cpu_bf16=False, on_device=True, **kw)
        if drafter.endswith(" + lookup"):  # (lookups' chains in rows of captured trees)
            return eager.to(device), fast, batch_drafter(LookupFirst(model_drafter, merge=0)), prompts
        return eager.to(device), fast, RowEagle3(model_drafter), prompts
    if drafter in OWN:
        (hf, eager), (_, fast) = heads_target(), heads_target()
        fast = compile_(fast)
        prompts = [[t % 16 for t in p] for p in PROMPTS]
        return eager.to(device), fast, batch_drafter(own_drafter(drafter, fast, hf)), prompts
    eager, fast = tiny_decoder("qwen3", seed=3).to(device), compile_(tiny_decoder("qwen3", seed=3))
    if drafter == "long later":  # the warm-up's 3 prompts never draft (so only measure's chains of every
        # length, measure._RowChains, capture those verify steps), the long ones that wait for a row do
        return eager, fast, Copies(after=20), PROMPTS[:3] + [list(range(1, 30)), list(range(40, 70))]
    draft_model = compile_(perturbed(tiny_decoder("qwen3", seed=3)))
    if drafter == "lookup first":
        return eager, fast, batch_drafter(LookupFirst(ModelDrafter(draft_model))), PROMPTS
    return eager, fast, {"none": None, "lookup": RowLookup(), "model": RowModel(draft_model)}[drafter], PROMPTS


@pytest.mark.parametrize("drafter", [*FAST, *FAST_SLOW, "long later"])
def test_the_fast_path_decodes_a_stream_as_each_prompt_alone_and_captures_nothing_after_warm_up(drafter):
    """A compiled target: 5 prompts streamed through 3 rows (a captured batch size of 4, one row of
    padding), each round a captured step. After measure's warm-up nothing is compiled or captured,
    and every output is the target's own greedy output (the eager target decoding the prompt alone)."""
    eager, target, row_drafter, prompts = fast_target(drafter)
    timed_from = []

    def progress(units):  # measure() iterates this once its warm-up is done
        timed_from.append(graphs.compile_counts())
        yield from units

    report = measure(target, row_drafter, prompts, sampler=Sampler, baseline=True, batch_size=3, gamma=3,
                     max_new_tokens=20, progress=progress)  # fmt: skip
    assert graphs.compile_counts() == timed_from[0]
    assert {key[1][0] for key in target.steps} == {4} and target.cache.kv.shape[1] == 4
    alone = [generate(eager, p, max_new_tokens=20).tokens for p in prompts]
    assert [g.tokens for g in report.spec] == [g.tokens for g in report.baseline] == alone
    if drafter in ("model", "lookup first", *EAGLE3, "eagle3 tree + lookup", *OWN):
        assert sum(g.stats.accepted for g in report.spec) > 5
    if drafter.endswith("lookup first") or drafter.endswith("+ lookup"):
        assert sum(g.stats.lookup_rounds for g in report.spec) > 3


@pytest.mark.slow  # (flex attention is off by default; the default run stays under 10 minutes)
@pytest.mark.parametrize("drafter", ["none", "eagle3 tree"])
def test_flex_attention_decodes_a_stream_as_each_prompt_alone(drafter):
    """attention="flex" with rows at different slots, padded rows at slot 0 and prompts refilled into
    a row: every output the target's own greedy output (aot_eager runs flex attention's mask without
    its block counts: check_live_blocks in test_fast_path checks those with inductor's kernels)."""
    eager, target, row_drafter, prompts = fast_target(drafter, attention="flex")
    outs = generate_many(target, prompts, row_drafter, Sampler(), rows=3, gamma=3, max_new_tokens=20)
    assert [g.tokens for g in outs] == [generate(eager, p, max_new_tokens=20).tokens for p in prompts]
    assert target.spans() == [target.cache.size] and target.cache.kv.shape[1] == 4


def test_a_stream_at_forced_acceptance_captures_nothing_after_warm_up():
    """scripts/bench_gpu_batch.py's runs: rows accept at random (accept_rate 0.7), so the last rows of
    the stream can reach their budgets together, and that round drafts for none of them: a verify of
    the newest tokens alone with the drafter's taps, which measure's warm-up captures too (a draft
    length of 0; here its own rows end apart)."""
    _, target, _, _ = fast_target("none")
    timed_from = []

    def progress(units):
        timed_from.append(graphs.compile_counts())
        yield from units

    report = measure(target, Copies(taps=(1,)), [[1, 2, 3]] * 6, sampler=lambda: Sampler(seed=2), baseline=True,
                     batch_size=3, gamma=3, max_new_tokens=24, accept_rate=0.7, progress=progress)  # fmt: skip
    assert graphs.compile_counts() == timed_from[0]
    assert 1 < report.total().tau < 4


SYNCS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def verifies(decoder, target, kwargs) -> bool:
    """Whether a forward is the target's own, every layer (not a truncate or layer-skip draft step)."""
    return decoder is target and kwargs.get("exit_layer") is None and kwargs.get("skip") is None


@pytest.mark.parametrize("drafter", [*FAST, *FAST_SLOW])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_one_host_sync_per_target_forward(monkeypatch, compiled, drafter):
    """Every Tensor -> Python conversion is counted: one per target forward (the prefill's first
    tokens, a refill's, then one a round), for every batched drafter (EAGLE-3 on the device where
    the target is compiled)."""
    eager, fast, row_drafter, prompts = fast_target(drafter)
    target = fast if compiled else eager
    if drafter in EAGLE3 | COMPILED and not compiled:
        kw = (EAGLE3 | COMPILED)[drafter]
        row_drafter = RowEagle3(Eagle3Drafter(row_drafter.d.model, eager, cpu_bf16=False, **kw))
    if drafter in OWN and not compiled:  # (of the eager target)
        row_drafter = batch_drafter(own_drafter(drafter, eager, heads_target()[0]))
    generate_many(target, prompts, row_drafter, max_new_tokens=20, gamma=3, rows=3)  # warm-up
    count, forwards, forward = {"n": 0}, {"n": 0}, rows.forward

    def counted_forward(decoder, *args, **kwargs):
        forwards["n"] += verifies(decoder, target, kwargs)
        return forward(decoder, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(rows, "forward", counted_forward)
        for sync in SYNCS:
            original = getattr(torch.Tensor, sync)

            def counted(self, *args, _original=original, **kwargs):
                count["n"] += 1
                return _original(self, *args, **kwargs)

            patched.setattr(torch.Tensor, sync, counted)
        generate_many(target, prompts, row_drafter, max_new_tokens=20, gamma=3, rows=3)
    assert count["n"] == forwards["n"] > len(prompts)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "drafter", ["none", "lookup", "model", "lookup first", *EAGLE3, "eagle3 tree + lookup", *COMPILED, *OWN]
)
def test_cuda_streams_in_cuda_graphs_equal_each_prompt_alone_and_sync_once_a_forward(monkeypatch, drafter):
    """Real CUDA graphs in fp32 (3 rows in a captured batch size of 4): every output is the target's
    own greedy output, every round's step is a graph, and the host waits for the device at most
    once per target forward (CUDA's sync debug mode)."""
    import warnings

    eager, target, row_drafter, prompts = fast_target(drafter, "cuda")
    alone = [generate(eager, p, max_new_tokens=20).tokens for p in prompts]
    assert [g.tokens for g in generate_many(target, prompts, row_drafter, max_new_tokens=20, gamma=3, rows=3)] == alone
    assert target.steps and all(s.graph is not None for s in target.steps.values())
    forwards, forward = {"n": 0}, rows.forward

    def counted_forward(decoder, *args, **kwargs):
        forwards["n"] += verifies(decoder, target, kwargs)
        return forward(decoder, *args, **kwargs)

    monkeypatch.setattr(rows, "forward", counted_forward)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            generate_many(target, prompts, row_drafter, max_new_tokens=20, gamma=3, rows=3)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= forwards["n"], sorted(set(syncs))


def test_forced_acceptance_accepts_each_position_with_the_rate_given_in_every_row():
    """generate_many(accept_rate=P), for measuring mechanics (scripts/bench_gpu_batch.py): P = 0
    accepts nothing, P = 1 every row's whole chain, and in between a chain of 2 accepts P + P^2
    tokens a round on average (~1500 rounds over 8 rows); a rate outside [0, 1] is refused."""
    target, rows_drafter = tiny_decoder(seed=3), Copies()
    prompts = [[1, 5, 9, 5, 9], [3, 4], [7, 7, 8, 9, 10, 11], [2]] * 2
    none = generate_many(target, prompts, rows_drafter, max_new_tokens=16, gamma=3, accept_rate=0.0)
    assert all(g.stats.accepted == 0 and g.stats.drafted > 0 for g in none)
    full = generate_many(target, prompts, rows_drafter, max_new_tokens=17, gamma=4, accept_rate=1.0)
    assert all(g.stats.accepted_at == g.stats.drafted_at == [3] * 4 for g in full)  # 3 rounds of 4 + 1 each
    runs = [generate_many(target, prompts, rows_drafter, Sampler(seed=s), max_new_tokens=61, gamma=2,
                          accept_rate=0.6) for s in range(8)]  # fmt: skip
    stats = [g.stats for run in runs for g in run]
    mean = sum(sum(s.accepted_at) for s in stats) / sum(s.rounds_with_draft for s in stats)
    assert abs(mean - (0.6 + 0.6**2)) < 0.07  # 0.96; the standard error is ~0.02
    with pytest.raises(SpecdecError, match="accept_rate"):
        generate_many(target, prompts, rows_drafter, max_new_tokens=4, accept_rate=-0.1)


def test_forced_acceptance_of_trees_takes_the_first_children_as_deep_as_the_draws_allow():
    """accept_rate with EAGLE-3 trees in rows (each depth's first child a draw, as one sequence's
    verify_forced): P = 0 accepts nothing; P = 1 the branch of first children every round, as deep
    as each tree has it: as often, position by position, as the same trees of each prompt alone."""
    _, target, model = eagle3_tiny(vocab=16, draft_vocab=12)
    rows = RowEagle3(Eagle3Drafter(model, target, cpu_bf16=False, tree_budget=5, top_k=3))
    alone = Eagle3Drafter(model, target, cpu_bf16=False, tree_budget=5, top_k=3, on_device=True)
    prompts = [[t % 16 for t in p] for p in PROMPTS]
    none = generate_many(target, prompts, rows, max_new_tokens=13, gamma=3, accept_rate=0.0)
    assert all(g.stats.accepted == 0 and g.stats.drafted > 0 for g in none)
    full = generate_many(target, prompts, rows, max_new_tokens=13, gamma=3, accept_rate=1.0)
    for p, g in zip(prompts, full, strict=True):
        one = generate(target, p, alone, max_new_tokens=13, gamma=3, accept_rate=1.0)
        assert g.stats.accepted_at == one.stats.accepted_at and g.stats.accepted_at[0] == g.stats.rounds_with_draft
    for seed in range(4):  # rows done apart, some by a branch past their budget, beside rows still running
        out = generate_many(target, prompts, rows, Sampler(seed=seed), max_new_tokens=14, gamma=3, accept_rate=0.7)
        assert [len(g.tokens) for g in out] == [14] * len(prompts)
