"""Online adaptation (specdec_runtime.drafters.online) against its oracles: the teacher is the target's own
distribution where it rejected a draft; the EAGLE-3 learner's rows are the runtime drafter's first
draft step; adapting raises acceptance on the stream it serves while every output stays the
target's greedy output; the adapted drafter saves as a folder the runtime loads with those weights;
bad settings and drafters that cannot learn are refused before decoding."""

import json

import pytest
import torch

from specdec_runtime.cli import main
from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.eagle3_format import load_eagle3, save_speculators
from specdec_runtime.drafters.online import OnlineAdapter, check_adapting
from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.loading import load_model
from specdec_runtime.sampling import Sampler
from specdec_runtime.stats import GenerationStats
from tests.conftest import save_tiny_model
from tests.runtime.test_eagle3 import tiny as eagle3_tiny

PROMPT = [5, 17, 3, 9, 30, 12, 7, 22]


def serve(target, drafter, adapter, prompts, max_new_tokens=24, gamma=3):
    """Each prompt's greedy output and stats, the adapter updating as it goes."""
    out = []
    for p in prompts:
        g = generate(target, p, drafter, Sampler(), max_new_tokens=max_new_tokens, gamma=gamma, teacher=adapter.record)
        adapter.served(p, g.tokens)
        out.append(g)
    return out


def test_the_teacher_is_the_targets_distribution_where_it_rejected_a_draft():
    hf, target, model = eagle3_tiny(seed=3)
    drafter = Eagle3Drafter(model, target, cpu_bf16=False)
    records, drafts, real = [], [], drafter.draft

    def recording(ids, gamma, sampler):
        draft = real(ids, gamma, sampler)
        drafts.append((ids.shape[0], draft.tokens.tolist()))
        return draft

    drafter.draft = recording
    g = generate(target, PROMPT, drafter, Sampler(), max_new_tokens=24, gamma=3,
                 teacher=lambda pos, probs: records.append((pos, probs.clone())))  # fmt: skip
    sequence = PROMPT + g.tokens
    rejected = []  # where each draft first differs from the output: the target rejected it there
    for L, tokens in drafts:
        n = next((i for i, t in enumerate(tokens) if L + i >= len(sequence) or sequence[L + i] != t), len(tokens))
        rejected += [L + n] if n < len(tokens) else []
    assert rejected and [pos for pos, _ in records] == rejected
    with torch.no_grad():
        logits = hf(torch.tensor([sequence])).logits[0]  # transformers' own: row i predicts token i + 1
    for pos, probs in records:
        torch.testing.assert_close(probs, logits[pos - 1].softmax(-1), atol=1e-5, rtol=1e-4)
        assert int(probs.argmax()) == sequence[pos]  # the token served there is the target's choice


def test_the_eagle3_learners_rows_are_the_runtime_drafters_first_draft_step():
    _, target, model = eagle3_tiny(seed=4)
    drafter = Eagle3Drafter(model, target, cpu_bf16=False)
    adapter = OnlineAdapter(drafter, target, every=100)
    firsts, real = [], drafter.draft

    def recording(ids, gamma, sampler):
        draft = real(ids, gamma, sampler)
        firsts.append((ids.shape[0], int(draft.tokens[0])))
        return draft

    drafter.draft = recording
    serve(target, drafter, adapter, [PROMPT], gamma=1)
    seq = adapter.buffer[0]
    assert seq.features.shape[0] == seq.tokens.shape[0] - 1
    learner = adapter.learner
    with torch.no_grad():
        heads = model.config.layer.num_heads
        T = seq.tokens.shape[0] - 2
        embeds = target.embed_tokens(seq.tokens[None, 1 : T + 1])
        causal = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k.repeat_interleave(heads // k.shape[1], 1), v.repeat_interleave(heads // v.shape[1], 1), is_causal=True
        )
        _, logits = learner.model.step(embeds, learner.model.project(seq.features[None, :T]), torch.arange(T), causal)
    draft_ids = model.draft_ids
    for L, token in firsts:  # the draft after ids[:L] is row L - 2's prediction
        assert int(draft_ids[logits[0, L - 2].argmax()]) == token


def test_adapting_an_eagle3_drafter_raises_acceptance_and_leaves_the_output_the_targets():
    _, target, model = eagle3_tiny(seed=5)
    drafter = Eagle3Drafter(model, target)
    prompts = [PROMPT[: 4 + i % 3] for i in range(8)]
    expected = [generate(target, p, None, Sampler(), max_new_tokens=24).tokens for p in prompts]
    adapter = OnlineAdapter(drafter, target, every=2, steps=16, lr=1e-2, keep=8)
    runs = serve(target, drafter, adapter, prompts)
    assert [g.tokens for g in runs] == expected
    assert len(adapter.updates) == 4 and all(u.after < u.before for u in adapter.updates)
    first = sum(g.stats.accepted for g in runs[:2]) / sum(g.stats.drafted for g in runs[:2])
    last = sum(g.stats.accepted for g in runs[-2:]) / sum(g.stats.drafted for g in runs[-2:])
    assert last > first + 0.3, (first, last)


