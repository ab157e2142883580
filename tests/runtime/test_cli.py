"""`specdec generate` end to end on a tiny local model, and its error handling."""

import json

import pytest
import torch

from specdec_runtime.cli import batched, main
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.loading import load_model
from tests.conftest import save_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("cli") / "tiny", "llama", seed=0, num_hidden_layers=3)


def run(argv, capsys):
    main(argv)
    return capsys.readouterr().out


def test_generate_writes_outputs_equal_to_autoregressive(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "hello there"})
        + "\n"
        + json.dumps({"question_id": "q2", "category": "qa", "turns": ["why?"]})
        + "\n"
    )
    outs = {}
    for drafter in ("none", "truncate:1", "ngram", "truncate:1+lookup"):
        out_file = tmp_path / f"{drafter.replace(':', '')}.jsonl"
        common = [
            "--target",
            str(tiny_dir),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "24",
            "--output",
            str(out_file),
        ]
        table = run(["generate", *common, "--drafter", drafter, "--gamma", "3", "--baseline"], capsys)
        assert f"drafter {drafter}" in table and "speedup" in table and "100%" in table  # lossless column
        outs[drafter] = [json.loads(line) for line in out_file.read_text().splitlines()]
    ar = outs["none"]
    assert [r["id"] for r in ar] == ["0", "q2"] and ar[1]["category"] == "qa"
    for records in outs.values():
        for r, base in zip(records, ar):
            assert r["output_ids"] == base["output_ids"] and r["identical_to_baseline"]
            assert set(r) >= {"id", "output_ids", "text", "stats"} and r["stats"]["new_tokens"] == len(r["output_ids"])
    assert outs["none"][0]["stats"]["tau"] == 1.0


def test_sampling_reports_speedup_but_no_losslessness(tiny_dir, tmp_path, capsys):
    out_file = tmp_path / "s.jsonl"
    argv = [
        "generate",
        "--target",
        str(tiny_dir),
        "--prompt",
        "abc",
        "--max-new-tokens",
        "12",
        "--drafter",
        "truncate:2",
    ]
    table = run(
        [*argv, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--baseline", "--output", str(out_file)],
        capsys,
    )
    assert "speedup" in table and "lossless" not in table and "T=0.8" in table
    first = json.loads(out_file.read_text())
    run(
        [*argv, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--baseline", "--output", str(out_file)],
        capsys,
    )
    assert json.loads(out_file.read_text())["output_ids"] == first["output_ids"]  # seeded: reproducible


def test_single_prompt_prints_its_text(tiny_dir, capsys):
    out = run(
        ["generate", "--target", str(tiny_dir), "--prompt", "abc", "--max-new-tokens", "5", "--no-warmup"], capsys
    )
    assert "new tokens" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--target", "no-such-model"], "unknown model 'no-such-model'"),
        (["--max-new-tokens", "100000"], "the target's context is 256"),
        (["--drafter", "truncate:9"], "K must be in 1..2"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        pytest.param(
            ["--device", "cuda"],
            "no CUDA GPU is available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU"),
        ),
        (["--dtype", "int8"], "unknown dtype 'int8'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--gamma", "0"], "--gamma must be >= 1, got 0 (for autoregressive decoding: --drafter none)"),
        (["--gamma", "-2"], "--gamma must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--prompt", " "], "--prompt is empty"),
        (["--batch-size", "0"], "batch sizes must be >= 1, got 0"),
        (["--batch-size", "2", "--adaptive-gamma"], "decode one prompt at a time: --batch-size 1"),
        (["--drafts", "0"], "--drafts must be >= 1"),
        (["--drafts", "2"], "--drafts > 1 needs a drafter"),
    ],
)
def test_user_errors_exit_with_a_message_not_a_traceback(tiny_dir, capsys, argv, message):
    base = ["generate", "--prompt", "hi", "--max-new-tokens", "8"] + (
        [] if "--target" in argv else ["--target", str(tiny_dir)]
    )
    argv = base + argv
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_bad_value_or_an_interruption_leaves_an_earlier_output_file_as_it_was(
    tiny_dir, tmp_path, capsys, monkeypatch
):
    """Arguments are checked before --output is opened; results stream to FILE.part, which replaces
    FILE only when the run ends; Ctrl-C says what was written and how to go on."""
    import importlib

    measure = importlib.import_module("specdec_runtime.measure")  # the module (the package exports its function)
    out = tmp_path / "out.jsonl"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("abc", "hello", "why")))
    base = ["generate", "--target", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "6"]
    main([*base, "--output", str(out), "--no-warmup"])
    before = out.read_bytes()
    assert len(before.splitlines()) == 3 and not out.with_name("out.jsonl.part").exists()
    for bad, message in (
        (["--gamma", "-2"], "--gamma must be >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--output", str(prompts)], "is the --prompts file"),
        (["--output", str(tmp_path)], "is a folder"),
    ):
        with pytest.raises(SystemExit) as e:
            main([*base, "--output", str(out), *bad])
        assert e.value.code == 2 and message in capsys.readouterr().err
        assert out.read_bytes() == before
    real = measure.generate
    calls = {"n": 0}

    def interrupted(*args, **kwargs):  # Ctrl-C while the second prompt decodes
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(measure, "generate", interrupted)
    with pytest.raises(SystemExit) as e:
        main([*base, "--output", str(out), "--no-warmup"])
    err = capsys.readouterr().err
    assert e.value.code == 130 and "interrupted after 1 of 3 prompts" in err and "out.jsonl.part" in err
    assert out.read_bytes() == before and len(out.with_name("out.jsonl.part").read_text().splitlines()) == 1


