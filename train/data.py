"""Conversations in, token ids with a loss mask out.

    convs = load_conversations("builtin:train")                 # the project's prompt set
    convs = load_conversations("data/chats.jsonl")              # local jsonl / json / parquet
    convs = load_conversations("hub:HuggingFaceH4/ultrachat_200k", split="train_sft", column="messages")
    ids = prompt_ids(tokenizer, convs[0])                       # chat template + generation prompt
    ex = encode_conversation(tokenizer, convs[0])               # dataset responses, assistant turns masked in
    ex = Example(ids + response, [False] * len(ids) + [True] * len(response))
    for micro_batch in Batches(examples, micro_batch=4, grad_accum=2, world=1, rank=0, seed=0).step(7): ...
    convs = round_robin_by_category(convs, 16)                  # 16 conversations, one category after another
    examples = with_responses(prompts, responses, max_len=512)  # prompt + response, loss on the response
    pre = pre_query_ids(tokenizer)                              # the template up to a user's message: a model
    convs = self_written(tokenizer, written, stop_ids)          # continues it with one (Magpie); the finished, once
    runs = responses_of(examples)                               # the tokens carrying loss, a run per turn
    prompts, categories = prompts_of(tokenizer, "builtin:val", 16)

A conversation is a list of {"role", "content"} messages. Accepted records: {"messages": [...]}
(UltraChat / OpenAI), {"conversations": [{"from": "human"|"gpt", "value"}]} (ShareGPT), the
Spec-Bench / MT-Bench prompt form {"turns": [...]} and {"prompt": "..."}. Only response tokens
(assistant turns) carry loss.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specdec_runtime.errors import SpecdecError
from specdec_runtime.prompts import builtin_prompts, read_jsonl, read_text

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
}
COLUMNS = ("messages", "conversations", "conversation", "turns", "prompt")


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]
    category: str | None = None

    @property
    def prompt(self) -> list[dict[str, str]]:
        """What a response is generated for: the whole conversation when it ends with the user's
        turn (a multi-turn prompt), else the messages before the first assistant reply."""
        if self.messages[-1]["role"] == "user":
            return self.messages
        for i, m in enumerate(self.messages):
            if m["role"] == "assistant":
                return self.messages[:i]
        return self.messages

    @property
    def has_response(self) -> bool:
        return any(m["role"] == "assistant" for m in self.messages)


@dataclass
class Example:
    ids: list[int]
    loss_mask: list[bool]  # True where the token is part of a response (predicting it carries loss)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_targets(self) -> int:
        return sum(self.loss_mask[1:])


def to_messages(record: dict[str, Any], column: str | None, where: str) -> list[dict[str, str]]:
    """Normalize one record's conversation into [{"role", "content"}, ...]."""
    column = column or next((c for c in COLUMNS if c in record), None)
    if column is None or column not in record:
        raise SpecdecError(f"{where}: no conversation column; expected one of {', '.join(COLUMNS)} (set data.column)")
    value = record[column]
    if isinstance(value, str):  # a bare prompt
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise SpecdecError(f"{where}: column '{column}' must be a non-empty list or a string")
    if all(isinstance(t, str) for t in value):  # MT-Bench turns: user messages only; the first is the prompt
        return [{"role": "user", "content": value[0]}]
    messages = []
    for m in value:
        role = str(m.get("role", m.get("from", ""))).lower()
        content = m.get("content", m.get("value"))
        if role not in ROLES or not isinstance(content, str):
            raise SpecdecError(f"{where}: message {m!r} needs a role/from in {sorted(ROLES)} and a text content/value")
        messages.append({"role": ROLES[role], "content": content})
    return messages


def load_hub_dataset(source: str, split: str) -> Any:
    """The `datasets` split of hub:ID[@SUBSET] (SUBSET: the dataset's configuration name)."""
    import datasets

    name, _, subset = source.removeprefix("hub:").partition("@")
    try:
        return datasets.load_dataset(name, subset or None, split=split)
    except Exception as e:  # offline, unknown id, bad split: say which
        raise SpecdecError(f"could not load dataset '{name}' split '{split}' from the Hub: {e}") from e


