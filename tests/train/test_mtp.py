"""MTP: sequential per-head backward against the naive summed loss (1 and 2 processes), the model
against transformers, the corpus, the runtime drafter (greedy exact, sampling lossless), the
recipe end to end (pinned losses, export that transformers loads, resume) and its errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from recipes import mtp as recipe
from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.loading import load_model
from specdec_runtime.sampling import Sampler
from tests.conftest import accelerate_launch, assert_follows, save_tiny_model
from tests.train.mtp_grad_worker import global_batch, tiny_mtp
from train.corpus import Document, corpus_documents, pack, packed_corpus
from train.mtp import MTPModel, head_loss, mtp_step

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
WEIGHTS = [1.0, 0.5, 0.25]


def naive_grads(model: MTPModel, ids: torch.Tensor, weights=WEIGHTS) -> dict[str, torch.Tensor]:
    """The oracle: sum_i w_i CE_i over every position written out, one backward, mean over positions."""
    model.zero_grad(set_to_none=True)
    n, S = model.num_heads, ids.shape[1]
    out = model.lm.model(input_ids=ids, output_hidden_states=True)
    z = out.hidden_states[model.trunk_layers]  # the trunk's output, via transformers' own forward
    loss = 0
    for i in range(n):
        h = model.lm.model.norm(
            model.head_layer(i)(z, position_embeddings=model.lm.model.rotary_emb(z, torch.arange(S)[None]))
        )
        logits = model.lm.lm_head(h)
        for t in range(S - n):
            loss = loss + weights[i] * torch.nn.functional.cross_entropy(
                logits[:, t], ids[:, t + 1 + i], reduction="sum"
            )
    (loss / (ids.shape[0] * (S - n))).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_head0_and_trunk_are_the_transformers_model():
    model = tiny_mtp()
    ids = global_batch(2, 16)
    with torch.no_grad():
        logits = model(ids)[0]  # head 0 at the first S - n positions
        want = model.lm(ids).logits[:, : logits.shape[1]]
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trainable", ["all", "heads", "new_heads"])
def test_sequential_backward_equals_the_naive_summed_loss(trainable):
    model = tiny_mtp()
    model.set_trainable(trainable)
    ids = global_batch(4, 20)
    want = naive_grads(model, ids)
    model.zero_grad(set_to_none=True)
    n_pos = ids.shape[0] * (ids.shape[1] - model.num_heads)
    loss, metrics = mtp_step(model, ids, weights=WEIGHTS, scale=1 / n_pos, backward=torch.Tensor.backward)
    got = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    frozen = {k for k, p in model.named_parameters() if not p.requires_grad}
    assert not frozen & set(got)
    if trainable == "new_heads":
        assert all(k.startswith("heads.") for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)
    # the naive mode of the same function gives the same gradients and metrics
    model.zero_grad(set_to_none=True)
    loss2, metrics2 = mtp_step(
        model, ids, weights=WEIGHTS, scale=1 / n_pos, backward=torch.Tensor.backward, sequential=False
    )
    for k in want:
        torch.testing.assert_close(model.get_parameter(k).grad, want[k], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, loss2)
    for k in metrics:
        torch.testing.assert_close(metrics[k], metrics2[k])


def test_head_loss_targets_are_i_plus_1_ahead():
    V = 10
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    for i in range(3):
        logits = torch.full((1, 3, V), -30.0)
        logits[0, torch.arange(3), ids[0, 1 + i : 4 + i]] = 30.0  # a perfect head i
        loss, correct = head_loss(logits, ids, i)
        assert loss.item() < 1e-6 and correct.item() == 3


# one process through accelerate launch (~13 s) is -m slow: the default run keeps the two-process case
@pytest.mark.parametrize("processes", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_recipe_backward_fn_gradients_match_naive_across_processes(processes, tmp_path):
    """The recipe's backward_fn under accelerate (DDP-wrapped, 2 accumulation micro-batches), with
    1 process or 2 gloo processes, gives rank 0 the naive gradient of the whole global batch:
    DDP does not reduce per head (twice) and no parameter is left unreduced."""
    out = tmp_path / "grads.pt"
    worker = ["-m", "tests.train.mtp_grad_worker", str(out)]
    if processes == 1:
        proc = subprocess.run([sys.executable, *worker], cwd=ROOT, capture_output=True, text=True, timeout=300)
    else:
        proc = accelerate_launch("multi_cpu", worker)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    want = naive_grads(tiny_mtp(), global_batch())
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- corpus


def test_stdlib_corpus_is_split_by_file_and_packed_with_eos():
    train, val = corpus_documents("stdlib", val_fraction=0.05)
    train_ids, val_ids = {d.id for d in train}, {d.id for d in val}
    assert not train_ids & val_ids and len(val) > 10
    assert "os.py" in train_ids | val_ids
    again = corpus_documents("stdlib", val_fraction=0.05)[1]
    assert [d.id for d in again] == [d.id for d in val]  # stable split
    seqs = pack([[5, 6, 7], [8, 9]], seq_len=3, eos_id=0)
    assert seqs.tolist() == [[5, 6, 7], [0, 8, 9]]  # [5 6 7 0 8 9 0] cut into 3s, the tail dropped


def test_local_corpus_and_its_errors(tmp_path):
    from tests.conftest import save_tiny_tokenizer

    tok = save_tiny_tokenizer(tmp_path / "tok")
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"hello world number {'abc'[i % 3]}"}) for i in range(60)))
    train, val, info = packed_corpus(tok, str(f), seq_len=16, cache_dir=tmp_path / "cache", val_fraction=0.2)
    assert train.shape[1] == 16 and val.numel() > 0 and info["val_documents"] + info["train_documents"] == 60
    again = packed_corpus(tok, str(f), seq_len=16, cache_dir=tmp_path / "cache", val_fraction=0.2)
    assert torch.equal(again[0], train)  # from the cache
    with pytest.raises(SpecdecError, match="no column 'body'"):
        corpus_documents(str(f), column="body")
    with pytest.raises(SpecdecError, match="no such file"):
        corpus_documents(str(tmp_path / "missing*.jsonl"))
    assert Document("a", "b").text == "b"


# ---------------------------------------------------------------- recipe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tokenizer-only model folder (the recipe pretrains from scratch) and a repetitive corpus
    that a tiny model learns in a few steps, so that its heads' drafts get accepted."""
    root = tmp_path_factory.mktemp("mtp")
    model = save_tiny_model(root / "tok", num_hidden_layers=1)
    phrases = ["the quick brown fox jumps over the lazy dog. ", "a big cat sat on a small mat. "]
    rows = [{"text": phrases[i % 2] * 6} for i in range(80)]
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in rows))
    return model, corpus, root / "cache"


