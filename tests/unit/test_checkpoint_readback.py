"""Reading a new commit back before retention deletes older checkpoints (``readback.py``).

A storage that keeps a shard's size but not its bytes (a flipped byte at the file's tail),
or loses a shard after the commit, makes the new commit unreadable: the committer's
retention (``keep``) and the controller's prune (``prune_below``) then delete nothing, and
the save's result says why. Before, the commit was never read and the older steps went.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sailor.checkpoint import LocalStorage, ParamState, TrainingGlobals, committed_steps
from sailor.checkpoint.checkpointer import Checkpointer
from sailor.checkpoint.errors import CorruptCheckpointError
from sailor.checkpoint.format import MARKER, step_dir
from sailor.checkpoint.readback import read_back
from sailor.checkpoint.reader import read_manifest
from sailor.checkpoint.writer import save_full
from tests.unit.test_checkpoint_blocks import one_layer_plan
from tests.unit.test_checkpoint_local import _state


class _FlipsTail(LocalStorage):
    """Layer files reach the disk at their size with their last byte flipped."""

    def write_all(self, objects: Any, *, workers: int = 4) -> list[int]:
        sizes = super().write_all(objects, workers=workers)
        for path, _chunks in objects:
            p = self._p(path)
            data = bytearray(p.read_bytes())
            data[-1] ^= 0xFF
            p.write_bytes(bytes(data))
        return sizes


class _LosesShards(LocalStorage):
    """A step's layer files vanish right after its commit marker is written."""

    def write(self, path: str, chunks: Any) -> int:
        n = super().write(path, chunks)
        if path.endswith(f"/{MARKER}"):
            for f in self.walk(path.rsplit("/", 1)[0]):
                if f.rsplit("/", 1)[-1].startswith("layer-"):
                    self._p(f).unlink()
        return n


def test_retention_keeps_the_older_steps_when_the_new_commit_fails_its_checksum(
    tmp_path: Path,
) -> None:
    state = _state(layers=1)
    ck = Checkpointer(LocalStorage(tmp_path), one_layer_plan(), 0, keep=1)
    ck.save(state, TrainingGlobals(1, 1, {}))
    ck.wait()
    ck.storage = _FlipsTail(tmp_path)
    ck.save(state, TrainingGlobals(2, 2, {}))
    res = ck.wait()
    ck.close()
    assert res is not None and res.manifest is not None  # committed all the same
    assert committed_steps(LocalStorage(tmp_path)) == [1, 2]  # step 1 not deleted
    assert "does not read back" in res.readback_error and "checksum" in res.readback_error
    assert res.retention_error == ""


def test_the_prune_keeps_the_older_steps_when_a_shard_of_the_new_commit_is_gone(
    tmp_path: Path,
) -> None:
    state = _state(layers=1)
    ck = Checkpointer(LocalStorage(tmp_path), one_layer_plan(), 0, keep=None)
    for step in (1, 2):
        ck.save(state, TrainingGlobals(step, step, {}))
        ck.wait()
    ck.storage = _LosesShards(tmp_path)
    ck.save(state, TrainingGlobals(3, 3, {}), prune_below=3)
    res = ck.wait()
    ck.close()
    assert res is not None and res.manifest is not None
    assert committed_steps(LocalStorage(tmp_path)) == [1, 2, 3]
    assert "missing" in res.readback_error and step_dir(3) in res.readback_error


def test_a_good_commit_reads_back_and_retention_goes_on(tmp_path: Path) -> None:
    state = _state(layers=1)
    ck = Checkpointer(LocalStorage(tmp_path), one_layer_plan(), 0, keep=1)
    for step in (1, 2):
        ck.save(state, TrainingGlobals(step, step, {}))
        res = ck.wait()
    ck.close()
    assert res is not None and res.readback_error == "" and res.readback_s > 0
    assert committed_steps(LocalStorage(tmp_path)) == [2]


def test_save_full_with_keep_raises_and_deletes_nothing_when_its_commit_does_not_read_back(
    tmp_path: Path,
) -> None:
    state = _state(layers=4)
    kw: dict[str, Any] = {"model": "toy", "num_layers": 4, "keep": 1}
    save_full(LocalStorage(tmp_path), state, TrainingGlobals(1, 1, {}), save_id="a", **kw)
    with pytest.raises(CorruptCheckpointError, match="does not read back"):
        save_full(_FlipsTail(tmp_path), state, TrainingGlobals(2, 2, {}), save_id="b", **kw)
    assert committed_steps(LocalStorage(tmp_path)) == [1, 2]


