"""EAGLE-3: the training-time test against a naive step-by-step computation (which is what the
runtime drafter does), the runtime drafter's logits against the training module's, greedy output
equal to the target's (chains and EAGLE-2 trees), sampled output following the target's exact
distribution, the speculators format (names, shapes, dtypes; a round trip with identical logits),
and bad values refused."""

import copy
import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from specdec_runtime.cpu import PREFILL_CHUNK
from specdec_runtime.cpu import kernel as cpu_kernel
from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.eagle3_format import is_eagle3_folder, read_speculators, save_speculators
from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model, grouped
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.sampling import Sampler
from tests.conftest import runtime_from_hf, tiny_hf_model
from train.eagle3 import Eagle3Training, shifted, target_states, warm_start

AUX = (1, 2, 3)


def tiny(seed: int = 0, vocab: int = 256, draft_vocab: int = 200, warm: bool = False, **over):
    """(HF target, runtime target, EAGLE-3 model): a 4-layer target, a drafter over a draft vocabulary."""
    hf = tiny_hf_model("llama", seed, num_hidden_layers=4, vocab_size=vocab, **over)
    target = runtime_from_hf(hf)
    cfg = Eagle3Config.for_target(target.config, aux_layers=AUX, draft_vocab_size=draft_vocab)
    torch.manual_seed(seed + 1)
    model = Eagle3Model(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    model.set_draft_vocab(ids)
    if warm:
        warm_start(model, hf, ids)
    return hf, target, model.eval()


def naive_logits(model: Eagle3Model, embed: torch.Tensor, taps: torch.Tensor, ids: torch.Tensor, steps: int) -> dict:
    """{(k, p): logits of draft step k at row p}, computed as the runtime does: step 0 over the
    sequence (causal), then, for each p, one row per step attending to step 0's rows 0..p and its
    own earlier rows."""
    T = ids.shape[1]
    kept = {}

    def causal(q, k, v):
        kept["k"], kept["v"] = k, v
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, grouped(k, q.shape[1]), grouped(v, q.shape[1]), attn_mask=mask)

    tokens = shifted(ids, 1)
    pre0, log0 = model.step(F.embedding(tokens, embed), model.project(taps), torch.arange(T), causal)
    out = {(0, p): log0[0, p] for p in range(T)}
    for p in range(T):
        feature, own = pre0[:, p : p + 1], []
        for k in range(1, steps):
            tok = ids[:, p + 1 + k : p + 2 + k] if p + 1 + k < T else torch.zeros(1, 1, dtype=torch.long)

            def attend(q, kk, vv, own=own, p=p):
                own.append((kk, vv))
                K = torch.cat([kept["k"][:, :, : p + 1], *[o[0] for o in own]], dim=2)
                V = torch.cat([kept["v"][:, :, : p + 1], *[o[1] for o in own]], dim=2)
                return F.scaled_dot_product_attention(q, grouped(K, q.shape[1]), grouped(V, q.shape[1]))

            feature, logits = model.step(F.embedding(tok, embed), feature, torch.tensor([p + k]), attend)
            out[(k, p)] = logits[0, 0]
    return out


@torch.no_grad()
def test_training_time_test_loss_equals_the_naive_step_by_step_loss():
    hf, _, model = tiny()
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(1, 13, dtype=torch.bool)
    mask[0, 4:] = True  # ids[5:] are the "response"
    states = target_states(AUX)(hf, ids, torch.ones_like(ids))
    embed = hf.get_input_embeddings().weight
    head_rows = hf.get_output_embeddings().weight[model.draft_ids]
    steps = 3
    loss, _, metrics = Eagle3Training(model, embed, head_rows, steps=steps, decay=0.8)(
        ids, torch.ones_like(ids), mask, states["taps"], states["final"]
    )
    naive = naive_logits(model, embed, states["taps"], ids, steps)
    t_logp = (states["final"] @ head_rows.t()).log_softmax(-1)[0]  # [T, N]
    want, T = torch.zeros(()), ids.shape[1]
    full_mask = F.pad(mask, (0, 1))[0]
    for k in range(steps):
        for p in range(T):
            if p + k + 2 < T and full_mask[p + k + 1] and model.t2d[ids[0, p + k + 2]]:
                target = t_logp[p + k + 1]
                want += 0.8**k * (target.exp() * (target - naive[(k, p)].log_softmax(-1))).sum()
    assert metrics["step2/count"] > 0
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)


