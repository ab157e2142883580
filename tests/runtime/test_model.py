"""The runtime decoder against transformers on the same weights (the oracle that keeps it honest)."""

import copy

import pytest
import torch

from specdec_runtime import layers
from specdec_runtime.config import DecoderConfig
from specdec_runtime.cpu import kernel as cpu_kernel
from specdec_runtime.errors import SpecdecError
from specdec_runtime.graphs import HostRead, NoHostReads
from specdec_runtime.layers import rms_norm
from specdec_runtime.model import Decoder, LayerSkip
from tests.conftest import runtime_from_hf, tiny_hf_config, tiny_hf_model

ATOL = 2e-5  # fp32: logits of the tiny models are O(1..10)

FAMILIES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32}),  # q/k norms; head_dim 32 where hidden / heads is 16
    "qwen3-moe": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),  # a dense layer between
    "mistral-window": ("mistral", {"sliding_window": 8}),
}


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_logits_match_transformers(family):
    kind, over = FAMILIES[family]
    hf = tiny_hf_model(kind, seed=1, **over)
    model = runtime_from_hf(hf)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    model.setup_cache(batch=2, size=32)
    ours = model(ids, 0).logits
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3-moe"])
def test_greedy_output_equals_transformers_greedy(family):
    """generate() on the runtime's decoder writes what transformers' greedy generate writes."""
    from specdec_runtime.generate import generate

    kind, over = FAMILIES[family]
    hf = tiny_hf_model(kind, seed=4, **over)
    hf.generation_config.eos_token_id = None  # neither side stops early
    prompt = [5, 9, 11, 2, 7, 3]
    ours = generate(runtime_from_hf(hf), prompt, max_new_tokens=32).tokens
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert ours == theirs[0, len(prompt) :].tolist()