def test_read_back_reads_within_its_budget(tmp_path: Path) -> None:
    """Sizes of every shard always; checksummed blocks only while the budget lasts (tails
    first); a budget of 0 reads no shard byte."""
    state = _state(layers=4)
    s = LocalStorage(tmp_path)
    save_full(s, state, TrainingGlobals(1, 1, {}), model="toy", num_layers=4)
    full = read_back(s, 1)
    assert full.ok and full.shards == 4 and full.blocks == 8 and full.bytes_read > 0
    none = read_back(s, 1, budget_bytes=0)
    assert none.ok and none.shards == 4 and none.blocks == 0 and none.bytes_read == 0
    some = read_back(s, 1, budget_bytes=full.bytes_read // 2)
    assert some.ok and 0 < some.bytes_read <= full.bytes_read // 2
    with pytest.raises(ValueError, match="budget_bytes=-1"):
        read_back(s, 1, budget_bytes=-1)
    assert not read_back(s, 7).ok  # no commit at all: reported, not raised


class _ReadRaises(LocalStorage):
    """Reads of layer files raise what an fsspec backend re-raises from its client (s3fs:
    aiohttp's ``ServerDisconnectedError``, no ``OSError``); the rest (parts, manifest,
    marker) reads as it is."""

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        if path.rsplit("/", 1)[-1].startswith("layer-"):
            raise RuntimeError("Server disconnected (aiohttp stand-in)")
        return super().read(path, start, length)


def test_a_read_back_that_raises_after_the_commit_is_reported_never_a_failed_save(
    tmp_path: Path,
) -> None:
    """A read-back whose storage raises something other than an ``OSError`` after the commit
    marker: the save stays committed and succeeds, the failure is ``readback_error`` and
    nothing older is deleted. Before, the RuntimeError failed a save that had committed."""
    state = _state(layers=1)
    ck = Checkpointer(LocalStorage(tmp_path), one_layer_plan(), 0, keep=1)
    ck.save(state, TrainingGlobals(1, 1, {}))
    ck.wait()
    ck.storage = _ReadRaises(tmp_path)
    ck.save(state, TrainingGlobals(2, 2, {}))
    res = ck.wait()
    ck.close()
    assert res is not None and res.manifest is not None
    assert committed_steps(LocalStorage(tmp_path)) == [1, 2]  # step 1 kept
    assert "does not read back" in res.readback_error
    assert "RuntimeError: Server disconnected" in res.readback_error
    rb = read_back(_ReadRaises(tmp_path), 2)  # a problem of the read-back, not raised
    assert not rb.ok and all("RuntimeError" in p for p in rb.problems)


SHARDS = 8
SMALL = (64, 64)  # 16 KB a tensor: one block
LARGE = (4096, 256)  # 4 MB a tensor: 16 blocks of 256 KB


def _big_tailed(tmp_path: Path) -> LocalStorage:
    """A commit whose shards end in tensors with blocks larger than a shard's share of the
    budget below (as a 70B layer's ~56 MB tail blocks against its 0.8 MB share), with a
    small tensor before them."""
    g = torch.Generator().manual_seed(0)
    state = {}
    for layer in range(SHARDS):
        for name, shape in (("a_norm", SMALL), ("z_mlp", LARGE)):
            ts = [torch.randn(*shape, generator=g) for _ in range(3)]
            state[f"{layer}.{name}"] = ParamState(*ts, tp_dim=0)
    s = LocalStorage(tmp_path)
    save_full(s, state, TrainingGlobals(1, 1, {}), model="toy", num_layers=SHARDS)
    return s


def test_read_back_checks_a_block_of_every_shard_when_the_tails_do_not_fit(
    tmp_path: Path,
) -> None:
    """Each shard gets its share of the budget and the last block of the file that fits in
    it: with tail blocks of 256 KB and 100 KB a shard, every shard has a small tensor's
    block checked, and a flipped byte in one of them is found. Before (tails first, then
    heads), three tails took the budget and five shards had no byte read: the flip passed."""
    s = _big_tailed(tmp_path)
    m = read_manifest(s, 1)
    assert len(m.shards) == SHARDS
    budget = SHARDS * 100 * 1024
    rb = read_back(s, 1, budget_bytes=budget)
    assert rb.ok and rb.unchecked == 0 and rb.blocks >= SHARDS, rb
    assert rb.bytes_read <= budget
    sh = m.shards[5]
    (small,) = [t for t in sh.tensors if t.param == "a_norm" and t.kind == "exp_avg_sq"]
    p = tmp_path / step_dir(1) / sh.path
    data = bytearray(p.read_bytes())
    data[small.offset + small.nbytes // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    bad = read_back(s, 1, budget_bytes=budget)
    assert not bad.ok and any(sh.path in x and "a_norm" in x for x in bad.problems), bad


def test_shards_with_no_block_checked_are_counted_and_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A budget too small for any block (none at all, for the save): the commit still reads
    back (sizes checked) but ``unchecked`` counts every shard, the save's result carries it
    and the worker's glue prints it. Before, a read-back that read nothing was ok and said
    nothing."""
    from sailor.checkpoint import readback
    from sailor.training_process.ckpt_glue import CheckpointSaves

    s = _big_tailed(tmp_path / "a")
    none = read_back(s, 1, budget_bytes=1024)
    assert none.ok and none.blocks == 0 and none.unchecked == SHARDS
    monkeypatch.setattr(readback, "READBACK_BYTES", 0)
    state = _state(layers=1)
    saves = CheckpointSaves(keep=1)
    root = str(tmp_path / "b")
    for step in (1, 2):
        g = TrainingGlobals(step, step, {})
        saves.save(lambda g=g: (state, g), one_layer_plan(), 0, None, root)  # type: ignore[misc]
        saves.wait()
    saves.close()
    assert committed_steps(LocalStorage(root)) == [2]  # read back (sizes): retention ran
    err = capsys.readouterr().err
    assert "read-back of step 2: 1 shard(s) had no block checked" in err, err
    ck = Checkpointer(LocalStorage(root), one_layer_plan(), 0, keep=1)
    ck.save(state, TrainingGlobals(3, 3, {}))
    res = ck.wait()
    ck.close()
    assert res is not None and res.readback_error == "" and res.readback_unchecked == 1