def test_refresh_drafts_as_a_drafter_built_on_the_changed_weights():
    _, target, model = eagle3_tiny(seed=6)
    drafter = Eagle3Drafter(model, target, tree_budget=6)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    drafter.refresh()
    fresh = Eagle3Drafter(model, target, tree_budget=6)
    a = generate(target, PROMPT, drafter, Sampler(), max_new_tokens=20)
    b = generate(target, PROMPT, fresh, Sampler(), max_new_tokens=20)
    assert a.tokens == b.tokens and (a.stats.drafted_at, a.stats.accepted_at) == (
        b.stats.drafted_at,
        b.stats.accepted_at,
    )


def test_an_adapted_eagle3_drafter_saves_as_its_folder_with_the_new_weights(tmp_path):
    _, target, model = eagle3_tiny(seed=7)
    source = save_speculators(model, tmp_path / "export", verifier=None, verifier_architectures=["LlamaForCausalLM"],
                              drafting={"gamma": 3, "tree_budget": 0, "top_k": 4})  # fmt: skip
    (source / "README.md").write_text("card\n")

    class Loaded:  # what load_eagle3 reads of a LoadedModel
        model = target

    drafter = load_eagle3(source, Loaded())
    drafter.source = source
    adapter = OnlineAdapter(drafter, target, every=1, steps=2, lr=1e-3)
    serve(target, drafter, adapter, [PROMPT])
    folder = adapter.save(tmp_path / "adapted")
    assert (folder / "README.md").read_text() == "card\n"
    again = load_eagle3(folder, Loaded())
    for name, w in adapter.learner.model.state_dict().items():
        torch.testing.assert_close(again.model.state_dict()[name], w.to(again.model.state_dict()[name].dtype))
    with pytest.raises(SpecdecError, match="not an empty folder"):
        adapter.save(folder)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a smaller stand-alone drafter folder sharing its tokenizer."""
    root = tmp_path_factory.mktemp("online")
    target = save_tiny_model(root / "target", "llama", seed=0, num_hidden_layers=3)
    drafter = save_tiny_model(root / "drafter", "llama", seed=1, num_hidden_layers=1)
    return target, drafter


def test_adapting_a_stand_alone_drafter_raises_acceptance_and_saves_it(pair, tmp_path):
    target_dir, drafter_dir = pair
    target = load_model(str(target_dir), device="cpu", dtype="float32")
    drafter = build_drafter(str(drafter_dir), target)
    prompts = [[1, 5 + i % 3, 9, 12, 4] for i in range(8)]
    expected = [generate(target.model, p, None, Sampler(), max_new_tokens=24).tokens for p in prompts]
    adapter = OnlineAdapter(drafter, target.model, every=2, steps=16, lr=1e-2, keep=8)
    runs = serve(target.model, drafter, adapter, prompts)
    assert [g.tokens for g in runs] == expected
    first = sum(g.stats.accepted for g in runs[:2]) / sum(g.stats.drafted for g in runs[:2])
    last = sum(g.stats.accepted for g in runs[-2:]) / sum(g.stats.drafted for g in runs[-2:])
    assert last > first + 0.3, (first, last)
    folder = adapter.save(tmp_path / "adapted")
    reloaded = build_drafter(str(folder), target)
    a = generate(target.model, prompts[0], drafter, Sampler(), max_new_tokens=24)
    b = generate(target.model, prompts[0], reloaded, Sampler(), max_new_tokens=24)
    assert a.stats.accepted_at == b.stats.accepted_at  # the saved weights are the ones it drafts with


def test_generate_adapts_and_reports_windows_and_refuses_what_cannot_learn(pair, tmp_path, capsys):
    target_dir, drafter_dir = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"{w} stone"}) for w in ("apple", "river", "cloud", "green")))
    out = tmp_path / "out.jsonl"
    common = ["generate", "--target", str(target_dir), "--prompts", str(prompts), "--max-new-tokens", "16"]
    main([*common, "--drafter", str(drafter_dir), "--adapt-every", "2", "--baseline", "--output", str(out)])
    text = capsys.readouterr().out
    assert "online adaptation: windows of 2 prompts" in text and "100%" in text
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["adapt"]["window"] for r in records] == [0, 0, 1, 1]
    for a, b in (records[0:2], records[2:4]):  # a window's last record: the window's tau
        s = GenerationStats.total([GenerationStats.from_dict(r["stats"]) for r in (a, b)])
        assert b["adapt"]["window_tau"] == pytest.approx(s.tau, abs=1e-4)
    assert [("update" in r["adapt"]) for r in records] == [False, True, False, True]
    assert all(r["identical_to_baseline"] for r in records)
    for argv, message in [
        (["--drafter", str(drafter_dir), "--adapt-every", "0"], "--adapt-every must be >= 1"),
        (["--drafter", "ngram", "--adapt-every", "2"], "drafter 'ngram:3' is neither"),
        (["--drafter", "truncate:1", "--adapt-every", "2"], "is neither"),
        (["--drafter", str(drafter_dir), "--adapt-every", "2", "--batch-size", "2"], "one prompt at a time"),
        (["--drafter", str(drafter_dir), "--adapt-every", "2", "--adapt-save", str(prompts)], "not an empty folder"),
    ]:
        with pytest.raises(SystemExit):
            main([*common, *argv])
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_bad_settings_are_refused():
    with pytest.raises(SpecdecError, match="--adapt-steps must be >= 1"):
        check_adapting(2, 0, 1e-3)
    with pytest.raises(SpecdecError, match="--adapt-lr > 0"):
        check_adapting(2, 1, 0.0)
