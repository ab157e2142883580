"""A phrase table: what the target's own responses agree follows a few tokens, drafted for free.

    table = PhraseTable.build(responses)           # token id lists the target wrote (a recipe's training data)
    table.save(export / PhraseTable.FILE); table = PhraseTable.load(export / PhraseTable.FILE, device)
    chain = table.get(seq)                         # a device tensor of 3-8 tokens, or None
    drafter = LookupFirst(eagle3_drafter, table=table)   # prompt lookup, then the table, then the model

Retrieval drafting (REST, He et al. 2024; vLLM's suffix decoding) with the datastore boiled down at
export: for every n-gram (4 tokens) that the responses continue alike, the chain they agree on,
token by token: the commonest next token while at least `support` of the continuations still
matching so far have it and it is at least `share` of them, up to `longest` tokens; chains shorter
than `shortest` are left to the model drafter, which guesses one or two tokens better. Its drafts
are chains, verified like prompt lookup's: greedy output stays the target's own, and sampled
output follows the target's distribution (a deterministic proposal is a point mass).

It pays where the target repeats its own phrasing across prompts ("Here is a Python function
that", a chat model's formulas), which a drafter trained on the same responses also learns but can
only draft 2 tokens of at a time on a CPU; it raised tau on the bundled target's best drafter
(docs/log/eagle3.md).
"""

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor


class PhraseTable:
    # In a folder of its own: serving engines load every *.safetensors beside config.json as weights.
    FILE = "specdec_phrases/table.safetensors"

    def __init__(self, keys: Tensor, chains: Tensor, device: torch.device | str = "cpu"):
        """keys [M, n] and chains [M, longest] (int, rows padded with -1) as build() makes them."""
        self.n, self.longest = keys.shape[1], chains.shape[1]
        self.keys, self.chains = keys.to(torch.int64), chains.to(torch.int64)
        lengths = (self.chains >= 0).sum(1).tolist()
        self.rows = {tuple(k): (i, g) for i, (k, g) in enumerate(zip(self.keys.tolist(), lengths))}
        self.device_chains = self.chains.clamp(min=0).to(device)  # drafts are slices: no copy a round
        self.host_chains: list[list[int]] | None = None  # (chain_ids: a batch's rows are assembled on the host)

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def build(
        cls,
        sequences: Iterable[Sequence[int]],
        *,
        n: int = 4,
        longest: int = 8,
        shortest: int = 3,
        support: int = 2,
        share: float = 0.5,
        device: torch.device | str = "cpu",
    ) -> "PhraseTable":
        """The table of `sequences` (token id lists the target wrote), by the rule of the module
        docstring: every n-gram that occurs at least `support` times, walked token by token; its
        chains kept on `device`."""
        seqs = [list(s) for s in sequences]
        after: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)  # n-gram -> (sequence, next position)
        for s, seq in enumerate(seqs):
            for i in range(n, len(seq)):
                after[tuple(seq[i - n : i])].append((s, i))
        keys, chains = [], []
        for key, alive in after.items():
            if len(alive) < support:
                continue
            chain: list[int] = []
            while len(chain) < longest:
                j = len(chain)
                counts = Counter(seqs[s][i + j] for s, i in alive if i + j < len(seqs[s]))
                if not counts:
                    break
                token, c = counts.most_common(1)[0]
                if c < support or c < share * len(alive):
                    break
                chain.append(token)
                alive = [(s, i) for s, i in alive if i + j < len(seqs[s]) and seqs[s][i + j] == token]
            if len(chain) >= shortest:
                keys.append(list(key))
                chains.append(chain + [-1] * (longest - len(chain)))
        as_tensor = lambda rows, width: torch.tensor(rows, dtype=torch.int64).view(-1, width)  # noqa: E731
        return cls(as_tensor(keys, n), as_tensor(chains, longest), device)

    def get(self, seq: Sequence[int], limit: int | None = None) -> Tensor | None:
        """The chain that follows seq's last n tokens (a host list), at most `limit` long; None if none."""
        found = self._found(seq)
        if found is None:
            return None
        row, g = found
        return self.device_chains[row, : g if limit is None else min(g, limit)]

    def _found(self, seq: Sequence[int]) -> tuple[int, int] | None:
        """(row, chain length) of the key seq ends with, or None."""
        return self.rows.get(tuple(seq[-self.n :])) if len(seq) >= self.n else None

    def chain_ids(self, seq: Sequence[int], limit: int) -> list[int]:
        """get()'s chain as host ids ([] if none)."""
        found = self._found(seq)
        if found is None:
            return []
        if self.host_chains is None:
            self.host_chains = self.chains.tolist()
        row, g = found
        return self.host_chains[row][: min(g, limit)]

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"keys": self.keys.to(torch.int32), "chains": self.chains.to(torch.int32)}, str(path))

    @classmethod
    def load(cls, path: Path, device: torch.device | str = "cpu") -> "PhraseTable":
        from safetensors.torch import load_file

        t = load_file(str(path))
        return cls(t["keys"], t["chains"], device)
