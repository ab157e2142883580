"""The training-time test's memory-lean paths against the plain computation: the attention over
all steps' keys in one SDPA call against the materialized [T, T + k] matrices it replaced (losses
and gradients), per-step activation checkpointing against none, and packed rows with document
masks against the same sequences unpacked (tokens, losses, metrics and gradients)."""

import pytest
import torch

from specdec_runtime.config import DecoderConfig
from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model, grouped
from tests.conftest import tiny_hf_model
from train import eagle3 as ttt
from train.eagle3 import Eagle3Training, pack, positions_in_documents

AUX, N = (1, 2, 3), 200


class MaterializedAttention:
    """The attention the training-time test used before: [B, h, T, T] scores in fp32 for step
    0's keys plus one column per earlier step, softmax, then the values (the oracle)."""

    def __init__(self, length: int, device: torch.device, steps: int, documents=None):
        assert documents is None
        self.keys, self.values, self.step = [], [], 0
        self.causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()

    def __call__(self, q, k, v):
        self.keys.append(k)
        self.values.append(v)
        h, scale = q.shape[1], q.shape[-1] ** -0.5
        k0, v0 = grouped(self.keys[0], h), grouped(self.values[0], h)
        first = ((q @ k0.transpose(-1, -2)).float() * scale).masked_fill(~self.causal, float("-inf"))
        later = [(q * grouped(kj, h)).sum(-1, keepdim=True).float() * scale for kj in self.keys[1:]]
        w = torch.cat([first, *later], dim=-1).softmax(-1).to(q.dtype)
        T = first.shape[-1]
        out = w[..., :T] @ v0
        for j, vj in enumerate(self.values[1:]):
            out = out + w[..., T + j : T + j + 1] * grouped(vj, h)
        return out