def _records(source: str, split: str) -> list[tuple[str, dict[str, Any]]]:
    """Raw records of a source, each with where it is for error messages (file:line for jsonl)."""
    if source.startswith("builtin:"):
        path = builtin_prompts(f"prompts-{source.split(':', 1)[1]}")
        if not path.is_file():
            raise SpecdecError(f"unknown built-in prompt set '{source}': use builtin:train or builtin:val")
        source = str(path)
    if source.startswith("hub:"):
        return [(f"{source[4:]} record {i}", r) for i, r in enumerate(load_hub_dataset(source, split))]
    path = Path(source).expanduser()
    if path.is_dir():  # a folder of JSON-lines files: recipes.regenerate's output
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise SpecdecError(f"data folder '{source}' holds no .jsonl files (recipes.regenerate writes them)")
        return [record for f in files for record in read_jsonl(f)]
    if not path.is_file():
        raise SpecdecError(
            f"data file '{source}' does not exist (use a .jsonl/.json/.parquet file, a folder of .jsonl files, "
            "builtin:NAME or hub:ID)"
        )
    if path.suffix == ".jsonl":  # read directly: quicker and quieter than datasets for small files
        return read_jsonl(path)
    kind = {".json": "json", ".parquet": "parquet"}.get(path.suffix)
    if kind is None:
        raise SpecdecError(f"data file '{source}': unsupported extension; use .jsonl, .json or .parquet")
    import datasets

    if kind == "json":
        read_text(path)  # a file that is not UTF-8 is refused with a message, not a traceback
    records = datasets.load_dataset(kind, data_files=str(path), split="train")
    return [(f"{path} record {i}", r) for i, r in enumerate(records)]


def unusable(messages: list[dict[str, str]]) -> str | None:
    """Why a conversation cannot be trained on, or None: its prompt needs a user's turn with text
    before the first reply (dumps of chat logs hold empty and one-sided conversations)."""
    for m in messages:
        if m["role"] == "assistant":
            return "a reply before any user's turn"
        if m["role"] == "user":
            return None if m["content"].strip() else "an empty user's turn"
    return "no user's turn"


def load_conversations(
    source: str,
    *,
    split: str = "train",
    column: str | None = None,
    max_samples: int | None = None,
    skipped: Callable[[str], None] | None = None,
    max_left_out: float = 1.0,
) -> list[Conversation]:
    """Conversations from builtin:NAME, a local jsonl/json/parquet file, or hub:ID[@SUBSET] (HF datasets).
    A malformed or unusable record (unusable()) is an error naming it, or with `skipped`, is left out
    and the records left out are said once through it (how many, and the first one's reason); more
    than max_left_out of the records left out (a wrong column, a broken dump), or none usable, is an
    error."""
    records = _records(source, split)
    if max_samples:
        records = records[:max_samples]
    convs, left_out = [], []
    for i, (where, r) in enumerate(records):
        try:
            if not isinstance(r, dict):
                raise SpecdecError(f"{where}: expected a JSON object, got {type(r).__name__}")
            messages = to_messages(r, column, where)
            why = unusable(messages)
            if why is not None:
                raise SpecdecError(f"{where}: {why}")
        except SpecdecError as e:
            if skipped is None:
                raise
            left_out.append(str(e))
            continue
        cid = str(r.get("question_id", r.get("id", i)))
        convs.append(Conversation(cid, messages, r.get("category")))
    if not convs:
        first = f" (the first: {left_out[0]})" if left_out else ""
        raise SpecdecError(f"{source} has no usable records{first}")
    if left_out and len(left_out) > max_left_out * len(records):
        raise SpecdecError(
            f"{source}: {len(left_out)} of {len(records)} records cannot be used, more than the {max_left_out:.0%} "
            f"data.max_unusable allows (the first: {left_out[0]}): check data.column and data.split, or raise "
            "data.max_unusable"
        )
    if left_out and skipped is not None:
        skipped(f"{source}: left out {len(left_out)} of {len(records)} records (the first: {left_out[0]})")
    return convs


def mixed(sources: list[tuple[str, list[Conversation], float]], n: int) -> tuple[list[Conversation], str]:
    """Conversations from several sources [(name, conversations, weight)] in the proportions of their
    weights: n in all (0: as many as keep the proportions without repeating any), each source's
    taken round-robin over its categories; and a line saying what came from where."""
    total = sum(w for _, _, w in sources)
    shares = [(name, convs, w / total) for name, convs, w in sources]
    n = n or min(int(len(convs) / share) for _, convs, share in shares)
    picked, said = [], []
    for name, convs, share in shares:
        take = min(len(convs), round(n * share))
        picked += round_robin_by_category(convs, take)
        said.append(f"{take:,} of {len(convs):,} from {name} ({share:.0%})")
    return picked, "data.mix: " + ", ".join(said)