def drafted_logits(drafter: Eagle3Drafter, target, prompt: torch.Tensor, gamma: int = 3, best: int = 0):
    """(the draft logits of each step, the greedy ids they drafted from, the draft) of a chain drafted
    after a prefill of prompt, the drafter fed the target's taps as the generate loop feeds them
    (best > 0: its draft_best of that many nodes, asked with a sampler at temperature 1)."""
    seen, real_run = [], drafter._run

    def recording(*args, **kwargs):
        prenorm, logits = real_run(*args, **kwargs)
        seen.append(logits[-1])
        return prenorm, logits

    drafter._run = recording
    target.setup_cache(1, 64)
    prefill = target.prefill(prompt[None], logits_to_keep=1, taps=drafter.hidden_layers)
    ids = torch.cat([prompt, prefill.logits[0, -1].argmax().view(1)])
    drafter.start(prompt, 64)
    drafter.observe(prefill.hidden[0])
    draft = drafter.draft_best(ids, gamma, Sampler(1.0, seed=0), best) if best else drafter.draft(ids, gamma, Sampler())
    del drafter._run  # the class's own again
    return seen, ids, draft


@pytest.mark.parametrize("norm_before_residual", [False, True])
@torch.no_grad()
def test_runtime_drafter_logits_equal_the_training_modules(norm_before_residual):
    """A chain drafted by the runtime drafter (its own KV cache, fed the target's taps as the generate
    loop feeds them) comes from exactly the logits of the naive computation on the same sequence; with
    the feature as the layer's residual, and its norm (speculators' norm_before_residual)."""
    hf, target, model = tiny()
    model.config = replace(model.config, norm_before_residual=norm_before_residual)
    prompt = torch.arange(7, 19)
    P = len(prompt)
    seen, ids, draft = drafted_logits(Eagle3Drafter(model, target, cpu_bf16=False), target, prompt)
    seq = torch.cat([ids, draft.tokens])[None]
    taps = target_states(AUX)(hf, seq, torch.ones_like(seq))["taps"]
    naive = naive_logits(model, hf.get_input_embeddings().weight, taps, seq, 3)
    assert len(seen) == 3  # the prompt's newest row, then two single rows
    for k in range(3):  # step k of row P - 1: what drafted token k
        torch.testing.assert_close(seen[k], naive[(k, P - 1)], rtol=1e-4, atol=1e-5)
        assert int(draft.tokens[k]) == int(model.draft_ids[naive[(k, P - 1)].argmax()])


def float64_products(monkeypatch, bf16_rows: bool) -> None:
    """The drafter's torch ops with every product computed in float64 from its fp32 weights (an
    oracle), each row rounded to bf16 first where bf16_rows (as the kernel's bf16 pairs do)."""
    import specdec_runtime.drafters.eagle3 as eagle3
    import specdec_runtime.layers as layers

    def linear(x, w, residual=None):
        rows = x.bfloat16() if bf16_rows else x
        y = rows.double() @ w.w.double() + (w.bias.double() if w.bias is not None else 0)
        return (y + (residual.double() if residual is not None else 0)).to(x.dtype)

    for module in (eagle3, layers):
        monkeypatch.setattr(module, "linear", linear)


@pytest.mark.skipif(cpu_kernel.library() is None, reason="the CPU kernel cannot be built here")
@torch.no_grad()
def test_bf16_drafting_is_the_drafter_with_its_weight_matrices_rounded_to_bf16(monkeypatch):
    """cpu_bf16 (the default on a CPU with the kernel) drafts as the same drafter whose weight
    matrices were rounded to bf16 beforehand, from half the bytes: to fp32 rounding of float64
    products, where the kernel widens bf16 to fp32; where it multiplies bf16 pairs (AVX512-BF16),
    with each product's rows rounded to bf16 too (the products exact, their sums in fp32). Its
    logits are not the unrounded drafter's: they differ by the rounding."""
    hf, target, model = tiny()
    rounded = copy.deepcopy(model)
    for p in rounded.parameters():
        if p.ndim == 2:  # fc, the layer's projections, lm_head (the embedding is the target's)
            p.copy_(p.bfloat16().float())
    prompt = torch.arange(7, 19)
    bf16 = Eagle3Drafter(model, target)
    assert bf16.w.head.packed.dtype == torch.bfloat16 and bf16.w.qkv.packed.dtype == torch.bfloat16
    assert (bf16.w.qkv.packed.dim() == 4) == cpu_kernel.pairs()  # [panels, K / 2, panel, 2]: pairs
    ours = drafted_logits(bf16, target, prompt)[0]
    exact = drafted_logits(Eagle3Drafter(model, target, cpu_bf16=False), target, prompt)[0]
    with monkeypatch.context() as m:
        float64_products(m, bf16_rows=cpu_kernel.pairs())
        oracle = Eagle3Drafter(rounded, target, cpu_bf16=False)
        oracle.kernel = None  # its torch ops, with the float64 products
        expected = drafted_logits(oracle, target, prompt)[0]
    assert len(ours) == 3
    tol = dict(rtol=1e-4, atol=1e-4) if cpu_kernel.pairs() else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(ours, expected):  # (with pairs, a row's rounding to bf16 flips where fp32 sums differ)
        torch.testing.assert_close(a, b, **tol)
    assert (ours[0] - exact[0]).abs().max() > 1e-4  # the weights' rounding (logits ~0.1): far above fp32's
    torch.testing.assert_close(ours[0], exact[0], rtol=0.05, atol=0.05)


