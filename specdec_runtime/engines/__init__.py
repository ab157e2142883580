"""What each serving engine's loader reads, written from the engine's own source, and a check of a
folder against it (`specdec check-export` runs these: specdec_runtime.export_check).

    verdict = vllm.eagle3(Folder(path))          # Verdict: problems (it would not load, or load wrong) and notes
    verdict = sglang.eagle3(Folder(path / "sglang"), target={"num_hidden_layers": 30, ...})
    verdict = CHECKS["faster_decoding", "medusa"](Folder(path), target)

One module per engine (the contract: vllm, sglang, faster_decoding, hf for transformers), each
naming the release or commit whose loader it follows and the files its rules are in (ENGINE). Each
check applies those rules, never specdec's writer: which files are read, which tensor names become
which parameters, which layers have biases and from which config field, what a missing or unknown
tensor does. A tensor an engine drops silently, or a parameter it leaves uninitialized without a
word, is a problem as much as an error is: a drafter that loads wrong must never load silently.
Tensors are read from the safetensors headers (names, shapes, dtypes), so checking a 70B export
reads a few kilobytes.
"""

from specdec_runtime.engines import faster_decoding, hf, sglang, vllm
from specdec_runtime.engines.common import Engine, Folder, Verdict

ENGINES: dict[str, Engine] = {
    "vllm": vllm.ENGINE,
    "sglang": sglang.ENGINE,
    "faster_decoding": faster_decoding.ENGINE,
    "transformers": hf.ENGINE,
}
CHECKS = {  # (engine, what it loads the folder as) -> check(folder, target facts or None)
    ("vllm", "eagle3"): vllm.eagle3,
    ("vllm", "draft_model"): lambda f, t: vllm.causal_lm(f, t, draft=True),
    ("vllm", "model"): vllm.causal_lm,
    ("vllm", "medusa"): vllm.medusa,
    ("sglang", "eagle3"): sglang.eagle3,
    ("faster_decoding", "medusa"): faster_decoding.medusa,
    ("transformers", "draft_model"): lambda f, t: hf.causal_lm(f, t, draft=True),
    ("transformers", "model"): hf.causal_lm,
}
__all__ = ["CHECKS", "ENGINES", "Engine", "Folder", "Verdict", "faster_decoding", "hf", "sglang", "vllm"]