def render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool, **template: Any) -> str:
    """The messages as the model reads them: its chat template (template: the template's own
    arguments, e.g. enable_thinking), or for plain LMs the turns joined by blank lines."""
    if not getattr(tokenizer, "chat_template", None):  # plain LMs: turns joined by blank lines
        text = "\n\n".join(m["content"] for m in messages)
        return text + ("\n\n" if generation_prompt and messages else "")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **template)


def prompt_ids(tokenizer: Any, conv: Conversation) -> list[int]:
    """Token ids of the conversation's prompt with the assistant generation prompt appended."""
    return tokenizer.encode(render(tokenizer, conv.prompt, True), add_special_tokens=False)


def pre_query_ids(tokenizer: Any) -> list[int]:
    """The chat template up to where a user's message begins (the system turn, if the template
    has one, and the user's header): fed alone to an instruction-tuned model, it makes the model
    write a user's message (Magpie, Xu et al. 2024). Needs a chat template."""
    mark = "\x00SPECDEC-USER-MESSAGE\x00"
    if not getattr(tokenizer, "chat_template", None):
        raise SpecdecError(
            "responses.self_prompts needs a target with a chat template (it prompts the target with the template "
            "up to a user's turn): set responses.self_prompts=0 for this target"
        )
    text = render(tokenizer, [{"role": "user", "content": mark}], False)
    if mark not in text:
        raise SpecdecError("responses.self_prompts: the chat template drops the user's message; set it to 0")
    return tokenizer.encode(text[: text.index(mark)], add_special_tokens=False)


def self_written(tokenizer: Any, written: list[list[int]], stop_ids: frozenset[int]) -> list[Conversation]:
    """The user messages a model wrote after pre_query_ids() as one-turn conversations: those it
    finished (ended with a stop token), stripped, without repeats, in order."""
    convs, seen = [], set()
    for i, ids in enumerate(written):
        if not ids or ids[-1] not in stop_ids:
            continue  # cut off by the token limit
        text = tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
        if text and text not in seen:
            seen.add(text)
            convs.append(Conversation(f"self-{i}", [{"role": "user", "content": text}], "self"))
    return convs


