"""Conversations, chat-template masks, batching and the shipped prompt set."""

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdec_runtime.errors import SpecdecError
from specdec_runtime.paths import resolve_model
from train.data import (
    Batches,
    Conversation,
    Example,
    collate,
    encode_conversation,
    load_conversations,
    pre_query_ids,
    prompt_ids,
    responses_of,
    self_written,
)


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


def test_builtin_prompt_set_is_large_varied_and_split():
    train, val = load_conversations("builtin:train"), load_conversations("builtin:val")
    assert len(train) >= 2000 and len(val) == 64
    assert len({c.messages[0]["content"] for c in train}) == len(train)  # no prompt twice
    multi = [c for c in train if len(c.messages) == 3]
    assert len(multi) > 100 and all(c.prompt == c.messages for c in multi)  # the model answers the follow-up
    cats = {"coding", "math", "reasoning", "writing", "summarization", "extraction", "translation", "qa"}
    assert set(Counter(c.category for c in train)) == cats == set(Counter(c.category for c in val))
    assert not {c.messages[0]["content"] for c in train} & {c.messages[0]["content"] for c in val}
    assert len({c.id for c in train + val}) == len(train) + len(val)


def test_record_forms(tmp_path):
    rows = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}]},
        {"question_id": 7, "category": "math", "turns": ["first", "second"]},
        {"prompt": "bare"},
    ]
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    convs = load_conversations(str(f))
    assert convs[0].messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert convs[0].has_response and not convs[1].has_response
    assert convs[0].prompt == [{"role": "user", "content": "hi"}]
    assert convs[2].messages == [{"role": "user", "content": "first"}] and convs[2].id == "7"
    assert convs[3].messages == [{"role": "user", "content": "bare"}]


def test_parquet_files_load_through_datasets(tmp_path):
    import datasets

    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hey"}]}]).to_parquet(str(path))
    assert load_conversations(str(path))[0].messages == [{"role": "user", "content": "hey"}]


def test_data_errors_say_what_to_do(tmp_path):
    with pytest.raises(SpecdecError, match="does not exist"):
        load_conversations(str(tmp_path / "missing.jsonl"))
    with pytest.raises(SpecdecError, match="builtin:train"):
        load_conversations("builtin:nope")
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(SpecdecError, match="set data.column"):
        load_conversations(str(tmp_path / "bad.jsonl"))
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(SpecdecError, match="unsupported extension"):
        load_conversations(str(tmp_path / "x.csv"))


def test_data_file_errors_name_the_line_and_a_file_that_is_not_utf8(tmp_path):
    """A fault on line 3 (a blank line 2 between) is reported at line 3, not at line 1 or record 1."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "fine"}\n\n{"prompt": "broken"\n')
    with pytest.raises(SpecdecError, match=r"d\.jsonl:3: not valid JSON"):
        load_conversations(str(path))
    path.write_text('{"prompt": "fine"}\n\n{"text": "no conversation"}\n')
    with pytest.raises(SpecdecError, match=r"d\.jsonl:3: no conversation column"):
        load_conversations(str(path))
    path.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(SpecdecError, match=r"d\.jsonl is not UTF-8 text \(byte 0xe9 at offset 15\): save it as UTF-8"):
        load_conversations(str(path))


def test_only_assistant_turns_carry_loss(smol_tokenizer):
    tok = smol_tokenizer
    msgs = [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green."},
    ]
    ex = encode_conversation(tok, Conversation("c", msgs))
    # Oracle: the template's own rendering of the whole conversation, tokenized at once.
    assert ex.ids == tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    masked = tok.decode([t for t, m in zip(ex.ids, ex.loss_mask) if m])
    assert masked == "Blue.<|im_end|>\nGreen.<|im_end|>\n"
    # The prompt part equals what the runtime feeds at generation time.
    n = ex.loss_mask.index(True)
    assert ex.ids[:n] == prompt_ids(tok, Conversation("c", msgs[:1]))


def test_pre_query_ids_are_the_template_up_to_a_users_message(smol_tokenizer):
    """SmolLM2's template with its default system turn, up to the user's header: a conversation's
    prompt ids begin with them and go on with the user's message."""
    pre = pre_query_ids(smol_tokenizer)
    assert smol_tokenizer.decode(pre).endswith("<|im_end|>\n<|im_start|>user\n")
    assert "You are a helpful AI assistant" in smol_tokenizer.decode(pre)
    ids = prompt_ids(smol_tokenizer, Conversation("c", [{"role": "user", "content": "Name a red fruit."}]))
    assert ids[: len(pre)] == pre
    assert smol_tokenizer.decode(ids[len(pre) :]).startswith("Name a red fruit.<|im_end|>")