def overrides(tiny, out: Path, *extra: str) -> list[str]:
    model, corpus, cache = tiny
    return [
        f"output_dir={out}",
        "device=cpu",  # the pinned losses are CPU numerics (CUDA training: the gpu tests)
        f"model.name={model}",
        f"data.corpus={corpus}",
        f"data.cache_dir={cache}",
        "data.val_fraction=0.1",
        "mtp.num_heads=3",
        "mtp.architecture.trunk_layers=2",
        "mtp.architecture.hidden_size=32",
        "mtp.architecture.intermediate_size=64",
        "mtp.architecture.max_position_embeddings=128",
        "trainer.max_seq_len=32",
        "trainer.micro_batch=4",
        "trainer.grad_accum=2",
        "trainer.max_steps=12",
        "trainer.log_every=1",
        "trainer.checkpoint_every=6",
        "optim.lr=1e-2",
        "optim.warmup_steps=2",
        "validate.num_prompts=4",
        "validate.prompt_tokens=8",
        "validate.max_new_tokens=24",
        "validate.eval_sequences=8",
        *extra,
    ]


def config(tiny, out: Path, *extra: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("mtp", overrides=overrides(tiny, out, *extra))


def logged(out: Path, key: str = "train/loss") -> list[float]:
    return [json.loads(line)[key] for line in (out / "log.jsonl").read_text().splitlines() if key in line]


# Pinned on torch 2.13.0 CPU (seeded tiny run on a fixed corpus).
PINNED = [
    10.77615452, 10.31024551, 10.05106831, 9.74052048, 9.48080063, 9.26791954,
    9.33553123, 9.13559818, 8.96687698, 8.67960644, 8.52086163, 8.46306419,
]  # fmt: skip


def test_recipe_pinned_losses_selfspeculation_and_export(tiny, tmp_path):
    out = tmp_path / "run"
    result = recipe.run(config(tiny, out))
    got = logged(out)
    assert got == pytest.approx(PINNED, rel=1e-4, abs=1e-6)
    for i in range(3):
        assert f"train/loss_{i}" in (out / "log.jsonl").read_text() and f"loss_{i}" in result["heldout"]
    v = result["validation"]
    assert v["lossless"] == 1.0 and v["tau"] > 1.5  # the heads learned the phrases: drafts get accepted

    export = out / "export"
    meta = json.loads((export / "specdec" / "mtp_config.json").read_text())
    assert meta["num_heads"] == 3 and meta["trunk_layers"] == 2
    # trunk + head 0 is an ordinary transformers causal LM with head 0's logits
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(export).eval()
    assert hf.config.num_hidden_layers == 3
    ids = torch.randint(0, 30, (2, 20), generator=torch.Generator().manual_seed(0))
    trained = recipe_model_from_export(export)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits[:, :17], trained(ids)[0], rtol=1e-5, atol=1e-5)

    # `specdec generate --target export --drafter mtp`: greedy output is the model's own, drafts accepted
    target = load_model(str(export), device="cpu", dtype="float32")
    drafter = build_drafter("mtp", target)
    prompt = target.tokenizer.encode("the quick brown")
    spec = generate(target.model, prompt, drafter, max_new_tokens=30, gamma=2, stop_ids=target.stop_ids)
    ar = generate(target.model, prompt, None, max_new_tokens=30, stop_ids=target.stop_ids)
    with torch.no_grad():
        hf_greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt) :]
    hf_greedy = hf_greedy.tolist()
    eos = [i for i, t in enumerate(hf_greedy) if t in target.stop_ids]
    assert spec.tokens == ar.tokens == hf_greedy[: eos[0] + 1 if eos else None]
    assert spec.stats.tau > 1.5

    # resume: drop the last checkpoint and what was logged after the first one; the rerun continues
    # from step 6 with exactly the losses of the uninterrupted run
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("export"))
    shutil.rmtree(resumed / "checkpoints" / "step-0000012")
    lines = (resumed / "log.jsonl").read_text().splitlines()
    (resumed / "log.jsonl").write_text("".join(f"{x}\n" for x in lines if json.loads(x)["step"] <= 6))
    recipe.run(config(tiny, resumed, "validate.enabled=false"))
    assert logged(resumed) == pytest.approx(got, rel=1e-6, abs=1e-7)


