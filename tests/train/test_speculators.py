"""The EAGLE-3 export read by speculators, the vLLM project's reference implementation of the format
(installed --no-deps by scripts/test.sh): its Eagle3DraftModel is built from our exported config.json
with its own config class, takes our weights with no unexpected key and only the missing keys it
ignores itself, and its first draft step's logits on the target's own hidden states equal those of
specdec's runtime drafter loaded from the same folder, for a Llama and a Qwen2 target.

Conventions are vLLM's where speculators' and vLLM's differ: tap k is the residual stream entering
the target's layer k (HF hidden_states[k]); row p reads the tap at p and the token at p + 1 at rope
position p (speculators' training numbers positions from 1; rope is relative, so its logits are the
same to rounding)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.eagle3_format import read_speculators
from tests.conftest import runtime_from_hf
from tests.runtime.test_eagle3 import drafted_logits
from tests.train.test_export_engines import card, eagle3_model, target_folder
from train.export import export_eagle3

speculators = pytest.importorskip("speculators", reason="scripts/test.sh installs speculators (--no-deps)")


@torch.no_grad()
def speculators_first_step(model, input_ids: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """speculators' draft step 0 (Eagle3DraftModel.forward's first step, with its own modules and
    causal mask): fc over the taps [1, T, 3H], [embedding ; feature] through its layers, norm and
    lm_head -> logits over the draft vocabulary [1, T, N]."""
    T = input_ids.shape[1]
    positions = torch.arange(T)[None]
    x = torch.cat([model.embed_tokens(input_ids), model.fc(taps)], dim=-1)
    embeddings = model.rotary_emb(x, positions)
    mask = model._build_attn_mask(torch.zeros(T, dtype=torch.long), T, x.device)
    for layer in model.layers:
        x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=embeddings)
    return model.lm_head(model.norm(x))


@pytest.mark.parametrize("family, draft_vocab", [("llama", 20), ("qwen2", 20), ("llama", 0)])
def test_speculators_loads_the_export_and_drafts_what_specdec_drafts(tmp_path, family, draft_vocab):
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoModelForCausalLM

    path, config = target_folder(tmp_path, family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    V = config["vocab_size"]
    folder = export_eagle3(eagle3_model(hf, draft_vocab or V), tmp_path / "export", card(config, "eagle3"),
                           drafting={"gamma": 3, "tree_budget": 0, "top_k": 1})  # fmt: skip

    spec_config = SpeculatorModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    spec_config.transformer_layer_config._attn_implementation = "sdpa"
    theirs = Eagle3DraftModel(spec_config).eval()
    sd = load_file(folder / "model.safetensors") | {"embed_tokens.weight": hf.get_input_embeddings().weight}
    missing, unexpected = theirs.load_state_dict(sd, strict=False)
    assert unexpected == []
    assert set(missing) <= set(Eagle3DraftModel._keys_to_ignore_on_load_missing), missing  # its loss-only heads
    if draft_vocab:
        ours, _ = read_speculators(folder)
        assert torch.equal(theirs.d2t, ours.d2t) and torch.equal(theirs.t2d, ours.t2d)

    target = runtime_from_hf(hf)
    drafter = Eagle3Drafter(read_speculators(folder)[0], target, cpu_bf16=False)  # the trained fp32 weights
    prompt = torch.randint(3, V, (11,), generator=torch.Generator().manual_seed(0))
    seen, ids, draft = drafted_logits(drafter, target, prompt, gamma=1)
    P = len(prompt)
    with torch.no_grad():
        hidden = hf(ids[None], output_hidden_states=True).hidden_states
    taps = torch.cat([hidden[k] for k in spec_config.eagle_aux_hidden_state_layer_ids], dim=-1)[:, :P]  # rows 0..P-1
    logits = speculators_first_step(theirs, ids[None, 1:], taps)  # row p: the token at p + 1
    torch.testing.assert_close(seen[0], logits[0, P - 1], rtol=1e-4, atol=1e-5)  # fp32, two attention codes
    best = int(logits[0, P - 1].argmax())
    assert int(draft.tokens[0]) == best + (int(theirs.d2t[best]) if draft_vocab else 0)