def test_attention_output_in_another_memory_layout(monkeypatch):
    """CUDA's memory-efficient attention returns [B, heads, T, D] laid out as [B, T, heads, D]
    (seen on an H100 in fp32: a view of it failed). The same values in that layout give the same
    logits, on a CPU, whose kernels return it contiguous."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def transposed_layout(*args, **kwargs):
        out = sdpa(*args, **kwargs)  # [B, Hkv, group * T, D]
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    hf = tiny_hf_model("llama", seed=1)
    model = runtime_from_hf(hf)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    model.setup_cache(batch=2, size=32)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", transposed_layout)
    torch.testing.assert_close(model(ids, 0).logits, hf_logits(hf, ids), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3-moe", "mistral-window", "llama3-rope"])
def test_incremental_decoding_matches_full_forward(family):
    """Prefill part of a sequence, then feed the rest in chunks of 1-3 tokens: same logits."""
    kind, over = FAMILIES[family]
    hf = tiny_hf_model(kind, seed=2, **over)
    model = runtime_from_hf(hf)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    full = hf_logits(hf, ids)
    model.setup_cache(1, 30)
    pieces = [model(ids[:, :10], 0).logits]
    pos = 10
    for step in (1, 3, 2, 1, 1, 3, 2, 1, 3, 1, 2):
        pieces.append(model(ids[:, pos : pos + step], pos).logits)
        pos += step
    assert pos == 30
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=ATOL, rtol=1e-5)


def test_logits_to_keep_and_taps():
    """taps=(0, 1, 2): the residual streams after 0, 1 and 2 layers at every position, as
    transformers' hidden_states (whose last entry has the final norm applied)."""
    hf = tiny_hf_model("llama", seed=3)
    model = runtime_from_hf(hf)
    ids = torch.randint(0, 256, (1, 12))
    model.setup_cache(1, 12)
    out = model(ids, 0, logits_to_keep=3, taps=(0, 1, 2))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits[:, -3:], atol=ATOL, rtol=1e-5)
    embeds, first, last = out.hidden.split(64, dim=-1)
    torch.testing.assert_close(embeds, ref.hidden_states[0], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(first, ref.hidden_states[1], atol=ATOL, rtol=1e-5)
    normed = rms_norm(last, model.norm, model.config.rms_norm_eps)
    torch.testing.assert_close(normed, ref.hidden_states[2], atol=ATOL, rtol=1e-5)
    bare = model(ids[:, -1:], 11, taps=(1,), head=False)
    assert bare.logits is None and torch.equal(bare.hidden, model(ids[:, -1:], 11, taps=(1,)).hidden)


def test_exit_layer_equals_transformers_hidden_state_through_norm_and_head():
    hf = tiny_hf_model("llama", seed=4, num_hidden_layers=4)
    model = runtime_from_hf(hf)
    ids = torch.randint(0, 256, (1, 16))
    model.setup_cache(1, 16)
    with torch.no_grad():
        h2 = hf(ids, output_hidden_states=True).hidden_states[2]  # after 2 layers, before the norm
        expected = hf.lm_head(hf.model.norm(h2))
    torch.testing.assert_close(model(ids, 0, exit_layer=2).logits, expected, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("skip", [LayerSkip(attn={1}), LayerSkip(mlp={0, 2}), LayerSkip(attn={0, 3}, mlp={1, 3})])
def test_skipped_sublayers_equal_a_model_without_them(skip):
    """Oracle: transformers with the skipped sublayers' output projections zeroed (their output is 0)."""
    hf = tiny_hf_model("qwen2", seed=5, num_hidden_layers=4)
    naive = copy.deepcopy(hf)
    with torch.no_grad():
        for i in skip.attn:
            naive.model.layers[i].self_attn.o_proj.weight.zero_()
        for i in skip.mlp:
            naive.model.layers[i].mlp.down_proj.weight.zero_()
    model = runtime_from_hf(hf)
    ids = torch.randint(0, 256, (1, 20))
    model.setup_cache(1, 20)
    torch.testing.assert_close(model(ids, 0, skip=skip).logits, hf_logits(naive, ids), atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(model(ids, 0).logits, hf_logits(hf, ids), atol=ATOL, rtol=1e-5)  # skip is per call


def test_tree_attention_equals_each_branch_decoded_alone():
    """A token tree verified in one forward gives every node the logits of its root path."""
    hf = tiny_hf_model("llama", seed=6)
    model = runtime_from_hf(hf)
    prefix = torch.randint(0, 256, (1, 9))
    #        node: 0   1   2   3   4   5      parents: -1, 0, 0, 1, 1, 2
    tree = torch.tensor([[11, 22, 33, 44, 55, 66]])
    parents = [-1, 0, 0, 1, 1, 2]
    depth, mask = [], torch.zeros(6, 6, dtype=torch.bool)
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    start = prefix.shape[1]
    model.setup_cache(1, 32)
    model(prefix, 0)
    tree_logits = model(tree, start, tree=(torch.tensor(depth), mask)).logits[0]
    for i in range(6):
        path = [j for j in range(6) if mask[i, j]]  # root path, ancestors first (indices ascend)
        seq = torch.cat([prefix, tree[:, path]], dim=1)
        torch.testing.assert_close(tree_logits[i], hf_logits(hf, seq)[0, -1], atol=ATOL, rtol=1e-5)


def test_cache_move_keeps_an_accepted_tree_path():
    """After verifying a tree, moving the accepted path's slots makes the cache a plain prefill."""
    hf = tiny_hf_model("qwen2", seed=7)
    model = runtime_from_hf(hf)
    prefix = torch.randint(0, 256, (1, 7))
    tree = torch.tensor([[5, 6, 7, 8]])  # node 0 root; 1, 2 children of 0; 3 child of 2
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    model.setup_cache(1, 16)
    model(prefix, 0)
    model(tree, 7, tree=(torch.tensor([0, 1, 1, 2]), mask))
    model.cache.move(torch.tensor([7 + 0, 7 + 2, 7 + 3]), 7)  # keep path 0 -> 2 -> 3
    after = model(torch.tensor([[9]]), 10).logits[0, -1]
    expected = hf_logits(hf, torch.cat([prefix, torch.tensor([[5, 7, 8, 9]])], dim=1))[0, -1]
    torch.testing.assert_close(after, expected, atol=ATOL, rtol=1e-5)


def test_bundled_model_matches_transformers(bundled, bundled_hf):
    ids = bundled.tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
    model = bundled.model
    model.setup_cache(1, 64)
    ours = model(ids, 0).logits
    ref = hf_logits(bundled_hf, ids)
    assert ours.shape == ref.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize(
    "kind, over, message",
    [
        (
            "llama",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
            "rope type 'yarn'",
        ),
        ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_unsupported_config_is_refused_clearly(kind, over, message):
    with pytest.raises(SpecdecError, match=message):
        DecoderConfig.from_hf(tiny_hf_config(kind, **over))


def test_unsupported_model_type_names_the_supported_ones():
    from transformers import GPT2Config

    with pytest.raises(SpecdecError, match="model_type .gpt2. is not supported.*qwen2, qwen3, qwen3_moe"):
        DecoderConfig.from_hf(GPT2Config())


@pytest.mark.parametrize("dtype, rel", [(torch.bfloat16, 0.03), (torch.float16, 0.005)])
def test_half_precision_tracks_transformers_in_the_same_dtype(dtype, rel):
    """Same weights in bf16/fp16 on both sides, torch's ops: differences stay at rounding level,
    argmax agrees. (With the CPU kernel a bf16 model computes in fp32: test_cpu_kernel.py.)"""
    hf = tiny_hf_model("qwen2", seed=1).to(dtype)
    with cpu_kernel.disabled():
        model = Decoder.from_hf_state_dict(DecoderConfig.from_hf(hf.config), hf.state_dict(), dtype=dtype)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    model.setup_cache(1, 20)
    ours, ref = model(ids, 0).logits.float(), hf_logits(hf, ids).float()
    assert ours.dtype == torch.float32 and model.dtype == dtype
    assert (ours - ref).abs().max() <= rel * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_a_decode_step_reads_only_the_experts_its_token_chose():
    """One token's step (1 x top-2 <= 8 experts) gathers its 2 experts' weights: every other
    expert's weights set to NaN change nothing (a dense pass over all experts would be NaN)."""
    hf = tiny_hf_model("qwen3_moe", seed=5, num_hidden_layers=2)
    model = runtime_from_hf(hf)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    model.setup_cache(1, 10)
    model(ids[:, :8], 0)
    want = model(ids[:, 8:], 8).logits
    picked = {}  # the experts each layer's router chooses for this token, seen in the same forward
    layers = model.layers
    originals = [layer.feed_forward for layer in layers]
    for i, layer in enumerate(layers):

        def spy(x, ffn=None, i=i, layer=layer):
            h = rms_norm(x, layer.mlp_norm, layer.eps)
            picked[i] = set((h @ layer.router.weight).topk(layer.top_k, dim=-1).indices.flatten().tolist())
            return originals[i](x)

        layer.feed_forward = spy
    model(ids[:, 8:], 8)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            layer.feed_forward = originals[i]
            for e in set(range(8)) - picked[i]:
                layer.experts_gate_up[e] = float("nan")
                layer.experts_down[e] = float("nan")
    assert all(len(p) == 2 for p in picked.values())
    torch.testing.assert_close(model(ids[:, 8:], 8).logits, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_more_rows_than_experts_go_to_grouped_products_without_a_host_read(monkeypatch, dtype):
    """A forward of more rows than experts over top-k (a prefill, a batch's verify: 3 x 9 x top-2 >
    8 experts) sorts its (row, expert) pairs into torch's grouped products (CUDA's bf16 ones in use,
    the CPU's here): nothing read on the host (graphs.NoHostReads, which refuses the expert-by-expert
    loop's read), and the logits equal that loop's."""
    monkeypatch.setattr(layers, "GROUPED_DTYPES", {"cpu": (torch.float32, torch.bfloat16)})
    grouped, calls = layers.experts_grouped, []
    monkeypatch.setattr(layers, "experts_grouped", lambda *a: calls.append(1) or grouped(*a))
    hf = tiny_hf_model("qwen3_moe", seed=5, num_hidden_layers=2)
    model = runtime_from_hf(hf).to("cpu", dtype)
    ids = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(2))
    model.setup_cache(3, 9)
    with NoHostReads():
        got = model(ids, 0).logits
    assert len(calls) == 2  # (a layer each)
    monkeypatch.setattr(layers, "grouped_product", lambda *tensors: None)
    with pytest.raises(HostRead), NoHostReads():
        model(ids, 0)
    want = model(ids, 0).logits
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(got, want, **tol)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= (1.0 if dtype == torch.float32 else 0.9)


@pytest.mark.gpu
def test_cuda_grouped_experts_read_nothing_on_the_host_and_equal_the_loop(monkeypatch):
    """layers.moe of 40 and 2,048 rows x top-8 > 128 experts (Qwen3-30B-A3B's router) in bf16 on CUDA:
    torch's grouped products under CUDA's sync check set to error, their output the expert-by-expert
    loop's."""
    torch.manual_seed(0)
    E, H, I, k = 128, 256, 64, 8  # noqa: E741
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    norm, router = torch.ones(2 * H, **cuda), layers.Weights(torch.randn(H, E, **cuda) / H**0.5)
    gate_up, down = torch.randn(E, H, 2 * I, **cuda) / H**0.5, torch.randn(E, I, H, **cuda) / I**0.5
    assert layers.grouped_product(norm[None, :H], gate_up, down) is not None
    for N in (40, 2048):  # a batch's verify; a prefill (16k pairs: another of torch's sorts)
        args = (torch.randn(N, H, **cuda), norm, router, gate_up, down, k, True, 1e-6)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = layers.moe(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        with monkeypatch.context() as m:
            m.setattr(layers, "grouped_product", lambda *tensors: None)
            torch.testing.assert_close(got, layers.moe(*args), atol=0.05, rtol=0.02)