def encode_conversation(tokenizer: Any, conv: Conversation, max_len: int | None = None) -> Example:
    """Token ids of a whole conversation; the mask marks the assistant turns (their end-of-turn too).

    The template is rendered for growing prefixes and each new piece is tokenized on its own, so
    every token belongs to exactly one message (templates must render prefixes as prefixes).
    """
    ids: list[int] = []
    mask: list[bool] = []
    done = ""
    for i, m in enumerate(conv.messages):
        pieces = []
        if m["role"] == "assistant":
            pieces.append((render(tokenizer, conv.messages[:i], True), False))  # the generation prompt
        pieces.append((render(tokenizer, conv.messages[: i + 1], False), m["role"] == "assistant"))
        for text, loss in pieces:
            if not text.startswith(done):
                raise SpecdecError(
                    f"conversation {conv.id}: the chat template does not render prefixes as prefixes; "
                    "use data.responses=target (self-distillation) for this model"
                )
            new = tokenizer.encode(text[len(done) :], add_special_tokens=False)
            ids += new
            mask += [loss] * len(new)
            done = text
    return Example(ids[:max_len] if max_len else ids, mask[:max_len] if max_len else mask, {"id": conv.id})


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask [B, T] and target_mask [B, T - 1] (predict t+1 at t)."""
    T = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(examples), T, dtype=torch.long)
    loss = torch.zeros(len(examples), T, dtype=torch.bool)
    for b, e in enumerate(examples):
        ids[b, : len(e.ids)] = torch.tensor(e.ids)
        attn[b, : len(e.ids)] = 1
        loss[b, : len(e.ids)] = torch.tensor(e.loss_mask)
    return {"input_ids": ids, "attention_mask": attn, "target_mask": loss[:, 1:]}


class Batches:
    """Deterministic global batches: step s always gets the same examples, so a resumed run sees
    exactly the data an uninterrupted one would. Each optimizer step takes
    micro_batch * grad_accum * world examples of a per-epoch seeded permutation; rank r gets its share.

    group_by_length: micro-batches of similar lengths (less padding: on random batches of the
    quickstart's data a quarter of every batch was padding). The permutation is cut into windows of
    64 micro-batches, each window sorted by length and cut into micro-batches, and the micro-batches
    are shuffled (seeded) into global batches, so a batch's length is random across steps."""

    WINDOW = 64  # micro-batches per window sorted by length

    def __init__(
        self,
        examples: list[Example],
        *,
        micro_batch: int,
        grad_accum: int,
        world: int,
        rank: int,
        seed: int,
        group_by_length: bool = False,
    ):
        self.examples, self.micro_batch, self.grad_accum = examples, micro_batch, grad_accum
        self.world, self.rank, self.seed, self.group_by_length = world, rank, seed, group_by_length
        self.global_batch = micro_batch * grad_accum * world
        if len(examples) < self.global_batch:
            raise SpecdecError(
                f"{len(examples)} training examples are fewer than one global batch "
                f"(micro_batch {micro_batch} x grad_accum {grad_accum} x {world} processes = {self.global_batch}): "
                "add data or lower trainer.micro_batch / trainer.grad_accum"
            )
        self.steps_per_epoch = len(examples) // self.global_batch

    def epoch(self, step: int) -> float:
        return step / self.steps_per_epoch

    def order(self, epoch: int) -> list[int]:
        """The examples of an epoch in the order its global batches take them."""
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        order = torch.randperm(len(self.examples), generator=g).tolist()
        if not self.group_by_length:
            return order
        n, window = self.micro_batch, self.micro_batch * self.WINDOW
        micro = []
        for w in range(0, len(order), window):
            chunk = sorted(order[w : w + window], key=lambda i: len(self.examples[i].ids))
            micro += [chunk[i : i + n] for i in range(0, len(chunk) - n + 1, n)]  # whole micro-batches
        shuffled = torch.randperm(len(micro), generator=g).tolist()
        return [i for m in shuffled for i in micro[m]]

    def step(self, step: int) -> list[list[Example]]:
        """This rank's grad_accum micro-batches for optimizer step `step` (0-based)."""
        epoch, offset = divmod(step, self.steps_per_epoch)
        order = self.order(epoch)
        begin = offset * self.global_batch + self.rank * self.micro_batch * self.grad_accum
        mine = [self.examples[i] for i in order[begin : begin + self.micro_batch * self.grad_accum]]
        return [mine[i : i + self.micro_batch] for i in range(0, len(mine), self.micro_batch)]


def round_robin_by_category(convs: list[Conversation], n: int) -> list[Conversation]:
    """The first n conversations taken round-robin over categories (all when n is 0)."""
    if not n or n >= len(convs):
        return convs
    by_cat: dict[Any, list[Conversation]] = {}
    for c in convs:
        by_cat.setdefault(c.category, []).append(c)
    picked, queues = [], list(by_cat.values())
    while len(picked) < n:
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    return picked


def with_responses(
    prompts: list[list[int]], responses: list[list[int]], max_len: int, cut: list[int] | None = None
) -> list[Example]:
    """Examples prompt + response with loss on the response tokens (empty responses dropped), at
    most max_len tokens; cut: gets the tokens cut from each response that did not fit (the caller
    says so)."""
    out = []
    for p, r in zip(prompts, responses):
        if r:
            if cut is not None and len(p) + len(r) > max_len:
                cut.append(len(p) + len(r) - max_len)
            ex = Example((p + r)[:max_len], ([False] * len(p) + [True] * len(r))[:max_len])
            if ex.n_targets:
                out.append(ex)
    return out


def responses_of(examples: Iterable[Example]) -> list[list[int]]:
    """The runs of tokens that carry loss in the examples (their responses, each turn apart)."""
    runs = []
    for ex in examples:
        run: list[int] = []
        for token, loss in zip(ex.ids, ex.loss_mask):
            if loss:
                run.append(token)
            elif run:
                runs.append(run)
                run = []
        if run:
            runs.append(run)
    return runs


def prompts_of(
    tokenizer: Any,
    source: str,
    n: int,
    split: str = "train",
    column: str | None = None,
    skipped: Callable[[str], None] | None = None,
) -> tuple[list[list[int]], list[Any]]:
    """Token ids (chat template and generation prompt applied) and categories of n prompts from a
    data source, spread over its categories (all when n is 0); skipped: as load_conversations."""
    convs = round_robin_by_category(load_conversations(source, split=split, column=column, skipped=skipped), n)
    return [prompt_ids(tokenizer, c) for c in convs], [c.category for c in convs]
