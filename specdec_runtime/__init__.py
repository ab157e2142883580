"""specdec_runtime: a speculative decoding runtime for Llama-family models, in pure PyTorch.

    from specdec_runtime import load_model, build_drafter, generate, Sampler
    target = load_model("smollm2-135m-instruct")
    drafter = build_drafter("ngram", target)
    out = generate(target.model, ids, drafter, Sampler(), max_new_tokens=128, stop_ids=target.stop_ids)
    print(out.stats.tau, out.stats.tokens_per_s)

It never imports the training code, Hydra or accelerate: a trained drafter is served with this
package alone.
"""

from specdec_runtime.config import DecoderConfig
from specdec_runtime.drafters.lookup import NgramDrafter
from specdec_runtime.drafters.protocol import Draft, Drafter
from specdec_runtime.drafters.spec import build_drafter
from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import Generation, generate
from specdec_runtime.loading import LoadedModel, load_hf_model, load_model
from specdec_runtime.measure import Report, measure
from specdec_runtime.model import Decoder, LayerSkip
from specdec_runtime.sampling import Sampler
from specdec_runtime.stats import GenerationStats

__all__ = [
    "Decoder",
    "DecoderConfig",
    "Draft",
    "Drafter",
    "Generation",
    "GenerationStats",
    "LayerSkip",
    "LoadedModel",
    "ModelDrafter",
    "NgramDrafter",
    "Report",
    "Sampler",
    "SpecdecError",
    "build_drafter",
    "generate",
    "load_hf_model",
    "load_model",
    "measure",
]
