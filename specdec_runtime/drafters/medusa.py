"""Medusa heads (Cai et al. 2024): the module, its drafter, and the two export layouts.

    heads = MedusaHeads(hidden_size=576, vocab_size=49152, num_heads=4, num_layers=1)
    logits = heads(hidden, lm_head)              # hidden [..., H] -> [heads, ..., V]
    drafter = MedusaDrafter(heads, target_decoder, Tree.from_paths(choices))
    drafter = load_medusa("runs/medusa/export", target)    # FasterDecoding or vLLM layout
    specdec generate --drafter runs/medusa/export --baseline

Head k (1-based) reads the target's last hidden state (after the final norm) at position t and
predicts the token at t + 1 + k: a stack of residual blocks x + SiLU(W x + b) (W starts at zero)
and its own vocabulary projection (initialized from the target's lm_head), or the target's
lm_head itself (share_lm_head: no extra vocabulary weights, and at run time one read of the
projection serves every head). Training (recipes/medusa.py) imports this module.

Layouts on disk (both hold the same tensors; shared heads are written as copies of the lm_head
so serving engines load them unchanged):
  FasterDecoding: config.json {medusa_num_heads, medusa_num_layers, base_model_name_or_path},
                  medusa_lm_head.pt (what FasterDecoding reads: torch.save of the dict) {h}.{l}.linear.weight|bias,
                  {h}.{num_layers}.weight; or the same tensors in medusa_lm_head.safetensors (specdec reads
                  either; an export writes that where FasterDecoding would load the heads wrong)
  vLLM:           config.json {model_type: medusa, num_heads, num_hidden_layers, hidden_size,
                  vocab_size, ...}, model.safetensors blocks.{h}.layers.{l}.weight|bias, lm_heads.{h}.weight
"""

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec_runtime.drafters.protocol import Draft, Drafter
from specdec_runtime.errors import SpecdecError
from specdec_runtime.layers import rms_norm
from specdec_runtime.loading import LoadedModel
from specdec_runtime.model import Decoder
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import Tree