def recipe_model_from_export(export: Path) -> MTPModel:
    """The MTP model rebuilt from an export (transformers LM + heads file): both parts round-trip."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(export).eval()
    model = MTPModel.attach(lm, json.loads((export / "specdec" / "mtp_config.json").read_text())["num_heads"])
    sd = load_file(str(export / "specdec" / "mtp_heads.safetensors"))
    for i, layer in enumerate(model.heads, 1):
        layer.load_state_dict({k.split(".", 2)[2]: v for k, v in sd.items() if k.startswith(f"heads.{i}.")})
    return model.eval()


def test_runtime_heads_equal_the_training_heads_and_sampling_is_lossless(tiny, tmp_path):
    """The runtime drafter's logits are the training heads' logits (transformers layers) at every
    position; sampled self-speculation follows the model's own distribution (chi-square)."""
    from specdec_runtime.drafters.mtp import MTPDrafter, MTPHeads
    from train.mtp import heads_state_dict
    from train.validate import runtime_decoder

    torch.manual_seed(3)
    model = tiny_mtp()
    target = runtime_decoder(model.lm, None, torch.device("cpu"), torch.float32)
    heads = MTPHeads.from_hf_state_dict(
        target.config, heads_state_dict(model), 3, model.trunk_layers, "cpu", torch.float32
    )
    drafter = MTPDrafter(heads, target)
    ids = global_batch(1, 12)
    target.setup_cache(1, 32)
    drafter.start(ids[0], 32)
    out = target(ids[:, :5], 0, taps=drafter.hidden_layers)
    drafter.observe(out.hidden[0])
    got = [drafter.logits]
    for t in range(5, 12):  # one accepted position at a time
        out = target(ids[:, t : t + 1], t, taps=drafter.hidden_layers)
        drafter.observe(out.hidden[0])
        got.append(drafter.logits)
    with torch.no_grad():
        z, ctx = model.trunk(ids)
        want = torch.stack([model.head_logits(i, z, ctx, 12)[0] for i in (1, 2)], dim=1)  # [12, 2, V]
    torch.testing.assert_close(torch.stack(got), want[4:], rtol=1e-4, atol=1e-4)

    # sampling: the first 3 new tokens (the 2nd and 3rd through a draft) follow the exact joint
    prompt = [5, 17, 33]
    sampler_kw = dict(temperature=1.0, top_k=3)
    samples = []
    sampler = Sampler(**sampler_kw, seed=0)
    for _ in range(1500):
        toks = generate(target, prompt, drafter, sampler, max_new_tokens=3, gamma=2).tokens
        samples.append(toks)
    from specdec_runtime.sampling import warp

    with torch.no_grad():

        def probs(seq):
            return warp(model.lm(torch.tensor([seq])).logits[0, -1], 1.0, top_k=3)

        p1 = probs(prompt)
        joint = {}
        for a in p1.nonzero().flatten().tolist():
            p2 = probs(prompt + [a])
            for b in p2.nonzero().flatten().tolist():
                p3 = probs(prompt + [a, b])
                for c in p3.nonzero().flatten().tolist():
                    joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    keys = sorted(joint)
    index = {k: i for i, k in enumerate(keys)}
    assert all(tuple(s) in index for s in samples)
    assert_follows([index[tuple(s)] for s in samples], torch.tensor([joint[k] for k in keys]))


