"""dry_run=true (recipes/plan.py): the activations it counts are the bytes autograd saves for the
training-time test's backward; the drafter's parameters are the model's; the 8B preset's plan is
made from config.json alone and fits 80 GB; a setting that does not fit is named."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from recipes import eagle3 as recipe
from recipes.plan import eagle3_drafter_params, ttt_activation_bytes
from specdec_runtime.config import DecoderConfig
from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model
from tests.conftest import tiny_hf_model
from train.eagle3 import Eagle3Training

CONF = Path(__file__).resolve().parents[2] / "conf"
LLAMA_3_1_8B = dict(  # meta-llama/Llama-3.1-8B-Instruct's config.json, the fields a plan reads
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072,
    rope_theta=500000.0, rms_norm_eps=1e-5,
)  # fmt: skip


def saved_by_autograd(hf, B: int, T: int, steps: int, N: int, half: bool, checkpoint_steps: bool = False):
    """(bytes the TTT forward keeps for its backward, the parameters it trains), on a CPU: each saved
    tensor's storage counted once, the drafter's own weights left out. With checkpoint_steps, what
    each recomputed step keeps instead of saved tensors (its inputs, its keys and values) is added."""
    cfg = Eagle3Config.for_target(DecoderConfig.from_hf(hf.config), aux_layers=(1, 2, 3), draft_vocab_size=N)
    model = Eagle3Model(cfg)
    model.set_draft_vocab(torch.arange(N))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    embed = hf.get_input_embeddings().weight.detach()
    training = Eagle3Training(
        model, embed, embed[:N].clone(), steps=steps, decay=0.8, checkpoint_steps=checkpoint_steps
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, N, (B, T), generator=g)
    taps, final = torch.randn(B, T, 3 * hf.config.hidden_size), torch.randn(B, T, hf.config.hidden_size)
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    step = training._layer_step

    def recorded(embeds, feature, positions, k, attend):
        out = step(embeds, feature, positions, k, attend)
        for t in (embeds, feature, *attend.keys[k], *attend.values[k], *attend.masks.values()):
            keep(t)
        return out

    if checkpoint_steps:
        training._layer_step = recorded
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            training(ids, torch.ones_like(ids), torch.ones(B, T - 1, dtype=torch.bool), taps, final)
    return sum(saved.values()), sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize(
    "B, T, steps, N",
    [(2, 48, 3, 200), (1, 128, 5, 200), (1, 384, 3, 200), (2, 64, 3, 2000)],
    ids=["rows", "steps", "attention", "logits"],
)
def test_the_activations_counted_are_what_autograd_saves(B, T, steps, N, half):
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    hf = tiny_hf_model("llama", 0, num_hidden_layers=4, vocab_size=max(256, N), **shape)
    saved, params = saved_by_autograd(hf, B, T, steps, N, half)
    counted = ttt_activation_bytes(hf.config, B, T, steps, N, half)
    counted.pop("target_logp")  # held through the forward, not saved for the backward
    assert counted.pop("recomputed") == 0
    assert sum(counted.values()) == pytest.approx(saved, rel=0.1)
    assert eagle3_drafter_params(hf.config, N) == params


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16-autocast"])
def test_checkpointed_steps_keep_what_is_counted(half):
    B, T, steps, N = 2, 96, 4, 200
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    hf = tiny_hf_model("llama", 0, num_hidden_layers=4, vocab_size=256, **shape)
    saved, _ = saved_by_autograd(hf, B, T, steps, N, half, checkpoint_steps=True)
    counted = ttt_activation_bytes(hf.config, B, T, steps, N, half, checkpoint_steps=True)
    plain = ttt_activation_bytes(hf.config, B, T, steps, N, half)
    assert counted["attention"] + counted["rows"] + counted["logits"] == pytest.approx(saved, rel=0.1)
    assert counted["recomputed"] < (plain["attention"] + plain["rows"]) / steps  # one step's, not all


QWEN3_8B = dict(  # Qwen/Qwen3-8B's config.json, the fields a plan reads
    hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6,
)  # fmt: skip


LLAMA_3_1_70B = LLAMA_3_1_8B | dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                    intermediate_size=28672)  # fmt: skip


def plan(tmp_path: Path, *overrides: str, preset: str = "eagle3_llama3_8b", config: dict | None = None):
    """recipes.eagle3's dry run on a folder holding the preset's target's config.json (or `config`)
    and nothing else."""
    from transformers import LlamaConfig, Qwen3Config

    folder = tmp_path / preset
    if config is not None:
        LlamaConfig(**config).save_pretrained(folder)
    elif preset == "eagle3_qwen3_8b":
        Qwen3Config(**QWEN3_8B).save_pretrained(folder)
    else:
        LlamaConfig(**LLAMA_3_1_8B).save_pretrained(folder)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        preset = [f"experiment={preset}", f"model.name={folder}", "dry_run=true", "plan.gpu_memory_gib=80"]
        cfg = compose("eagle3", overrides=[*preset, f"output_dir={tmp_path / 'run'}", *overrides])
    return recipe.run(cfg)["plan"]


@pytest.mark.parametrize("preset, billions", [("eagle3_llama3_8b", 8.03), ("eagle3_qwen3_8b", 8.19)])
def test_the_8b_presets_are_planned_from_config_json_alone_and_fit(tmp_path, capsys, preset, billions):
    result = plan(tmp_path, preset=preset)
    assert not (tmp_path / "run").exists()  # nothing written, no weights read (there are none)
    memory = {what: b / 2**30 for what, b, _ in result.memory}
    assert memory["target (frozen, whole)"] == pytest.approx(billions * 1e9 * 2 / 2**30, rel=0.01)  # in bf16
    assert 40 < result.peak_gib < 70 and result.fits and result.steps == 15000
    out = capsys.readouterr().out
    assert "dry run: recipes.eagle3" in out and "peak per GPU" in out and "fits" in out


def test_a_plan_that_does_not_fit_names_the_setting_to_change(tmp_path):
    result = plan(tmp_path, "trainer.micro_batch=8", "trainer.max_seq_len=4096")
    assert not result.fits
    assert result.advice == [
        "eagle3.checkpoint_steps=true, or lower trainer.micro_batch (raise trainer.grad_accum to keep the batch)"
    ]
    assert (
        plan(tmp_path, "trainer.micro_batch=8", "trainer.max_seq_len=4096", "eagle3.checkpoint_steps=true").peak_gib
        < result.peak_gib
    )


def test_a_70b_target_fits_once_its_layers_are_split_across_8_processes(tmp_path):
    whole = plan(tmp_path / "whole", config=LLAMA_3_1_70B)
    assert not whole.fits and "model.shard=true" in whole.advice[0]
    split = plan(tmp_path / "split", "model.shard=true", "plan.processes=8", "responses.source=dataset",
                 config=LLAMA_3_1_70B)  # fmt: skip
    memory = {what: b / 2**30 for what, b, _ in split.memory}
    layers = 80 * (8192 * (64 + 16) * 128 + 64 * 128 * 8192 + 3 * 8192 * 28672 + 2 * 8192)
    assert memory["target (frozen, layers split)"] == pytest.approx(
        (2 * 128256 * 8192 + 8192 + layers / 8 + layers / 80) * 2 / 2**30, rel=1e-6
    )
    assert split.fits and split.peak_gib < whole.peak_gib - 100


def saved_bytes(fn, *modules: torch.nn.Module) -> int:
    """Bytes of the tensors autograd keeps while fn() runs (each storage once), the modules'
    parameters (and views of them) aside."""
    weights = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fn()
    return sum(saved.values())


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_transformers_decoder_layer_keeps_what_is_counted(half):
    """decoder_activation_bytes (distill's drafter, Medusa-2's target, MTP's model): a layer's
    share, as one more layer changes what autograd keeps in a transformers Llama's training forward."""
    from recipes.plan import decoder_activation_bytes

    B, T = 2, 96
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))

    def kept(layers: int) -> int:
        hf = tiny_hf_model("llama", 0, num_hidden_layers=layers, vocab_size=256, hidden_size=64,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2).train()  # fmt: skip
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            return saved_bytes(lambda: hf(input_ids=ids, labels=ids), hf)

    config = tiny_hf_model("llama", 0, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2).config  # fmt: skip
    assert decoder_activation_bytes(config, B * T, half, layers=1) == pytest.approx(kept(3) - kept(2), rel=0.1)


