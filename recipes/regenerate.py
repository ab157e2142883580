"""The regeneration job: every assistant turn of a chat dataset rewritten by the target
(train/regenerate.py), in this job or through an OpenAI-compatible server, sharded across processes.

    python -m recipes.regenerate data=sharegpt model.name=meta-llama/Llama-3.1-8B-Instruct output_dir=runs/sharegpt
    python -m recipes.regenerate data=sharegpt model.name=... engine.kind=server engine.url=http://127.0.0.1:8000
    python -m recipes.eagle3 data=files data.train=runs/sharegpt responses.source=dataset ...   # train on it
"""

import json
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from recipes.checks import ENGINES, check_collective_timeout, check_data, check_shard, refuse, run_or_exit
from recipes.data import local_engine, training_conversations
from recipes.run import load_tokenizer
from specdec_runtime.hardware import resolve_dtype
from specdec_runtime.loading import load_hf_model
from train.launch import make_accelerator
from train.regenerate import InProcess, Server, regenerate
from train.validate import runtime_decoder

KINDS = ("in_process", "server")
SETTINGS = "regenerate.json"  # what made the folder: target, engine, generation settings, counts


def check_config(cfg: DictConfig) -> None:
    """Refuse bad values before anything loads or any request is sent."""
    engine, generation = cfg.engine, cfg.generation
    problems = check_data(cfg) + check_shard(cfg, "regenerate")
    if engine.kind not in KINDS:
        problems.append(f"engine.kind='{engine.kind}': use in_process (the target in this job) or server")
    if engine.kind == "server" and not str(engine.url or "").startswith(("http://", "https://")):
        problems.append(f"engine.kind=server needs engine.url=http://HOST:PORT of the server, got {engine.url}")
    counts = {"engine.concurrency": engine.concurrency, "engine.batch_size": engine.batch_size}
    counts |= {"generation.max_new_tokens": generation.max_new_tokens, "generation.chunk": generation.chunk}
    for key, value in counts.items():
        if not isinstance(value, int) or value < 1:
            problems.append(f"{key}={value} must be an integer >= 1")
    if not isinstance(engine.retries, int) or engine.retries < 0 or not engine.timeout_s > 0:
        problems.append(f"engine.retries={engine.retries} must be >= 0 and engine.timeout_s={engine.timeout_s} > 0")
    if generation.temperature < 0 or not 0 < generation.top_p <= 1:
        problems.append("generation: need temperature >= 0 and 0 < top_p <= 1")
    if engine.backend not in ENGINES:
        problems.append(f"engine.backend='{engine.backend}': use one of {', '.join(ENGINES)}")
    if generation.thinking not in (None, True, False):
        problems.append(f"generation.thinking={generation.thinking}: true, false or null (the template's default)")
    refuse(problems + check_collective_timeout(cfg))


def make_engine(cfg: DictConfig, device: Any) -> InProcess | Server:
    engine, generation = cfg.engine, cfg.generation
    sampling = dict(max_new_tokens=generation.max_new_tokens, temperature=generation.temperature,
                    top_p=generation.top_p, thinking=generation.thinking)  # fmt: skip
    if engine.kind == "server":
        return Server(engine.url, engine.served_model or cfg.model.name, concurrency=engine.concurrency,
                      retries=engine.retries, timeout_s=engine.timeout_s, **sampling)  # fmt: skip
    _, tokenizer, pad_id, _, stop_ids = load_tokenizer(cfg.model.name)
    model = load_hf_model(cfg.model.name, dtype=resolve_dtype(cfg.model.dtype, device)).to(device).eval()
    if local_engine(engine.backend, device) == "runtime":
        model = runtime_decoder(model, None, device, fast_path=False)
    return InProcess(model, tokenizer, pad_id=pad_id, stop_ids=stop_ids, seed=cfg.seed,
                     batch_size=engine.batch_size, **sampling)  # fmt: skip


def run(cfg: DictConfig) -> dict[str, Any]:
    check_config(cfg)
    out = Path(cfg.output_dir)
    server = cfg.engine.kind == "server"
    accelerator = make_accelerator(
        mixed_precision="no", grad_accum=1, seed=cfg.seed, log_with=None, project_dir=str(out),
        cpu=True if server or cfg.device == "cpu" else None, collective_timeout_minutes=cfg.collective_timeout_minutes,
    )  # fmt: skip
    main = accelerator.is_main_process
    say = lambda line: main and print(line)  # noqa: E731
    convs = training_conversations(cfg.data, say)
    rank, world = accelerator.process_index, accelerator.num_processes
    say(f"regenerating {len(convs):,} conversations with {cfg.model.name} ({cfg.engine.kind}), {world} processes")
    written = regenerate(
        convs, make_engine(cfg, accelerator.device), out, rank=rank, world=world, chunk=cfg.generation.chunk,
        progress=lambda n: tqdm(total=n, desc="conversations", unit="conversation", disable=not main),
    )  # fmt: skip
    accelerator.wait_for_everyone()
    result = {"conversations": len(convs), "written_by_rank0": written, "output_dir": str(out)}
    if main:
        settings = {"target": cfg.model.name, "processes": world, "engine": OmegaConf.to_container(cfg.engine),
                    "generation": OmegaConf.to_container(cfg.generation), "conversations": len(convs)}  # fmt: skip
        (out / SETTINGS).write_text(json.dumps(settings, indent=2) + "\n")
        print(f"{out}: {len(convs):,} conversations; train on them with data=files data.train={out} "
              "responses.source=dataset")  # fmt: skip
    return result


@hydra.main(config_path="../conf", config_name="regenerate", version_base=None)
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
