"""Processes, devices and launchers: the Accelerator of a run, what `accelerate launch` asked for,
and the helpers for parameters split across processes (ZeRO-3, FSDP). No Hydra inside.

    accelerator = make_accelerator(mixed_precision="no", grad_accum=2, seed=0, log_with=None, project_dir=out)
    kind = check_launch(accelerator, "distill", ("zero1", "zero2"), "why")  # refuses what a recipe does not fit
    with unpartitioned(accelerator): model = load(...)   # stays whole under ZeRO-3
    sd = gathered_state_dict(accelerator, wrapped)       # the whole weights on rank 0 (every process calls it)
"""

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from specdec_runtime.errors import SpecdecError

MIXED_PRECISION = ("no", "bf16", "fp16")


def launcher() -> str:
    """What `accelerate launch` asked for: "deepspeed", "fsdp", or "" (DDP or a plain process)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "deepspeed"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "fsdp"
    return ""


def make_accelerator(
    *,
    mixed_precision: str,
    grad_accum: int,
    seed: int,
    log_with: str | None,
    project_dir: str,
    micro_batch: int = 1,
    max_grad_norm: float | None = None,
    cpu: bool | None = None,
    collective_timeout_minutes: float | None = None,
) -> Any:
    """An Accelerator for one run; the scheduler is stepped by hand, once per optimizer step.

    collective_timeout_minutes: how long a rank waits at a collective for the others (torch's
    default is 10 minutes under NCCL: a rank regenerating responses or computing states longer
    than its peers would end the job); None: torch's.

    cpu=None: CPU when there is no GPU. Then torchrun-style launches (WORLD_SIZE > 1, e.g.
    conf/accelerate/multi_cpu.yaml) form a gloo process group instead of silently running alone,
    and a DeepSpeed launch runs DeepSpeed on its CPU accelerator (gloo). DeepSpeed's own batch
    settings are taken from the trainer's (micro_batch, grad_accum, max_grad_norm), so a launcher
    config can never disagree with the recipe's.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    logging.getLogger("accelerate").setLevel(logging.WARNING)  # no per-file "saved ..." lines
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"trainer.mixed_precision='{mixed_precision}': use no, bf16 or fp16")
    process_group: dict[str, Any] = {}
    if collective_timeout_minutes is not None:
        process_group["timeout"] = timedelta(minutes=collective_timeout_minutes)
    if cpu is None:
        cpu = not torch.cuda.is_available()
    if cpu and launcher() == "deepspeed":
        # accelerate's cpu=True would silently turn a DeepSpeed launch into plain DDP: run
        # DeepSpeed on its CPU accelerator over gloo instead.
        cpu = False
        process_group["backend"] = "gloo"
    handlers = [InitProcessGroupKwargs(**process_group)] if process_group else []
    if launcher() == "deepspeed":
        # accelerate launch exports the config file's values, which the Accelerator prefers to its
        # arguments: the recipe's trainer settings win instead.
        os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(grad_accum)
        os.environ["ACCELERATE_GRADIENT_CLIPPING"] = str(float(max_grad_norm or 0.0))
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        gradient_accumulation_steps=grad_accum,
        step_scheduler_with_optimizer=False,
        log_with=log_with,
        project_dir=project_dir,
        cpu=cpu,
        kwargs_handlers=handlers,
    )
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch  # no dataloader is prepared
        if plugin.zero_stage == 3:  # validation and export read whole weights (accelerator.get_state_dict)
            plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    set_seed(seed, device_specific=False)
    return accelerator


def launch_kind(accelerator: Any) -> str:
    """How the run was launched: "single", "ddp", "zero1"/"zero2"/"zero3" (DeepSpeed) or "fsdp"."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if kind == DistributedType.FSDP:
        return "fsdp"
    return "single" if accelerator.num_processes == 1 else "ddp"


def _plain(accelerator: Any, wrapped: Any) -> Any:
    """The model inside `wrapped` where accelerate did no more than DDP to it (one process, or DDP;
    not compiled by an accelerate config's dynamo_backend), else None. Mixed precision patches the
    model's forward in place, so it stays the model."""
    if launch_kind(accelerator) not in ("single", "ddp"):
        return None
    model = wrapped.module if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) else wrapped
    return None if hasattr(model, "_orig_mod") else model


def unwrap(accelerator: Any, wrapped: Any) -> Any:
    """accelerator.unwrap_model(wrapped), without the DeepSpeed import accelerate's makes wherever
    DeepSpeed is installed, to test for its engine (~0.8 s, and on a CPU machine a warning that a
    GPU could not be detected), where no DeepSpeed engine can be (_plain)."""
    plain = _plain(accelerator, wrapped)
    return plain if plain is not None else accelerator.unwrap_model(wrapped)


