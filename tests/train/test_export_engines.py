"""Every export kind, for a Llama-family and a Qwen2 target, held against the loader of each engine
it claims (specdec_runtime.engines: vLLM, SGLang, FasterDecoding, transformers, from their sources),
and the failures the issue found, each rebuilt as the older writer laid it out and caught."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model
from specdec_runtime.drafters.layerskip import SkipSet
from specdec_runtime.drafters.medusa import MedusaHeads, read_layout
from specdec_runtime.engines import Folder, faster_decoding, hf, sglang, vllm
from specdec_runtime.export_check import MANIFEST, check_export, target_facts
from tests.conftest import runtime_from_hf, save_tiny_model, tiny_hf_model
from train.export import Card, export_eagle3, export_medusa, export_mtp, export_skipset, export_standalone

FAMILIES = ("llama", "qwen2", "qwen3")


def target_folder(tmp_path: Path, kind: str) -> tuple[Path, dict]:
    """A tiny 4-layer target of the family saved as users have it, and its config.json."""
    path = save_tiny_model(tmp_path / f"target-{kind}", kind, num_hidden_layers=4)
    return path, json.loads((path / "config.json").read_text())


def card(config: dict, recipe: str, hub: str | None = "org/target") -> Card:
    return Card(target="my-target", target_hub_id=hub, target_config=config, recipe=recipe, data="builtin",
                setup={"steps": 3}, metrics={"tau": 2.0, "speedup": 1.5, "lossless": 1.0, "prompts": 2})  # fmt: skip


def eagle3_model(target_hf, draft_vocab: int, seed: int = 1) -> Eagle3Model:
    target = runtime_from_hf(target_hf)
    model = Eagle3Model(Eagle3Config.for_target(target.config, aux_layers=(1, 2, 3), draft_vocab_size=draft_vocab))
    torch.manual_seed(seed)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    V = target.config.vocab_size
    model.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values)
    return model.eval()


def export_all(tmp_path: Path, kind: str, hub: str | None = "org/target") -> dict[str, Path]:
    """One export of every kind for a tiny target of the family (draft vocabularies included)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.train.mtp_grad_worker import tiny_mtp
    from train.draft_model import use_draft_vocab
    from train.mtp import heads_state_dict

    path, config = target_folder(tmp_path, kind)
    target_hf = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    V, H = config["vocab_size"], config["hidden_size"]
    drafter = tiny_hf_model(kind, 3, vocab_size=V, num_hidden_layers=1)
    use_draft_vocab(drafter, torch.arange(0, V, 3))
    lm_head = target_hf.lm_head.weight.detach()
    out = tmp_path / f"exports-{kind}"
    mtp = tiny_mtp()
    return {
        "standalone": export_standalone(tiny_hf_model(kind, 2, vocab_size=V, num_hidden_layers=1), tok,
                                        out / "standalone", card(config, "distill", hub), vocab_ids=None,
                                        generation_config=None, gamma=4),  # fmt: skip
        "standalone_vocab": export_standalone(drafter, tok, out / "standalone_vocab", card(config, "distill", hub),
                                              vocab_ids=torch.arange(0, V, 3), generation_config=None,
                                              gamma=4),  # fmt: skip
        "eagle3": export_eagle3(eagle3_model(target_hf, V // 2), out / "eagle3", card(config, "eagle3", hub),
                                drafting={"gamma": 3, "tree_budget": 0, "top_k": 1}),  # fmt: skip
        "eagle3_full_vocab": export_eagle3(eagle3_model(target_hf, V), out / "eagle3_full", card(config, "eagle3", hub),
                                           drafting={"gamma": 3, "tree_budget": 0, "top_k": 1}),  # fmt: skip
        "medusa5": export_medusa(MedusaHeads(H, V, 5, 1), out / "medusa5", card(config, "medusa", hub),
                                 lm_head=lm_head, tree=None),  # fmt: skip
        "medusa4": export_medusa(MedusaHeads(H, V, 4, 1), out / "medusa4", card(config, "medusa", hub),
                                 lm_head=lm_head, tree=None),  # fmt: skip
        "medusa2": export_medusa(MedusaHeads(H, V, 5, 1), out / "medusa2", card(config, "medusa", hub),
                                 lm_head=lm_head, tree=None, target_model=target_hf, tokenizer=tok),  # fmt: skip
        "mtp": export_mtp(mtp.lm, heads_state_dict(mtp), {"num_heads": 3, "trunk_layers": 2}, tok, out / "mtp",
                          card(config, "mtp", hub), generation_config=None),  # fmt: skip
        "layerskip": export_skipset(SkipSet([1], [0], 4, target="org/target"), out / "skip", card(config, "layerskip")),
    }


@pytest.fixture(scope="module", params=FAMILIES)
def exports(request, tmp_path_factory):
    return request.param, export_all(tmp_path_factory.mktemp(request.param), request.param)


def claimed(report) -> set[tuple[str, str, str]]:
    return {(v.engine, v.folder, v.role) for v in report.verdicts}


def test_every_export_loads_in_every_engine_it_claims(exports):
    family, folders = exports
    llama = family == "llama"
    want = {
        "standalone": {("transformers", ".", "draft_model"), ("vllm", ".", "draft_model")},
        "standalone_vocab": {("transformers", ".", "draft_model"), ("vllm", ".", "draft_model")},
        "eagle3": {("vllm", ".", "eagle3"), ("sglang", "sglang", "eagle3")},
        "eagle3_full_vocab": {("vllm", ".", "eagle3"), ("sglang", "sglang", "eagle3")},
        # FasterDecoding: 5 heads of one block on a Llama or Mistral base only
        "medusa5": {("vllm", "vllm", "medusa")} | ({("faster_decoding", ".", "medusa")} if llama else set()),
        "medusa4": {("vllm", "vllm", "medusa")},
        "medusa2": {("vllm", "vllm", "medusa"), ("transformers", "target", "model"), ("vllm", "target", "model")},
        "mtp": {("transformers", ".", "model"), ("vllm", ".", "model")},
        "layerskip": set(),
    }
    for name, folder in folders.items():
        report = check_export(folder)
        assert report.ok, report.text()
        assert claimed(report) == want[name], name
        manifest = json.loads((folder / MANIFEST).read_text())
        recorded = [tuple(c.values()) for c in manifest["claims"]]
        assert recorded == [(v.engine, v.folder, v.role) for v in report.verdicts]
        text = (folder / "README.md").read_text()
        assert ("## Serving engines" in text) == bool(want[name] or report.unclaimed), name
        assert "my-target" not in json.dumps([Folder(p).json() for p in folder.rglob("config.json")])
    if llama:  # medusa_lm_head.pt: the heads FasterDecoding and specdec read, those of vLLM's layout
        pt, vllm_layout = read_layout(folders["medusa5"]), read_layout(folders["medusa5"] / "vllm")
        assert pt[1] == "faster_decoding" and (folders["medusa5"] / "medusa_lm_head.pt").is_file()
        for k, t in vllm_layout[0].state_dict().items():
            assert torch.equal(pt[0].state_dict()[k], t), k
    reasons = {name: check_export(folders[name]).unclaimed.get("faster_decoding", "") for name in folders}
    assert "builds 5 whatever medusa_num_heads says" in reasons["medusa4"]
    assert "push target/ as a repo of its own" in reasons["medusa2"]
    assert ("Llama and Mistral only" in reasons["medusa5"]) == (not llama)
    # where FasterDecoding is not claimed, it finds no medusa_lm_head.pt (it fails, never loads wrong);
    # specdec reads either file
    for name in ("medusa4", "medusa2", *(() if llama else ("medusa5",))):
        assert not (folders[name] / "medusa_lm_head.pt").exists()
        assert (folders[name] / "medusa_lm_head.safetensors").exists()
        assert read_layout(folders[name])[1] == "faster_decoding"


def test_exported_configs_name_the_target_by_its_hub_id_and_sglang_by_its_dtype(exports):
    family, folders = exports
    e3 = json.loads((folders["eagle3"] / "config.json").read_text())
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert e3["speculators_config"]["verifier"] == {"name_or_path": "org/target", "architectures": [architecture]}
    layer = e3["transformer_layer_config"]
    assert layer["attention_bias"] is False and layer["mlp_bias"] is False and layer["model_type"] == "llama"
    sg = json.loads((folders["eagle3"] / "sglang" / "config.json").read_text())
    assert sg["torch_dtype"] == sg["dtype"] == "bfloat16"  # the tiny target is fp32: SGLang would run fp16
    assert sg["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    assert set(load_file(folders["eagle3_full_vocab"] / "model.safetensors")).isdisjoint({"d2t", "t2d"})
    for name in ("medusa5", "medusa4"):
        assert json.loads((folders[name] / "config.json").read_text())["base_model_name_or_path"] == "org/target"
    assert json.loads((folders["medusa2"] / "config.json").read_text())["base_model_name_or_path"] is None
    assert not list(folders["standalone_vocab"].glob("*vocab*")) and not list(folders["mtp"].glob("mtp_*"))
    assert (folders["standalone_vocab"] / "specdec" / "draft_vocab.safetensors").is_file()


def test_a_target_without_hub_id_is_named_in_no_config_and_vllm_serve_dir_is_said_to_need_one(tmp_path):
    folders = export_all(tmp_path, "llama", hub=None)
    e3 = json.loads((folders["eagle3"] / "config.json").read_text())
    assert e3["speculators_config"]["verifier"]["name_or_path"] is None
    report = check_export(folders["eagle3"])
    assert report.ok and any("`vllm serve DIR` cannot find the target" in n for v in report.verdicts for n in v.notes)
    assert "base_model_name_or_path is null" in check_export(folders["medusa5"]).unclaimed["faster_decoding"]
    card_text = (folders["eagle3"] / "README.md").read_text()
    assert "model.hub_id=ORG/NAME" in card_text and "TARGET_HUB_ID" in card_text


# ---------------------------------------------------------------- the failures, as older exports had them


def rewrite(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def add_tensors(path: Path, **tensors: torch.Tensor) -> None:
    sd = load_file(path)
    sd.update(tensors)
    save_file(sd, str(path))


def test_a_qwen2_eagle3_drafter_with_the_targets_biases_is_refused_by_vllm_and_sglang(tmp_path):
    """The older writer gave a Qwen2 target's drafter its q/k/v biases and wrote attention_bias true:
    vLLM then creates an o_proj bias nothing fills, and SGLang drops the q/k/v biases."""
    folders = export_all(tmp_path, "qwen2")
    e3 = folders["eagle3"]
    rewrite(e3 / "config.json", lambda c: c["transformer_layer_config"].update(attention_bias=True))
    rewrite(e3 / "sglang" / "config.json", lambda c: c.update(attention_bias=True))
    hd = 64  # 4 heads x 16, 2 kv heads x 16 = 32
    biases = {"q_proj": torch.randn(hd), "k_proj": torch.randn(hd // 2), "v_proj": torch.randn(hd // 2)}
    add_tensors(e3 / "model.safetensors", **{f"layers.0.self_attn.{k}.bias": b for k, b in biases.items()})
    add_tensors(e3 / "sglang" / "model.safetensors", **{f"midlayer.self_attn.{k}.bias": b for k, b in biases.items()})
    by_vllm = vllm.eagle3(Folder(e3))
    assert any("layers.0.self_attn.o_proj.bias" in p and "uninitialized memory" in p for p in by_vllm.problems)
    by_sglang = sglang.eagle3(Folder(e3 / "sglang"))
    assert any("q_proj.bias" in p and "skips it silently" in p for p in by_sglang.problems)
    assert any("o_proj.bias" in p and "uninitialized" in p for p in by_sglang.problems)
    assert not check_export(e3).ok
    # specdec's runtime still reads it as it was trained: q/k/v biases, none on o_proj
    from specdec_runtime.drafters.eagle3_format import read_speculators

    model, _ = read_speculators(e3)
    layer = model.layers[0].self_attn
    assert torch.equal(layer.q_proj.bias, biases["q_proj"]) and layer.o_proj.bias is None


def test_sglang_refuses_a_config_without_dtype_and_ids_it_cannot_tap(tmp_path):
    folders = export_all(tmp_path, "llama")
    sg = folders["eagle3"] / "sglang"
    rewrite(sg / "config.json", lambda c: (c.pop("torch_dtype"), c.pop("dtype")))
    assert any("float16" in p for p in sglang.eagle3(Folder(sg)).problems)
    rewrite(sg / "config.json", lambda c: c.update(torch_dtype="bfloat16"))
    assert sglang.eagle3(Folder(sg)).ok
    target = target_facts(json.loads((tmp_path / "target-llama" / "config.json").read_text()), "org/target")
    rewrite(sg / "config.json", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 3]))
    problems = sglang.eagle3(Folder(sg), target).problems
    assert any("cannot tap the output of the target's last layer" in p for p in problems)


def test_vllm_refuses_d2t_beside_a_full_vocabulary_a_short_name_as_verifier_and_stray_weights(tmp_path):
    folders = export_all(tmp_path, "llama")
    full = folders["eagle3_full_vocab"]
    V = json.loads((full / "config.json").read_text())["draft_vocab_size"]
    add_tensors(full / "model.safetensors", d2t=torch.zeros(V, dtype=torch.long))
    assert any("d2t" in p for p in vllm.eagle3(Folder(full)).problems)
    e3 = folders["eagle3"]
    verifier = lambda name: lambda c: c["speculators_config"]["verifier"].update(name_or_path=name)  # noqa: E731
    rewrite(e3 / "config.json", verifier("smollm2-135m-instruct"))
    assert any("'smollm2-135m-instruct' is no Hub id" in p for p in vllm.eagle3(Folder(e3)).problems)
    rewrite(e3 / "config.json", verifier("/home/me/models/t"))
    assert any("is no Hub id" in p for p in vllm.eagle3(Folder(e3)).problems)
    rewrite(e3 / "config.json", verifier("org/t"))
    assert vllm.eagle3(Folder(e3)).ok
    d2t = load_file(e3 / "model.safetensors")["d2t"]
    add_tensors(e3 / "model.safetensors", d2t=d2t.float())
    assert any("d2t is F32" in p for p in vllm.eagle3(Folder(e3)).problems)
    add_tensors(e3 / "model.safetensors", d2t=d2t)
    rewrite(e3 / "config.json", lambda c: c.pop("norm_before_residual"))
    assert any("takes a missing one as true" in p for p in vllm.eagle3(Folder(e3)).problems)


def test_side_files_in_the_root_are_fed_to_the_model_by_vllms_weight_glob(tmp_path):
    """Older exports kept draft_vocab.safetensors and mtp_heads.safetensors beside the model: vLLM
    reads every root *.safetensors ("There is no module or parameter named 'ids'"). specdec still
    reads them there."""
    from specdec_runtime.drafters.mtp import read_mtp_config
    from specdec_runtime.loading import load_draft_vocab

    folders = export_all(tmp_path, "llama")
    sa, mtp = folders["standalone_vocab"], folders["mtp"]
    ids = load_draft_vocab(sa)
    (sa / "specdec" / "draft_vocab.safetensors").rename(sa / "draft_vocab.safetensors")
    (mtp / "specdec" / "mtp_heads.safetensors").rename(mtp / "mtp_heads.safetensors")
    (mtp / "specdec" / "mtp_config.json").rename(mtp / "mtp_config.json")
    report = check_export(sa)
    problems = [p for v in report.verdicts for p in v.problems]
    assert any("ids in the checkpoint" in p and "no module or parameter" in p for p in problems)
    assert torch.equal(load_draft_vocab(sa), ids)
    report = check_export(mtp)
    by_vllm = next(v for v in report.verdicts if v.engine == "vllm")
    assert any("heads.1." in p for p in by_vllm.problems) and read_mtp_config(mtp)["num_heads"] == 3


def test_fasterdecoding_refuses_what_its_v01_loader_reads_wrong(tmp_path):
    """It reads only medusa_lm_head.pt, builds 5 heads whatever the config says, repeats one block
    per head, and takes its base from base_model_name_or_path."""
    folders = export_all(tmp_path, "llama")
    m = folders["medusa5"]
    target = target_facts(json.loads((tmp_path / "target-llama" / "config.json").read_text()), "org/target")
    assert faster_decoding.medusa(Folder(m), target).ok
    rewrite(m / "config.json", lambda c: c.update(base_model_name_or_path="/home/me/target"))
    assert any("no Hub id" in p for p in faster_decoding.medusa(Folder(m), target).problems)
    rewrite(m / "config.json", lambda c: c.update(base_model_name_or_path="org/target", medusa_num_layers=2))
    assert any("last block's weights serve them all" in p for p in faster_decoding.medusa(Folder(m), target).problems)
    rewrite(m / "config.json", lambda c: c.update(medusa_num_layers=1))
    sd = torch.load(m / "medusa_lm_head.pt", weights_only=True)
    save_file(sd, str(m / "medusa_lm_head.safetensors"))
    (m / "medusa_lm_head.pt").unlink()
    assert any("reads only that file" in p for p in faster_decoding.medusa(Folder(m), target).problems)
    torch.save({k.replace("linear.", ""): v for k, v in sd.items()}, m / "medusa_lm_head.pt")
    problems = faster_decoding.medusa(Folder(m), target).problems
    assert any("dropped silently" in p for p in problems) and any("random initialization" in p for p in problems)


def test_rows_outside_a_draft_vocabulary_never_win_and_transformers_never_drafts_outside_it(tmp_path):
    """A drafter over a few tokens whose logits there are often all negative: the older export's
    zero rows (logit 0) and no suppression make transformers' assisted generation draft outside the
    vocabulary; the export's mean rows and suppress_tokens never do (the target's greedy output is
    the same either way)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation import candidate_generator

    from train.draft_model import use_draft_vocab

    path, config = target_folder(tmp_path, "llama")
    V = config["vocab_size"]
    target_hf = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    drafter = tiny_hf_model("llama", 7, vocab_size=V, num_hidden_layers=1)
    ids = torch.arange(5, V, V // 6)[:6]
    use_draft_vocab(drafter, ids)
    folder = export_standalone(drafter, tok, tmp_path / "sa", card(config, "distill"), vocab_ids=ids,
                               generation_config=None, gamma=3)  # fmt: skip
    drafted = []
    real = candidate_generator.AssistedCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        out = real(self, input_ids, *args, **kwargs)
        drafted.extend(out[0][0, input_ids.shape[1] :].tolist())
        return out

    def assisted(assistant) -> list[int]:
        drafted.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(candidate_generator.AssistedCandidateGenerator, "get_candidates", recording)
            prompt = torch.randint(3, V, (4, 10), generator=torch.Generator().manual_seed(0))
            outs = [target_hf.generate(p[None], assistant_model=assistant, max_new_tokens=24, do_sample=False,
                                pad_token_id=0) for p in prompt]  # fmt: skip
        plain = [target_hf.generate(p[None], max_new_tokens=24, do_sample=False, pad_token_id=0) for p in prompt]
        assert all(torch.equal(a, b) for a, b in zip(outs, plain))  # lossless either way
        return list(drafted)

    exported = AutoModelForCausalLM.from_pretrained(folder).eval()
    x = torch.randint(0, V, (3, 17))
    with torch.no_grad():
        logits = exported(x).logits
    inside = torch.zeros(V, dtype=torch.bool)
    inside[ids] = True
    assert (logits[..., ~inside].max(-1).values <= logits[..., inside].max(-1).values + 1e-5).all()
    assert drafted_ok(assisted(exported), inside)
    assert hf.causal_lm(Folder(folder), draft=True).ok
    # the older layout: zero rows, no suppression
    old = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        old.lm_head.weight[~inside] = 0
    old.generation_config.suppress_tokens = None
    assert not drafted_ok(assisted(old), inside)  # the scenario the test guards against does occur
    old.save_pretrained(tmp_path / "old")
    (tmp_path / "old" / "specdec").mkdir()
    (folder / "specdec" / "draft_vocab.safetensors").rename(tmp_path / "old" / "specdec" / "draft_vocab.safetensors")
    problems = hf.causal_lm(Folder(tmp_path / "old"), draft=True).problems
    assert any("unsuppressed" in p for p in problems) and any("not the mean of the rows inside" in p for p in problems)


def drafted_ok(drafted: list[int], inside: torch.Tensor) -> bool:
    assert drafted, "transformers drafted nothing"
    return all(bool(inside[t]) for t in drafted)


# ---------------------------------------------------------------- the command


def specdec(capsys, *args: str) -> tuple[int, str]:
    """`specdec ARGS` in this process: (exit code, standard output)."""
    from specdec_runtime.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().out


def test_check_export_command_says_per_engine_and_exits_2_where_a_claimed_one_fails(tmp_path, capsys):
    folders = export_all(tmp_path, "llama")
    capsys.readouterr()
    code, out = specdec(capsys, "check-export", str(folders["eagle3"]))
    assert code == 0
    assert "vLLM as an EAGLE-3 drafter: loads" in out and "SGLang as an EAGLE-3 drafter from sglang/: loads" in out
    rewrite(folders["eagle3"] / "sglang" / "config.json", lambda c: c.pop("torch_dtype") and c.pop("dtype"))
    code, out = specdec(capsys, "check-export", str(folders["eagle3"]))
    assert code == 2 and "SGLang as an EAGLE-3 drafter from sglang/: WILL NOT LOAD RIGHT" in out
    code, out = specdec(capsys, "check-export", str(folders["medusa4"]), "--engine", "faster_decoding")
    assert code == 2 and "builds 5 whatever medusa_num_heads says" in out
    (folders["eagle3"] / MANIFEST).unlink()  # an older export: claims read off its files
    code, out = specdec(capsys, "check-export", str(folders["eagle3"]))
    assert code == 2 and "claims read off its files" in out