def setup(seed: int = 0, **training):
    hf = tiny_hf_model("llama", seed, num_hidden_layers=4, vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    cfg = Eagle3Config.for_target(DecoderConfig.from_hf(hf.config), aux_layers=AUX, draft_vocab_size=N)
    torch.manual_seed(seed + 1)
    model = Eagle3Model(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model.set_draft_vocab(torch.arange(N))
    embed = hf.get_input_embeddings().weight.detach()
    return model, Eagle3Training(model, embed, hf.get_output_embeddings().weight.detach()[:N], steps=4, decay=0.8,
                                 **training)  # fmt: skip


def batch(lengths, seed: int = 0):
    """A right-padded batch: ids, attention mask, target mask (the second half of each sequence is
    its response), taps and final states (random; zero on the padding)."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(0, N, (B, T), generator=g)
    attn = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        attn[b, :n] = 1
        mask[b, n // 2 : n] = True
    taps, final = torch.randn(B, T, 3 * 64, generator=g), torch.randn(B, T, 64, generator=g)
    taps, final = taps * attn[..., None], final * attn[..., None]
    return ids * attn, attn, mask[:, 1:], taps, final


def loss_and_grads(training, *args, **kwargs):
    model = training.drafter
    model.zero_grad()
    loss, n, metrics = training(*args, **kwargs)
    loss.backward()
    return loss.detach(), n, metrics, {k: p.grad.clone() for k, p in model.named_parameters()}


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    (la, na, ma, ga), (lb, nb, mb, gb) = a, b
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    assert na == nb and ma.keys() == mb.keys()
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=rtol, atol=atol)
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=rtol, atol=atol, msg=k)


def test_one_sdpa_call_a_step_equals_the_materialized_attention(monkeypatch):
    _, training = setup()
    args = batch([40, 33, 21])
    lean = loss_and_grads(training, *args)
    monkeypatch.setattr(ttt, "TTTAttention", MaterializedAttention)
    assert_same(lean, loss_and_grads(training, *args))
    assert lean[2]["step3/count"] > 0


def test_checkpointed_steps_give_the_same_loss_and_gradients_and_keep_less():
    _, plain = setup()
    _, checkpointed = setup(checkpoint_steps=True)
    args = batch([64, 50])
    assert_same(loss_and_grads(plain, *args), loss_and_grads(checkpointed, *args))

    def saved(training) -> int:
        sizes = {}

        def keep(t):
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            training(*args)
        return sum(sizes.values())

    assert saved(checkpointed) < 0.6 * saved(plain)  # the layer's rows are recomputed, not kept


def test_positions_restart_at_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1]])
    assert positions_in_documents(docs).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


@pytest.mark.parametrize(
    "budget, device",
    [(64, "cpu"), (100, "cpu"), pytest.param(100, "cuda", marks=pytest.mark.gpu)],
    ids=["a-row-each-or-two", "all-in-two-rows", "cuda"],
)
def test_packed_rows_train_exactly_as_the_sequences_unpacked(budget, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (scripts/gpu_check.sh runs the gpu tests on one)")
    _, training = setup()
    training = training.to(device)
    training._frozen = [t.to(device) for t in training._frozen]
    lengths = [40, 33, 21, 9]
    ids, attn, mask, taps, final = (t.to(device) for t in batch(lengths, seed=1))
    packed = pack(lengths, budget, ids, mask, taps, final)
    assert packed["input_ids"].shape[0] < len(lengths) and packed["input_ids"].shape[1] <= budget
    assert (packed["documents"] >= 0).sum() == sum(lengths)
    unpacked = loss_and_grads(training, ids, attn, mask, taps, final)
    p = packed
    rows = loss_and_grads(training, p["input_ids"], p["documents"] >= 0, p["target_mask"], p["taps"],
                          p["final"], documents=p["documents"])  # fmt: skip
    assert_same(unpacked, rows, rtol=1e-4, atol=1e-5)


def test_packed_documents_attend_in_groups_of_similar_lengths():
    """Each document at 0..len-1 of a row of its group (the longest first; a group holds lengths of
    at least 2/3 of its longest), a row's end a document's end even where the next row's first
    document has the same id, and back again unchanged."""
    docs = torch.tensor([[5, 5, 5, 5, 5, 5, 1, 1, 1, 1, -1], [1, 1, 1, 1, 1, 7, 7, 9, 9, 9, 9]])
    layout = ttt.Documents(docs)
    assert layout.groups == [(4, 6), (1, 2)]  # lengths 6, 5, 4, 4 | 2
    x = torch.arange(22.0).view(2, 1, 11, 1).expand(2, 3, 11, 2)  # [R, h, L, d]: each token's flat index
    parts = layout.split(x)
    assert [p.shape for p in parts] == [(4, 3, 6, 2), (1, 3, 2, 2)]
    rows = [[0, 1, 2, 3, 4, 5], [11, 12, 13, 14, 15, 0], [6, 7, 8, 9, 0, 0], [18, 19, 20, 21, 0, 0]]
    assert parts[0][:, 1, :, 1].tolist() == rows  # (the slots past a document's end copy token 0)
    assert parts[1][0, 2, :, 0].tolist() == [16, 17]
    kept = (docs >= 0)[:, None, :, None].expand_as(x)
    assert torch.equal(layout.join(parts)[kept], x[kept])


@pytest.mark.gpu
def test_on_cuda_the_lean_attention_follows_the_materialized_one_in_less_memory(monkeypatch):
    """On a GPU (SDPA's fused kernels, a mask row stride that is no multiple of 16): the same loss
    and gradients as the materialized attention in fp32, and a lower peak under bf16 autocast."""
    _, training = setup()
    training = training.cuda()
    training._frozen = [t.cuda() for t in training._frozen]
    args = [t.cuda() for t in batch([1000, 777])]

    def run(half: bool):
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=half):
            result = loss_and_grads(training, *args)
        return result, torch.cuda.max_memory_allocated() - start

    lean, _ = run(False)
    _, lean_half = run(True)
    monkeypatch.setattr(ttt, "TTTAttention", MaterializedAttention)
    naive, _ = run(False)
    _, naive_half = run(True)
    assert_same(lean, naive, rtol=1e-4, atol=1e-5)
    assert lean_half < 0.5 * naive_half, (lean_half, naive_half)
