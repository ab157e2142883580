"""Building drafters, the draft vocabulary, and the export's round trips (transformers and runtime)."""

import pytest
import torch

from specdec_runtime.drafters.standalone import ModelDrafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.generate import generate
from specdec_runtime.loading import load_model
from specdec_runtime.sampling import Sampler
from tests.conftest import runtime_from_hf, save_tiny_model, save_tiny_tokenizer, tiny_hf_model
from train.draft_model import (
    SelectedLogits,
    draft_vocab,
    drafter_from_config,
    drafter_from_pretrained,
    drafter_from_target_layers,
    use_draft_vocab,
)
from train.export import write_hf_model
from train.validate import runtime_decoder


def test_target_layers_drafter_is_the_early_exit_target():
    target = tiny_hf_model(num_hidden_layers=3, tie_word_embeddings=True)
    draft = drafter_from_target_layers(target, 1).eval()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    runtime = runtime_from_hf(target)
    runtime.setup_cache(1, 16)
    want = runtime(ids, 0, exit_layer=1).logits  # oracle: the target cut after layer 1
    with torch.no_grad():
        torch.testing.assert_close(draft(ids).logits, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(SpecdecError, match="choose 1..2"):
        drafter_from_target_layers(target, 3)


def test_config_drafter_takes_the_target_embeddings():
    target = tiny_hf_model()
    same = drafter_from_config(target, hidden_size=64, num_layers=1, intermediate_size=32, num_heads=2, num_kv_heads=1)
    torch.testing.assert_close(same.get_input_embeddings().weight, target.get_input_embeddings().weight)
    narrow = drafter_from_config(
        target, hidden_size=16, num_layers=1, intermediate_size=32, num_heads=2, num_kv_heads=1
    )
    e = narrow.get_input_embeddings().weight
    assert e.shape == (256, 16) and e.std() > 0
    assert narrow.config.vocab_size == target.config.vocab_size
    with pytest.raises(SpecdecError, match="multiple of num_heads"):
        drafter_from_config(target, hidden_size=30, num_layers=1, intermediate_size=8, num_heads=4, num_kv_heads=1)


def test_pretrained_drafter_with_another_tokenizer_is_refused(tmp_path):
    target_tok = save_tiny_tokenizer(tmp_path / "t")
    save_tiny_model(tmp_path / "other")
    save_tiny_tokenizer(tmp_path / "other", extra_tokens=("#",))
    with pytest.raises(SpecdecError, match="does not share the target's tokenizer"):
        drafter_from_pretrained(str(tmp_path / "other"), target_tok)


def test_draft_vocab_takes_the_most_frequent_tokens():
    ids = draft_vocab([[5, 5, 5, 7, 7, 9], [7, 3]], size=3, vocab_size=20, always=[2])
    assert ids.tolist() == [2, 5, 7]  # stop token first, then by frequency (7: 3, 5: 3 -> id order), sorted
    assert draft_vocab([[4]], size=3, vocab_size=20).tolist() == [0, 1, 4]  # filled in id order
    with pytest.raises(SpecdecError, match="draft_vocab_size"):
        draft_vocab([[1]], size=30, vocab_size=20)


@pytest.mark.parametrize("tied", [True, False])
def test_draft_vocab_export_round_trips(tmp_path, tied):
    """The export loads in transformers (same logits on the draft vocabulary) and in the runtime."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "target", tie_word_embeddings=tied)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path).eval()
    draft = drafter_from_target_layers(target, 1).eval()
    vocab = torch.tensor([2, 3, 5, 8, 13, 21, 30])
    use_draft_vocab(draft, vocab)
    ids = torch.tensor([[1, 5, 8, 13, 3, 30]])
    select = torch.arange(6)
    with torch.no_grad():
        small = SelectedLogits(draft)(ids, torch.ones_like(ids), select)  # [6, 7]
    out = write_hf_model(draft, tok, tmp_path / "export", vocab_ids=vocab, generation_config=None)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        full = hf(ids).logits[0]  # [6, V]
    torch.testing.assert_close(full[:, vocab], small, rtol=1e-5, atol=1e-5)
    outside = torch.ones(full.shape[1], dtype=torch.bool)
    outside[vocab] = False
    # rows outside: the mean of the rows inside, so their logit is the mean of the vocabulary's
    torch.testing.assert_close(full[:, outside], small.mean(-1, keepdim=True).expand(-1, int(outside.sum())))
    runtime = load_model(str(out), device="cpu", dtype="float32").model
    assert runtime.vocab_ids.tolist() == vocab.tolist() and runtime.lm_head.weight.shape[1] == len(vocab)
    runtime.setup_cache(1, 8)
    torch.testing.assert_close(runtime(ids, 0).logits[0], small, rtol=1e-4, atol=1e-4)
    # The in-memory conversion validation uses is the same model.
    mem = runtime_decoder(draft, vocab, torch.device("cpu"), torch.float32)
    mem.setup_cache(1, 8)
    torch.testing.assert_close(mem(ids, 0).logits, runtime(ids, 0).logits)


def test_draft_vocab_drafter_is_lossless_and_never_proposes_outside_it(tmp_path):
    target_hf = tiny_hf_model(seed=1)
    target = runtime_from_hf(target_hf)
    draft = drafter_from_target_layers(target_hf, 1).eval()
    vocab = torch.arange(0, 256, 2)  # even ids only
    use_draft_vocab(draft, vocab)
    drafter = ModelDrafter(runtime_decoder(draft, vocab, torch.device("cpu"), torch.float32), vocab_size=256)
    prompt = torch.tensor([3, 17, 42, 99])
    ar = generate(target, prompt, None, Sampler(), max_new_tokens=40)
    spec = generate(target, prompt, drafter, Sampler(), max_new_tokens=40, gamma=4)
    assert spec.tokens == ar.tokens  # greedy: exactly the target's output
    drafter.start(prompt, 64)
    d = drafter.draft(prompt, 4, Sampler(temperature=1.0, seed=0))
    assert (d.tokens % 2 == 0).all() and (d.probs[:, 1::2] == 0).all()


def test_validation_runs_a_bf16_target_from_its_bf16_weights_on_a_cpu():
    """runtime_decoder's default dtype: a bf16 transformers model runs on a CPU as its bf16 weights
    with fp32 activations where the kernel reads them (the fp32 model of the same weights, which
    validation ran before, to fp32 rounding, at half the bytes); an fp32 model in fp32."""
    from specdec_runtime.config import DecoderConfig
    from specdec_runtime.cpu import kernel as cpu_kernel
    from specdec_runtime.model import Decoder

    hf = tiny_hf_model(seed=4)
    cpu = torch.device("cpu")
    assert not runtime_decoder(hf, None, cpu).bf16_weights
    half = hf.to(torch.bfloat16)
    ours = runtime_decoder(half, None, cpu)
    assert ours.bf16_weights == cpu_kernel.reads_bf16_weights(cpu)
    sd = {k: v.float() for k, v in half.state_dict().items()}
    fp32 = Decoder.from_hf_state_dict(DecoderConfig.from_hf(half.config), sd, cpu_copies=False)
    fp32.keep_cpu_copies()  # packed in fp32
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    for m in (ours, fp32):
        m.setup_cache(1, 12)
    torch.testing.assert_close(ours(ids, 0).logits, fp32(ids, 0).logits, rtol=1e-5, atol=1e-5)
