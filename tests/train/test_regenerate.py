"""The regeneration job (recipes/regenerate.py, train/regenerate.py): every assistant turn the
target's, each seeing the target's earlier answers; shards per process, resumed after a kill; the
server engine against a real HTTP server on loopback serving the bundled model, whose answers are
the in-process engine's; the output read as it is by data.train."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from recipes import regenerate as recipe
from specdec_runtime.errors import SpecdecError
from train.data import Conversation, load_conversations
from train.regenerate import InProcess, Server, regenerate, regenerate_chunk
from train.validate import runtime_decoder

CONF = Path(__file__).resolve().parents[2] / "conf"


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


class Echo:
    """A stand-in engine: answers with what it was asked, and records every request."""

    def __init__(self, fail_after: int | None = None):
        self.requests: list[list[dict]] = []
        self.fail_after = fail_after

    def replies(self, conversations):
        if self.fail_after is not None and len(self.requests) >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.requests += [list(c) for c in conversations]
        return [f"answer to {c[-1]['content']} after {len(c)} messages" for c in conversations]


def test_every_assistant_turn_is_the_targets_and_later_turns_see_its_answers():
    system = {"role": "system", "content": "Be brief."}
    convs = [
        Conversation("multi", [system, user("u1"), assistant("a1"), user("u2"), assistant("a2"), user("u3")], "x"),
        Conversation("one", [user("q"), assistant("dataset's answer")], "y"),
    ]
    engine = Echo()
    (multi, one) = regenerate_chunk(convs, engine)
    r1, r2, r3 = (f"answer to u{i} after {2 * i} messages" for i in (1, 2, 3))
    assert multi["messages"] == [
        system,
        user("u1"),
        assistant(r1),
        user("u2"),
        assistant(r2),
        user("u3"),
        assistant(r3),
    ]
    assert one == {"id": "one", "category": "y", "messages": [user("q"), assistant("answer to q after 1 messages")]}
    # the second turn was asked with the target's first answer, not the dataset's
    assert [system, user("u1"), assistant(r1), user("u2")] in engine.requests
    assert len(engine.requests) == 4  # round 1: both first turns together; then u2, then u3


def test_processes_write_their_own_chunks_and_a_killed_run_resumes(tmp_path):
    convs = [Conversation(f"c{i}", [user(f"q{i}"), assistant("old")], None) for i in range(10)]
    killed = Echo(fail_after=4)  # rank 0 (c0, c2, ..., c8), chunks of 2: killed in its 3rd chunk
    with pytest.raises(KeyboardInterrupt):
        regenerate(convs, killed, tmp_path, rank=0, world=2, chunk=2)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["part-w2-r0-00000.jsonl", "part-w2-r0-00001.jsonl"]
    rerun = Echo()
    assert regenerate(convs, rerun, tmp_path, rank=0, world=2, chunk=2) == 1  # c8 alone, the rest kept
    assert [r[-1]["content"] for r in rerun.requests] == ["q8"]
    assert regenerate(convs, Echo(), tmp_path, rank=1, world=2, chunk=2) == 5
    got = load_conversations(str(tmp_path))  # data.train=OUTPUT_DIR reads the folder as it is
    assert sorted(c.id for c in got) == sorted(c.id for c in convs)
    assert all(c.messages[-1]["content"] == f"answer to q{c.id[1:]} after 1 messages" for c in got)
    with pytest.raises(SpecdecError, match="holds a regeneration by 2 processes: rerun with as many"):
        regenerate(convs, Echo(), tmp_path, rank=0, world=4, chunk=2)


class ChatServer(BaseHTTPRequestHandler):
    """/v1/chat/completions of the bundled model, greedy, as vLLM answers it (the first request of
    each conversation is refused with a 503 first, so that every answer comes after a retry)."""

    model = tokenizer = None
    refused: set = set()
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = json.dumps(body["messages"])
        with self.lock:
            first = key not in self.refused
            self.refused.add(key)
        if first or self.path != "/v1/chat/completions":
            self.send_response(503 if first else 404)
            self.end_headers()
            return
        with self.lock:  # one generation at a time (the model is shared)
            text = self.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([self.tokenizer.encode(text, add_special_tokens=False)])
            with torch.inference_mode():
                out = self.model.generate(ids, max_new_tokens=body["max_tokens"], do_sample=False,
                                          pad_token_id=self.tokenizer.eos_token_id)  # fmt: skip
            reply = self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def chat_server(bundled_hf):
    from transformers import AutoTokenizer

    from specdec_runtime.paths import resolve_model

    ChatServer.model, ChatServer.refused = bundled_hf, set()
    ChatServer.tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), ChatServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_server_engine_regenerates_what_the_target_writes_in_process(chat_server, bundled_hf, tmp_path):
    """recipes.regenerate with engine.kind=server against the loopback server (each request refused
    once, then answered): its conversations are the in-process engine's, turn for turn, whether
    transformers' generate or the runtime's batched decoding writes them (batches of 2: padded)."""
    rows = [
        {"id": "a", "messages": [user("Name a red fruit."), assistant("An apple."), user("And a yellow one?")]},
        {"id": "b", "conversations": [{"from": "human", "value": "Two plus two?"}, {"from": "gpt", "value": "4"}]},
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "regenerated"
    overrides = [f"data.train={data}", f"output_dir={out}", "engine.kind=server", f"engine.url={chat_server}",
                 "engine.retries=2", "generation.max_new_tokens=12", "device=cpu"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        recipe.run(compose("regenerate", overrides=overrides))
    served = {c.id: c.messages for c in load_conversations(str(out))}
    tokenizer, convs = ChatServer.tokenizer, load_conversations(str(data))
    stop = dict(pad_id=tokenizer.eos_token_id, stop_ids=frozenset({tokenizer.eos_token_id}))
    runtime = runtime_decoder(bundled_hf, None, torch.device("cpu"), fast_path=False)
    for model in (bundled_hf, runtime):  # engine.backend: transformers' generate, the runtime's batches
        here = InProcess(model, tokenizer, max_new_tokens=12, batch_size=2, **stop)
        assert served == {r["id"]: r["messages"] for r in regenerate_chunk(convs, here)}
    assert len(served["a"]) == 4 and served["a"][1]["content"] != "An apple."
    assert all(m["content"] for c in served.values() for m in c if m["role"] == "assistant")  # the model wrote them
    settings = json.loads((out / "regenerate.json").read_text())
    assert settings["engine"]["kind"] == "server" and settings["conversations"] == 2


def test_a_server_that_never_answers_is_an_error_naming_it():
    engine = Server("http://127.0.0.1:9", "m", max_new_tokens=4, retries=1, timeout_s=2, backoff_s=0.01)
    with pytest.raises(SpecdecError, match=r"127.0.0.1:9/v1/chat/completions: no answer after 2 tries"):
        engine.replies([[user("hi")]])


@pytest.mark.parametrize(
    "override, message",
    [
        ("engine.kind=server", "engine.kind=server needs engine.url=http://HOST:PORT"),
        ("engine.kind=grpc", "engine.kind='grpc'"),
        ("generation.chunk=0", "generation.chunk=0 must be an integer >= 1"),
        ("generation.thinking=maybe", "generation.thinking=maybe"),
    ],
)
def test_bad_settings_are_refused_before_anything_loads(override, message, tmp_path):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("regenerate", overrides=[override, f"output_dir={tmp_path / 'out'}"])
    with pytest.raises(SpecdecError, match=message):
        recipe.run(cfg)
    assert not (tmp_path / "out").exists()
