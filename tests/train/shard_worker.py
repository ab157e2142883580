"""Worker for tests/train/test_shard.py, under accelerate launch (2 CPU processes): a tiny target
loaded with its decoder layers split across the processes (train.launch.load_layer_sharded), its
states against the whole target's on the same rows, the rows each process keeps, and the state
store filled with unequal shares (one process computes twice as many batches as the other: the
other must run as many forwards, or both wait for ever). Writes OUT/rank{r}.json.

    python tests/train/shard_worker.py TARGET_DIR OUT_DIR
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from accelerate.utils import gather_object

from train.data import Example
from train.eagle3 import target_states
from train.hidden_cache import cache_states, padded
from train.launch import load_layer_sharded, make_accelerator, most
from train.responses import generate_responses


def main(target: str, out: str) -> None:
    acc = make_accelerator(
        mixed_precision="no", grad_accum=1, seed=0, log_with=None, project_dir=tempfile.mkdtemp(), cpu=True
    )
    rank = acc.process_index
    from transformers import AutoModelForCausalLM

    whole = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    split = load_layer_sharded(target, torch.float32, torch.device("cpu"))
    states = target_states((1, 2, 3))
    g = torch.Generator().manual_seed(rank)  # each process its own rows
    ids = torch.randint(3, whole.config.vocab_size, (2, 17), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 12:] = 0  # a padded row
    with torch.no_grad():
        want, got = states(whole, ids, attn), states(split, ids, attn)
    diff = max((want[k] - got[k]).abs().max().item() for k in want)
    q = split.model.layers[0].self_attn.q_proj.weight
    kept = [int(q.to_local().shape[0]), int(whole.model.layers[0].self_attn.q_proj.weight.shape[0])]

    # 3 examples over 2 processes, a batch each: rank 0 computes 2 batches, rank 1 one
    examples = [Example([5 + i, 6, 7, 8 + i], [False, False, True, True]) for i in range(3)]
    folder = Path(out) / "store"
    stored = cache_states(split, examples, folder, states=states, pad_id=0, token_bytes=4, batch_size=1, rank=rank,
                          world=acc.num_processes, barrier=acc.wait_for_everyone, together=most)  # fmt: skip
    with torch.no_grad():
        direct = states(whole, torch.tensor([examples[2].ids]), torch.ones(1, 4, dtype=torch.long))
    store_diff = (padded(stored[2:], "taps", torch.device("cpu")) - direct["taps"]).abs().max().item()
    # responses in the job: 3 prompts over 2 processes, a batch each, every process as many batches
    # and steps as the busiest; the same greedy tokens as the whole target's normal generate
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    kw = dict(pad_id=0, stop_ids=frozenset({2}), max_new_tokens=6, batch_size=1, rank=rank, world=acc.num_processes)
    split_responses = generate_responses(split, prompts, gather=lambda d: gather_object([d]), together=most, **kw)
    whole_responses = generate_responses(whole, prompts, pad_id=0, stop_ids=frozenset({2}), max_new_tokens=6)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({
        "diff": diff, "kept": kept, "store_diff": store_diff, "world": acc.num_processes,
        "responses_equal": split_responses == whole_responses, "responses": split_responses,
    }))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
