"""Reusable training pieces the recipes share (no Hydra inside: builders take flat arguments).

launch.py       the Accelerator, launcher checks, helpers for sharded parameters (ZeRO-3, FSDP)
loop.py         optimizer + schedule, the token-normalized optimizer step, the progress bar and log
checkpoint.py   atomic checkpoints and exact resume
tracking.py     log.jsonl + Weights & Biases
data.py         conversations, chat-template loss masks, deterministic batches, prompt selection
corpus.py       plain-text corpora packed into sequences (pretraining), an own tokenizer
responses.py    batched, cached, resumable generation (self-distillation, on-policy)
losses.py       FKL / RKL / JSD / TVD per token, dense or top-k teacher
draft_model.py  building drafters, draft vocabulary, logits at selected positions
medusa.py       Medusa heads with their target as one trained module, hidden-state cache, calibration
mtp.py          multi-token-prediction model, sequential per-head backward, held-out evaluation
layerskip.py    the layer-skip search: search space, cost model, evaluator, optuna studies
validate.py     tau / speedup / losslessness on specdec_runtime
export.py       HF folders, model cards, Hub push
"""