def test_pre_query_ids_need_a_chat_template(smol_tokenizer):
    import copy

    plain = copy.deepcopy(smol_tokenizer)
    plain.chat_template = None
    with pytest.raises(SpecdecError, match="self_prompts=0"):
        pre_query_ids(plain)


def test_self_written_keeps_the_finished_distinct_messages(smol_tokenizer):
    end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    enc = lambda text: smol_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    written = [
        enc("How do bees make honey?") + [end],
        enc("What is the capital of"),  # cut off by the token limit: dropped
        enc(" How do bees make honey? ") + [end],  # the first again, once stripped: dropped
        [end],  # empty: dropped
        enc("Write a haiku about rain.") + [end],
    ]
    convs = self_written(smol_tokenizer, written, frozenset({end}))
    assert [(c.id, c.messages, c.category) for c in convs] == [
        ("self-0", [{"role": "user", "content": "How do bees make honey?"}], "self"),
        ("self-4", [{"role": "user", "content": "Write a haiku about rain."}], "self"),
    ]


def test_responses_of_are_the_runs_that_carry_loss():
    examples = [
        Example([1, 2, 3, 4, 5, 6, 7], [False, False, True, True, False, True, True]),  # two turns
        Example([8, 9], [False, False]),  # nothing to learn
        Example([10, 11], [True, True]),
    ]
    assert responses_of(examples) == [[3, 4], [6, 7], [10, 11]]