def check_launch(accelerator: Any, recipe: str, fits: tuple[str, ...], why: str = "") -> str:
    """Refuse, before any model loads, a launcher config the recipe does not fit; returns the kind.
    fits: the kinds of launch_kind() the recipe runs under ("single" and "ddp" always fit)."""
    asked, kind = launcher(), launch_kind(accelerator)
    if asked == "fsdp" and kind != "fsdp":
        raise SpecdecError(
            "the accelerate config asks for FSDP, which accelerate runs on GPUs only: on this machine use "
            "conf/accelerate/multi_cpu.yaml (DDP over gloo) or a DeepSpeed config"
        )
    if kind not in ("single", "ddp", *fits):
        ok = ", ".join(["DDP (conf/accelerate/multi_gpu.yaml)", *(FITS_NAMES[f] for f in fits)])
        raise SpecdecError(
            f"recipes.{recipe} does not run under {FITS_NAMES[kind]}{': ' + why if why else ''}. Use {ok}"
        )
    return kind


FITS_NAMES = {
    "single": "one process",
    "ddp": "DDP",
    "zero0": "DeepSpeed ZeRO-0",
    "zero1": "DeepSpeed ZeRO-1",
    "zero2": "DeepSpeed ZeRO-2 (conf/accelerate/deepspeed_zero2.yaml)",
    "zero3": "DeepSpeed ZeRO-3 (conf/accelerate/deepspeed_zero3*.yaml)",
    "fsdp": "FSDP (conf/accelerate/fsdp.yaml)",
}


def sharded(accelerator: Any) -> bool:
    """Parameters are split across processes (ZeRO-3, FSDP): reading the weights needs a gather."""
    return launch_kind(accelerator) in ("zero3", "fsdp")


@contextmanager
def unpartitioned(accelerator: Any) -> Iterator[None]:
    """Models created inside stay whole on every process. Under ZeRO-3, transformers would otherwise
    partition every model at creation (zero.Init); a frozen target must stay whole, and the trained
    model is partitioned when accelerator.prepare() wraps it."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


def gathered_state_dict(accelerator: Any, wrapped: Any) -> dict[str, torch.Tensor] | None:
    """The prepared model's whole state dict on rank 0 (None elsewhere). Every process must call it:
    under ZeRO-3 and FSDP it gathers the shards."""
    plain = _plain(accelerator, wrapped)  # accelerator.get_state_dict imports DeepSpeed too (unwrap)
    sd = plain.state_dict() if plain is not None else accelerator.get_state_dict(wrapped)
    return {k: v.detach() for k, v in sd.items()} if accelerator.is_main_process else None


def most(n: int) -> int:
    """The largest n any process holds (n itself in a single process)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return n
    t = torch.tensor([n], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def load_layer_sharded(path: str | Path, dtype: torch.dtype, device: torch.device) -> Any:
    """A frozen causal LM whose decoder layers are split across the processes (FSDP2's
    fully_shard: each process keeps 1/world of every layer's rows and gathers one layer at a time
    in the forward), the embeddings, final norm and lm_head whole on every process (the recipes
    read them). Each process reads only its own rows, one tensor at a time from the memory-mapped
    safetensors files, so none ever holds the whole target (a 70B target in bf16 is 141 GB).

    Every process must run the same forwards: each layer's gather is a collective."""
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world > 1:
        mesh = init_device_mesh(device.type, (world,))
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if world > 1:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
            # Each layer is its own FSDP root (a root over the whole model would rename its class,
            # and transformers finds the hidden states to return by class name); a root keeps its
            # gathered weights after the forward, which here would gather the whole target.
            layer.register_forward_hook(lambda module, args, out: module.reshard())
    model.to_empty(device=device)
    params = dict(model.named_parameters())  # a tied lm_head is the embedding's parameter, named once
    loaded: set[str] = set()
    with torch.no_grad():
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(file), "pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    if key not in params:
                        continue
                    p = params[key]
                    if isinstance(p, DTensor):  # this process's rows, as fully_shard splits them (torch.chunk)
                        rows = -(-p.shape[0] // world)
                        p.to_local().copy_(f.get_slice(key)[rank * rows : (rank + 1) * rows])
                    else:
                        p.copy_(f.get_tensor(key))
                    loaded.add(key)
    if missing := sorted(set(params) - loaded):
        raise SpecdecError(
            f"model.shard: {path} has no tensors named {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
            "sharding reads checkpoints whose tensor names are the model's own (Llama, Mistral, Qwen2/3 dense)"
        )
    rotary = model.model.rotary_emb  # its frequencies, a buffer made on the meta device: again, for real
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(config=model.config)
    return model.eval().requires_grad_(False)
