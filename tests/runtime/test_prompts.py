"""Prompt files (both line forms) and chat templates."""

import json

import pytest

from specdec_runtime.errors import SpecdecError
from specdec_runtime.prompts import Prompt, builtin_prompts, encode_prompt, read_prompts


def write_lines(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_both_line_forms(tmp_path):
    f = write_lines(
        tmp_path / "p.jsonl",
        [
            {"prompt": "plain"},
            {"question_id": 81, "category": "writing", "turns": ["first turn", "second turn"]},
            "",
            {"prompt": "x", "id": "mine"},
        ],
    )
    assert read_prompts(f) == [Prompt("0", "plain"), Prompt("81", "first turn", "writing"), Prompt("mine", "x")]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "p.jsonl:2: not valid JSON"),
        ('{"text": "hi"}', "p.jsonl:2: needs a 'prompt' string or a 'turns' list"),
        ('{"turns": []}', "'turns' must be a non-empty list"),
        ('{"prompt": "  "}', "prompt text is empty"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    f = write_lines(tmp_path / "p.jsonl", [{"prompt": "ok"}, line])
    with pytest.raises(SpecdecError, match=message):
        read_prompts(f)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(SpecdecError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(SpecdecError, match="has no prompts"):
        read_prompts(write_lines(tmp_path / "empty.jsonl", [""]))


def test_builtin_smoke_prompts_cover_the_categories():
    prompts = read_prompts(builtin_prompts("smoke"))
    assert len(prompts) == 16
    assert {p.category for p in prompts} == {
        "coding",
        "math",
        "reasoning",
        "writing",
        "summarization",
        "extraction",
        "translation",
        "qa",
    }


def test_chat_template_is_applied_for_chat_models(bundled):
    tok = bundled.tokenizer
    ids = encode_prompt(tok, "What is 2+2?")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert "What is 2+2?" in text
    assert encode_prompt(tok, "What is 2+2?", chat=False) == tok.encode("What is 2+2?")