def test_collate_shifts_the_loss_mask():
    batch = collate([Example([5, 6, 7], [False, True, True]), Example([8, 9], [False, True])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["target_mask"].tolist() == [[True, True], [True, False]]  # position t predicts t + 1


def test_batches_are_deterministic_and_ranks_partition_the_global_batch():
    examples = [Example([i, i], [False, True]) for i in range(24)]
    one = Batches(examples, micro_batch=2, grad_accum=2, world=1, rank=0, seed=3)
    two = [Batches(examples, micro_batch=1, grad_accum=2, world=2, rank=r, seed=3) for r in range(2)]
    for step in (0, 5, 6, 13):  # 6 steps per epoch: crosses epochs
        ids = lambda mbs: [e.ids[0] for mb in mbs for e in mb]
        assert ids(one.step(step)) == ids(two[0].step(step)) + ids(two[1].step(step))
        assert ids(one.step(step)) == ids(
            Batches(examples, micro_batch=2, grad_accum=2, world=1, rank=0, seed=3).step(step)
        )
    epoch = sorted(e.ids[0] for s in range(6) for mb in one.step(s) for e in mb)
    assert epoch == list(range(24))  # every example once per epoch
    assert [e.ids[0] for mb in one.step(0) for e in mb] != [e.ids[0] for mb in one.step(6) for e in mb]
    with pytest.raises(SpecdecError, match="fewer than one global batch"):
        Batches(examples[:3], micro_batch=2, grad_accum=2, world=1, rank=0, seed=0)
    assert torch.tensor([len(mb) for mb in one.step(0)]).tolist() == [2, 2]


def test_length_grouped_batches_cut_padding_and_still_take_every_example_once_per_epoch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 200, (1030,), generator=g).tolist()
    examples = [Example([i] * n, [False] * n) for i, n in enumerate(lengths)]
    grouped = Batches(examples, micro_batch=4, grad_accum=2, world=1, rank=0, seed=1, group_by_length=True)
    plain = Batches(examples, micro_batch=4, grad_accum=2, world=1, rank=0, seed=1)

    def padded(b: Batches) -> int:  # tokens of one epoch's padded micro-batches
        return sum(max(len(e.ids) for e in mb) * len(mb) for s in range(b.steps_per_epoch) for mb in b.step(s))

    assert padded(grouped) < 0.8 * padded(plain)  # random batches: ~40% padding; grouped: a few %
    seen = [e.ids[0] for s in range(grouped.steps_per_epoch) for mb in grouped.step(s) for e in mb]
    assert len(seen) == len(set(seen)) == grouped.steps_per_epoch * 8  # no example twice in an epoch
    first = [max(len(e.ids) for e in mb) for mb in grouped.step(0)] + [
        max(len(e.ids) for e in mb) for mb in grouped.step(1)
    ]
    assert len(set(first)) > 1  # batches of different lengths follow each other (not sorted over the epoch)
    two = [
        Batches(examples, micro_batch=4, grad_accum=1, world=2, rank=r, seed=1, group_by_length=True) for r in range(2)
    ]
    ids = lambda mbs: [e.ids[0] for mb in mbs for e in mb]  # noqa: E731
    assert ids(grouped.step(7)) == ids(two[0].step(7)) + ids(two[1].step(7))  # ranks partition the global batch


def sharegpt_file(path, bad: bool = True):
    """A ShareGPT-style dump: two usable conversations and, with bad, what real dumps also hold (an
    empty conversation, one that starts with the reply, an empty user's turn, a turn without text)."""
    turn = lambda who, text: {"from": who, "value": text}  # noqa: E731
    rows = [
        {"id": "a", "conversations": [turn("human", "Name a red fruit."), turn("gpt", "An apple.")]},
        {"id": "b", "conversations": [turn("human", "Two plus two?"), turn("gpt", "Four."), turn("human", "And 3+3?")]},
    ]
    if bad:
        rows[1:1] = [
            {"id": "empty", "conversations": []},
            {"id": "reply-first", "conversations": [turn("gpt", "Hello!"), turn("human", "Hi.")]},
            {"id": "blank", "conversations": [turn("human", "  "), turn("gpt", "?")]},
            {"id": "no-text", "conversations": [turn("human", None)]},
        ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_records_that_hold_no_usable_conversation_are_left_out_and_said(tmp_path):
    """With `skipped`, the empty and one-sided records of a dump are left out and said once (how
    many, and the first one's reason); without it, the first is an error naming its line; a source
    with none usable is an error either way."""
    path = sharegpt_file(tmp_path / "dump.jsonl")
    said = []
    convs = load_conversations(str(path), column="conversations", skipped=said.append)
    assert [c.id for c in convs] == ["a", "b"] and convs[1].prompt[-1]["content"] == "And 3+3?"
    assert len(said) == 1 and "left out 4 of 6 records" in said[0] and "dump.jsonl:2" in said[0]
    with pytest.raises(SpecdecError, match=r"dump.jsonl:2: column 'conversations' must be a non-empty list"):
        load_conversations(str(path), column="conversations")
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text(json.dumps({"conversations": [{"from": "gpt", "value": "Hi"}]}) + "\n")
    with pytest.raises(SpecdecError, match="no usable records .*a reply before any user's turn"):
        load_conversations(str(only_bad), skipped=said.append)


@pytest.mark.parametrize("preset, column", [("sharegpt", "conversations"), ("ultrachat", "messages")])
def test_the_chat_presets_read_their_column_from_the_data_and_detect_the_builtin_prompts(
    tmp_path, smol_tokenizer, preset, column
):
    """data=sharegpt / ultrachat with a local file of that form: the training set is read with the
    preset's column, the built-in validation prompts with detection (they crashed the run at start:
    'prompts-val.jsonl:1: no conversation column'), and a dump's bad records are left out and said."""
    from hydra import compose, initialize_config_dir

    from recipes.data import conversations

    rows = sharegpt_file(tmp_path / "s.jsonl").read_text().splitlines()
    if column == "messages":  # the same conversations in UltraChat's form
        role = {"human": "user", "gpt": "assistant"}

        def ultrachat(row: dict) -> str:
            turns = [{"role": role[t["from"]], "content": t["value"]} for t in row["conversations"]]
            return json.dumps({"id": row["id"], "messages": turns})

        rows = [ultrachat(json.loads(r)) for r in rows]
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(
            "eagle3",
            overrides=[
                f"data={preset}",
                f"data.train={tmp_path / 'd.jsonl'}",
                "data.max_samples=0",
                "validate.num_prompts=8",
                "data.max_unusable=0.75",
            ],
        )  # fmt: skip (4 of 6 bad)
    said = []
    run = SimpleNamespace(tokenizer=smol_tokenizer, print_once=said.append)
    data = conversations(cfg, run)
    assert [c.id for c in data.train] == ["a", "b"] and len(data.val) == 8 and all(data.val_prompts)
    assert len(said) == 1 and "left out 4 of 6 records" in said[0]


def test_responses_that_do_not_fit_are_cut_and_counted():
    """with_responses keeps prompt + response within max_len; what it cuts is counted for the caller
    to say (recipes/data.training_examples prints it), never silent."""
    from train.data import with_responses

    cut: list[int] = []
    examples = with_responses([[1, 2, 3], [4]], [[5, 6, 7, 8, 9], [10, 11]], 6, cut)
    assert [e.ids for e in examples] == [[1, 2, 3, 5, 6, 7], [4, 10, 11]]
    assert [e.loss_mask for e in examples] == [[False] * 3 + [True] * 3, [False, True, True]]
    assert cut == [2]  # the first response lost its last 2 tokens


def test_more_unusable_records_than_data_max_unusable_stop_the_run(tmp_path):
    """A source whose records are mostly unusable (a wrong column, a broken dump) is an error naming
    the share and the setting, not a run on what is left."""
    path = sharegpt_file(tmp_path / "dump.jsonl")  # 4 of its 6 records are unusable
    with pytest.raises(SpecdecError, match=r"4 of 6 records cannot be used, more than the 50% data.max_unusable"):
        load_conversations(str(path), column="conversations", skipped=print, max_left_out=0.5)
    assert len(load_conversations(str(path), column="conversations", skipped=print, max_left_out=0.75)) == 2


def chats(path: Path, n: int, form: str) -> str:
    """n usable conversations in ShareGPT's or UltraChat's form, ids form-0, form-1, ..."""
    rows = []
    for i in range(n):
        q, a = f"Question {i} of {form}?", f"Answer {i}."
        if form == "sharegpt":
            rows.append(
                {"id": f"{form}-{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
            )
        else:
            rows.append(
                {"id": f"{form}-{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("max_samples, want", [(4, (3, 1)), (0, (6, 2))])
def test_data_mix_reads_each_source_with_its_own_column_in_the_weights_proportions(
    tmp_path, smol_tokenizer, max_samples, want
):
    """data.mix: a ShareGPT file (column conversations) and an UltraChat file (column messages),
    weights 3 : 1; max_samples in those proportions, or (0) as many as keep them without repeats."""
    from hydra import compose, initialize_config_dir

    from recipes.data import conversations

    share, ultra = chats(tmp_path / "s.jsonl", 6, "sharegpt"), chats(tmp_path / "u.jsonl", 4, "ultrachat")
    mix = f"[{{train: '{share}', column: conversations, weight: 3}}, {{train: '{ultra}', column: messages, weight: 1}}]"
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose("eagle3", overrides=[f"data.mix={mix}", f"data.max_samples={max_samples}"])
    said = []
    data = conversations(cfg, SimpleNamespace(tokenizer=smol_tokenizer, print_once=said.append))
    forms = [c.id.split("-")[0] for c in data.train]
    assert (forms.count("sharegpt"), forms.count("ultrachat")) == want
    assert said == [f"data.mix: {want[0]} of 6 from {share} (75%), {want[1]} of 4 from {ultra} (25%)"]
