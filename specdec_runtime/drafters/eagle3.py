"""EAGLE-3 drafters (Li et al. 2025): an Eagle3Model (eagle3_model.py, shared with training) drafting for a target.

    drafter = Eagle3Drafter(model, target)                   # chain drafts; tree_budget > 0: EAGLE-2 trees
    drafter = Eagle3Drafter(model, target, on_device=True)   # fixed shapes, captured steps (a GPU's default)
    specdec generate --drafter runs/eagle3/export --baseline  # (export and load: eagle3_format.py)

Positions: the drafter's row p reads the target's feature at position p and the token at p + 1,
and predicts the token at p + 2, at rope position p (+ 1 per step it has drafted ahead). At run
time the generate loop hands the target's features of every accepted position to `observe`; the
next `draft` runs the drafter on those rows (it needs the tokens after them, which `draft` sees),
which rewrites the rows it had drafted speculatively, then drafts ahead from the last one: a chain
of gamma tokens, or an EAGLE-2 dynamic tree (expand the top_k most likely nodes of each level,
keep the tree_budget most likely nodes overall), verified by the target with tree attention.

On a GPU (on_device) a round is captured steps with fixed shapes and nothing read back, in the
manner of SGLang's EAGLE worker: the catch-up over the accepted rows padded to one of CATCH_UP_ROWS,
then the whole tree (each level a fixed frontier of top_k rows, their mask built by indexing, the
final choice a device topk) or the whole greedy chain as one step, attending over the whole cache
with masks. The draft carries the tree's tensors (tree.DeviceTree): the loop's one sync a round,
after verification, is the only one. The nodes are the host tree's (_tree) up to tie order.
"""

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec_runtime import cpu, graphs
from specdec_runtime.drafters.eagle3_model import Eagle3Config, Eagle3Model
from specdec_runtime.drafters.protocol import Draft, Drafter, DraftExit
from specdec_runtime.errors import SpecdecError
from specdec_runtime.layers import Weights, block_state_dict, linear, mlp, rms_norm, rope_table, self_attention
from specdec_runtime.model import Decoder
from specdec_runtime.sampling import Sampler
from specdec_runtime.tree import DeviceTree, Tree
from specdec_runtime.verify import pick

MAX_DEPTH = 16  # the deepest tree the drafter builds
CATCH_UP_ROWS = (1, 2, 4, 8, 16)  # on_device: the row counts a catch-up step is captured for (padded up)
CATCH_UP_DIMS = {"tokens": 0, "taps": 0}  # its inputs' row dimension (compile_steps: compiled once for all)


class FusedLayer(NamedTuple):
    """An Eagle3Model's tensors as the runtime Decoder keeps its own (layers.block_state_dict): q/k/v
    and gate/up fused, stored [in, out] (+ the copy a CPU's few-row products read: Weights.from_matrix), q/k
    rows interleaved for rope on adjacent dim pairs, norm weights doubled (layers.rms_norm). Drafting
    a token is then a dozen kernels; the training modules' weights are read once, at construction."""

    fc: Weights
    input_norm: Tensor
    hidden_norm: Tensor
    qkv: Weights
    o: Weights
    post_norm: Tensor
    gate_up: Weights
    down: Weights
    norm: Tensor
    head: Weights

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @classmethod
    @torch.no_grad()
    def from_model(
        cls, model: "Eagle3Model", device: torch.device, dtype: torch.dtype, cpu_copies: bool, cpu_bf16: bool = False
    ) -> "FusedLayer":
        """The layout on `device` in `dtype` (the model itself stays where it is). cpu_bf16: where the
        CPU kernel reads them (cpu_copies, fp32 on a CPU), the weight matrices rounded to bf16 and
        packed so: half the bytes a draft step reads. Every path then uses the rounded weights.
        Where the kernel multiplies bf16 pairs (cpu.bf16_layout: AVX512-BF16), it multiplies
        them by rows rounded to bf16 too, summing in fp32 (twice the multiply-adds a cycle, which
        bound a draft step's products on a CPU more than their bytes: docs/log/cpu-kernel.md)."""
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        prep = lambda w: w.to(device=device, dtype=dtype).contiguous()  # noqa: E731
        own = block_state_dict(model.config.layer, sd, "layers.0.", "", prep)
        twice = lambda w: prep(torch.cat([w, w]))  # noqa: E731

        names = {"fc": "fc.weight", "qkv": "qkv.weight", "o": "o.weight", "gate_up": "gate_up.weight"}
        names |= {"down": "down.weight", "head": "lm_head.weight"}
        mats = {k: own[n] if n in own else prep(sd[n].t()) for k, n in names.items()}  # [in, out]
        bf16, pairs = cpu.bf16_layout(list(mats.values())) if cpu_bf16 and cpu_copies else (False, False)

        def weights(key: str, bias_name: str | None = None) -> Weights:
            w = mats[key].to(torch.bfloat16).to(dtype) if bf16 else mats[key]
            return Weights.from_matrix(w, own.get(bias_name) if bias_name else None, cpu_copies, bf16, pairs)

        layer = cls(
            fc=weights("fc"),
            input_norm=own["attn_norm"],
            hidden_norm=twice(sd["layers.0.hidden_norm.weight"]),
            qkv=weights("qkv", "qkv.bias"),
            o=weights("o", "o.bias"),
            post_norm=own["mlp_norm"],
            gate_up=weights("gate_up", "gate_up.bias"),
            down=weights("down", "down.bias"),
            norm=twice(sd["norm.weight"]),
            head=weights("head"),
        )
        packed = {k: w for k, w in layer._asdict().items() if isinstance(w, Weights) and w.packed is not None}
        copies = cpu.on_huge_pages([w.packed for w in packed.values()])  # side by side, huge pages
        return layer._replace(**{k: w._replace(packed=c) for (k, w), c in zip(packed.items(), copies)})