def test_the_distillation_divergence_keeps_what_is_counted():
    from recipes.plan import DISTILL_LOGITS
    from train import losses

    N, V = 64, 500
    student = torch.randn(N, V, requires_grad=True)
    teacher = losses.Teacher.dense(torch.randn(N, V))
    kept = saved_bytes(lambda: losses.divergence("jsd", student * 1.0, teacher).sum())
    assert DISTILL_LOGITS * N * V * 4 == pytest.approx(kept, rel=0.25)


def dry(tmp_path: Path, recipe: str, *overrides: str):
    """A recipe's dry run on a folder holding Llama-3.1-8B's config.json and nothing else."""
    from transformers import LlamaConfig

    import recipes.distill
    import recipes.layerskip
    import recipes.medusa
    import recipes.mtp

    folder = tmp_path / "llama-8b"
    LlamaConfig(**LLAMA_3_1_8B).save_pretrained(folder)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        base = [f"model.name={folder}", "dry_run=true", "plan.gpu_memory_gib=80", "model.dtype=bfloat16"]
        cfg = compose(recipe, overrides=[*base, f"output_dir={tmp_path / 'run'}", *overrides])
    module = {"distill": recipes.distill, "medusa": recipes.medusa, "mtp": recipes.mtp, "layerskip": recipes.layerskip}
    return module[recipe].run(cfg)["plan"]


