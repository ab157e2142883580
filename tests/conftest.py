"""Shared fixtures: tiny random models from configs, a bigram stub with fixed logits, a tiny
offline tokenizer, and the bundled SmolLM2-135M (converted once by scripts/setup.sh)."""

import json
import os
import struct

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from specdec_runtime.config import DecoderConfig  # noqa: E402
from specdec_runtime.model import Decoder, DecoderOutput  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu skip, saying why, where there is no CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs the gpu tests on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # spread-out logits: greedy argmax has no near-ties
)

# Qwen3-MoE: 8 experts of 32, 2 chosen per token, every layer sparse unless mlp_only_layers says
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=True, head_dim=32)  # fmt: skip


def tiny_hf_config(kind: str = "llama", **overrides):
    """A 2-layer, hidden-64 transformers config of the given family."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
               "qwen3_moe": Qwen3MoeConfig}  # fmt: skip
    extra = TINY_MOE if kind == "qwen3_moe" else {}
    return classes[kind](**{**TINY, **extra, **overrides})


def tiny_hf_model(kind: str = "llama", seed: int = 0, **overrides):
    """A random transformers causal LM (fp32, eval mode), deterministic for a seed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind, **overrides), attn_implementation="sdpa")
    return model.float().eval()


def runtime_from_hf(hf_model) -> Decoder:
    """Our Decoder with the same weights as a transformers model."""
    return Decoder.from_hf_state_dict(DecoderConfig.from_hf(hf_model.config), hf_model.state_dict())


def tiny_decoder(kind: str = "llama", seed: int = 0, **overrides) -> Decoder:
    return runtime_from_hf(tiny_hf_model(kind, seed, **overrides))


def assert_cache_is_a_fresh_prefill(target: Decoder, hf_model, tokens: list[int], atol=1e-5, rtol=1e-5) -> None:
    """The target's KV cache after generating `tokens` (prompt + output) holds exactly what a fresh
    prefill of all but the newest token writes (the newest is not cached yet)."""
    seq = torch.tensor([tokens[:-1]])
    n = seq.shape[1]
    fresh = runtime_from_hf(hf_model)
    fresh.setup_cache(1, n)
    fresh(seq, 0)
    torch.testing.assert_close(target.cache.kv[..., :n, :], fresh.cache.kv[..., :n, :], atol=atol, rtol=rtol)


class NoCache:
    """A stub's KV cache: a bigram model has no context to keep (tree branches need no moving)."""

    def move(self, src: torch.Tensor, dst: int) -> None:
        pass


class BigramStub(nn.Module):
    """A 'model' whose logits at each position depend only on that position's token: table[token].

    Speaks the Decoder interface the generate loop and drafters use, with fixed, known logits.
    """

    def __init__(self, table: torch.Tensor, context: int = 512):
        super().__init__()
        self.table = table.float()  # [V, V]
        self.config = DecoderConfig(
            vocab_size=table.shape[1], hidden_size=1, intermediate_size=1, num_layers=1, num_heads=1,
            num_kv_heads=1, head_dim=2, max_position_embeddings=context,
        )  # fmt: skip
        self.calls = 0
        self.cache = NoCache()
        self.compiled = False

    @property
    def device(self) -> torch.device:
        return self.table.device

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    def setup_cache(self, batch: int, size: int) -> None:
        pass

    def forward(self, ids, start, *, logits_to_keep=0, **_):
        self.calls += 1
        logits = self.table[ids]  # [B, T, V]
        return DecoderOutput(logits[:, -logits_to_keep:] if logits_to_keep else logits, None)

    def prefill(self, ids, **kwargs):
        return self.forward(ids, 0, **kwargs)


def assert_follows(samples: list[int], probs: torch.Tensor) -> None:
    """Chi-square goodness of fit of samples (token ids) to probs [V]; p = 0 cells must stay empty."""
    from scipy.stats import chisquare

    c, p = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double(), probs.double()
    assert c[p == 0].sum() == 0, "sampled a token of probability 0"
    keep = p > 0
    expected = p[keep] / p[keep].sum() * c.sum()
    assert chisquare(c[keep].numpy(), expected.numpy()).pvalue > 1e-3


def sequence_joint(next_logits, prompt: list[int], n: int, **warp_kw) -> dict[tuple[int, ...], float]:
    """The exact probability of every sequence of n tokens sampled after prompt (sampling.warp with
    warp_kw): next_logits(ids) gives the logits [V] of the token after the list ids."""
    from specdec_runtime.sampling import warp

    joint = {(): 1.0}
    for _ in range(n):
        longer = {}
        for seq, p in joint.items():
            probs = warp(next_logits(prompt + list(seq)), **warp_kw)
            for t in probs.nonzero().flatten().tolist():
                longer[seq + (t,)] = p * float(probs[t])
        joint = longer
    return joint


def assert_sequences_follow(samples: list[list[int]], joint: dict[tuple[int, ...], float]) -> None:
    """assert_follows over whole sequences (sequence_joint); one outside the joint fails it."""
    cell = {seq: i for i, seq in enumerate(joint)}
    assert_follows([cell.get(tuple(s), len(cell)) for s in samples], torch.tensor([*joint.values(), 0.0]))