def layer_rows(w: FusedLayer, cfg: Eagle3Config, embeds: Tensor, feature: Tensor, B: int, cos: Tensor, sin: Tensor,
               kv: Tensor, slots: Tensor, mask: Tensor | None, bound: int) -> Tensor:  # fmt: skip
    """Eagle3Layer.forward on fused weights over B sequences' rows: the target's embeddings of the
    next tokens and the features [B*T, H] -> the prenorm [B*T, H], writing K/V into kv at slots and
    attending under mask (layers.self_attention's shapes; a slot per row where slots is [B, T])."""
    eps = cfg.layer.rms_norm_eps
    h = rms_norm(feature, w.hidden_norm, eps)
    x = torch.cat([rms_norm(embeds, w.input_norm, eps), h], dim=-1)
    residual = h if cfg.norm_before_residual else feature
    out = self_attention(x, residual, B, w.qkv, w.o, cos, sin, kv, slots, mask, bound)
    return mlp(out, w.post_norm, w.gate_up, w.down, eps)


def best_nodes(score: Tensor, tok: Tensor, parent: Tensor, rank: Tensor, depth: Tensor, K: int, budget: int,
               levels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """The `budget` best of each row's tree candidates [B, C] (their path scores, draft ids, parent
    candidate (-1: the root), rank among siblings, depth; numbered level by level: the root's K
    children, then K x K a level) as a tree: (their draft ids [B, budget], Tree.tensors a row each,
    levels [D + 1] shared), on the device (a device topk and sort, the ancestor mask by indexing)."""
    B, C = score.shape
    index = torch.arange(C, device=score.device)
    # The host sort's order, (-score, index): a child never scores above its parent and comes after
    # it, so the best `budget` are a tree (parents first once sorted by index).
    key = score.double() - index.double() * 1e-12
    chosen = key.topk(budget, dim=1).indices.sort(dim=1).values  # [B, n]
    eye = (index[:, None] == index[None, :]).expand(B, C, C)
    ancestor = eye[:, :K, :].clone()  # candidate -> its ancestors and itself, level by level
    for lo in range(K, C, K * K):
        up = parent[:, lo : lo + K * K, None].expand(-1, -1, C)  # [B, K K, C]
        ancestor = torch.cat([ancestor, ancestor.gather(1, up) | eye[:, lo : lo + K * K]], dim=1)
    p = parent.gather(1, chosen)
    zero = chosen[:, :1] * 0
    node_parent = torch.cat([zero, torch.where(p >= 0, torch.searchsorted(chosen, p.clamp(min=0)) + 1, 0)], 1)
    node_depth = torch.cat([zero, depth.gather(1, chosen)], 1)
    node_rank = torch.cat([zero, rank.gather(1, chosen)], 1)
    n = chosen.shape[1]
    among = ancestor.gather(1, chosen[..., None].expand(-1, -1, C)).gather(2, chosen[:, None].expand(-1, n, -1))
    # (built by concatenation: a Python scalar written into a CUDA tensor is a copy from the host)
    anc = torch.cat([(node_depth >= 0)[..., None], torch.cat([among[:, :1] & False, among], 1)], 2)
    node = node_depth > 0  # the root is nobody's sibling
    earlier = (node_parent[:, :, None] == node_parent[:, None, :]) & (node_rank[:, None, :] < node_rank[:, :, None])
    earlier = earlier & node[:, :, None] & node[:, None, :]
    tensors = dict(parent=node_parent, depth=node_depth, rank=node_rank, ancestor=anc, earlier=earlier, levels=levels)
    return tok.gather(1, chosen), tensors


class Eagle3Drafter(Drafter):
    """Drafts with an EAGLE-3 model for a target (see the module docstring).

    tree_budget 0: a chain of gamma tokens (greedy, or sampled from the draft distribution);
    tree_budget > 0: an EAGLE-2 dynamic tree of that many nodes, at most gamma deep, expanding
    the top_k most likely nodes of each level (by the product of draft probabilities on the path).
    cpu_bf16 (default): for an fp32 target on a CPU with the runtime's kernel, the drafter's weight
    matrices are rounded to bf16 (FusedLayer.from_model), as serving engines run drafters: a draft step
    reads half the bytes. Only drafts can change; the target, and so the output, is untouched.
    False: the trained fp32 weights exactly.

    confidence > 0 (chains): a chain stops right after a token the drafter gives a probability
    below it (DraftExit), so gamma can be long where the drafter is sure and a draft costs one
    drafter step where it is not. Lossless as any draft length is: where a chain stops depends
    only on tokens already drafted.

    on_device (default: on a GPU): drafting in captured steps of fixed shapes that read nothing
    back to the host (the module docstring); trees and greedy chains (sampled chains and draft
    exits run as before). Off it, on a CPU, the runtime's kernel drafts where it can, else the torch
    ops with host-side trees. compile_steps: on a compiled target, those steps are compiled with
    its torch.compile backend before they are captured, so that a tree level's few dozen small ops
    run as fewer fused kernels (at 8B the tree's levels cost 1.86 ms, about three times their
    weight reads: docs/log/gpu.md). Off by default until measured on a GPU (scripts/bench_gpu.py
    --compile-drafter).
    """

    def __init__(self, model: Eagle3Model, target: Decoder, *, tree_budget: int = 0, top_k: int = 8,
                 gamma: int | None = None, name: str = "eagle3", cpu_bf16: bool = True,
                 confidence: float = 0.0, on_device: bool | None = None, compile_steps: bool = False):  # fmt: skip
        cfg = model.config
        if cfg.target_hidden_size != target.config.hidden_size or cfg.vocab_size != target.config.vocab_size:
            raise SpecdecError(
                f"this EAGLE-3 drafter was trained for a target of hidden size {cfg.target_hidden_size} and vocabulary "
                f"{cfg.vocab_size}; the target has {target.config.hidden_size} and {target.config.vocab_size}: "
                "train one for it (python -m recipes.eagle3)"
            )
        if max(cfg.aux_layers) >= target.config.num_layers:
            raise SpecdecError(
                f"EAGLE-3 aux layers {list(cfg.aux_layers)} do not fit a {target.config.num_layers}-layer target"
            )
        if tree_budget < 0 or not 1 <= top_k <= cfg.draft_vocab_size:
            raise SpecdecError(
                f"eagle3 tree: need tree_budget >= 0 and 1 <= top_k <= the draft vocabulary "
                f"({cfg.draft_vocab_size}); got {tree_budget}, {top_k}"
            )
        if confidence and tree_budget:
            raise SpecdecError(
                "eagle3: a draft-exit confidence applies to chains (tree_budget 0; --tree chain), not to trees"
            )
        self.draft_exit = DraftExit(confidence, adaptive=False) if confidence > 0 else None
        self.model = model.eval()  # its config and vocabulary; drafting reads self.w
        self.target, self.name, self.gamma = target, name, gamma
        self.tree_budget, self.top_k = tree_budget, top_k
        self.tree_nodes = tree_budget  # the target's KV slots a tree writes past the sequence
        # Its best 2 nodes beside each lookup (LookupFirst.merge): on a CPU the best of 2, 3 and 8
        # greedy and sampled (docs/log/eagle3.md). Off on a GPU, where it is unmeasured and its trees
        # of up to 11 rows would add captured steps to the warm-up.
        self.lookup_merge = 2 if target.device.type == "cpu" else 0
        self.hidden_layers = tuple(cfg.aux_layers)
        self.draft_ids = self.model.draft_ids.to(target.device)  # [N] target id of each draft id
        self.target_ids: list[int] = self.draft_ids.tolist()  # the same on the host (a draft's tokens)
        self.shapes: dict[tuple, tuple[Tree, list[int]]] = {}  # _draft_of's trees by the chosen paths
        layer = cfg.layer  # the kernel's dims: (H, heads, kv heads, head dim, intermediate)
        self.dims = (layer.hidden_size, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.intermediate_size)
        self.cpu_bf16 = cpu_bf16
        self.w = FusedLayer.from_model(model, target.device, target.dtype, target.lm_head.cpu_copy, cpu_bf16)
        eps, norm_first = layer.rms_norm_eps, cfg.norm_before_residual
        self.kernel = None  # its steps and tree drafts in the CPU kernel, where it takes them (_run, _draft)
        if target.lm_head.cpu_copy:
            self.kernel = cpu.Eagle3Kernel.from_layer(self.w, self.dims, eps, norm_first)
        self.on_device = target.device.type == "cuda" if on_device is None else on_device
        if self.on_device:
            self.kernel = None  # the torch ops, in captured steps
        self.steps: dict[tuple, graphs.CapturedStep] = {}  # on_device: by (kind, shape); they point at self.kv
        self.compile_steps = compile_steps
        self.pending: list[Tensor] = []  # target features of accepted rows not yet run [k, 3 H_t]
        self.kv: Tensor | None = None  # [1, 2 h_kv, S, D] the drafter's own cache (keys, values), row p at slot p
        self.rope: Tensor | None = None  # [S, 2, D] cos / signed sin per position (layers.rope_table)
        self.slots: Tensor | None = None  # [S] 0, 1, ..., S-1 on the device
        self.kept: list[Tensor] | None = None  # online adaptation: every observed feature row, in order

    def start(self, prompt: Tensor, capacity: int) -> None:
        cfg = self.model.config.layer
        size = capacity + MAX_DEPTH * self.top_k + CATCH_UP_ROWS[-1]  # + a tree's rows, a catch-up's padding
        if self.kv is None or self.kv.shape[2] < size:
            if self.on_device:
                size = -(-size // 256) * 256  # grown in steps, as the target's cache: each growth captures again
            self.steps.clear()
            shape = (1, 2 * cfg.num_kv_heads, size, cfg.head_dim)
            self.kv = torch.zeros(shape, device=self.target.device, dtype=self.target.dtype)
            self.rope = rope_table(cfg, size, self.target.device, self.target.dtype)
            self.slots = torch.arange(size, device=self.target.device)
        self.pending = []
        if self.kept is not None:
            self.kept = []  # this sequence's features only

    def observe(self, hidden: Tensor) -> None:
        self.pending.append(hidden)  # the loop's copies (indexed rows), kept until the next draft
        if self.kept is not None:
            self.kept.append(hidden.clone())  # (the prefill's rows may be a step's own buffer)

    @torch.no_grad()
    def refresh(self) -> None:
        """Read self.model's weights again (online adaptation changed them), into the tensors drafting
        reads, in place: the CPU kernel's and the captured steps' pointers stay valid."""
        t = self.target
        fresh = FusedLayer.from_model(self.model, t.device, t.dtype, t.lm_head.cpu_copy, self.cpu_bf16)
        flat = lambda w: [x for f in w for x in (f if isinstance(f, tuple) else (f,)) if x is not None]  # noqa: E731
        for old, new in zip(flat(self.w), flat(fresh), strict=True):
            old.copy_(new)

    def _rows(
        self, tokens: Tensor, feature: Tensor, positions: Tensor, slots: Tensor, mask: Tensor | None, bound: int
    ) -> Tensor:
        """Run rows (tokens [T], features [T, H], rope positions [T]) writing K/V at slots [T],
        each attending to the cache slots < bound that mask [T, bound] allows (None: all of
        them): their prenorm [T, H]. Eagle3Layer.forward on fused weights (FusedLayer)."""
        group = self.model.config.layer.num_heads // self.model.config.layer.num_kv_heads
        if mask is not None and group > 1:
            mask = mask.repeat(group, 1)  # a row per folded query head (layers.self_attention)
        cs = self.rope[positions]  # [T, 2, D]
        embeds = self.target.embed_tokens(tokens[None])[0]
        return layer_rows(self.w, self.model.config, embeds, feature, 1, cs[:, None, 0], cs[:, None, 1], self.kv, slots,
                          mask, bound)  # fmt: skip

    def _head(self, prenorm: Tensor) -> Tensor:
        """Draft logits [T, N] of prenorm [T, H] (Eagle3Model.head)."""
        return linear(rms_norm(prenorm, self.w.norm, self.model.config.layer.rms_norm_eps), self.w.head)

    def _run(
        self,
        tokens: Tensor,
        inputs: Tensor,
        project: bool,
        first: int,
        step: int,
        slots: Tensor,
        mask: Tensor | None,
        bound: int,
        head_from: int,
    ) -> tuple[Tensor, Tensor]:
        """A draft step of rows tokens [T]: (prenorm [T, H], draft logits [T - head_from, N] of rows
        head_from..). inputs: the target's features [T, 3 H_t] (project: fc first, Eagle3Model.project)
        or the previous step's prenorm [T, H]; row t at rope position first + t * step; slots, mask
        and bound as _rows. On a CPU with the runtime's kernel, one call (cpu.Eagle3Kernel.rows,
        instead of ~20 torch ops around three kernel calls: docs/log/cpu-kernel.md); its norms are
        the kernel's, so drafts agree with the torch ops' to rounding (tested), and the target
        decides either way."""
        inputs = inputs.to(self.w.dtype)
        if self.kernel is not None:
            out = self.kernel.rows(tokens, self.target.embedding_panels(), inputs, project, head_from, self.rope,
                                   first, step, self.kv, slots, mask, bound)  # fmt: skip
            if out is not None:
                return out
        T = tokens.shape[0]
        positions = self.slots[first : first + T] if step else self.slots[first].expand(T)
        feature = linear(inputs, self.w.fc) if project else inputs
        prenorm = self._rows(tokens, feature, positions, slots, mask, bound)
        return prenorm, self._head(prenorm[head_from:])

    def draft(self, ids: Tensor, gamma: int, sampler: Sampler) -> Draft:
        if self.on_device and (self.tree_budget or (sampler.greedy and self.draft_exit is None)):
            return self._draft_on_device(ids, gamma)
        return self._draft(ids, gamma, sampler, self.tree_budget)

    def draft_best(self, ids: Tensor, gamma: int, sampler: Sampler, nodes: int) -> Draft:
        """A tree's `nodes` best nodes (its levels stop at that depth, which they cannot pass); chains:
        the greedy chain of that many tokens (Drafter.draft_best)."""
        return self._draft(ids, min(gamma, nodes), Sampler(), min(nodes, self.tree_budget))

    def _taps(self) -> Tensor:
        """The target's features of the rows not yet run [k, 3 H_t] (observe)."""
        if not self.pending:
            raise RuntimeError("Eagle3Drafter.draft before observe(): the generate loop feeds it hidden states")
        taps = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = []
        return taps

    def samples(self, ids: Tensor, gamma: int, sampler: Sampler, k: int) -> list[Draft]:
        """k chains sampled independently after one catch-up (SpecTr's drafts: drafters/multi.py)."""
        return self._draft(ids, gamma, sampler, 0, sequences=k)

    @torch.inference_mode()
    def _draft(self, ids: Tensor, gamma: int, sampler: Sampler, budget: int, sequences: int = 0) -> Any:
        L, taps = ids.shape[0], self._taps()
        k = taps.shape[0]
        # More rows than a kernel call takes (a long prompt's, at its first draft): the leading ones in
        # chunks through the kernel, each causal over the slots before it, as the target's prefill runs
        # (a fraction of one pass of the torch ops: docs/log/cpu-kernel.md).
        chunk = cpu.PREFILL_CHUNK
        while self.kernel is not None and k > cpu.max_rows():
            first = L - 1 - k
            pos = self.slots[first : first + chunk]
            mask = self.slots[: first + chunk][None, :] <= pos[:, None]
            rows = ids[L - k : L - k + chunk]
            self._run(rows, taps[:chunk], True, first, 1, pos, mask, first + chunk, head_from=chunk)
            taps, k = taps[chunk:], k - chunk
        # Rows L-1-k .. L-2: the accepted positions' features, with the tokens after them (causal).
        nodes = None
        if budget and self.kernel is not None:  # the whole draft in one call, where the kernel takes it
            levels, embed = min(gamma, MAX_DEPTH), self.target.embedding_panels()
            nodes = self.kernel.draft(
                ids[L - k : L], taps, L - 1 - k, self.draft_ids, levels, self.top_k, budget, embed, self.rope, self.kv
            )
        if nodes is not None:
            paths: list[tuple[int, ...]] = []
            for parent, rank, _ in nodes:
                paths.append((paths[parent] if parent >= 0 else ()) + (rank,))
            return self._draft_of(paths, [node[2] for node in nodes])
        pos = self.slots[L - 1 - k : L - 1]
        mask = self.slots[: L - 1][None, :] <= pos[:, None] if k > 1 else None
        prenorm, logits = self._run(ids[L - k : L], taps, True, L - 1 - k, 1, pos, mask, L - 1, head_from=k - 1)
        last = prenorm[-1:]  # the newest row drafts the next token; logits [1, N] are its
        if budget:
            return self._tree(last[0], logits[0], L, gamma, budget)
        if sequences:  # each chain rewrites the rows after L - 2 that it reads
            return [self._chain(last, logits, L, gamma, sampler) for _ in range(sequences)]
        return self._chain(last, logits, L, gamma, sampler)

    def _chain(self, prenorm: Tensor, logits: Tensor, L: int, gamma: int, sampler: Sampler) -> Draft:
        """gamma tokens, each row reading the previous one's prenorm [1, H] (logits [1, N])."""
        tokens, probs = [], []
        for i in range(gamma):
            if sampler.greedy:  # draft ids ascend with target ids: the same first maximum
                token = pick(self.draft_ids, logits[0].argmax())  # on the device: no host read a token
            else:
                full = logits.new_full((self.target.config.vocab_size,), float("-inf"))
                full = full.index_copy_(0, self.draft_ids, logits[0])  # ids outside the draft vocabulary: probability 0
                p = sampler.probs(full)
                token = sampler.sample(p)
                probs.append(p)
            tokens.append(token)
            if self.draft_exit is not None:  # host sync per draft token, only when enabled
                conf = probs[-1][token] if probs else logits[0].float().softmax(-1).max()
                if self.draft_exit.stop(conf.item()):
                    break
            if i + 1 < gamma:  # row L-1+i: the token just drafted, the previous row's prenorm; sees slots 0..L-1+i
                pos = self.slots[L - 1 + i : L + i]
                prenorm, logits = self._run(token.view(1), prenorm, False, L - 1 + i, 1, pos, None, L + i, 0)
        return Draft(torch.stack(tokens), torch.stack(probs) if probs else None)

    def _tree(self, prenorm: Tensor, logits: Tensor, L: int, gamma: int, budget: int) -> Draft:
        """EAGLE-2's dynamic tree: level by level, the top_k children of each expanded node; the
        top_k of them (by path log-probability) are expanded next; the `budget` best nodes of all
        (tree_budget, or fewer for draft_best) are drafted. One host sync per level (the chosen
        nodes' structure). On a CPU with the runtime's kernel the whole draft is one call instead
        (_draft: cpu.Eagle3Kernel.draft, the same nodes)."""
        K, dev, levels = self.top_k, prenorm.device, min(gamma, MAX_DEPTH)
        logp = logits.float().log_softmax(-1)
        top = logp.topk(K)
        # Every node: (score, draft id, parent node index or -1, rank among its siblings, row slot or -1).
        scores, tok, parent, rank = top.values, top.indices, [-1] * K, list(range(K))
        frontier = list(range(K))  # node indices to expand
        ancestors: dict[int, list[int]] = {i: [] for i in range(K)}  # row slots of a node's ancestors
        features = prenorm[None].expand(K, -1)  # the feature each frontier node's row reads
        slot = L - 1
        for depth in range(1, levels):  # nodes of depth `depth` get rows; their children depth + 1
            F_ = len(frontier)
            slots = self.slots[slot : slot + F_]
            tree_rows = [[False] * (slot + F_ - (L - 1)) for _ in range(F_)]  # slots L-1..: the tree's own rows
            for r, node in enumerate(frontier):
                for a in ancestors[node] + [slot + r]:
                    tree_rows[r][a - (L - 1)] = True
            prefix = torch.ones(F_, L - 1, dtype=torch.bool, device=dev)
            mask = torch.cat([prefix, torch.tensor(tree_rows, device=dev)], dim=1)
            rows = self.draft_ids[tok[frontier]]  # the frontier's tokens as target ids (tok holds draft ids)
            rows_prenorm, rows_logits = self._run(rows, features, False, L - 2 + depth, 0, slots, mask, slot + F_, 0)
            child = rows_logits.float().log_softmax(-1).topk(K)  # [F, K]
            cand = (scores[frontier][:, None] + child.values).flatten()  # [F * K]
            keep = cand.topk(min(K, cand.numel())).indices
            base = len(parent)
            scores = torch.cat([scores, cand])
            tok = torch.cat([tok, child.indices.flatten()])
            keep_list = keep.tolist()  # host sync: which candidates are expanded next
            for j in range(F_ * K):
                r = j // K
                parent.append(frontier[r])
                rank.append(j % K)
                ancestors[base + j] = ancestors[frontier[r]] + [slot + r]
            frontier = [base + j for j in keep_list]
            features = rows_prenorm[[j // K for j in keep_list]]
            slot += F_
        return self._best(scores.tolist(), tok, parent, rank, budget)  # host sync

    def _best(self, scores: list[float], tok: Tensor, parent: list[int], rank: list[int], budget: int) -> Draft:
        """The `budget` best nodes (scores, draft ids, parents and ranks of _tree's nodes), parents
        before children, as the draft."""
        paths: dict[int, tuple[int, ...]] = {}
        for i in sorted(range(len(parent)), key=lambda i: (-scores[i], i)):
            if len(paths) == budget:
                break
            if parent[i] < 0 or parent[i] in paths:  # a child never scores above its parent
                paths[i] = (paths[parent[i]] if parent[i] >= 0 else ()) + (rank[i],)
        ids = tok.tolist()
        return self._draft_of(list(paths.values()), [ids[i] for i in paths])

    def _draft_of(self, paths: list[tuple[int, ...]], ids: list[int]) -> Draft:
        """The tree of these nodes (rank paths and draft ids, in the order chosen: parents first) as a
        draft, its tree and node order kept per list of paths (a few hundred recur)."""
        key = tuple(paths)
        shape = self.shapes.get(key)
        if shape is None:
            if len(self.shapes) >= 4096:
                self.shapes.clear()
            tree = Tree.from_paths(paths)
            at = {p: i for i, p in enumerate(paths)}
            shape = self.shapes[key] = (tree, [at[p] for p in tree.paths])
        tree, order = shape
        tokens = torch.tensor([self.target_ids[ids[i]] for i in order], device=self.draft_ids.device)
        return Draft(tokens, None, tree=tree)

    # ------------------------------------------------------------ on the device (module docstring)

    @property
    def step_backend(self) -> str | None:
        """The torch.compile backend its captured steps are compiled with (compile_steps: the target's)."""
        return self.target.compile_backend if self.compile_steps else None

    def _step(self, key: tuple, fn: Callable[..., Any], inputs: dict[str, Tensor]) -> graphs.CapturedStep:
        step = self.steps.get(key)
        if step is None:
            rows = CATCH_UP_DIMS if key[0] == "catch-up" else None  # (one compiled version for its row counts)
            step = self.steps[key] = graphs.CapturedStep(fn, inputs, host_reads=False, compile=self.step_backend,
                                                         dynamic=rows)  # fmt: skip
        return step

    @torch.inference_mode()
    def _draft_on_device(self, ids: Tensor, gamma: int) -> Draft:
        """A tree (tree_budget) or a greedy chain of gamma tokens, every step captured."""
        L, taps = ids.shape[0], self._taps()
        k = taps.shape[0]
        first = L - 1 - k  # rows first .. L-2: the accepted positions' features, the tokens after them
        lead = max(0, k - CATCH_UP_ROWS[-1])
        if lead:  # a prompt's rows (the first draft): all but the last ones eagerly, once a prompt
            pos = self.slots[first : first + lead]
            mask = self.slots[: first + lead][None, :] <= pos[:, None]
            self._rows(ids[first + 1 : first + 1 + lead], linear(taps[:lead].to(self.w.dtype), self.w.fc), pos, pos,
                       mask, first + lead)  # fmt: skip
            first, k, taps = first + lead, k - lead, taps[lead:]
        R = next(r for r in CATCH_UP_ROWS if r >= k)
        inputs = dict(
            tokens=F.pad(ids[L - k : L], (0, R - k)), taps=F.pad(taps.to(self.w.dtype), (0, 0, 0, R - k)),
            first=self.slots[first], last=self.slots[k - 1],
        )  # fmt: skip
        if ("catch-up", R) not in self.steps:  # every row count at once: none is captured inside a timed round
            for r in CATCH_UP_ROWS:  # (a capture runs the step: rows past k write the tree's scratch slots only)
                m = min(k, r)
                rows = dict(tokens=F.pad(ids[L - k : L - k + m], (0, r - m)), last=self.slots[m - 1],
                            taps=F.pad(taps[:m].to(self.w.dtype), (0, 0, 0, r - m)))  # fmt: skip
                self._step(("catch-up", r), self._catch_up, inputs | rows)
        prenorm, logits = self._step(("catch-up", R), self._catch_up, inputs)(**inputs)
        levels = min(gamma, MAX_DEPTH)
        start = self.slots[L - 1]
        if not self.tree_budget:
            chain = self._step(("chain", levels), partial(self._chain_on_device, gamma=levels),
                               dict(prenorm=prenorm, logits=logits, start=start))  # fmt: skip
            return Draft(chain(prenorm=prenorm, logits=logits, start=L - 1), None)
        budget = min(self.tree_budget, self.top_k + (levels - 1) * self.top_k**2)
        key = ("tree", levels, budget)
        tree = self._step(key, partial(self._tree_on_device, levels=levels, budget=budget),
                          dict(prenorm=prenorm, logits=logits, start=start))  # fmt: skip
        tokens, reached, tensors = tree(prenorm=prenorm, logits=logits, start=L - 1)
        return Draft(tokens, None, tree=DeviceTree(tensors, levels, reached))

    def _catch_up(self, tokens: Tensor, taps: Tensor, first: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
        """Rows tokens [R] and features taps [R, 3 H_t] at slots and positions first + 0..R-1, causal
        over the whole cache (rows after `last` are padding: they write slots the tree rewrites and
        nobody reads): the prenorm [H] and draft logits [N] of row `last`."""
        R = tokens.shape[0]
        pos = first + self.slots[:R]
        mask = self.slots[None, :] <= pos[:, None]  # [R, S]
        prenorm = pick(self._rows(tokens, linear(taps, self.w.fc), pos, pos, mask, self.slots.shape[0]), last)
        return prenorm, self._head(prenorm[None])[0]

    def _chain_on_device(self, prenorm: Tensor, logits: Tensor, start: Tensor, *, gamma: int) -> Tensor:
        """_chain's greedy chain of gamma tokens: [gamma] target ids. Row i (the token just drafted,
        the previous row's prenorm) at slot and position start + i, seeing the slots up to its own."""
        tokens, prenorm = [], prenorm[None]
        for i in range(gamma):
            tokens.append(self.draft_ids[logits.argmax(-1, keepdim=True)])  # [1]
            if i + 1 < gamma:
                pos = (start + i).view(1)
                prenorm = self._rows(tokens[-1], prenorm, pos, pos, self.slots[None, :] <= pos, self.slots.shape[0])
                logits = self._head(prenorm)[0]
        return torch.cat(tokens)

    def _tree_on_device(
        self, prenorm: Tensor, logits: Tensor, start: Tensor, *, levels: int, budget: int
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """_tree's EAGLE-2 tree with fixed shapes: the root row's prenorm [H] and logits [N] ->
        (the chosen nodes' target ids [budget], the depth they reach, the tree's index tensors as
        Tree.tensors). Candidates are numbered level by level (the root's top_k, then top_k x top_k
        per level: frontier row r's child of rank c is r * top_k + c), their rows at slots start +
        (depth - 1) * top_k + r, each seeing the prefix (slots < start) and its ancestors' rows."""
        K, dev, S = self.top_k, prenorm.device, self.slots.shape[0]
        ar = self.slots[:K]
        top = logits.float().log_softmax(-1).topk(K)
        scores, toks, parents, ranks, depths = [top.values], [top.indices], [ar - 1 - ar], [ar], [ar * 0 + 1]
        frontier, front_scores, front_toks = ar, top.values, top.indices  # candidate indices, path scores, draft ids
        features = prenorm[None].expand(K, -1)
        W = max(levels - 1, 1) * K  # the tree's rows
        rel = self.slots - start  # each cache slot relative to the tree's first row
        prefix, row_of = rel < 0, rel.clamp(0, W - 1)
        in_tree = (rel >= 0) & (rel < W)
        seen = torch.zeros(K, W, dtype=torch.bool, device=dev)  # the frontier's ancestors' rows
        base = K
        for depth in range(1, levels):
            own = (depth - 1) * K + ar  # the frontier's rows
            seen = seen | (self.slots[None, :W] == own[:, None])
            mask = prefix[None, :] | (in_tree[None, :] & seen[:, row_of])  # [K, S]
            rows = self.draft_ids[front_toks]
            position = (start - 1 + depth).expand(K)
            out = self._rows(rows, features, position, start + own, mask, S)
            child = self._head(out).float().log_softmax(-1).topk(K)  # [K, K]
            cand = (front_scores[:, None] + child.values).flatten()  # [K * K]
            keep = cand.topk(K).indices
            scores.append(cand)
            toks.append(child.indices.flatten())
            parents.append(frontier.repeat_interleave(K))
            ranks.append(ar.repeat(K))
            depths.append(ar.repeat(K) * 0 + depth + 1)
            r = keep // K
            frontier, front_scores, front_toks = base + keep, cand[keep], toks[-1][keep]
            features, seen = out[r], seen[r]
            base += K * K
        candidates = (torch.cat(x)[None] for x in (scores, toks, parents, ranks, depths))  # (a row of one)
        tok, tensors = best_nodes(*candidates, K, budget, self.slots[: levels + 1])
        tensors = {k: v if k == "levels" else v[0] for k, v in tensors.items()}
        return self.draft_ids[tok[0]], tensors["depth"].max(), tensors
