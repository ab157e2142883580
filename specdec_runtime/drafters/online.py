"""Online speculative decoding (Liu et al. 2023): the drafter keeps learning from the prompts it serves.

    adapter = OnlineAdapter(drafter, target, every=8, steps=4, lr=3e-4)   # refuses drafters that cannot train
    for prompt in stream:
        out = generate(target, prompt, drafter, sampler, teacher=adapter.record)
        update = adapter.served(prompt, out.tokens)   # every 8 prompts: 4 distillation steps, then drafting resumes
    adapter.save("runs/adapted")                      # the drafter's folder with the adapted weights
    specdec generate --drafter runs/eagle3/export --prompts coding.jsonl --adapt-every 8 --baseline

Verification computes the target's distribution at every drafted position, so the teacher is free:
at each round whose draft it rejected, generate hands the adapter the target's distribution there
(its 64 likeliest tokens, renormalized). Every `every` prompts the drafter takes `steps` AdamW steps,
each on `every` of the last `keep` prompts served (default 4 windows), then drafts with the new
weights. The loss over each served sequence's generated positions is the cross-entropy of the
drafter's prediction against the token served there (a draw from the target's distribution,
whatever was accepted: verification is lossless) plus the cross-entropy against the recorded
distribution at the rejected positions (the paper's emphasis on where the drafter was wrong).
Both are smallest where the drafter's distribution is the target's. Verification is unchanged,
so the output is the target's whatever the drafter learns.

Drafters that learn: a stand-alone draft model (all its weights, as transformers' model of its
folder) and EAGLE-3 (its fc, layer and head, on the target's features that the loop already hands
it, with UNROLLED_STEPS draft steps unrolled as the runtime drafts them: the training-time test).
Weights train in fp32 on the target's device and are copied into what drafting reads, in place.
"""

import copy
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec_runtime.drafters.eagle3 import Eagle3Drafter
from specdec_runtime.drafters.eagle3_model import grouped
from specdec_runtime.drafters.lookup import LookupFirst
from specdec_runtime.drafters.multi import MultiDraft
from specdec_runtime.drafters.protocol import Drafter
from specdec_runtime.drafters.standalone import ModelDrafter, in_target_vocab
from specdec_runtime.errors import SpecdecError
from specdec_runtime.model import Decoder

TEACHER_TOP_K = 64  # the target's likeliest tokens kept per rejected position (the rest is a sliver of mass)
UNROLLED_STEPS = 3  # EAGLE-3's draft steps trained per row (the training recipe unrolls 7)


@dataclass
class Served:
    """One served prompt, as the adapter keeps it."""

    tokens: Tensor  # [S] the prompt and the output
    prompt_len: int
    rejected: list[tuple[int, Tensor, Tensor]]  # (position, ids [K], probs [K]): the target's distribution there
    features: Tensor | None = None  # [S - 1, n H_t] EAGLE-3: the target's taps at every position but the last


@dataclass
class Update:
    """One adaptation: `steps` steps on `prompts` kept prompts, the last window's loss from `before` to `after`."""

    prompts: int
    steps: int
    before: float
    after: float
    seconds: float

    def to_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def trainable(drafter: Drafter | None) -> Drafter | None:
    """The drafter inside LookupFirst or SpecTr's MultiDraft (what online adaptation trains)."""
    while isinstance(drafter, (LookupFirst, MultiDraft)):
        drafter = drafter.drafter
    return drafter


def distillation_loss(logq: Tensor, labels: Tensor, soft: tuple[Tensor, Tensor, Tensor] | None) -> tuple[Tensor, int]:
    """(summed loss, terms): cross-entropy of log-probabilities logq [T, N] against labels [T] (-1:
    no term), and against the distributions probs [R, K] over ids [R, K] at rows [R] (soft)."""
    keep = labels >= 0
    loss = -logq[keep].gather(1, labels[keep, None]).sum()
    terms = int(keep.sum())
    if soft is not None:
        rows, ids, probs = soft
        loss = loss - (probs * logq[rows[:, None], ids]).sum()
        terms += rows.shape[0]
    return loss, terms


