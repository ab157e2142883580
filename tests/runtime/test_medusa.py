"""Medusa heads in the runtime: losslessness, the KV cache after tree rounds, the two layouts, the CLI."""

import json

import pytest
import torch

from specdec_runtime.cli import main
from specdec_runtime.drafters.medusa import (
    MedusaDrafter,
    MedusaHeads,
    load_medusa,
    read_layout,
    to_layout,
    tree_from_spec,
    write_layout,
)
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.loading import load_model
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree
from tests.conftest import assert_cache_is_a_fresh_prefill, runtime_from_hf, save_tiny_model, tiny_hf_model

PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]


def random_heads(hidden: int, vocab: int, num_heads: int = 3, num_layers: int = 1, seed: int = 0, **kw) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(hidden, vocab, num_heads, num_layers, **kw)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return heads.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("paths", [PATHS, "chain"])
def test_random_heads_greedy_equals_target_greedy(kind, paths):
    target = runtime_from_hf(tiny_hf_model(kind, seed=0, num_hidden_layers=3))
    tree = Tree.chain(3) if paths == "chain" else Tree.from_paths(paths)
    drafter = MedusaDrafter(random_heads(64, 256), target, tree)
    prompt = [1, 2, 3, 4, 5]
    ar = generate(target, prompt, None, max_new_tokens=40)
    spec = generate(target, prompt, drafter, max_new_tokens=40, gamma=3)
    assert spec.tokens == ar.tokens
    assert spec.stats.drafted_at[0] == spec.stats.rounds_with_draft > 0


def test_kv_cache_after_tree_rounds_equals_a_fresh_prefill():
    """Sampling with a wide tree: branches are accepted and rejected, KV entries are moved; the
    cache then equals a prefill of the final sequence."""
    hf = tiny_hf_model("llama", seed=0, num_hidden_layers=3, vocab_size=8)  # small vocabulary: many acceptances
    target = runtime_from_hf(hf)
    heads = random_heads(64, 8)
    drafter = MedusaDrafter(heads, target, Tree.from_paths(PATHS))
    prompt = [1, 2, 3, 4, 5]
    out = generate(target, prompt, drafter, Sampler(1.5, seed=0), max_new_tokens=40, gamma=3)
    assert out.stats.drafted > out.stats.accepted > 0
    assert_cache_is_a_fresh_prefill(target, hf, prompt + out.tokens)


def test_tree_accepts_more_than_its_chain_with_informative_heads():
    """With 8 tokens, random heads are sometimes right; a tree's second and third candidates add
    acceptances that its top-1 chain misses (greedy output unchanged)."""
    target = runtime_from_hf(tiny_hf_model("llama", seed=0, num_hidden_layers=3, vocab_size=8))
    heads = random_heads(64, 8)
    prompt = [1, 2, 3, 4, 5]
    ar = generate(target, prompt, None, max_new_tokens=60)
    taus = {}
    for name, tree in (("chain", Tree.chain(3)), ("tree", Tree.from_paths(PATHS))):
        out = generate(target, prompt, MedusaDrafter(heads, target, tree), max_new_tokens=60, gamma=3)
        assert out.tokens == ar.tokens
        taus[name] = out.stats.tau
    assert taus["tree"] > taus["chain"] > 1


