"""The hidden-state store: states equal what the target computed, written in shards as they are
computed, resumed after a kill, shared across ranks without duplication, refused when the disk
lacks room, and read lazily."""

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from train.data import Example
from train.hidden_cache import Stored, cache_states, check_disk, disk_needed, padded

H = 8


def make_examples(n: int, seed: int = 0) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [Example(torch.randint(1, 500, (t,), generator=g).tolist(), [1] * t, {}) for t in lengths]


class Target(torch.nn.Module):
    """A stand-in for the frozen target: its states are a fixed function of the token ids, and it
    records which examples' ids it ran (one set of ids per row)."""

    def __init__(self, fail_after: int | None = None):
        super().__init__()
        self.anchor = torch.nn.Linear(1, 1)  # cache_states reads the device from the parameters
        self.seen: list[tuple[int, ...]] = []
        self.fail_after = fail_after

    def states(self, _target, input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.fail_after is not None and len(self.seen) >= self.fail_after:
            raise KeyboardInterrupt("killed")
        for row, m in zip(input_ids, mask):
            self.seen.append(tuple(row[m.bool()].tolist()))
        return expected(input_ids)


def expected(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The states of ids [B, T]: "taps" [B, T, 3H] and "final" [B, T, H], in bf16."""
    x = ids[..., None].float() / 7 + torch.arange(4 * H).float()
    return {"taps": x[..., : 3 * H].bfloat16(), "final": x[..., 3 * H :].sin().bfloat16()}


def run(target: Target, examples: list[Example], folder: Path, **kw) -> list[Example]:
    kw = dict(states=target.states, pad_id=0, token_bytes=4 * H * 2, batch_size=4) | kw
    return cache_states(target, examples, folder, **kw)


def assert_states_are_the_targets(examples: list[Example]) -> None:
    for e in examples:
        want = expected(torch.tensor([e.ids]))
        for name in ("taps", "final"):
            assert isinstance(e.meta[name], Stored)  # a reference, read when needed
            assert torch.equal(e.meta[name].load(), want[name][0])
    batch = padded(examples[:3], "taps", torch.device("cpu"))  # [B, T, 3H], right-padded with zeros
    for b, e in enumerate(examples[:3]):
        assert torch.equal(batch[b, : len(e.ids)], expected(torch.tensor([e.ids]))["taps"][0])
        assert not batch[b, len(e.ids) :].any()


def test_states_are_written_in_shards_as_they_are_computed(tmp_path):
    examples = make_examples(30)
    target = Target()
    shard_bytes = 4 * 40 * 4 * H * 2  # about one batch of the longest examples
    said = []
    stored = run(target, examples, tmp_path, shard_bytes=shard_bytes, say=said.append)
    assert_states_are_the_targets(stored)
    need = sum(len(e.ids) for e in examples) * 4 * H * 2 / 1e6  # said before computing: what it will write
    assert len(said) == 1 and f"30 of 30 examples to compute, {need:.1f} MB on disk" in said[0]
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) >= 3 and not list(tmp_path.glob("*.tmp"))
    # a shard is flushed once it holds shard_bytes: at most one batch (4 examples of < 40 tokens) more
    assert all(f.stat().st_size < shard_bytes + 4 * 40 * 4 * H * 2 + 4096 for f in shards)
    assert sorted(target.seen) == sorted(tuple(e.ids) for e in examples)  # each example once


def test_a_killed_run_resumes_with_the_examples_no_shard_holds(tmp_path):
    examples = make_examples(30, seed=1)
    killed = Target(fail_after=12)  # killed in its 4th batch: three shards written, one batch lost
    with pytest.raises(KeyboardInterrupt):
        run(killed, examples, tmp_path, shard_bytes=1)
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
    rerun = Target()
    stored = run(rerun, examples, tmp_path, shard_bytes=1)
    assert_states_are_the_targets(stored)
    assert len(rerun.seen) == len(examples) - 12 and not set(rerun.seen) & set(killed.seen)


def test_ranks_share_the_examples_without_duplicates(tmp_path):
    examples = make_examples(25, seed=2)
    barrier = threading.Barrier(2)
    targets, results, errors = [Target(), Target()], [None, None], []

    def rank(r: int) -> None:
        try:
            results[r] = run(targets[r], examples, tmp_path, rank=r, world=2, barrier=barrier.wait)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(targets[0].seen + targets[1].seen) == sorted(tuple(e.ids) for e in examples)
    assert {tuple(e.ids) for e in examples[0::2]} == set(targets[0].seen)  # every world-th example
    for r in (0, 1):
        assert_states_are_the_targets(results[r])
    assert {f.name.split("-")[1] for f in tmp_path.glob("*.safetensors")} == {"r0", "r1"}


def test_the_store_refuses_before_computing_when_the_disk_lacks_room(tmp_path, monkeypatch):
    examples = make_examples(10, seed=3)
    need = disk_needed(examples, 4 * H * 2)
    assert need == sum(len(e.ids) for e in examples) * 4 * H * 2
    refusal = r"needs [0-9.]+ MB more in .*, which has [0-9.]+ MB free.*cache_hidden=false"
    with pytest.raises(RuntimeError, match=refusal):
        check_disk(tmp_path, need, free=need)  # no headroom
    check_disk(tmp_path, need, free=2 * need)

    import train.hidden_cache as store

    monkeypatch.setattr(store.shutil, "disk_usage", lambda _: type("Usage", (), {"free": need // 2})())
    target = Target()
    with pytest.raises(RuntimeError, match="hidden-state store needs"):
        run(target, examples, tmp_path)
    assert target.seen == []  # refused before the target ran


def test_a_store_written_in_one_part_per_rank_is_still_read(tmp_path):
    """Folders of the earlier format (one part file per rank, written at the end) are read as they are."""
    examples = make_examples(6, seed=4)
    part = {}
    for i, e in enumerate(examples):
        for name, value in expected(torch.tensor([e.ids])).items():
            part[f"{name}.{i}"] = value[0].contiguous()
    save_file(part, str(tmp_path / "part-0-of-1.safetensors"))
    (tmp_path / "done").write_text("")
    target = Target()
    assert_states_are_the_targets(run(target, examples, tmp_path))
    assert target.seen == []