def test_a_prompt_file_that_is_not_utf8_is_refused_with_where(tiny_dir, tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(SystemExit) as e:
        main(["generate", "--target", str(tiny_dir), "--prompts", str(bad)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is not UTF-8 text (byte 0xe9 at offset 32)" in err and "Traceback" not in err


@pytest.mark.gpu
def test_generate_runs_on_cuda_by_default_without_a_warning(tiny_dir, tmp_path, capsys):
    """The default on a CUDA machine (bf16, the fast path) crashed the first time it ran there;
    now it runs, warns about nothing, and its greedy output equals its own autoregressive output."""
    import warnings

    for drafter in ("none", "truncate:1", "ngram"):
        out_file = tmp_path / f"{drafter.replace(':', '')}.jsonl"
        argv = ["generate", "--target", str(tiny_dir), "--prompt", "hello there", "--max-new-tokens", "24"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # hidden from users by default; torch 2.11's inductor raised one of its own (torch.jit) here
            warnings.simplefilter("ignore", DeprecationWarning)
            table = run([*argv, "--drafter", drafter, "--baseline", "--output", str(out_file)], capsys)
        record = json.loads(out_file.read_text())
        assert record["identical_to_baseline"] and "100%" in table


def test_generate_decodes_on_the_measured_thread_count_unless_told(tiny_dir, tmp_path, capsys, monkeypatch):
    """--threads 0 (the default): the count decoding ran fastest on here (cpu_threads), said;
    --threads N: N, nothing timed."""
    from specdec_runtime import hardware

    choice = hardware.ThreadChoice("decode", 1, ((1, 0.004), (2, 0.006)))
    asked = []
    monkeypatch.setattr(hardware, "cpu_threads", lambda work: asked.append(work) or choice)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello there"}) + "\n")
    common = ["generate", "--target", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "4"]
    before = torch.get_num_threads()
    try:
        main([*common, "--output", str(tmp_path / "a.jsonl")])
        assert torch.get_num_threads() == 1 and asked == ["decode"]
        assert "threads: decoding on 1 CPU thread: its timed work took 4.00 ms with 1, 6.00 ms with 2" in (
            capsys.readouterr().err
        )
        main([*common, "--threads", "2", "--output", str(tmp_path / "b.jsonl")])
        assert torch.get_num_threads() == 2 and asked == ["decode"] and "threads:" not in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_batched_generation_writes_each_prompts_output_equal_to_autoregressive(tiny_dir, tmp_path, capsys):
    """--batch-size 2 over 3 prompts (a full batch and one of a single prompt): every output equals
    the autoregressive one decoded at the same batch size, whichever the drafter; a kind that decodes
    a prompt at a time (a draft exit's) runs at batch size 1 and says so."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("hello there", "why?", "a b c a b c")))
    common = ["generate", "--target", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "16"]
    outs = {}
    for drafter in ("none", "ngram", "truncate:1", "truncate:1+lookup"):
        out_file = tmp_path / f"{drafter.replace(':', '').replace('+', '')}.jsonl"
        main([*common, "--drafter", drafter, "--batch-size", "2", "--baseline", "--output", str(out_file)])
        printed = capsys.readouterr()
        outs[drafter] = [json.loads(line) for line in out_file.read_text().splitlines()]
        assert "100%" in printed.out and all(r["identical_to_baseline"] for r in outs[drafter])
        assert "batch 2" in printed.out and "decodes one prompt at a time" not in printed.err
    exits = ModelDrafter(load_model(str(tiny_dir)).model, exit_layer=1, shares_target_cache=True, confidence=0.5)
    assert batched(exits, "truncate:1", 2) == (exits, 1) and "decodes one prompt at a time" in capsys.readouterr().err
    for records in outs.values():
        assert [r["output_ids"] for r in records] == [r["output_ids"] for r in outs["none"]]
        assert [r["id"] for r in records] == ["0", "1", "2"]


def test_spectr_drafts_sampled_sequences_and_leaves_greedy_output_alone(tiny_dir, tmp_path, capsys):
    """--drafts 3 with a stand-alone drafter: sampled, it drafts and says SpecTr; greedy, the target's
    own output."""
    common = ["generate", "--target", str(tiny_dir), "--drafter", str(tiny_dir), "--prompt", "hello", "--gamma", "2",
              "--max-new-tokens", "16", "--drafts", "3", "--no-warmup"]  # fmt: skip
    sampled = tmp_path / "s.jsonl"
    main([*common, "--temperature", "1.0", "--output", str(sampled)])
    assert "SpecTr, 3 drafts" in capsys.readouterr().out
    stats = json.loads(sampled.read_text())["stats"]
    assert stats["drafted_at"][0] > 0
    greedy = tmp_path / "g.jsonl"
    main([*common, "--baseline", "--output", str(greedy)])
    assert json.loads(greedy.read_text())["identical_to_baseline"]
