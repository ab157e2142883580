"""conf/accelerate/*.yaml: each file is a valid accelerate config that asks for what its name says,
and the recipes' launcher checks refuse what they do not fit. The configs that run on CPU are run
for real in each recipe's 2-process test (DDP and DeepSpeed); FSDP runs on GPUs only, so here its
plugin is built from the file and its wrap policy applied to the distill recipe's model."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdec_runtime.errors import SpecdecError
from tests.conftest import tiny_hf_model
from train.draft_model import SelectedLogits, drafter_from_target_layers
from train.launch import check_launch, launch_kind

CONFIGS = Path(__file__).resolve().parents[2] / "conf" / "accelerate"

EXPECTED = {  # file: (distributed_type, machines, what else it must say)
    "single_gpu": ("NO", 1, {}),
    "multi_gpu": ("MULTI_GPU", 1, {}),
    "multi_cpu": ("MULTI_GPU", 1, {"num_processes": 2, "mixed_precision": "no", "gpu_ids": "-1,-1"}),
    "multi_node": ("MULTI_GPU", 2, {"main_process_port": 29500}),
    "deepspeed_zero2": ("DEEPSPEED", 1, {"zero_stage": 2, "offload_param_device": "none"}),
    "deepspeed_zero3": ("DEEPSPEED", 1, {"zero_stage": 3, "offload_param_device": "none"}),
    "deepspeed_zero3_offload": ("DEEPSPEED", 1, {"zero_stage": 3, "offload_param_device": "cpu"}),
    "fsdp": ("FSDP", 1, {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}),
}


def load(name: str):
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(CONFIGS / f"{name}.yaml"))


def test_every_config_file_is_listed_here():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_files_load_and_ask_for_what_their_name_says(name):
    cfg = load(name)  # accelerate's own parser: unknown keys or bad values raise
    kind, machines, more = EXPECTED[name]
    assert cfg.distributed_type.value == kind and cfg.num_machines == machines
    flat = {**cfg.to_dict(), **(cfg.deepspeed_config or {}), **(cfg.fsdp_config or {})}
    for key, value in more.items():
        assert flat[key] == value, key
    if machines > 1:
        assert cfg.main_process_ip and cfg.machine_rank == 0 and cfg.num_processes % machines == 0
    if kind == "DEEPSPEED" and more["zero_stage"] == 3:
        assert cfg.deepspeed_config["zero3_init_flag"] is False  # frozen targets load whole


WHERE_AM_I = """
import os, sys, torch
from train.launch import gathered_state_dict, make_accelerator, unwrap
acc = make_accelerator(mixed_precision="no", grad_accum=1, seed=0, log_with=None, project_dir=sys.argv[1],
                       collective_timeout_minutes=77)
group = torch.distributed.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
model = torch.nn.Linear(2, 2)
wrapped = acc.prepare(model)
sd = gathered_state_dict(acc, wrapped)
line = (f"rank {acc.process_index} of {acc.num_processes} on {acc.device.type} cuda visible "
        f"{torch.cuda.is_available()} CUDA_VISIBLE_DEVICES {os.environ.get('CUDA_VISIBLE_DEVICES')}, "
        f"DDP {type(wrapped).__name__ == 'DistributedDataParallel'} unwrapped {unwrap(acc, wrapped) is model} "
        f"state dict {sorted(sd) if sd else sd} deepspeed imported {'deepspeed' in sys.modules} "
        f"timeout {group.options._timeout}")
