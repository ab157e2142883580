"""Prompt files and chat templates.

    prompts = read_prompts("prompts.jsonl")        # [Prompt(id, text, category), ...]
    ids = encode_prompt(tokenizer, prompts[0].text)  # chat template applied when the model has one

A prompt file is JSON lines, each either {"prompt": "..."} (optionally with "id" and "category")
or the MT-Bench / Spec-Bench form {"question_id": ..., "category": ..., "turns": ["...", ...]},
of which the first turn is used.
"""

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specdec_runtime.errors import SpecdecError


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    category: str | None = None


def parse_prompt(record: Any, where: str, index: int) -> Prompt:
    """One prompt from a decoded JSON line; `where` names the line in errors."""
    if not isinstance(record, dict):
        raise SpecdecError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "prompt" in record:
        text = record["prompt"]
        pid = record.get("id", record.get("question_id", index))
    elif "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise SpecdecError(f"{where}: 'turns' must be a non-empty list of strings")
        text = turns[0]
        pid = record.get("question_id", record.get("id", index))
    else:
        raise SpecdecError(f"{where}: needs a 'prompt' string or a 'turns' list (MT-Bench / Spec-Bench form)")
    if not isinstance(text, str) or not text.strip():
        raise SpecdecError(f"{where}: the prompt text is empty or not a string")
    category = record.get("category")
    return Prompt(str(pid), text, None if category is None else str(category))


def read_text(path: Path) -> str:
    """A text file's contents; a file that is not UTF-8 is a user's error that says where."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SpecdecError(
            f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}): save it as UTF-8"
        ) from None
    except IsADirectoryError:
        raise SpecdecError(f"{path} is a folder: give a file") from None


def read_jsonl(path: Path) -> list[tuple[str, Any]]:
    """The records of a JSON-lines file, each with where it is ("path:line") for error messages;
    blank lines are skipped."""
    records = []
    for n, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((f"{path}:{n}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise SpecdecError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    return records


def read_prompts(path: str | Path) -> list[Prompt]:
    """All prompts of a JSON-lines file, with errors that name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise SpecdecError(f"prompt file '{path}' does not exist")
    prompts = [parse_prompt(record, where, i) for i, (where, record) in enumerate(read_jsonl(path))]
    if not prompts:
        raise SpecdecError(f"prompt file '{path}' has no prompts")
    return prompts


def first_per_category(prompts: list[Prompt], n: int) -> list[Prompt]:
    """The first n prompts of each category, in file order."""
    counts: dict[str | None, int] = {}
    kept = []
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
        if counts[p.category] <= n:
            kept.append(p)
    return kept


def builtin_prompts(name: str = "smoke") -> Path:
    """Path of a prompt file shipped with the package (specdec_runtime/data/<name>.jsonl)."""
    return Path(str(resources.files("specdec_runtime") / "data" / f"{name}.jsonl"))


def encode_prompt(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids of a user message: through the chat template when the tokenizer has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer.encode(text)
