"""Multi-token prediction heads as a drafter: blockwise parallel decoding (Stern et al. 2018) with
the heads of a model trained by recipes.mtp (Gloeckle et al. 2024).

    drafter = load_mtp(target)                 # target: a LoadedModel exported by recipes.mtp
    drafter = build_drafter("mtp", target)     # the same, from the command line: --drafter mtp
    out = generate(target.model, prompt, drafter, gamma=3)

The exported model is a plain causal LM: its first L layers are the shared trunk and its last
layer is head 0 (the next token). Heads 1..n-1 live beside it in specdec/mtp_heads.safetensors (the
same layer type, keys heads.{i}.*; specdec/mtp_config.json says how many and where the trunk ends;
older exports kept both in the root, where vLLM's weight glob feeds the heads to the model). Head i
reads the trunk's output z at position t and predicts the token t+1+i, through the shared final
norm and vocabulary projection.

Drafting costs the extra heads only: the target's verify forward already computes z for every
position (`hidden_layers` = (L,)), the loop passes the accepted positions' z to `observe`, and each
head runs its one layer on them with its own KV cache. After a round that ends at position t
(its token t+1 comes from head 0, i.e. the target), heads 1..n-1 at t propose t+2..t+n: a draft
of up to n-1 tokens the next forward verifies, exactly as for any drafter (greedy exact,
rejection sampling lossless: each head's warped distribution is the draft's q).
"""

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from specdec_runtime.cache import KVCache
from specdec_runtime.config import DecoderConfig
from specdec_runtime.drafters.protocol import Draft, Drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.layers import Block, Linear, attention, block_state_dict, mlp, rms_norm
from specdec_runtime.loading import LoadedModel
from specdec_runtime.model import Decoder
from specdec_runtime.paths import SIDE_FOLDER
from specdec_runtime.sampling import Sampler

MTP_CONFIG = f"{SIDE_FOLDER}/mtp_config.json"  # specdec/: no engine's weight glob reads it (paths.SIDE_FOLDER)
MTP_WEIGHTS = f"{SIDE_FOLDER}/mtp_heads.safetensors"


class MTPHeads(nn.Module):
    """Heads 1..n-1: one decoder layer each over the trunk's output, with their own KV cache."""

    def __init__(self, cfg: DecoderConfig, num_heads: int, trunk_layers: int):
        super().__init__()
        self.num_heads, self.trunk_layers = num_heads, trunk_layers
        self.cfg = replace(cfg, num_layers=num_heads - 1)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(num_heads - 1))
        self.cache: KVCache | None = None
        self.kv_layers: list[Tensor] = []

    def setup_cache(self, size: int, device: torch.device, dtype: torch.dtype) -> None:
        if self.cache is not None and self.cache.size >= size:
            return
        self.cache = None
        self.cache = KVCache(self.cfg, 1, size, device, dtype)
        self.kv_layers = list(self.cache.kv.unbind(0))

    @torch.inference_mode()
    def forward(self, z: Tensor, start: int, target: Decoder) -> Tensor:
        """Logits [n-1, V] of heads 1..n-1 at the last of the trunk outputs z [T, H] (slots start..)."""
        T = z.shape[0]
        a = target.attention_inputs(target.slots[start], T, start + T)  # the target's rope and masks
        return self.run(z, 1, a, self.kv_layers, target, slice(T - 1, T))[:, 0]

    def run(self, z: Tensor, B: int, a, kv_layers: list[Tensor], target: Decoder, picked: Tensor | slice) -> Tensor:
        """Logits [n-1, P, V] of heads 1..n-1 at the P rows `picked` of the trunk outputs z [B*T, H]
        under attention inputs a (the target's: one sequence's, or a slot per row), K/V in kv_layers."""
        last = []
        for block, kv in zip(self.layers, kv_layers, strict=True):
            x = attention(z, B, *block.attn_weights, a.cos, a.sin, kv, a.slots, a.mask, a.bound, block.eps)
            last.append(mlp(x[picked], *block.mlp_weights, block.eps))  # (row-wise: the others' are unused)
        h = rms_norm(torch.stack(last), target.norm, target.config.rms_norm_eps)
        return target.lm_head(h)

    @classmethod
    def from_hf_state_dict(
        cls, cfg: DecoderConfig, sd: dict[str, Tensor], num_heads: int, trunk_layers: int, device, dtype
    ) -> "MTPHeads":
        with torch.device("meta"):
            heads = cls(cfg, num_heads, trunk_layers)
        prep = lambda w: w.to(device=device, dtype=dtype).contiguous()  # noqa: E731
        own: dict[str, Tensor] = {}
        for i in range(1, num_heads):
            own |= block_state_dict(cfg, sd, f"heads.{i}.", f"layers.{i - 1}.", prep)
        heads.load_state_dict(own, strict=True, assign=True)
        if torch.device(device).type == "cpu":  # several rows per call: see layers.linear
            for m in heads.modules():
                if isinstance(m, Linear):
                    m.keep_cpu_copy()
        return heads.eval()