sys.stdout.write(line + "\\n")  # one write: the two processes share the pipe
"""


def test_multi_cpu_runs_two_cpu_processes_even_where_cuda_is_visible(tmp_path):
    """The launch the findings saw fail on a one-GPU machine (rank 1: invalid device ordinal): the
    file hides the GPUs from its processes, so both ranks run on the CPU in one gloo group. Its DDP
    model unwraps to the model, and its state dict reaches rank 0 with the model's names, without
    importing DeepSpeed (accelerate's unwrap_model imports it wherever it is installed: ~0.8 s, and
    on a CPU a warning that no GPU was detected). The process group waits collective_timeout_minutes
    at a collective (here 77), not torch's default."""
    from tests.conftest import accelerate_launch

    script = tmp_path / "where.py"
    script.write_text(WHERE_AM_I)
    proc = accelerate_launch("multi_cpu", [str(script), str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))
    where = "on cpu cuda visible False CUDA_VISIBLE_DEVICES -1,-1, DDP True unwrapped True"
    sds = ["['bias', 'weight']", "None"]
    want = [f"rank {r} of 2 {where} state dict {sds[r]} deepspeed imported False timeout 1:17:00" for r in (0, 1)]
    assert lines == want, proc.stdout


def test_one_process_unwraps_to_the_model_itself(tmp_path):
    """In one process prepare() wraps nothing: unwrap gives the model. A compiled model (an
    accelerate config's dynamo_backend) is left to accelerate, as before."""
    from train.launch import gathered_state_dict, make_accelerator, unwrap

    acc = make_accelerator(mixed_precision="no", grad_accum=1, seed=0, log_with=None, project_dir=str(tmp_path))
    model = torch.nn.Linear(2, 2)
    assert unwrap(acc, acc.prepare(model)) is model and acc.unwrap_model(model) is model
    assert sorted(gathered_state_dict(acc, model)) == ["bias", "weight"]
    compiled = torch.compile(model)  # compiled on its first call, which never comes
    assert sorted(compiled.state_dict()) == ["_orig_mod.bias", "_orig_mod.weight"]
    assert unwrap(acc, compiled) is acc.unwrap_model(compiled)
    assert sorted(gathered_state_dict(acc, compiled)) == sorted(acc.get_state_dict(compiled))


def test_fsdp_plugin_from_the_file_wraps_each_decoder_layer_of_the_recipe_model(monkeypatch):
    """What `accelerate launch --config_file conf/accelerate/fsdp.yaml` hands the recipe: the plugin
    built from the FSDP_* variables the launcher exports, its policy applied to distill's model."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    for key, value in load("fsdp").fsdp_config.items():
        monkeypatch.setenv(key.upper(), str(value).lower() if isinstance(value, bool) else str(value))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    model = SelectedLogits(drafter_from_target_layers(tiny_hf_model("llama", num_hidden_layers=3), 2))
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [name for name, module in model.named_modules() if policy(module)]
    assert wrapped == ["model.model.layers.0", "model.model.layers.1"]


def fake_accelerator(distributed_type: str, processes: int, zero_stage: int | None = None):
    from accelerate.utils import DistributedType

    plugin = SimpleNamespace(zero_stage=zero_stage) if zero_stage else None
    return SimpleNamespace(
        distributed_type=DistributedType[distributed_type],
        num_processes=processes,
        state=SimpleNamespace(deepspeed_plugin=plugin),
    )


def test_launch_kinds_and_refusals(monkeypatch):
    single, ddp = fake_accelerator("NO", 1), fake_accelerator("MULTI_GPU", 8)
    zero3, fsdp = fake_accelerator("DEEPSPEED", 8, zero_stage=3), fake_accelerator("FSDP", 8)
    assert [launch_kind(a) for a in (single, ddp, zero3, fsdp)] == ["single", "ddp", "zero3", "fsdp"]
    assert check_launch(ddp, "mtp", ()) == "ddp" and check_launch(zero3, "distill", ("zero2", "zero3")) == "zero3"
    with pytest.raises(SpecdecError, match=r"recipes.medusa does not run under DeepSpeed ZeRO-3.*: why\. Use DDP"):
        check_launch(zero3, "medusa", ("zero1", "zero2"), "why")
    with pytest.raises(SpecdecError, match="does not run under FSDP"):
        check_launch(fsdp, "mtp", ())
    # accelerate runs an FSDP config on CPU as plain DDP: said, not done silently
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(SpecdecError, match="accelerate runs on GPUs only"):
        check_launch(ddp, "distill", ("fsdp",))