@pytest.mark.parametrize("layout", ["faster_decoding", "vllm"])
@pytest.mark.parametrize("share", [False, True])
def test_layouts_round_trip_with_identical_head_logits(layout, share, tmp_path):
    heads = random_heads(64, 256, num_heads=3, num_layers=2, share_lm_head=share)
    lm = torch.randn(256, 64)
    write_layout(heads, tmp_path / layout, layout, "base/model", lm_head_weight=lm if share else None)
    cfg = json.loads((tmp_path / layout / "config.json").read_text())
    if layout == "faster_decoding":
        assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"], cfg["base_model_name_or_path"]) == (
            3,
            2,
            "base/model",
        )
        keys = set(to_layout(heads, layout, lm))
        assert {"0.0.linear.weight", "0.1.linear.bias", "2.2.weight"} <= keys
    else:
        assert cfg["model_type"] == "medusa" and (cfg["num_heads"], cfg["num_hidden_layers"]) == (3, 2)
        assert (cfg["hidden_size"], cfg["vocab_size"]) == (64, 256)
        assert {"blocks.0.layers.1.weight", "blocks.2.layers.0.bias", "lm_heads.2.weight"} <= set(
            to_layout(heads, layout, lm)
        )
    loaded, got_layout = read_layout(tmp_path / layout)
    assert got_layout == layout
    h = torch.randn(5, 64)
    for k in range(3):  # head by head: the same matmul shapes on both sides, so bitwise equal
        expected = heads.head_logits(k, h, lambda x: torch.nn.functional.linear(x, lm))
        torch.testing.assert_close(loaded.head_logits(k, h), expected, atol=0, rtol=0)


def test_load_medusa_shares_copied_lm_heads_and_reads_the_stored_tree(tmp_path):
    hf_dir = save_tiny_model(tmp_path / "target", num_hidden_layers=2)
    target = load_model(str(hf_dir), device="cpu", dtype="float32")
    heads = random_heads(64, target.config.vocab_size, share_lm_head=True)
    lm = target.model.lm_head.weight.t()  # [V, H]
    write_layout(heads, tmp_path / "m", "faster_decoding", str(hf_dir), lm_head_weight=lm)
    (tmp_path / "m" / "medusa_tree.json").write_text(json.dumps({"paths": [[0], [1], [0, 0]]}))
    drafter = load_medusa(tmp_path / "m", target)
    assert drafter.heads.lm_heads is None  # copies of the target's lm_head: shared again at run time
    assert drafter.tree.paths == ((0,), (1,), (0, 0))
    h = torch.randn(64)
    torch.testing.assert_close(drafter.heads(h, drafter.target.lm_head), heads(h, target.model.lm_head))
    assert tree_from_spec("chain", tmp_path / "m", 3) == Tree.chain(3)
    with pytest.raises(SpecdecError, match="no such file"):
        tree_from_spec(str(tmp_path / "missing.json"), tmp_path / "m", 3)


def test_heads_that_do_not_fit_the_target_are_refused():
    target = runtime_from_hf(tiny_hf_model("llama", seed=0))
    with pytest.raises(SpecdecError, match="do not fit the target"):
        MedusaDrafter(random_heads(32, 256), target, Tree.chain(2))
    with pytest.raises(SpecdecError, match="deep"):
        MedusaDrafter(random_heads(64, 256, num_heads=2), target, Tree.chain(3))


def test_cli_generates_with_exported_heads_losslessly(tmp_path, capsys):
    hf_dir = save_tiny_model(tmp_path / "target", num_hidden_layers=3)
    target = load_model(str(hf_dir), device="cpu", dtype="float32")
    heads = random_heads(64, target.config.vocab_size)
    write_layout(heads, tmp_path / "vllm", "vllm", str(hf_dir))
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps([[0], [1], [0, 0]]))
    out_file = tmp_path / "out.jsonl"
    main(["generate", "--target", str(hf_dir), "--drafter", str(tmp_path / "vllm"), "--tree", str(tree),
          "--prompt", "hello there", "--max-new-tokens", "20", "--baseline", "--output", str(out_file)])  # fmt: skip
    table = capsys.readouterr().out
    assert "100%" in table  # lossless column
    assert json.loads(out_file.read_text())["identical_to_baseline"]
    main(["generate", "--target", str(hf_dir), "--drafter", str(tmp_path / "vllm"), "--prompt", "hi",
          "--max-new-tokens", "8", "--temperature", "1", "--typical"])  # fmt: skip
    assert "LOSSY" in capsys.readouterr().out