@pytest.mark.parametrize(
    "recipe, overrides, fits",
    [
        ("distill", ("trainer.micro_batch=4", "trainer.max_seq_len=2048"), True),
        ("distill", ("trainer.micro_batch=32", "trainer.max_seq_len=4096"), False),
        ("medusa", ("medusa.share_lm_head=true", "trainer.micro_batch=4", "trainer.max_seq_len=2048"), True),
        ("medusa", ("trainer.micro_batch=8", "trainer.max_seq_len=2048"), False),  # 5 heads, each a vocabulary
        ("medusa", ("medusa.mode=medusa2", "trainer.micro_batch=16", "trainer.max_seq_len=4096"), False),
        ("mtp", ("trainer.micro_batch=8", "trainer.max_seq_len=2048"), True),
        ("layerskip", (), True),
    ],
)
def test_every_recipe_plans_from_config_json_alone(tmp_path, capsys, recipe, overrides, fits):
    result = dry(tmp_path, recipe, *overrides)
    assert not (tmp_path / "run").exists()
    assert result.fits == fits and (fits or result.advice)
    out = capsys.readouterr().out
    assert f"dry run: recipes.{recipe}" in out and "peak per GPU" in out
    memory = dict((what, b) for what, b, _ in result.memory)
    if recipe != "mtp":  # mtp pretrains its own model: no frozen target
        assert memory["target (frozen, whole)"] == pytest.approx(8.03e9 * 2, rel=0.01)


def test_the_medusa_heads_keep_what_is_counted():
    """medusa_plan's heads term against what autograd keeps in train.medusa's forward (Medusa-1: the
    frozen target's states given), every position a response token."""
    from recipes.plan import medusa_plan
    from specdec_runtime.drafters.medusa import MedusaHeads
    from train.medusa import MedusaTraining

    B, T, H, V, heads = 2, 64, 64, 256, 3
    target = tiny_hf_model("llama", 0, vocab_size=V, hidden_size=H)
    training = MedusaTraining(target, MedusaHeads(H, V, heads, 1))
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(B, T, H)
    mask = torch.ones(B, T - 1, dtype=torch.bool)
    kept = saved_bytes(lambda: training(ids, torch.ones_like(ids), mask, hidden), training, target)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("medusa", overrides=[f"medusa.num_heads={heads}", "medusa.num_layers=1", "trainer.micro_batch=2",
                                           f"trainer.max_seq_len={T}", "plan.gpu_memory_gib=80"])  # fmt: skip
    counted = dict((what, b) for what, b, _ in medusa_plan(cfg, target.config).memory)["activations: heads"]
    assert counted == pytest.approx(kept, rel=0.15)