def assert_not_follows(samples: list[int], probs: torch.Tensor) -> None:
    """The same test rejects a wrong distribution (shows the test has power)."""
    from scipy.stats import chisquare

    c, p = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double(), probs.double().clamp(min=1e-9)
    assert chisquare(c.numpy(), (p / p.sum() * c.sum()).numpy()).pvalue < 1e-6


def bigram_table(V: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) * scale


def bigram_greedy(table: torch.Tensor, first: int, n: int) -> list[int]:
    """The bigram model's own greedy continuation of `first` (n tokens)."""
    out, t = [], first
    for _ in range(n):
        t = int(table[t].argmax())
        out.append(t)
    return out


def exact_joint(table: torch.Tensor, first: int, n: int, **warp_kwargs) -> torch.Tensor:
    """P(t1..tn | first) of a bigram model under the warped distribution, flattened [V**n]."""
    import itertools

    from specdec_runtime.sampling import warp

    p = warp(table, **warp_kwargs)  # [V, V]
    V = table.shape[0]
    joint = torch.zeros([V] * n)
    for seq in itertools.product(range(V), repeat=n):
        prob, prev = 1.0, first
        for t in seq:
            prob *= float(p[prev, t])
            prev = t
        joint[seq] = prob
    return joint.flatten()


def save_tiny_tokenizer(path: Path, extra_tokens: tuple[str, ...] = ()):
    """A 34-token character-level tokenizer with a chat template; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<eot>": 3}
    for ch in "abcdefghijklmnopqrstuvwxyz ,.!?" + "".join(extra_tokens):
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<eot>"],
    )
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}<eot>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    tok.save_pretrained(path)
    return tok


def save_tiny_model(path: Path, kind: str = "llama", seed: int = 0, **overrides) -> Path:
    """A tiny model folder as users have them: config, safetensors, tokenizer, generation config."""
    tok = save_tiny_tokenizer(path)
    model = tiny_hf_model(kind, seed, **{"vocab_size": len(tok), "bos_token_id": 1, "eos_token_id": 2, **overrides})
    model.save_pretrained(path)
    return path


WORDS = "apple river stone cloud green quick lazy small brave happy quiet north".split()


def write_prompt_file(path: Path, n: int, *, stride: int, suffix: str) -> Path:
    """n MT-Bench-form prompts "<word i> <word stride*i><suffix>" in categories a and b, words
    a character-level tiny tokenizer covers."""
    texts = [f"{WORDS[i % 12]} {WORDS[(stride * i) % 12]}{suffix}" for i in range(n)]
    rows = [{"question_id": f"p{i}", "category": "ab"[i % 2], "turns": [t]} for i, t in enumerate(texts)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


@pytest.fixture(scope="session")
def bundled():
    """The bundled SmolLM2-135M-Instruct, loaded once for the session (fp32, CPU)."""
    from specdec_runtime.loading import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def bundled_hf():
    from specdec_runtime.loading import load_hf_model

    return load_hf_model("smollm2-135m-instruct").eval()


ROOT = Path(__file__).resolve().parents[1]


def accelerate_launch(config: str, args: list[str], processes: int = 2, timeout: int = 300):
    """`accelerate launch --config_file conf/accelerate/<config>.yaml` of `args` (e.g. ["-m", "recipes.distill",
    ...]) with `processes` CPU processes in full precision (the flags override the file's GPU values).
    On a machine with GPUs the processes still run on the CPU: multi_cpu.yaml hides the GPUs itself
    (that is what its test checks there); for the others this helper hides them."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a free port, so launches of parallel test runs do not collide
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "conf" / "accelerate" / f"{config}.yaml"),
        "--num_processes", str(processes), "--mixed_precision", "no", "--main_process_port", str(port),
        *args,
    ]  # fmt: skip
    env = dict(os.environ) | ({} if config == "multi_cpu" else {"CUDA_VISIBLE_DEVICES": ""})
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def wandb_records(path: Path) -> list:
    """Records of an offline .wandb file: a 7-byte W&B header, then LevelDB-log records in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, out, part = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's zero trailer
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0 and length == 0 or pos + 7 + length > len(data):  # (the end, or a record still being written)
            break
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def offline_run(out: Path) -> tuple[list[dict], set[str], list]:
    """(history rows, config keys, artifact records) of the one offline W&B run under out/wandb."""
    import time

    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    for _ in range(100):  # W&B's service process may still be writing the file after run.finish()
        records = wandb_records(run_file)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds:
            break
        time.sleep(0.2)
    history = [
        {("/".join(i.nested_key) or i.key): json.loads(i.value_json) for i in r.history.item}
        for r, k in zip(records, kinds)
        if k == "history"
    ]
    # The config arrives with the run record (wandb.init) or as later config records, depending on timing.
    configs = [r.config for r, k in zip(records, kinds) if k == "config"]
    configs += [r.run.config for r, k in zip(records, kinds) if k == "run"]
    config_keys = {i.key for c in configs for i in c.update}
    return history, config_keys, [r.artifact for r, k in zip(records, kinds) if k == "artifact"]
