"""Reusable training pieces the recipes share (no Hydra inside: builders take flat arguments).

data.py         conversations, chat-template loss masks, deterministic batches
responses.py    batched, cached, resumable generation (self-distillation, on-policy)
losses.py       FKL / RKL / JSD / TVD per token, dense or top-k teacher
draft_model.py  building drafters, draft vocabulary, logits at selected positions
loop.py         accelerator, optimizer + schedule, token-normalized optimizer step
checkpoint.py   atomic checkpoints and exact resume
tracking.py     log.jsonl + Weights & Biases
validate.py     tau / speedup / losslessness on specdec_runtime
export.py       HF folders, model cards, Hub push
"""
