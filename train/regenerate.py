"""Regenerating a chat dataset with the target: every assistant turn rewritten by the target, each
with the conversation so far as the target wrote it (recipes/regenerate.py runs it as a job).

    engine = InProcess(hf_model, tokenizer, pad_id=2, stop_ids={2}, max_new_tokens=1024)
    engine = Server("http://127.0.0.1:8000", "meta-llama/Llama-3.1-8B-Instruct", max_new_tokens=1024, concurrency=64)
    regenerate(conversations, engine, Path("runs/regenerated"), rank=0, world=8, chunk=256)
    # -> runs/regenerated/part-w8-r0-00000.jsonl, ...: {"id", "category", "messages"} records,
    #    which `data.train=runs/regenerated` reads as they are

A conversation [u1, a1, u2, a2, ...] becomes [u1, a1', u2, a2', ...]: a1' answers u1, a2' answers
[u1, a1', u2], ... (later turns see the target's own earlier answers, as it will at run time); a
conversation that ends with a user's turn gets an answer to it. Process r of w takes conversations
r, r + w, ..., in chunks; each chunk is written to its own file when its last turn is done (under a
temporary name, then renamed): nothing is gathered at the end, a killed job loses at most the
chunks in progress, and a rerun with the same process count skips the chunks that exist. Turns are
generated round by round: the first turns of a chunk's conversations together, then the second ones.
"""

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from specdec_runtime.errors import SpecdecError
from train.data import Conversation, render
from train.responses import batch_generator

Messages = list[dict[str, str]]


class Engine(Protocol):
    def replies(self, conversations: Sequence[Messages]) -> list[str]:
        """The target's reply to each conversation (each ends with a user's turn)."""
        ...


class InProcess:
    """The target in this process: chat template, batched generation (train/responses.py's)."""

    def __init__(self, model: Any, tokenizer: Any, *, pad_id: int, stop_ids: frozenset[int], max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, batch_size: int = 16,
                 thinking: bool | None = None):  # fmt: skip
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.template = {} if thinking is None else {"enable_thinking": thinking}
        self.generate = batch_generator(model, pad_id=pad_id, stop_ids=stop_ids, max_new_tokens=max_new_tokens,
                                         temperature=temperature, top_p=top_p, seed=seed)  # fmt: skip

    def replies(self, conversations: Sequence[Messages]) -> list[str]:
        ids = [
            self.tokenizer.encode(render(self.tokenizer, m, True, **self.template), add_special_tokens=False)
            for m in conversations
        ]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch
        out: list[str] = [""] * len(ids)
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            for i, reply in zip(idx, self.generate([ids[i] for i in idx])):
                out[i] = self.tokenizer.decode(reply, skip_special_tokens=True).strip()
        return out


class Server:
    """An OpenAI-compatible server (`vllm serve`, SGLang, ...): its /v1/chat/completions, up to
    `concurrency` requests at a time, each retried `retries` times (with backoff) on a refused
    connection, a timeout, a 429 or a 5xx."""

    def __init__(self, url: str, model: str, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 concurrency: int = 16, retries: int = 5, timeout_s: float = 600.0, thinking: bool | None = None,
                 backoff_s: float = 1.0):  # fmt: skip
        self.endpoint = url.rstrip("/") + "/v1/chat/completions"
        self.body = {"model": model, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        if thinking is not None:  # vLLM and SGLang pass it to the chat template
            self.body["chat_template_kwargs"] = {"enable_thinking": thinking}
        self.concurrency, self.retries, self.timeout_s, self.backoff_s = concurrency, retries, timeout_s, backoff_s

    def replies(self, conversations: Sequence[Messages]) -> list[str]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._reply, conversations))

    def _reply(self, messages: Messages) -> str:
        data = json.dumps(self.body | {"messages": messages}).encode()
        request = urllib.request.Request(self.endpoint, data, {"Content-Type": "application/json"})
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())["choices"][0]["message"]["content"].strip()
            except urllib.error.HTTPError as e:
                if e.code != 429 and e.code < 500:  # the request itself is wrong: retrying will not help
                    raise SpecdecError(f"{self.endpoint}: HTTP {e.code}: {e.read()[:300]!r}") from None
                why = f"HTTP {e.code}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                why = str(getattr(e, "reason", e))
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        raise SpecdecError(
            f"{self.endpoint}: no answer after {self.retries + 1} tries ({why}): is the server up and serving "
            f"'{self.body['model']}' (engine.url, engine.served_model)?"
        )


def regenerate_chunk(conversations: Sequence[Conversation], engine: Engine) -> list[dict[str, Any]]:
    """The conversations with every assistant turn the target's (see the module docstring)."""
    written: list[Messages] = [[] for _ in conversations]
    position = [0] * len(conversations)  # the next original message of each conversation
    while True:
        asking = []  # conversations whose next original message is a user's turn (with any system turn before it)
        for c, conv in enumerate(conversations):
            messages, p = conv.messages, position[c]
            while p < len(messages) and messages[p]["role"] != "user":
                if messages[p]["role"] == "system":
                    written[c].append(messages[p])
                p += 1  # an original assistant's turn: the target's replaces it
            if p < len(messages):
                written[c].append(messages[p])
                asking.append(c)
            position[c] = p + 1
        if not asking:
            break
        for c, reply in zip(asking, engine.replies([written[c] for c in asking])):
            written[c].append({"role": "assistant", "content": reply})
    return [{"id": conv.id, "category": conv.category, "messages": m} for conv, m in zip(conversations, written)]


def regenerate(
    conversations: Sequence[Conversation],
    engine: Engine,
    out: Path,
    *,
    rank: int = 0,
    world: int = 1,
    chunk: int = 256,
    progress: Callable[[int], Any] | None = None,
) -> int:
    """This process's share, chunk by chunk, into out/part-w{world}-r{rank}-{k}.jsonl; returns how
    many conversations it wrote (chunks already there are kept)."""
    out.mkdir(parents=True, exist_ok=True)
    other = sorted({f.name.split("-")[1] for f in out.glob("part-*.jsonl")} - {f"w{world}"})
    if other:
        raise SpecdecError(
            f"{out} holds a regeneration by {other[0][1:]} processes: rerun with as many (its chunks are kept), "
            "or give a new output_dir"
        )
    mine = list(conversations[rank::world])
    chunks = [mine[i : i + chunk] for i in range(0, len(mine), chunk)]
    bar = progress(len(mine)) if progress else None
    written = 0
    for k, part in enumerate(chunks):
        path = out / f"part-w{world}-r{rank}-{k:05d}.jsonl"
        if not path.is_file():
            records = regenerate_chunk(part, engine)
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
            os.replace(tmp, path)
            written += len(records)
        if bar is not None:
            bar.update(len(part))
    if bar is not None:
        bar.close()
    return written
