"""Worker for tests/train/test_mtp.py: one optimizer step's gradients through the mtp recipe's
backward_fn (sequential per-head backward, DDP-wrapped, 2 micro-batches of gradient accumulation),
as rank 0 sees them after the step. Run alone (1 process) or under accelerate launch (2 processes).

    python tests/train/mtp_grad_worker.py OUT.pt [sequential|naive]
"""

import sys
import tempfile

import torch

from recipes.mtp import make_backward_fn
from train.launch import make_accelerator
from train.mtp import PackedSequence


def tiny_mtp(num_heads: int = 3):
    from transformers import LlamaConfig

    from train.mtp import MTPModel

    cfg = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return MTPModel.from_config(cfg, num_heads)


def global_batch(n_seqs: int = 8, seq_len: int = 20) -> torch.Tensor:
    return torch.randint(0, 96, (n_seqs, seq_len), generator=torch.Generator().manual_seed(1))


def main(out: str, mode: str) -> None:
    acc = make_accelerator(
        mixed_precision="no", grad_accum=2, seed=0, log_with=None, project_dir=tempfile.mkdtemp(), cpu=True
    )
    model = tiny_mtp()
    wrapped = acc.prepare(model)
    backward_fn = make_backward_fn(acc, wrapped, [1.0, 0.5, 0.25], mode == "sequential")
    ids = global_batch()
    n = model.num_heads
    per_rank = ids.shape[0] // acc.num_processes
    mine = ids[acc.process_index * per_rank : (acc.process_index + 1) * per_rank]
    micro = mine.chunk(2)
    total = ids.shape[0] * (ids.shape[1] - n)  # loss positions of the global batch
    scale = acc.num_processes * acc.gradient_accumulation_steps / total  # as optimizer_step
    for mb in micro:
        with acc.accumulate(wrapped):
            backward_fn([PackedSequence(s, ids.shape[1] - n) for s in mb], scale)
    if acc.is_main_process:
        torch.save({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, out)
    acc.wait_for_everyone()
    # The DDP wrapper (and the gloo group it holds) collected now, while the interpreter is alive:
    # left to interpreter exit, rank 0 aborted twice in ~30 full runs ("terminate called without an
    # active exception"), the exit-time teardown of gloo work that pytorch/pytorch#179291 describes.
    del wrapped, backward_fn, model
    acc.free_memory()  # drops accelerate's references, then gc.collect()
    acc.end_training()  # as Tracker.finish ends a recipe's run


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "sequential")