FASTER_DECODING_PT = "medusa_lm_head.pt"
FASTER_DECODING_WEIGHTS = "medusa_lm_head.safetensors"
VLLM_WEIGHTS = "model.safetensors"
LAYOUTS = ("faster_decoding", "vllm")
TREE_FILE = "medusa_tree.json"  # {"paths": [[0], [0, 0], ...], "accuracy": [[...]], ...}


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W initialized to zero (Medusa's block)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """num_heads independent stacks of num_layers ResBlocks, each with its own (or the shared) lm_head."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, share_lm_head: bool = False):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise SpecdecError(f"Medusa needs num_heads >= 1 and num_layers >= 0 (got {num_heads}, {num_layers})")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.share_lm_head = num_heads, num_layers, share_lm_head
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers))) for _ in range(num_heads)
        )
        self.lm_heads = (
            None
            if share_lm_head
            else nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
        )

    def init_lm_heads(self, weight: Tensor) -> None:
        """Copy the target's lm_head weight [V, H] into every head's projection."""
        if self.lm_heads is not None:
            with torch.no_grad():
                for head in self.lm_heads:
                    head.weight.copy_(weight)

    def head_logits(self, k: int, hidden: Tensor, lm_head: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """Head k's (0-based) logits [..., V] from hidden states [..., H]."""
        x = self.blocks[k](hidden)
        return self._project(lm_head, x) if self.lm_heads is None else self.lm_heads[k](x)

    def forward(
        self, hidden: Tensor, lm_head: Callable[[Tensor], Tensor] | None = None, count: int | None = None
    ) -> Tensor:
        """The first `count` heads' logits [count, ..., V] (default: every head's); lm_head (the
        target's) is required when shared."""
        x = torch.stack([blocks(hidden) for blocks in self.blocks[:count]])  # [count, ..., H]
        if self.lm_heads is None:
            return self._project(lm_head, x)  # one pass over the shared projection for all heads
        return torch.stack([head(x[k]) for k, head in enumerate(self.lm_heads[:count])])

    @staticmethod
    def _project(lm_head: Callable[[Tensor], Tensor] | None, x: Tensor) -> Tensor:
        if lm_head is None:
            raise ValueError("these Medusa heads share the target's lm_head: pass it")
        return lm_head(x)

    @torch.no_grad()
    def share_if_equal(self, weight: Tensor) -> bool:
        """Drop per-head projections that all equal `weight` [V, H] (the target's lm_head), so that
        at run time one read of the shared projection serves every head. Returns whether it did."""
        if self.lm_heads is None or any(
            h.weight.shape != weight.shape or not torch.equal(h.weight, weight.to(h.weight)) for h in self.lm_heads
        ):
            return self.lm_heads is None
        self.lm_heads, self.share_lm_head = None, True
        return True


# ---------------------------------------------------------------- layouts


def to_layout(heads: MedusaHeads, layout: str, lm_head_weight: Tensor | None = None) -> dict[str, Tensor]:
    """The heads' tensors under a serving layout's names ("faster_decoding" or "vllm").

    Shared heads need the target's lm_head weight [V, H]; it is written once per head.
    """
    sd = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    out: dict[str, Tensor] = {}
    L = heads.num_layers
    for h in range(heads.num_heads):
        for layer in range(L):
            for p in ("weight", "bias"):
                t = sd[f"blocks.{h}.{layer}.linear.{p}"]
                out[f"{h}.{layer}.linear.{p}" if layout == "faster_decoding" else f"blocks.{h}.layers.{layer}.{p}"] = t
        if heads.lm_heads is not None:
            w = sd[f"lm_heads.{h}.weight"]
        elif lm_head_weight is not None:
            w = lm_head_weight.detach().to("cpu").contiguous()
        else:
            raise ValueError("shared Medusa heads: pass the target's lm_head weight to export them")
        out[f"{h}.{L}.weight" if layout == "faster_decoding" else f"lm_heads.{h}.weight"] = w.clone()
    return out


def layout_config(heads: MedusaHeads, layout: str, base_model: str | None) -> dict:
    """config.json for a layout (base_model: the target's Hub id, None where it has none)."""
    if layout == "faster_decoding":
        return {
            "medusa_num_heads": heads.num_heads,
            "medusa_num_layers": heads.num_layers,
            "base_model_name_or_path": base_model,
            "hidden_size": heads.hidden_size,
            "vocab_size": heads.vocab_size,
        }
    return {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "truncated_vocab_size": heads.vocab_size,
        "medusa_fc_bias": True,
        "original_lm_head": False,
        "base_model_name_or_path": base_model,
    }


def write_layout(
    heads: MedusaHeads, folder: Path, layout: str, base_model: str | None, lm_head_weight: Tensor | None = None
) -> Path:
    """Write config.json + weights of one layout ("faster_decoding": medusa_lm_head.pt, or "vllm") into `folder`."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise SpecdecError(f"Medusa layout '{layout}': use one of {', '.join(LAYOUTS)}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(layout_config(heads, layout, base_model), indent=2))
    tensors = to_layout(heads, layout, lm_head_weight)
    if layout == "faster_decoding":
        torch.save(tensors, folder / FASTER_DECODING_PT)
    else:
        save_file(tensors, str(folder / VLLM_WEIGHTS), metadata={"format": "pt"})
    return folder


def read_layout(folder: Path) -> tuple[MedusaHeads, str]:
    """Heads (own lm_heads, fp32, CPU) from a FasterDecoding or vLLM Medusa folder, and the layout."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if "medusa_num_heads" in cfg:
        layout, n_heads, n_layers = "faster_decoding", cfg["medusa_num_heads"], cfg["medusa_num_layers"]
        file = folder / FASTER_DECODING_PT
        if not file.is_file():
            file = folder / FASTER_DECODING_WEIGHTS
        block = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
        head = re.compile(r"^(\d+)\.(\d+)\.weight$")
    elif cfg.get("model_type") == "medusa":
        layout, n_heads, n_layers = "vllm", cfg["num_heads"], cfg["num_hidden_layers"]
        file = folder / VLLM_WEIGHTS
        block = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
        head = re.compile(r"^lm_heads\.(\d+)\.weight$")
    else:
        raise SpecdecError(
            f"{folder}/config.json describes no Medusa heads (no medusa_num_heads, not model_type medusa)"
        )
    if not file.is_file():
        raise SpecdecError(f"{folder} has a Medusa config but no {file.name}: copy the weights next to config.json")
    if file.suffix == ".safetensors":
        raw = load_file(str(file))
    else:
        raw = torch.load(file, map_location="cpu", weights_only=True)
    own: dict[str, Tensor] = {}
    for key, t in raw.items():
        if m := block.match(key):
            own[f"blocks.{m.group(1)}.{m.group(2)}.linear.{m.group(3)}"] = t
        elif (m := head.match(key)) and (layout == "vllm" or int(m.group(2)) == n_layers):
            own[f"lm_heads.{m.group(1)}.weight"] = t
    hidden, vocab = own["lm_heads.0.weight"].shape[1], own["lm_heads.0.weight"].shape[0]
    heads = MedusaHeads(hidden, vocab, n_heads, n_layers)
    missing = set(heads.state_dict()) - set(own)
    if missing:
        raise SpecdecError(f"{file} lacks Medusa tensors {sorted(missing)[:4]}: the file does not match its config")
    heads.load_state_dict({k: v.float() for k, v in own.items()})
    return heads.eval(), layout


def read_tree(folder: Path) -> dict | None:
    """The calibrated tree stored with an export (paths, accuracies), if any."""
    path = Path(folder) / TREE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def tree_from_spec(spec: str | Path | None, folder: Path | None, num_heads: int) -> Tree:
    """The tree a drafter uses: a JSON file of paths, `chain`, or (None) the export's calibrated tree."""
    if spec is None or str(spec) == "":
        stored = read_tree(folder) if folder is not None else None
        return Tree.from_paths(stored["paths"]) if stored else Tree.chain(num_heads)
    if str(spec) == "chain":
        return Tree.chain(num_heads)
    path = Path(spec)
    if not path.is_file():
        raise SpecdecError(f"--tree {spec}: no such file; give a JSON list of paths (or {{'paths': [...]}}) or 'chain'")
    data = json.loads(path.read_text())
    tree = Tree.from_paths(data["paths"] if isinstance(data, dict) else data)
    if tree.depth > num_heads:
        raise SpecdecError(f"--tree {spec} is {tree.depth} deep but the export has {num_heads} heads")
    return tree


# ---------------------------------------------------------------- drafter


class MedusaDrafter(Drafter):
    """Candidates from each head's top-k at the newest token, as a tree the target verifies in one forward.

    The generate loop hands over the target's last residual stream after every forward (`observe`):
    the heads read the final-norm state of the one that produced the newest token, so drafting
    costs the heads only.
    """

    def __init__(self, heads: MedusaHeads, target: Decoder, tree: Tree, name: str = "medusa"):
        if tree.depth > heads.num_heads:
            raise SpecdecError(f"the tree is {tree.depth} deep but there are only {heads.num_heads} Medusa heads")
        if heads.hidden_size != target.config.hidden_size or heads.vocab_size != target.config.vocab_size:
            raise SpecdecError(
                f"Medusa heads (hidden {heads.hidden_size}, vocab {heads.vocab_size}) do not fit the target "
                f"(hidden {target.config.hidden_size}, vocab {target.config.vocab_size}): use heads trained on it"
            )
        self.heads = heads.to(device=target.device, dtype=target.dtype).eval()
        self.target, self.tree, self.name = target, tree, name
        self.tree_nodes = len(tree)  # the loop reserves this many extra KV slots
        self.hidden_layers = (target.config.num_layers,)  # the output of the last layer
        self.hidden: Tensor | None = None

    def start(self, prompt: Tensor, capacity: int) -> None:
        self.hidden = None

    def observe(self, hidden: Tensor) -> None:
        """The target's last-layer residual streams [k, H]; the last produced the newest token."""
        self.hidden = rms_norm(hidden[-1], self.target.norm, self.target.config.rms_norm_eps)  # [H], its own

    @torch.inference_mode()
    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        if self.hidden is None:
            raise RuntimeError("MedusaDrafter.draft before observe(): the generate loop feeds it hidden states")
        tree = self.tree.truncated(gamma)
        logits = self.heads(self.hidden[None, :], self.target.lm_head)[: tree.depth, 0]  # [depth, V]
        topk_ids = logits.topk(max(tree.top_k), dim=-1).indices  # [depth, k]
        return Draft(tree.candidates(ids[-1], topk_ids)[1:], None, tree=tree)

    @torch.inference_mode()
    def samples(self, ids: Tensor, gamma: int, sampler: Sampler, k: int) -> list[Draft]:
        """k paths sampled from the heads (SpecTr's drafts: drafters/multi.py): head i's distribution
        at the newest token is what the path's token i is drawn from, whatever the path before it."""
        if self.hidden is None:
            raise RuntimeError("MedusaDrafter.samples before observe(): the generate loop feeds it hidden states")
        depth = min(gamma, self.heads.num_heads)
        q = sampler.probs(self.heads(self.hidden[None, :], self.target.lm_head)[:depth, 0])  # [depth, V]
        paths = sampler.sample(q[None].expand(k, -1, -1))  # [k, depth], k draws of every head
        return [Draft(path, q) for path in paths]


def is_medusa_folder(folder: Path) -> bool:
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return False
    data = json.loads(cfg.read_text())
    return "medusa_num_heads" in data or data.get("model_type") == "medusa"


def load_medusa(folder: str | Path, target: LoadedModel, tree: str | Path | None = None) -> MedusaDrafter:
    """A MedusaDrafter from an exported folder (either layout) for a loaded target."""
    folder = Path(folder)
    heads, _ = read_layout(folder)
    heads.to(target.model.dtype).share_if_equal(target.model.lm_head.weight.t())
    return MedusaDrafter(
        heads, target.model, tree_from_spec(tree, folder, heads.num_heads), name=f"medusa:{folder.name}"
    )