class MTPDrafter(Drafter):
    """Drafts with the extra MTP heads of the target itself (see the module docstring)."""

    def __init__(self, heads: MTPHeads, target: Decoder, name: str = "mtp"):
        if target.config.num_layers != heads.trunk_layers + 1:
            raise SpecdecError(
                f"MTP heads expect a trunk of {heads.trunk_layers} layers + head 0, but the target has "
                f"{target.config.num_layers} layers: use the model exported with these heads"
            )
        self.heads, self.target, self.name = heads, target, name
        self.hidden_layers = (heads.trunk_layers,)  # the loop hands over the trunk's output
        self.seen = 0  # positions in the heads' KV cache
        self.logits: Tensor | None = None

    def start(self, prompt: Tensor, capacity: int) -> None:
        # A verify forward reads up to gamma positions past the accepted ones; z rows are only fed
        # for accepted positions, so the heads never need more slots than the sequence.
        self.heads.setup_cache(capacity, self.target.device, self.target.dtype)
        self.seen, self.logits = 0, None

    def observe(self, hidden: Tensor) -> None:
        """The trunk's output [k, H] at the positions just accepted (the whole prompt at first)."""
        self.logits = self.heads(hidden, self.seen, self.target)
        self.seen += hidden.shape[0]

    @torch.inference_mode()
    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        if self.logits is None:
            raise RuntimeError("MTPDrafter.draft before observe(): the generate loop feeds it hidden states")
        logits = self.logits[: min(gamma, self.heads.num_heads - 1)]
        if sampler.greedy:
            return Draft(logits.argmax(-1), None)
        probs = sampler.probs(logits)
        return Draft(sampler.sample(probs), probs)


def mtp_files(folder: Path) -> tuple[Path, Path]:
    """(config, weights) of an MTP export: in specdec/, or in the root for an older export."""
    folder = Path(folder)
    if (folder / MTP_CONFIG).is_file():
        return folder / MTP_CONFIG, folder / MTP_WEIGHTS
    return folder / Path(MTP_CONFIG).name, folder / Path(MTP_WEIGHTS).name


def read_mtp_config(folder: Path) -> dict | None:
    path = mtp_files(folder)[0]
    return json.loads(path.read_text()) if path.is_file() else None


def load_mtp(target: LoadedModel, folder: str | Path | None = None) -> MTPDrafter:
    """The MTP drafter of a target exported by recipes.mtp (its heads file sits in the target's folder)."""
    from safetensors.torch import load_file

    folder = Path(folder) if folder is not None else Path(target.path)
    meta, weights = read_mtp_config(folder), mtp_files(folder)[1]
    if meta is None or not weights.is_file():
        raise SpecdecError(
            f"--drafter mtp needs {MTP_CONFIG} and {MTP_WEIGHTS} next to the target's weights, and {folder} "
            "has none: pass --target the export/ folder of an mtp run (python -m recipes.mtp)"
        )
    if meta["num_heads"] < 2:
        raise SpecdecError(f"{folder}/{MTP_CONFIG}: num_heads={meta['num_heads']}, so there is no head to draft with")
    m = target.model
    heads = MTPHeads.from_hf_state_dict(
        target.config, load_file(str(weights)), meta["num_heads"], meta["trunk_layers"], m.device, m.dtype
    )
    return MTPDrafter(heads, m, name=f"mtp:{meta['num_heads']}")