def test_config_errors_come_before_any_work(tiny, tmp_path):
    cases = {
        "mtp.num_heads=0": "num_heads",
        "mtp.loss_weights=[1,1]": "loss_weights",
        "mtp.backward=fast": "mtp.backward",
        "mtp.trainable=some": "mtp.trainable",
        "mtp.init=mine": "mtp.init",
        "trainer.max_seq_len=3": "max_seq_len",
        "validate.prompt_tokens=40": "prompt_tokens",
        "mtp.architecture.hidden_size=30": "architecture",
    }
    for override, message in cases.items():
        with pytest.raises(SpecdecError, match=message):
            recipe.run(config(tiny, tmp_path / "bad", override))
    assert not (tmp_path / "bad").exists()
    with pytest.raises(SpecdecError, match="no such file"):
        recipe.run(config(tiny, tmp_path / "bad2", f"data.corpus={tmp_path}/none.jsonl"))


def test_bf16_autocast_sequential_matches_naive():
    """Mixed precision: under bf16 autocast both modes run the same ops, so gradients agree closely."""
    model = tiny_mtp()
    ids = global_batch(2, 16)
    n_pos = ids.shape[0] * (ids.shape[1] - model.num_heads)
    grads = []
    for sequential in (False, True):
        model.zero_grad(set_to_none=True)
        mtp_step(
            model,
            ids,
            weights=WEIGHTS,
            scale=1 / n_pos,
            backward=torch.Tensor.backward,
            sequential=sequential,
            autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        )
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=2e-2, atol=1e-3)


def test_heads_on_a_pretrained_model_leave_it_unchanged(tiny, tmp_path):
    """mtp.init=pretrained, trainable=new_heads: the export is the pretrained model, bit for bit,
    and the heads moved away from their initial copies of its last layer."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir, _, _ = tiny
    out = tmp_path / "pre"
    overrides = ["mtp.init=pretrained", "mtp.trainable=new_heads", "trainer.max_steps=3", "validate.enabled=false"]
    recipe.run(config(tiny, out, *overrides))
    before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "export").state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    heads = load_file(str(out / "export" / "specdec" / "mtp_heads.safetensors"))
    last = f"model.layers.{AutoModelForCausalLM.from_pretrained(model_dir).config.num_hidden_layers - 1}."
    start = {k[len(last) :]: v for k, v in before.items() if k.startswith(last)}
    assert heads and {k.split(".", 2)[2] for k in heads} == set(start)
    assert [k for k, v in heads.items() if not torch.equal(v, start[k.split(".", 2)[2]])]  # trained


@pytest.mark.slow  # ~35 s on a 2-core CPU: the default run stays under 10 minutes (DDP runs by default in eagle3's)
def test_two_processes_match_one_and_deepspeed_is_refused_at_start_up(tiny, tmp_path):
    """accelerate launch with 2 gloo processes on the same global batch: same losses (all heads), same
    exported weights, one run folder, validation on (rank 0 alone) to the export.
    Under DeepSpeed the recipe stops before any work, saying why."""
    from safetensors.torch import load_file

    short = ("trainer.max_steps=4", "validate.enabled=false")
    one, two = tmp_path / "one", tmp_path / "two"
    recipe.run(config(tiny, one, *short))
    # validated on rank 0 while the other waits, as users run it
    validated = ("trainer.micro_batch=2", "validate.enabled=true", "validate.num_prompts=2")
    validated += ("validate.max_new_tokens=8",)
    proc = accelerate_launch("multi_cpu", ["-m", "recipes.mtp", *overrides(tiny, two, *short, *validated)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 processes, global batch 8" in proc.stdout
    assert json.loads((two / "metrics.json").read_text())["validation"]["tau"] >= 1.0
    for key in ("train/loss", "train/loss_0", "train/loss_2"):
        assert logged(two, key) == pytest.approx(logged(one, key), rel=1e-5, abs=1e-6)
    w1, w2 = (load_file(d / "export/model.safetensors") for d in (one, two))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-5)
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())

    refused = tmp_path / "zero2"
    proc = accelerate_launch("deepspeed_zero2", ["-m", "recipes.mtp", *overrides(tiny, refused, *short)])
    assert proc.returncode != 0
    assert "recipes.mtp does not run under DeepSpeed ZeRO-2" in proc.stderr and "per-head backward" in proc.stderr
    assert not (refused / "checkpoints").exists() and not (refused / "log.jsonl").exists()
