"""`specdec bench` end to end on a tiny model: every number against the per-prompt records and
the autoregressive oracle, transformers' reference outputs, failures, resume, W&B, user errors."""

import json

import pytest
import torch

from specdec_runtime import bench
from specdec_runtime.cli import main
from specdec_runtime.hardware import cpu_threads
from specdec_runtime.stats import GenerationStats
from tests.conftest import offline_run, save_tiny_model, write_prompt_file

DRAFTERS = "none,ngram,truncate:2@2,/no/such/drafter"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("bench") / "tiny", "llama", seed=0, num_hidden_layers=3)


def argv(tiny_dir, tmp_path, out, drafters=DRAFTERS, *extra):
    prompts = write_prompt_file(tmp_path / "p.jsonl", 4, stride=5, suffix=" and")
    return ["bench", "--target", str(tiny_dir), "--prompts", str(prompts), "--drafters", drafters,
            "--max-new-tokens", "20", "--output-dir", str(out), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def benched(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    out = tmp / "out"
    with pytest.raises(SystemExit) as e:  # one drafter failed: the bench finishes the others, then exits 2
        main(argv(tiny_dir, tmp, out))
    assert e.value.code == 2
    return out


def test_outputs_and_numbers_follow_from_the_records(benched):
    results = json.loads((benched / "results.json").read_text())
    rows = {(r["drafter"], r["mode"]): r for r in results["summary"]}
    assert set(rows) == {(d, m) for d in DRAFTERS.split(",") for m in ("greedy", "sampled")}
    for (spec, mode), row in rows.items():
        if spec.startswith("/no"):
            assert row["error"].startswith("failed to load: unknown model '/no/such/drafter'")
            continue
        records = json.loads((benched / "drafters" / f"{bench.slug(spec)}.json").read_text())["modes"][mode]
        records = records["records"]
        assert set(row["categories"]) == {"a", "b", "all"}
        for cat, c in row["categories"].items():
            mine = [r for r in records if cat in ("all", r["category"])]
            stats = [GenerationStats.from_dict(r["stats"]) for r in mine]
            ar = [GenerationStats.from_dict(r["ar_stats"]) for r in mine]
            tokens = sum(s.new_tokens for s in stats)
            assert c["tau"] == pytest.approx(tokens / sum(s.target_forwards for s in stats))
            tok_s = tokens / sum(s.total_s for s in stats)
            ar_tok_s = sum(s.new_tokens for s in ar) / sum(s.total_s for s in ar)
            assert c["speedup"] == pytest.approx(tok_s / ar_tok_s)
            refs = [r["reference"] for r in mine]
            ref_tok_s = sum(r["new_tokens"] for r in refs) / sum(r["seconds"] for r in refs)
            assert c["vs_ref"] == pytest.approx(tok_s / ref_tok_s)
            if mode == "greedy":  # the oracle: the target's own greedy output
                assert c["lossless"] == 1.0 and all(r["tokens"] == r["ar_tokens"] for r in mine)
                assert all(r["same_as_ar"] for r in refs)  # transformers' (assisted) greedy output, too
            else:
                assert c["lossless"] is None
        drafted = [sum(GenerationStats.from_dict(r["stats"]).drafted_at[:1]) for r in records]
        assert (sum(drafted) > 0) == (spec != "none")
        assert row["gamma"] == {"none": 0, "ngram": 4, "truncate:2@2": 2}[spec]
    assert rows[("none", "greedy")]["categories"]["all"]["tau"] == 1.0
    for mode in ("greedy", "sampled"):  # one autoregressive pass per mode, shared by every drafter
        ar = [json.loads((benched / "drafters" / f"{bench.slug(d)}.json").read_text())["modes"][mode]["records"]
              for d in ("none", "ngram", "truncate:2@2")]  # fmt: skip
        assert [r["ar_stats"] for r in ar[0]] == [r["ar_stats"] for r in ar[1]] == [r["ar_stats"] for r in ar[2]]
    table = (benched / "results.md").read_text()
    assert "| truncate:2@2 | greedy | 2 |" in table and "failed to load: unknown model" in table
    assert "tau / speedup by category" in table and "sampled: T=" in table.splitlines()[0]
    threads = cpu_threads("decode").threads  # what the CLI decoded on (--threads 0: the measured choice)
    assert json.loads((benched / "settings.json").read_text())["threads"] == threads
    assert f" · {threads} CPU threads" in table.splitlines()[0]
    for png in ("speedup_tau.png", "acceptance.png"):
        assert (benched / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reruns_resume_per_drafter_and_refuse_other_settings(benched, tiny_dir, tmp_path, monkeypatch, capsys):
    before = (benched / "drafters" / "ngram.json").read_text()
    assert not (benched / "drafters" / "no_such_drafter.json").exists()  # failures are retried, not stored
    calls = []
    real = bench.bench_drafter
    monkeypatch.setattr(bench, "bench_drafter", lambda *a: calls.append((a[3], a[4])) or real(*a))
    ar_passes = []
    real_ar = bench.autoregressive
    monkeypatch.setattr(bench, "autoregressive", lambda *a: ar_passes.append(a[2]) or real_ar(*a))
    main(argv(tiny_dir, tmp_path, benched, "none,ngram,truncate:1"))
    assert calls == [("truncate:1", "greedy"), ("truncate:1", "sampled")]
    assert ar_passes == ["greedy", "sampled"]  # one shared autoregressive pass per mode
    assert (benched / "drafters" / "ngram.json").read_text() == before
    with pytest.raises(SystemExit):
        main(argv(tiny_dir, tmp_path, benched, "none", "--max-new-tokens", "21"))
    assert "max_new_tokens: 20 -> 21" in capsys.readouterr().err
    threads = json.loads((benched / "settings.json").read_text())["threads"]
    try:
        with pytest.raises(SystemExit):  # rows decoded on other thread counts would not compare
            main(argv(tiny_dir, tmp_path, benched, "none", "--threads", str(threads + 1)))
    finally:
        torch.set_num_threads(threads)  # --threads set the process's count
    assert f"threads: {threads} -> {threads + 1}" in capsys.readouterr().err
    monkeypatch.setattr(bench, "runtime_digest", lambda: "sha1 000000000000")  # the runtime's code changed
    with pytest.raises(SystemExit):
        main(argv(tiny_dir, tmp_path, benched, "none"))
    assert "runtime: 'sha1 " in capsys.readouterr().err


def test_paired_measures_each_drafter_against_an_autoregressive_run_beside_it(tiny_dir, tmp_path, monkeypatch):
    """--paired: every drafter run of a prompt has an autoregressive run of it right beside it (before
    it on even prompts, after it on odd ones), which is the record's baseline (greedy: the same tokens
    as the shared pass); 'none' keeps the shared pass."""
    runs = []
    real = bench.generate

    def recording(model, ids, drafter, *args, **kwargs):
        g = real(model, ids, drafter, *args, **kwargs)
        runs.append((drafter is None, kwargs["max_new_tokens"], g))
        return g

    monkeypatch.setattr(bench, "generate", recording)
    out = tmp_path / "out"
    main(argv(tiny_dir, tmp_path, out, "none,ngram,truncate:2@2", "--modes", "greedy", "--no-reference", "--paired"))
    full = [(ar, g) for ar, n, g in runs if n == 20]  # warm-ups decode 8 tokens
    shared, rest = [g for _, g in full[:4]], full[4:]
    assert all(ar for ar, _ in full[:4]) and len(rest) == 2 * 2 * 4  # 2 drafters x (AR, drafter) x 4 prompts
    assert [ar for ar, _ in rest] == [True, False, False, True] * 4
    for k, spec in enumerate(("ngram", "truncate:2@2")):
        records = json.loads((out / "drafters" / f"{bench.slug(spec)}.json").read_text())["modes"]["greedy"]["records"]
        pairs = rest[8 * k : 8 * (k + 1)]
        for i, r in enumerate(records):
            first, second = pairs[2 * i][1], pairs[2 * i + 1][1]
            ar, mine = (first, second) if i % 2 == 0 else (second, first)
            assert r["ar_stats"] == ar.stats.to_dict() and r["stats"] == mine.stats.to_dict()
            assert r["ar_tokens"] == ar.tokens == shared[i].tokens == r["tokens"]
    none = json.loads((out / "drafters" / "none.json").read_text())["modes"]["greedy"]["records"]
    assert [r["ar_stats"] for r in none] == [g.stats.to_dict() for g in shared]
    settings = json.loads((out / "settings.json").read_text())
    assert settings["paired"] is True
    assert "sampled" not in (out / "results.md").read_text().splitlines()[0]  # greedy only: no sampling settings


def test_a_drafter_that_fails_to_decode_is_reported_and_the_rest_run(tiny_dir, tmp_path, monkeypatch, capsys):
    from specdec_runtime.drafters.lookup import NgramDrafter

    monkeypatch.setattr(NgramDrafter, "draft", lambda *a: 1 / 0)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(argv(tiny_dir, tmp_path, out, "ngram,truncate:2", "--modes", "greedy", "--no-reference"))
    assert e.value.code == 2 and "1 of 2 drafters failed (ngram)" in capsys.readouterr().err
    rows = json.loads((out / "results.json").read_text())["summary"]
    assert rows[0]["error"] == "failed to decode: ZeroDivisionError: division by zero"
    assert rows[1]["categories"]["all"]["lossless"] == 1.0 and rows[1]["categories"]["all"]["ref_tok_s"] is None


def test_wandb_offline_run_has_the_summary_metrics_and_plots(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "out"
    main(argv(tiny_dir, tmp_path, out, "none,ngram", "--modes", "greedy", "--no-reference", "--wandb"))
    history, config_keys, _ = offline_run(out)
    logged = {k for h in history for k in h}
    assert {"greedy/ngram/tau", "greedy/ngram/speedup", "greedy/ngram/lossless", "greedy/none/tok_s"} <= logged
    media = next(h for h in history if "bench/summary/_type" in h)
    assert media["bench/summary/_type"] == "table-file" and media["bench/summary/nrows"] == 2 * 3  # x (a, b, all)
    assert media["bench/speedup_tau/_type"] == media["bench/acceptance/_type"] == "image-file"
    assert {"target", "max_new_tokens", "temperature"} <= config_keys
    summary = json.loads((out / "results.json").read_text())["summary"]
    ngram = next(h for h in history if "greedy/ngram/tau" in h)
    assert ngram["greedy/ngram/tau"] == pytest.approx(summary[1]["categories"]["all"]["tau"])


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--modes", "greedy,beam"], "--modes 'greedy,beam'"),
        (["--temperature", "0"], "the sampled mode needs --temperature > 0"),
        (["--drafters", "ngram,ngram"], "without repeats"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--gamma", "0"], "--gamma must be >= 1"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--per-category", "-1"], "--per-category must be >= 0"),
        (["--batch-sizes", "1,x"], "give comma-separated numbers"),
        (["--batch-sizes", "0,2"], "every value must be >= 1"),
    ],
)
def test_user_errors_stop_before_any_model_loads_or_anything_is_written(tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["bench", "--target", "/no/such/model", "--output-dir", str(out), *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()  # no settings left behind to block the folder


def test_output_dir_that_is_a_file_and_prompts_that_are_not_utf8_are_refused(tmp_path, capsys):
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    latin1 = tmp_path / "p.jsonl"
    latin1.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    for extra, message in (
        (["--output-dir", str(a_file)], "is a file: give a folder"),
        (["--output-dir", str(tmp_path / "o"), "--prompts", str(latin1)], "is not UTF-8 text (byte 0xe9"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["bench", "--target", "/no/such/model", *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "Traceback" not in err


def test_batch_sizes_compare_each_drafter_with_autoregressive_at_the_same_size(tiny_dir, tmp_path, capsys):
    """--batch-sizes 1,3: a row per drafter, mode and size; tokens/s and tau from the same decoding
    as `generate --batch-size` (greedy outputs all equal the autoregressive ones), the target cut
    short and lookup before it batched too."""
    out = tmp_path / "out"
    drafters = "none,truncate:2,truncate:2+lookup"
    main(argv(tiny_dir, tmp_path, out, drafters, "--batch-sizes", "3,1", "--modes", "greedy"))
    rows = json.loads((out / "batch.json").read_text())
    assert [(r["drafter"], r["batch"]) for r in rows] == [(d, b) for d in drafters.split(",")[1:] for b in (1, 3)]
    for r in rows:
        assert r["lossless"] == 1.0 and r["tau"] >= 1.0 and r["speedup"] == pytest.approx(r["tok_s"] / r["ar_tok_s"])
    assert (out / "speedup_vs_batch.png").stat().st_size > 0
    assert "| truncate:2 | greedy | 3 |" in capsys.readouterr().out


def test_tune_writes_the_best_setting_per_batch_size_and_temperature_with_the_engines(tiny_dir, tmp_path, capsys):
    """specdec tune over 2 batch sizes x 2 temperatures: every candidate measured (chains of each gamma;
    at batch 1 also prompt lookup first), the best the fastest, and the engines' settings of a chain
    as each counts (vLLM: the draft length; SGLang: + the verified root)."""
    prompts = write_prompt_file(tmp_path / "p.jsonl", 3, stride=5, suffix=" and")
    out = tmp_path / "tune.json"
    main(["tune", "--target", str(tiny_dir), "--drafter", "ngram", "--prompts", str(prompts), "--batch-sizes", "2,1",
          "--temperatures", "0,0.8", "--gammas", "2,3", "--max-new-tokens", "12", "--output", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    keys = [(s["batch_size"], s["temperature"]) for s in result["settings"]]
    assert keys == [(1, 0.0), (1, 0.8), (2, 0.0), (2, 0.8)] and result["drafter"] == "ngram"
    for s in result["settings"]:
        names = [c["name"] for c in s["candidates"]]
        assert names == ["chain:2", "chain:3"]  # (prompt lookup is the drafter: nothing to put first)
        best = max(s["candidates"], key=lambda c: c["tok_s"])
        assert s["best"]["name"] == best["name"] and s["best"]["speedup"] == pytest.approx(
            best["tok_s"] / s["autoregressive_tok_s"])
        g = s["best"]["gamma"]
        assert s["best"]["vllm"] == {"method": "ngram", "num_speculative_tokens": g, "prompt_lookup_max": 3,
                                     "prompt_lookup_min": 1}  # fmt: skip
    assert "| 2 | 0.8 |" in capsys.readouterr().out


def test_tune_measures_medusa_chains_at_every_batch_size_and_writes_vllms_medusa_config(tmp_path):
    """An export's Medusa heads (3 of them: no chain longer than 3) at batch 1 and 2: chains of each
    gamma and lookup first (at batch 1 before its own length, in batches before the chain that
    measured fastest), run batched at 2, and vLLM's config pointing at the export's vllm/ layout."""
    from specdec_runtime.drafters.medusa import write_layout
    from tests.runtime.test_medusa import random_heads

    hf_dir = save_tiny_model(tmp_path / "target", num_hidden_layers=3)
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    heads, export = random_heads(64, vocab), tmp_path / "export"
    write_layout(heads, export, "faster_decoding", str(hf_dir))
    write_layout(heads, export / "vllm", "vllm", str(hf_dir))
    prompts, out = write_prompt_file(tmp_path / "p.jsonl", 3, stride=5, suffix=" and"), tmp_path / "tune.json"
    main(["tune", "--target", str(hf_dir), "--drafter", str(export), "--prompts", str(prompts), "--batch-sizes", "1,2",
          "--temperatures", "0", "--gammas", "2,5", "--max-new-tokens", "12", "--output", str(out)])  # fmt: skip
    settings = json.loads(out.read_text())["settings"]
    for s in settings:
        chains = [c for c in s["candidates"] if not c["lookup"]]
        assert [c["name"] for c in chains] == ["chain:2", "chain:3"] and s["best"]["tok_s"] > 0
        for c in chains:
            vllm = {"method": "medusa", "model": str(export / "vllm"), "num_speculative_tokens": c["gamma"]}
            assert c["vllm"] == vllm and c["tau"] >= 1
    chains = [[c for c in s["candidates"] if not c["lookup"]] for s in settings]
    fastest = max(chains[1], key=lambda c: c["tok_s"])["gamma"]  # batch 2: lookup first before it
    looked = [[c["name"] for c in s["candidates"] if c["lookup"]] for s in settings]
    assert looked == [["chain:3+lookup"], [f"chain:{fastest}+lookup"]]


def test_tune_measures_an_eagle3_exports_trees_in_batches_too(tmp_path):
    """An EAGLE-3 export drafting trees of 5 nodes (top-3, 3 deep): at batch 2 its tree is a
    candidate beside the chains (a tree a row), with SGLang's settings for it (topk 3, 6 draft
    tokens: the root counted), and lookup first before the fastest chain and before its trees (a
    lookup's chain in its row's tree)."""
    from specdec_runtime.drafters.eagle3_format import save_speculators
    from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model
    from specdec_runtime.loading import load_model

    hf_dir = save_tiny_model(tmp_path / "target", num_hidden_layers=4)
    torch.manual_seed(1)
    config = load_model(str(hf_dir)).model.config
    model = Eagle3Model(Eagle3Config.for_target(config, aux_layers=None, draft_vocab_size=16))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model.set_draft_vocab(torch.arange(16))
    export = save_speculators(model, tmp_path / "export", verifier=None, verifier_architectures=["LlamaForCausalLM"],
                              drafting={"gamma": 3, "tree_budget": 5, "top_k": 3})  # fmt: skip
    prompts, out = write_prompt_file(tmp_path / "p.jsonl", 3, stride=5, suffix=" and"), tmp_path / "tune.json"
    main(["tune", "--target", str(hf_dir), "--drafter", str(export), "--prompts", str(prompts), "--batch-sizes", "2",
          "--temperatures", "0", "--gammas", "2", "--max-new-tokens", "12", "--output", str(out)])  # fmt: skip
    (setting,) = json.loads(out.read_text())["settings"]
    tree = {c["name"]: c for c in setting["candidates"]}["tree:5:3"]
    assert tree["tau"] >= 1 and tree["tree_budget"] == 5 and tree["top_k"] == 3
    assert "--speculative-eagle-topk 3 --speculative-num-draft-tokens 6" in tree["sglang"]
    assert [c["name"] for c in setting["candidates"]] == ["chain:2", "tree:5:3", "chain:2+lookup", "tree+lookup"]
    looked = {c["name"]: c for c in setting["candidates"]}["tree+lookup"]
    assert looked["tau"] >= 1 and looked["tree_budget"] == 5 and looked["sglang"] is None


def test_tune_refuses_bad_lists_before_loading(tmp_path, capsys):
    for extra, message in ((["--gammas", "0,2"], "--gammas '0,2': every value must be >= 1"),
                           (["--temperatures", "a"], "--temperatures 'a': give comma-separated numbers"),
                           (["--drafter", "none"], "give the drafter to tune")):  # fmt: skip
        argv = ["tune", "--target", "/no/such/model", "--drafter", "ngram", "--output", str(tmp_path / "t.json")]
        with pytest.raises(SystemExit) as e:
            main(argv + extra)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