def stacked(rejected: list[tuple[int, Tensor, Tensor]], offset: int, device: torch.device):
    """The records as (rows [R], ids [R, K], probs [R, K]): the row predicting position p is p - offset."""
    if not rejected:
        return None
    rows = torch.tensor([p - offset for p, _, _ in rejected], device=device)
    ids, probs = (torch.stack([r[j] for r in rejected]).to(device) for j in (1, 2))
    return rows, ids, probs


class Eagle3Learner:
    """Trains an Eagle3Drafter's model on the target's features of what it served."""

    def __init__(self, drafter: Eagle3Drafter, target: Decoder):
        self.drafter, self.target = drafter, target
        self.model = copy.deepcopy(drafter.model).float().to(target.device).train().requires_grad_(True)
        t2d = self.model.t2d
        self.draft_id = torch.where(t2d, t2d.long().cumsum(0) - 1, -1)  # [V] each target id's draft id, or -1
        drafter.kept = []

    def parameters(self) -> list[Tensor]:
        return list(self.model.parameters())

    def features(self, rows: int) -> Tensor:
        """The drafter's kept features of the sequence just served, its first `rows` [rows, n H_t]."""
        kept, self.drafter.kept = self.drafter.kept, []
        return torch.cat(kept)[:rows]

    def loss(self, seq: Served) -> tuple[Tensor, int]:
        """Draft steps unrolled as the runtime drafts (the training-time test): at step j row p reads
        the feature at p (step 0) or its own step j - 1 output, and the token at p + 1 + j; it
        predicts the token at p + 2 + j, attending to step 0's rows up to p and its own earlier steps."""
        tokens = seq.tokens.to(self.target.device)
        S, device = tokens.shape[0], tokens.device
        T, steps = S - 2, min(UNROLLED_STEPS, S - 2)
        with torch.no_grad():  # the tokens after each row, padded for the later steps
            embeds = self.target.embed_tokens(F.pad(tokens, (0, steps))[None]).float()  # [1, S + steps, H]
        eye = torch.eye(T, dtype=torch.bool, device=device)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        mask = torch.cat([causal, *[eye] * (steps - 1)], dim=1)  # [T, steps T]: step 0's rows up to p, then p's own
        heads, keys, values = self.model.config.layer.num_heads, [], []

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            keys.append(k)
            values.append(v)
            K, V = torch.cat(keys, 2), torch.cat(values, 2)
            allowed = mask[:, : K.shape[2]]
            return F.scaled_dot_product_attention(q, grouped(K, heads), grouped(V, heads), attn_mask=allowed)

        soft = stacked(seq.rejected, 2, device)
        if soft is not None:  # the target's probabilities within the draft vocabulary, renormalized
            rows, ids, probs = soft
            probs = torch.where(self.draft_id[ids] >= 0, probs, 0)
            soft = rows, self.draft_id[ids].clamp(min=0), probs / probs.sum(-1, keepdim=True).clamp(min=1e-9)
        feature, positions = self.model.project(seq.features[None, :T].float()), torch.arange(T, device=device)
        loss, terms = torch.zeros((), device=device), 0
        for j in range(steps):
            feature, logits = self.model.step(embeds[:, 1 + j : T + 1 + j], feature, positions + j, attend)
            labels = torch.full((T,), -1, device=device)
            labels[: T - j] = self.draft_id[tokens[2 + j :]]  # row p: the token at p + 2 + j
            labels[: max(seq.prompt_len - 2 - j, 0)] = -1  # only the generated tokens teach
            # a rejected position r is what row r - 2 - j predicts at step j
            shifted = None
            if soft is not None and bool((keep := soft[0] >= j).any()):
                shifted = soft[0][keep] - j, soft[1][keep], soft[2][keep]
            part, n = distillation_loss(logits[0].float().log_softmax(-1), labels, shifted)
            loss, terms = loss + part, terms + n
        return loss, terms

    def publish(self) -> None:
        self.drafter.model.load_state_dict({k: v.to("cpu") for k, v in self.model.state_dict().items()})
        self.drafter.refresh()

    def save(self, folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        from specdec_runtime.drafters.eagle3_format import SGLANG, WEIGHTS, sglang_layout, weights

        dtype = load_file(str(folder / WEIGHTS))["fc.weight"].dtype  # as exported
        model = copy.deepcopy(self.model).to("cpu", dtype)
        sd = weights(model)
        save_file(sd, str(folder / WEIGHTS), metadata={"format": "pt"})
        if (folder / SGLANG).is_dir():
            flat = sglang_layout(model, sd, str(dtype).removeprefix("torch."))[1]
            save_file(flat, str(folder / SGLANG / WEIGHTS), metadata={"format": "pt"})


class ModelLearner:
    """Trains a stand-alone draft model (transformers' model of its folder) on what it served."""

    def __init__(self, drafter: ModelDrafter, target: Decoder):
        from specdec_runtime.loading import load_draft_vocab, load_hf_model

        self.drafter, self.target, self.source = drafter, target, drafter.source
        self.hf = load_hf_model(str(self.source), dtype=torch.float32).to(target.device).train()
        self.vocab_ids = load_draft_vocab(self.source)

    def parameters(self) -> list[Tensor]:
        return list(self.hf.parameters())

    def features(self, rows: int) -> None:
        return None

    def loss(self, seq: Served) -> tuple[Tensor, int]:
        """Row p predicts the token at p + 1."""
        tokens = seq.tokens.to(self.target.device)
        logits = in_target_vocab(self.hf(tokens[None, :-1]).logits[0], self.target.config.vocab_size, None)
        labels = tokens[1:].clone()
        labels[: max(seq.prompt_len - 1, 0)] = -1
        return distillation_loss(logits.float().log_softmax(-1), labels, stacked(seq.rejected, 1, tokens.device))

    @torch.no_grad()
    def publish(self) -> None:
        model = self.drafter.model
        sd = {k: v.detach() for k, v in self.hf.state_dict().items()}
        fresh = Decoder.from_hf_state_dict(model.config, sd, model.device, model.dtype, vocab_ids=self.vocab_ids,
                                           cpu_copies=False)  # fmt: skip
        model.load_state_dict(fresh.state_dict(), strict=False)  # (its CPU copies are made again there)

    def save(self, folder: Path) -> None:
        from specdec_runtime.loading import load_state_dict

        dtype = next(iter(load_state_dict(self.source).values())).dtype  # as saved
        copy.deepcopy(self.hf).to("cpu", dtype).save_pretrained(folder)


class OnlineAdapter:
    """Collects what verification teaches while prompts are served, and updates the drafter every
    `every` prompts (module docstring)."""

    def __init__(self, drafter: Drafter | None, target: Decoder, *, every: int, steps: int = 4, lr: float = 3e-4,
                 keep: int = 0):  # fmt: skip
        check_adapting(every, steps, lr)
        inner = trainable(drafter)
        if isinstance(inner, Eagle3Drafter):
            self.learner = Eagle3Learner(inner, target)
        elif isinstance(inner, ModelDrafter) and not inner.shares_target_cache and inner.source is not None:
            self.learner = ModelLearner(inner, target)
        else:
            name = getattr(inner, "name", "none")
            raise SpecdecError(
                f"online adaptation trains a stand-alone draft model or an EAGLE-3 drafter; drafter '{name}' is "
                "neither (n-gram lookup, truncate, layer skip, Medusa and MTP heads do not learn online)"
            )
        self.drafter, self.every, self.steps = inner, every, steps
        # the most recent prompts an update trains on (default: 4 windows; the last window alone
        # measured less: docs/results.md#online-adaptation)
        self.keep = max(keep or 4 * every, every)
        self.shuffle = torch.Generator().manual_seed(0)  # the order an update's steps take the kept prompts in
        self.optimizer = torch.optim.AdamW(self.learner.parameters(), lr=lr, weight_decay=0.0)
        self.buffer: list[Served] = []
        self.rejected: list[tuple[int, Tensor, Tensor]] = []  # the prompt being served's records
        self.updates: list[Update] = []
        self.served_prompts = 0

    def record(self, position: int, probs: Tensor) -> None:
        """generate's teacher: the target's distribution probs [V] where it rejected a draft."""
        top = probs.topk(min(TEACHER_TOP_K, probs.shape[-1]))
        self.rejected.append((position, top.indices, top.values / top.values.sum()))

    def served(self, prompt: list[int], output: list[int]) -> Update | None:
        """A prompt has been served: keep what it taught, and every `every` prompts update the drafter."""
        S = len(prompt) + len(output)
        features = self.learner.features(S - 1)
        rejected = [r for r in self.rejected if r[0] < S]  # (drafts accepted past a stop token are not output)
        self.rejected = []
        self.served_prompts += 1
        if S >= 3:
            self.buffer.append(Served(torch.tensor(list(prompt) + list(output)), len(prompt), rejected, features))
        return self.update() if self.served_prompts % self.every == 0 else None

    def loss(self, batch: list[Served]) -> Tensor:
        """The loss over a batch of served prompts, normalized by its terms."""
        parts = [self.learner.loss(seq) for seq in batch]
        return sum(part for part, _ in parts) / max(sum(n for _, n in parts), 1)

    def update(self) -> Update:
        """`steps` AdamW steps, each on `every` of the kept prompts (in a shuffled order: a step costs
        the same whatever `keep`), then drafting reads the new weights. before / after: the loss on
        the window just served (traffic the drafter had not trained on) before and after them."""
        t0, window = time.perf_counter(), self.buffer[-self.every :]
        order = torch.randperm(len(self.buffer), generator=self.shuffle).tolist()
        batches = [order[i : i + self.every] for i in range(0, len(order), self.every)]
        with torch.inference_mode(False), torch.enable_grad():
            with torch.no_grad():
                before = float(self.loss(window)) if window else 0.0
            for step in range(self.steps if self.buffer else 0):
                self.optimizer.zero_grad(set_to_none=True)
                self.loss([self.buffer[i] for i in batches[step % len(batches)]]).backward()
                torch.nn.utils.clip_grad_norm_(self.learner.parameters(), 1.0)
                self.optimizer.step()
            with torch.no_grad():
                after = float(self.loss(window)) if window else 0.0
            if self.buffer:
                self.learner.publish()
        update = Update(len(self.buffer), self.steps if self.buffer else 0, before, after, time.perf_counter() - t0)
        self.buffer = self.buffer[-(self.keep - self.every) :] if self.keep > self.every else []  # replayed next time
        self.updates.append(update)
        return update

    def save(self, folder: str | Path) -> Path:
        """The drafter's folder copied to `folder`, with the adapted weights in place of its own."""
        folder, source = Path(folder), self.drafter.source
        check_save_folder(folder)
        shutil.copytree(source, folder, dirs_exist_ok=True)
        self.learner.save(folder)
        return folder


def check_adapting(every: int, steps: int, lr: float, save: Path | None = None, batch_size: int = 1) -> None:
    """Online adaptation's settings (`specdec generate --adapt-*`), checked before anything loads."""
    problems = []
    if every < 1:
        problems.append(f"--adapt-every must be >= 1 (prompts served between updates), got {every}")
    if steps < 1 or not lr > 0:
        problems.append(f"--adapt-steps must be >= 1 and --adapt-lr > 0 (got {steps}, {lr})")
    if batch_size > 1:
        problems.append("online adaptation serves one prompt at a time: --batch-size 1")
    if problems:
        raise SpecdecError("; ".join(problems))
    if save is not None:
        check_save_folder(save)


def check_save_folder(folder: Path) -> None:
    """Refuse to write an adapted drafter over anything a user has."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise SpecdecError(f"--adapt-save {folder} exists and is not an empty folder: name a new one")