@pytest.mark.skipif(cpu_kernel.library() is None, reason="the CPU kernel cannot be built here")
@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("heads, tied", [((4, 2), False), ((4, 4), True)])
@torch.no_grad()
def test_the_kernels_draft_step_is_the_torch_ops_to_rounding(norm_before_residual, bf16, heads, tied):
    """On a CPU a draft step runs in one kernel call (cpu_kernel.eagle3_rows: the target's embedding
    gathered, both norms, fc, the layer, the head); its logits are those of the drafter's torch ops
    (the first step's rows under a causal mask, then single rows), with GQA and without, a tied
    embedding (the lm_head's columns) and not, the residual the feature or its norm, fp32 and bf16
    weights; and an EAGLE-2 tree drafted either way (cpu_kernel.eagle3_draft: the catch-up, the
    levels and the choice of nodes in one call) is the same, node for node."""
    hf, target, model = tiny(num_attention_heads=heads[0], num_key_value_heads=heads[1], tie_word_embeddings=tied)
    assert (target.embed is None) == tied
    model.config = replace(model.config, norm_before_residual=norm_before_residual)
    prompt = torch.arange(7, 19)
    fused = Eagle3Drafter(model, target, cpu_bf16=bf16)
    ops = Eagle3Drafter(model, target, cpu_bf16=bf16)
    ops.kernel = None  # the torch ops (as on a GPU, or where the kernel is off)
    assert fused.kernel is not None
    runs = [drafted_logits(d, target, prompt, gamma=4) for d in (fused, ops)]
    assert len(runs[0][0]) == 4
    for a, b in zip(runs[0][0], runs[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(runs[0][2].tokens, runs[1][2].tokens)
    K = fused.top_k  # 3 levels: K children of the root, then K for each of the K best, twice
    for budget in (8, K + 2 * K * K):  # the 8 best nodes; every node the levels made
        trees = []
        for d in (fused, ops):  # the whole draft in one kernel call (eagle3_draft), or the torch ops
            d.tree_budget = d.tree_nodes = budget
            trees.append(drafted_logits(d, target, prompt, gamma=3)[2])
        assert trees[0].tree == trees[1].tree and torch.equal(trees[0].tokens, trees[1].tokens)
        assert len(trees[0].tree) == budget


@pytest.mark.skipif(cpu_kernel.library() is None, reason="the CPU kernel cannot be built here")
@pytest.mark.parametrize("budget", [0, 8])
@torch.no_grad()
def test_a_prompt_longer_than_a_kernel_call_is_caught_up_in_chunks_as_the_torch_ops_do(budget):
    """The first draft after a prompt longer than a kernel call takes (cpu_kernel.max_rows()) runs
    its leading rows through the kernel in chunks of PREFILL_CHUNK (causal over the slots before
    each), then the draft as usual: every prompt row's keys and values in the drafter's cache are
    the torch ops' (the whole prompt in one pass) to rounding, and so is the draft: the chain's
    tokens, the tree node for node."""
    P = cpu_kernel.max_rows() + 2 * PREFILL_CHUNK + 9  # two chunks, then a last call of max_rows() - 119
    _, target, model = tiny(warm=True, initializer_range=0.05, max_position_embeddings=P + 64)
    prompt = torch.randint(0, 256, (P,), generator=torch.Generator().manual_seed(3))
    drafts = []
    for kernel in (True, False):
        d = Eagle3Drafter(model, target, tree_budget=budget, top_k=3, cpu_bf16=False)  # fp32: to rounding
        if not kernel:
            d.kernel = None  # the torch ops: the whole prompt in one pass
        calls: list[int] = []
        d._run = lambda t, *a, calls=calls, run=d._run, **kw: calls.append(t.shape[0]) or run(t, *a, **kw)
        target.setup_cache(1, P + 16)
        prefill = target.prefill(prompt[None], logits_to_keep=1, taps=d.hidden_layers)
        ids = torch.cat([prompt, prefill.logits[0, -1].argmax().view(1)])
        d.start(prompt, P + 16)
        d.observe(prefill.hidden[0])
        drafts.append((d.draft(ids, 3, Sampler()), calls, d.kv[:, :, :P].clone()))
    (fused, chunks, fused_kv), (ops, _, ops_kv) = drafts
    assert chunks[:2] == [PREFILL_CHUNK, PREFILL_CHUNK]  # then the rest in one call (the tree's, or the chain's)
    torch.testing.assert_close(fused_kv, ops_kv, rtol=1e-5, atol=1e-5)  # every prompt row's keys and values
    assert torch.equal(fused.tokens, ops.tokens) and fused.tree == ops.tree
    assert len(fused.tokens) == (budget or 3)


@pytest.mark.parametrize("budget", [0, 8])
@torch.no_grad()
def test_draft_best_is_the_best_nodes_of_the_whole_tree(budget):
    """draft_best(k), what LookupFirst merges: the k nodes of highest path score among all the full
    tree's candidates (its levels stop at depth k, which the best k cannot pass), as the full tree's
    own choice of k would be; for a chain drafter, the greedy chain's first k tokens (asked while
    sampling: deterministic all the same)."""
    _, target, model = tiny(warm=True, initializer_range=0.05)
    prompt = torch.arange(7, 19)
    drafter = Eagle3Drafter(model, target, tree_budget=budget, top_k=3)
    ops = Eagle3Drafter(model, target, tree_budget=budget, top_k=3)
    ops.kernel = None  # the torch ops: every candidate node passes through _best
    nodes, real_best = [], ops._best
    ops._best = lambda *a: nodes.append(a) or real_best(*a)
    full = drafted_logits(ops, target, prompt, gamma=3)[2]
    for k in (1, 2, 3, 5):
        for d in (drafter, ops):  # the kernel's one call (where it is built), the torch ops
            best = drafted_logits(d, target, prompt, gamma=3, best=k)[2]
            if not budget:
                assert torch.equal(best.tokens, full.tokens[: min(k, 3)]) and best.tree is None and best.probs is None
                continue
            want = real_best(*nodes[0][:4], k)  # the full tree's candidates, k of them kept
            assert best.tree == want.tree and torch.equal(best.tokens, want.tokens) and len(best.tree) == k
            assert best.tree.depth <= k


@torch.no_grad()
def test_a_trees_second_level_is_what_the_training_module_ranks_after_each_first_level_node():
    """Each first-level node's children in an EAGLE-2 tree are the drafter's top choices after that
    node's token (naive_logits on the sequence continued by it): the level's rows read their tokens
    as the target's ids, with a draft vocabulary whose ids are not the target's."""
    hf, target, model = tiny(warm=True, initializer_range=0.05)
    model.fc.weight.zero_()  # no feature: each row's choices follow its token (and the rows before it)
    assert not torch.equal(model.draft_ids, torch.arange(model.config.draft_vocab_size))
    prompt = torch.arange(7, 19)
    P, K = len(prompt), 3
    _, ids, tree = drafted_logits(Eagle3Drafter(model, target, tree_budget=16, top_k=K), target, prompt, gamma=3)
    node = {p: int(t) for p, t in zip(tree.tree.paths, tree.tokens)}
    checked = 0
    for (i,), token in [(p, t) for p, t in node.items() if len(p) == 1]:
        seq = torch.cat([ids, torch.tensor([token])])[None]
        taps = target_states(AUX)(hf, seq, torch.ones_like(seq))["taps"]
        ranked = model.draft_ids[
            naive_logits(model, hf.get_input_embeddings().weight, taps, seq, 2)[(1, P - 1)].topk(K).indices
        ]
        for r, child in [(p[1], t) for p, t in node.items() if len(p) == 2 and p[0] == i]:
            assert child == int(ranked[r]), (i, r)
            checked += 1
    assert checked >= 3


@torch.no_grad()
def test_a_chain_with_a_draft_exit_stops_right_after_its_first_unsure_token():
    """confidence: the chain is the one drafted without it, cut right after the first token whose
    draft probability (softmax of the logits it was drafted from) is below the threshold; greedy
    generation with it is still the target's own output."""
    hf, target, model = tiny(warm=True, initializer_range=0.05)
    prompt = torch.arange(7, 19)
    logits, _, full = drafted_logits(Eagle3Drafter(model, target), target, prompt, gamma=6)
    conf = [float(x.float().softmax(-1).max()) for x in logits]
    threshold = sorted(conf)[len(conf) // 2]  # some tokens below it, some not
    stop = next(i for i, c in enumerate(conf) if c < threshold)
    _, _, cut = drafted_logits(Eagle3Drafter(model, target, confidence=threshold), target, prompt, gamma=6)
    assert 0 < stop + 1 < 6 and torch.equal(cut.tokens, full.tokens[: stop + 1])

    ar = generate(target, [5, 9, 11, 2, 7, 3, 9, 11], None, max_new_tokens=48)
    spec = generate(target, [5, 9, 11, 2, 7, 3, 9, 11], Eagle3Drafter(model, target, confidence=0.3),
                    max_new_tokens=48, gamma=6)  # fmt: skip
    assert spec.tokens == ar.tokens and spec.stats.drafted > 0
    with pytest.raises(SpecdecError, match="--tree chain"):
        Eagle3Drafter(model, target, tree_budget=4, confidence=0.3)


@pytest.mark.parametrize("budget", [0, 6, 16])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_speculative_output_equals_the_targets(budget, kind):
    hf, target, model = tiny()
    if kind != "llama":  # a target with qkv biases (qwen2) or q/k norms (qwen3): a plain drafter layer
        hf = tiny_hf_model(kind, 0, num_hidden_layers=4)
        target = runtime_from_hf(hf)
        cfg = Eagle3Config.for_target(target.config, aux_layers=AUX, draft_vocab_size=200)
        model = Eagle3Model(cfg).eval()
        model.set_draft_vocab(torch.arange(200))
    prompt = [5, 9, 11, 2, 7, 3, 9, 11]
    ar = generate(target, prompt, None, max_new_tokens=48)
    drafter = Eagle3Drafter(model, target, tree_budget=budget, top_k=3)
    spec = generate(target, prompt, drafter, max_new_tokens=48, gamma=4)
    assert spec.tokens == ar.tokens and spec.stats.drafted > 0
    if budget:  # trees of the budget's size, up to gamma deep
        assert spec.stats.drafted_at[0] == spec.stats.rounds_with_draft and len(spec.stats.drafted_at) <= 4


# The on-device tree's variant emulates its captured steps on a CPU (~40 s, which kept the default run
# past 10 minutes): -m slow. By default its nodes are checked against the host tree's, round by
# round (test_device_drafts_are_the_host_drafts_round_by_round below).
ON_DEVICE = pytest.param(5, 0.0, True, marks=pytest.mark.slow)


@pytest.mark.parametrize("budget, confidence, on_device", [(0, 0.0, False), (5, 0.0, False), (0, 0.34, False),
                                                          ON_DEVICE])  # fmt: skip
def test_sampled_output_follows_the_targets_exact_distribution(budget, confidence, on_device):
    """Four sampled tokens (top-k 3), the last three through drafts: the joint of the output equals
    the target's, enumerated exactly (chi-square), with a chain drafter (rejection sampling), a
    tree (multi-candidate), chains that stop after a sampled token below a draft probability, and a
    tree drafted on the device (tree.DeviceTree, verified by the same rule)."""
    from tests.conftest import assert_sequences_follow, sequence_joint

    hf, target, model = tiny(warm=True, initializer_range=0.05)
    prompt, w = [3, 1, 4], dict(temperature=1.0, top_k=3)

    def next_logits(ids: list[int]) -> torch.Tensor:
        target.setup_cache(1, 8)
        return target.prefill(torch.tensor([ids])).logits[0, -1]

    joint = sequence_joint(next_logits, prompt, 4, **w)
    drafter = Eagle3Drafter(model, target, tree_budget=budget, top_k=2, confidence=confidence, on_device=on_device)
    exits, stop = [], drafter.draft_exit.stop if confidence else None
    if confidence:
        drafter.draft_exit.stop = lambda p: exits.append(stop(p)) or exits[-1]
    samples, drafted = [], 0
    for seed in range(3000):
        out = generate(target, prompt, drafter, Sampler(**w, seed=seed), max_new_tokens=4, gamma=2)
        samples.append(out.tokens)
        drafted += out.stats.drafted
    assert drafted > 3000 and (not confidence or 0 < sum(exits) < len(exits))
    assert_sequences_follow(samples, joint)


def test_speculators_format_names_shapes_dtypes_and_round_trip(tmp_path):
    _, target, model = tiny()
    H, N, V = 64, 200, 256
    drafting = {"gamma": 4, "tree_budget": 8, "top_k": 3}
    arch = ["LlamaForCausalLM"]
    folder = save_speculators(
        model,
        tmp_path / "e3",
        verifier="org/target",
        verifier_architectures=arch,
        drafting=drafting,
        sglang_dtype="bfloat16",
    )
    from safetensors.torch import load_file

    sd = load_file(str(folder / "model.safetensors"))
    heads, kv = target.config.num_heads * 16, target.config.num_kv_heads * 16
    expected = {  # the speculators EAGLE-3 checkpoint (vLLM's llama_eagle3 / speculators' Eagle3 model)
        "fc.weight": ((H, 3 * H), torch.float32),
        "layers.0.self_attn.q_proj.weight": ((heads, 2 * H), torch.float32),
        "layers.0.self_attn.k_proj.weight": ((kv, 2 * H), torch.float32),
        "layers.0.self_attn.v_proj.weight": ((kv, 2 * H), torch.float32),
        "layers.0.self_attn.o_proj.weight": ((H, heads), torch.float32),
        "layers.0.mlp.gate_proj.weight": ((128, H), torch.float32),
        "layers.0.mlp.up_proj.weight": ((128, H), torch.float32),
        "layers.0.mlp.down_proj.weight": ((H, 128), torch.float32),
        "layers.0.hidden_norm.weight": ((H,), torch.float32),
        "layers.0.input_layernorm.weight": ((H,), torch.float32),
        "layers.0.post_attention_layernorm.weight": ((H,), torch.float32),
        "norm.weight": ((H,), torch.float32),
        "lm_head.weight": ((N, H), torch.float32),
        "d2t": ((N,), torch.int64),
        "t2d": ((V,), torch.bool),
    }
    assert {k: (tuple(v.shape), v.dtype) for k, v in sd.items()} == expected
    ids = model.draft_ids
    assert torch.equal(torch.arange(N) + sd["d2t"], ids) and torch.equal(sd["t2d"].nonzero().flatten(), ids)
    c = json.loads((folder / "config.json").read_text())
    assert c["speculators_model_type"] == "eagle3" and c["draft_vocab_size"] == N and c["target_hidden_size"] is None
    assert c["architectures"] == ["Eagle3DraftModel"] and c["norm_before_residual"] is False
    assert not (c["norm_before_fc"] or c["fc_norm"] or c["norm_output"])
    assert c["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    s = c["speculators_config"]
    assert s["algorithm"] == "eagle3" and s["verifier"] == {
        "name_or_path": "org/target",
        "architectures": ["LlamaForCausalLM"],
    }
    assert s["proposal_methods"][0]["speculative_tokens"] == 4 and s["default_proposal_method"] == "greedy"
    t = c["transformer_layer_config"]
    assert (t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]) == (H, 1, V)
    assert is_eagle3_folder(folder)
    # SGLang's flat layout: midlayer.* names, id j the output of layer j (SGLang taps j + 1), its serving dtype
    sg = json.loads((folder / "sglang" / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["draft_vocab_size"] == N
    assert sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and sg["num_hidden_layers"] == 1
    assert sg["torch_dtype"] == "bfloat16" and c["dtype"] == "float32"
    flat = load_file(str(folder / "sglang" / "model.safetensors"))
    assert set(flat) == {k.replace("layers.0.", "midlayer.") for k in expected}
    loaded, drafting = read_speculators(folder)
    assert drafting == {"gamma": 4, "tree_budget": 8, "top_k": 3}
    x, f = torch.randn(1, 5, H), torch.randn(1, 5, 3 * H)

    def causal(q, k, v):
        return F.scaled_dot_product_attention(q, grouped(k, q.shape[1]), grouped(v, q.shape[1]), is_causal=True)

    with torch.no_grad():
        a = model.step(x, model.project(f), torch.arange(5), causal)
        b = loaded.step(x, loaded.project(f), torch.arange(5), causal)
    torch.testing.assert_close(b[1], a[1], rtol=0, atol=0)


def test_bad_aux_layers_and_draft_vocabularies_are_refused():
    _, target, _ = tiny()
    for aux in [(1, 2, 4), (3, 2, 1), (1, 2, 2)]:  # past the target; the taps arrive in layer order; twice
        with pytest.raises(SpecdecError, match=rf"aux layers \[{', '.join(map(str, aux))}\]: give 3 ascending"):
            Eagle3Config.for_target(target.config, aux_layers=aux, draft_vocab_size=10)
    assert Eagle3Config.for_target(target.config, aux_layers=None, draft_vocab_size=10).aux_layers == (1, 2, 3)
    with pytest.raises(SpecdecError, match="at least 4 layers"):
        Eagle3Config.for_target(replace(target.config, num_layers=3), aux_layers=None, draft_vocab_size=10)
    with pytest.raises(SpecdecError, match=r"draft vocabulary of 300 tokens: need 1..256"):
        Eagle3Config.for_target(target.config, aux_layers=AUX, draft_vocab_size=300)
    _, _, model = tiny()
    vocab = model.config.draft_vocab_size
    with pytest.raises(SpecdecError, match=rf"1 <= top_k <= the draft vocabulary \({vocab}\); got 8, {vocab + 1}"):
        Eagle3Drafter(model, target, tree_budget=8, top_k=vocab + 1)  # a tree can try no more children


class Recording(Eagle3Drafter):
    """An Eagle3Drafter that keeps each draft it made, with the sequence it drafted after."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls = []

    def draft(self, ids, gamma, sampler):
        rounds = len(self.pending)  # the target forwards whose features it has not run yet
        out = super().draft(ids, gamma, sampler)
        self.calls.append((ids.clone(), gamma, out.tokens.clone(), rounds))
        return out


def test_lookup_first_is_lossless_and_the_drafter_catches_up_on_the_rounds_it_missed():
    """LookupFirst drafts by prompt lookup where the last 2-3 tokens occurred before, by EAGLE-3
    elsewhere: greedy output equals the target's, both kinds of rounds happen, and every EAGLE-3
    draft made after rounds it missed equals a fresh drafter's given the whole sequence at once."""
    from specdec_runtime.drafters.lookup import LookupFirst

    hf, target, model = tiny(warm=True, vocab=24, draft_vocab=20)  # a small vocabulary: its output repeats itself
    prompt = [5, 9, 11, 2, 7, 3, 9, 11, 2, 7, 5, 9, 11]
    ar = generate(target, prompt, None, max_new_tokens=40)
    inner = Recording(model, target)
    drafter = LookupFirst(inner, merge=0)  # (merged rounds draft too: below)
    spec = generate(target, prompt, drafter, max_new_tokens=40, gamma=3)
    assert spec.tokens == ar.tokens
    assert drafter.lookups > 0 and drafter.name == "eagle3+lookup"
    assert max(c[3] for c in inner.calls) > 1  # some drafts came after lookup rounds
    fresh = Eagle3Drafter(model, target)
    caught_up = 0
    for ids, gamma, tokens, _ in inner.calls:
        L = ids.shape[0]
        target.setup_cache(1, L + 8)
        taps = target.prefill(ids[None, : L - 1], taps=AUX).hidden[0]  # the features of every verified position
        fresh.start(ids[: len(prompt)], L + 8)
        fresh.observe(taps)
        assert fresh.draft(ids, gamma, Sampler()).tokens.tolist() == tokens.tolist()
        caught_up += 1
    assert caught_up == len(inner.calls)


@pytest.mark.parametrize("budget", [0, 6])
def test_lookups_merged_with_the_drafters_best_nodes_are_lossless(budget):
    """LookupFirst over EAGLE-3 trees and chains (merge: 2 by default): every lookup round also verifies the
    drafter's 2 best nodes in one tree with the lookup's chain; greedy output equals the target's."""
    from specdec_runtime.drafters.lookup import LookupFirst

    hf, target, model = tiny(warm=True, vocab=24, draft_vocab=20)
    prompt = [5, 9, 11, 2, 7, 3, 9, 11, 2, 7, 5, 9, 11]
    ar = generate(target, prompt, None, max_new_tokens=40)
    inner = Eagle3Drafter(model, target, tree_budget=budget, top_k=3)
    merged = []
    real = inner.draft_best
    inner.draft_best = lambda *a: merged.append(real(*a)) or merged[-1]
    drafter = LookupFirst(inner)  # merge: the drafter's lookup_merge
    spec = generate(target, prompt, drafter, max_new_tokens=40, gamma=3)
    assert spec.tokens == ar.tokens
    assert drafter.lookups == len(merged) > 0 and all(len(d.tokens) == 2 for d in merged)


# ---------------------------------------------------------------- on the device (fixed shapes, captured steps)


def node_paths(draft) -> list[tuple]:
    """A draft's nodes as the target ids on the path from the root, sorted (a chain: its prefixes);
    a tree's with each node's rank among its siblings and the paths of its ancestors and of its
    earlier siblings, as its index tensors say (what verification reads: any node order)."""
    tokens = draft.tokens.tolist()
    if draft.tree is None:
        return [tuple(tokens[: i + 1]) for i in range(len(tokens))]
    parent = draft.tree.structure[0]
    paths = [()]
    for i in range(1, len(parent)):
        paths.append(paths[parent[i]] + (tokens[i - 1],))
    t = {k: v.tolist() for k, v in draft.tree.tensors.items()}
    of = lambda row: tuple(sorted(paths[j] for j, on in enumerate(row) if on))  # noqa: E731
    facts = [(paths[i], t["rank"][i], of(t["ancestor"][i]), of(t["earlier"][i])) for i in range(1, len(parent))]
    return sorted(facts)


@pytest.mark.parametrize("budget, top_k, gamma", [(0, 3, 4), (5, 3, 3), (10, 4, 4), (16, 2, 6), (8, 3, 1)])
@torch.no_grad()
def test_device_drafts_are_the_host_drafts_round_by_round(budget, top_k, gamma):
    """on_device (captured steps of fixed shapes, nothing read back): in every round, the same nodes
    (target ids on their paths) as the host's dynamic tree or chain. Each depth is accepted with
    probability 0.7 (forced acceptance, the same draws for both), so the catch-ups have rows of
    every count; the prompt is longer than the largest catch-up step (its leading rows run eagerly).
    The emulated steps raise on any host read (graphs.NoHostReads). Greedy output is the target's."""
    _, target, model = tiny(warm=True, initializer_range=0.05)
    prompt = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    drafts = {}
    for on_device in (False, True):
        d = Eagle3Drafter(model, target, tree_budget=budget, top_k=top_k, on_device=on_device)
        d.kernel, seen, real = None, [], d.draft  # host: the torch ops (the kernel's trees are tested apart)
        # (read at once: a captured step's outputs live until it runs again)
        d.draft = lambda *a, seen=seen, real=real: seen.append(node_paths(x := real(*a))) or x
        out = generate(target, prompt, d, Sampler(seed=0), max_new_tokens=60, gamma=gamma, accept_rate=0.7)
        drafts[on_device] = (out, seen)
        del d.draft
        ar = generate(target, prompt, None, max_new_tokens=40).tokens
        assert generate(target, prompt, d, max_new_tokens=40, gamma=gamma).tokens == ar
    (host, host_nodes), (dev, dev_nodes) = drafts[False], drafts[True]
    assert dev_nodes == host_nodes and len(dev_nodes) == dev.stats.rounds_with_draft
    assert dev.tokens == host.tokens and dev.stats.drafted_at == host.stats.drafted_at
    assert dev.stats.accepted_at == host.stats.accepted_at and dev.stats.accepted_at[0] > 5


@torch.no_grad()
def test_forced_acceptance_accepts_each_depth_with_the_rate_given():
    """generate(accept_rate=P), for measuring mechanics: P = 0 accepts nothing (tau 1), P = 1 a whole
    chain each round, and in between the mean accepted length of a chain of g is sum_{d<=g} P^d;
    a rate outside [0, 1] is refused."""
    _, target, model = tiny(warm=True, initializer_range=0.05)
    prompt = [5, 9, 11, 2, 7, 3, 9, 11]
    for budget in (0, 8):
        d = Eagle3Drafter(model, target, tree_budget=budget, top_k=3, on_device=True)
        assert generate(target, prompt, d, max_new_tokens=30, gamma=4, accept_rate=0.0).stats.tau == 1.0
        full = generate(target, prompt, d, max_new_tokens=31, gamma=4, accept_rate=1.0).stats
        assert full.accepted_at[0] == full.rounds_with_draft  # every round accepts its first depth at least
        if not budget:  # the prefill's token, then 6 rounds of 4 drafts + 1
            assert full.accepted_at == full.drafted_at == [6] * 4 and full.tau == 31 / 7
    chain = Eagle3Drafter(model, target, on_device=True)
    runs = [generate(target, prompt, chain, Sampler(seed=s), max_new_tokens=61, gamma=2, accept_rate=0.6).stats
            for s in range(40)]  # fmt: skip
    mean = sum(sum(r.accepted_at) for r in runs) / sum(r.rounds_with_draft for r in runs)  # ~1000 rounds
    assert abs(mean - (0.6 + 0.6**2)) < 0.07  # 0.96; the standard error is ~0.025
    with pytest.raises(SpecdecError, match="accept_rate"):
        generate(target, prompt, chain, max_new_tokens=4, accept_rate=1.5)
