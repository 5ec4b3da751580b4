"""What makes a save durable, and what a save reports when the storage fails.

The crash test (``test_checkpoint_crash.py``) kills the writer with SIGKILL, which the page
cache survives: it would pass with every fsync removed. Here the calls that make a save
durable are recorded on a real directory (``os.fsync``, ``os.replace``: each passed through to
the real one, by ``test_durable._record``) and their order checked: each file fsync'd before
it is renamed, its directory fsync'd after, and every shard durable before the rank's part,
the part before the manifest, the manifest before the commit marker. Then the failures the
storage used to swallow: a directory fsync's EIO, a step directory that could not be deleted,
a manifest of a newer release met by retention.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sailor.checkpoint import (
    LocalStorage,
    StorageError,
    TrainingGlobals,
    committed_steps,
    read_manifest,
    verify,
)
from sailor.checkpoint.checkpointer import Checkpointer
from sailor.checkpoint.errors import SaveCancelledError, SaveSkippedError
from sailor.checkpoint.format import MANIFEST, MARKER, PARTS, part_name, shard_name, step_dir
from sailor.checkpoint.writer import persist_layers, save_full
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from tests.unit.test_checkpoint_blocks import KINDS, one_layer_plan
from tests.unit.test_checkpoint_local import _state
from tests.unit.test_durable import Event, _fsync_failing, _record


def _durable_at(events: list[Event], final: str) -> tuple[int, int]:
    """(index of the rename onto ``final``, index of the first fsync of its directory after
    it), having checked that its temp file was fsync'd before the rename."""
    renames = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == final]
    assert len(renames) == 1, f"{final}: renamed {len(renames)} times"
    r = renames[0]
    tmp = events[r][1]
    assert ("fsync", tmp, "") in events[:r], f"{final}: its temp file not fsync'd before rename"
    parent = str(Path(final).parent)
    synced = [i for i, e in enumerate(events) if i > r and e == ("fsync", parent, "")]
    assert synced, f"{final}: its directory never fsync'd after the rename"
    return r, synced[0]


def check_durable_order(events: list[Event], step_path: Path, new_dir: bool = True) -> None:
    """Shards, then the part, then the manifest, then the marker: each renamed only once all
    before it are durable (renamed and their directory fsync'd); the marker durable too; and
    (``new_dir``: the save made the step directory) the step directory's own entry fsync'd
    into the root before the marker is renamed."""
    finals = sorted({e[2] for e in events if e[0] == "replace"})
    shards = [f for f in finals if Path(f).name.startswith("layer-")]
    parts = [f for f in finals if Path(f).parent.name == PARTS]
    assert shards and len(parts) == 1, finals
    shard_done = max(_durable_at(events, f)[1] for f in shards)
    part_r, part_done = _durable_at(events, parts[0])
    man_r, man_done = _durable_at(events, str(step_path / MANIFEST))
    mark_r, _ = _durable_at(events, str(step_path / MARKER))
    assert shard_done < part_r, "the part was renamed before every shard was durable"
    assert part_done < man_r, "the manifest was renamed before the part was durable"
    assert man_done < mark_r, "the marker was renamed before the manifest was durable"
    if new_dir:
        root_synced = [i for i, e in enumerate(events) if e == ("fsync", str(step_path.parent), "")]
        assert root_synced and root_synced[0] < mark_r, "the step directory's entry never durable"


def _save_recorded(
    root: Path, monkeypatch: pytest.MonkeyPatch, dirs_made: bool = False
) -> list[Event]:
    """The calls of a one-process save of step 7 to ``root``; ``dirs_made``: its step and
    parts directories made beforehand (by another writer rank of a multi-rank save), so the
    fsyncs of their new entries do not also cover the shards' renames."""
    storage = LocalStorage(root)
    if dirs_made:
        (root / step_dir(7) / PARTS).mkdir(parents=True)
    with monkeypatch.context() as m:
        events = _record(m)
        save_full(storage, _state(layers=3), TrainingGlobals(7, 28, {}), model="toy", num_layers=3)
    return events


@pytest.mark.parametrize("dirs_made", [False, True])
def test_save_makes_each_object_durable_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dirs_made: bool
) -> None:
    """A save on a real directory: every shard fsync'd, renamed and its directory fsync'd
    before the part; the part before the manifest; the manifest before the marker; a step
    directory the save made durable in the root before the marker."""
    root = tmp_path.resolve()
    events = _save_recorded(root, monkeypatch, dirs_made)
    check_durable_order(events, root / step_dir(7), new_dir=not dirs_made)
    assert verify(LocalStorage(root), 7) == []


def test_the_order_check_misses_no_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a save whose directories another writer rank made, the check holds, and fails
    when any one of the save's fsyncs is taken out of the record (what removing it from the
    code leaves): none can go unnoticed. (In a save that makes them, a new directory's
    entry fsync'd may also cover renames before it: the parts directory's, made after the
    shards, covers theirs.)"""
    root = tmp_path.resolve()
    events = _save_recorded(root, monkeypatch, dirs_made=True)
    step = root / step_dir(7)
    check_durable_order(events, step, new_dir=False)
    fsyncs = [i for i, e in enumerate(events) if e[0] == "fsync"]
    assert len(fsyncs) == 10  # 3 shards, their directory, the part, its directory, ...
    for i in fsyncs:
        without = events[:i] + events[i + 1 :]
        with pytest.raises(AssertionError):
            check_durable_order(without, step, new_dir=False)


def test_a_directory_fsync_error_fails_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO (or ENOSPC) from a directory's fsync is the storage failing: the write raises
    ``StorageError`` naming the directory. EINVAL (a file system that does not fsync
    directories) is skipped, as before."""
    s = LocalStorage(tmp_path)
    s.write("a/x", [b"1"])
    monkeypatch.setattr(os, "fsync", _fsync_failing(errno.EIO))
    with pytest.raises(StorageError, match=r"cannot fsync directory .*/a: .*Input/output error"):
        s.write("a/y", [b"2"])
    with pytest.raises(StorageError, match="cannot fsync directory"):
        s.write_all([("a/z", [b"3"])])
    monkeypatch.setattr(os, "fsync", _fsync_failing(errno.EINVAL))
    s.write("a/w", [b"4"])
    assert s.read("a/w") == b"4"


def test_a_failed_step_deletion_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step directory the committer's prune cannot delete (here: its layer file refuses
    to go, EPERM) is reported in ``SaveResult.retention_error``; the save stays committed.
    ``rmtree(ignore_errors=True)`` reported nothing."""
    s = LocalStorage(tmp_path)
    state = _state(layers=1)
    ck = Checkpointer(s, one_layer_plan(), 0, keep=None)
    for step in (1, 2):
        ck.save(state, TrainingGlobals(step, step, {}))
        ck.wait()
    real_unlink = os.unlink

    def unlink(path: Any, *a: Any, **kw: Any) -> None:
        if os.fspath(path).startswith("layer-") or "/layer-" in os.fspath(path):
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), os.fspath(path))
        real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    ck.save(state, TrainingGlobals(3, 3, {}), prune_below=2)
    res = ck.wait()
    monkeypatch.undo()
    ck.close()
    assert res is not None and res.manifest is not None
    assert "cannot delete" in res.retention_error and step_dir(1) in res.retention_error
    assert committed_steps(s) == [2, 3]  # step 1 lost its marker first: uncommitted debris


def test_retention_meeting_a_newer_manifest_is_a_retention_error(tmp_path: Path) -> None:
    """An older step whose manifest this release cannot validate (a newer release wrote a
    tensor kind it does not know) is spared by the committer's retention and reported, and
    the save does not fail: the new step is committed and the error is
    ``retention_error``."""
    s = LocalStorage(tmp_path)
    state = _state(layers=1)
    ck = Checkpointer(s, one_layer_plan(), 0, keep=1)
    ck.save(state, TrainingGlobals(1, 1, {}))
    ck.wait()
    d = tmp_path / step_dir(1)
    manifest = json.loads((d / MANIFEST).read_text())
    manifest["schema_version"] += 1
    manifest["shards"][0]["tensors"][0]["kind"] = "master_bf16"
    raw = json.dumps(manifest).encode()
    (d / MANIFEST).write_bytes(raw)
    marker = json.loads((d / MARKER).read_text())
    marker.update(manifest_sha256=hashlib.sha256(raw).hexdigest(), manifest_size=len(raw))
    (d / MARKER).write_text(json.dumps(marker))
    ck.save(state, TrainingGlobals(2, 2, {}))
    res = ck.wait()
    ck.close()
    assert res is not None and res.manifest is not None and res.manifest.step == 2
    assert "spared 1 step(s)" in res.retention_error, res.retention_error
    assert "not a manifest this release reads: shards.0.tensors.0.kind" in res.retention_error
    assert committed_steps(s) == [1, 2] and verify(s, 2) == []


def _two_stage_plan() -> Plan:
    """Ranks 0 and 1 each holding one layer of a two-layer toy model: two writers."""
    stage = {"replica": ReplicaGroup(gpu_type="cpu", zone="z", tp=1, gpus_per_node=1)}
    return Plan(
        plan_id="two",
        model="toy",
        global_batch_size=1,
        pipelines=(
            Pipeline(
                stages=(
                    Stage(first_layer=0, last_layer=0, **stage),
                    Stage(first_layer=1, last_layer=1, **stage),
                ),
                microbatch_size=1,
                num_microbatches=1,
            ),
        ),
    )


def test_a_cancelled_save_commits_nothing_over_a_later_commit_of_its_step(
    tmp_path: Path,
) -> None:
    """A save of an abandoned world (``Checkpointer.cancel``, at ``CheckpointSaves.reset``):
    its committer, still waiting for a part, must not commit once the part comes late,
    when a later generation has committed the same step meanwhile; it ends with
    ``SaveCancelledError`` and the later commit stands."""
    s = LocalStorage(tmp_path)
    state = _state(layers=2)
    mine = {k: p for k, p in state.items() if k.startswith("0.")}
    ck = Checkpointer(s, _two_stage_plan(), 0, keep=None, commit_timeout_s=60)
    ck.save(mine, TrainingGlobals(3, 3, {}), save_id="old")  # waits for rank 1's part
    save_full(s, state, TrainingGlobals(3, 3, {}), model="toy", num_layers=2, save_id="new")
    ck.cancel()
    late = {1: {k.split(".", 1)[1]: p for k, p in state.items() if k.startswith("1.")}}
    persist_layers(s, 3, "old", late, rank=1)  # the abandoned peer's part, late
    with pytest.raises(SaveCancelledError):
        ck.wait()
    assert committed_steps(s) == [3] and read_manifest(s, 3).save_id == "new"
    assert verify(s, 3) == []
    # the cancelled save's files there when its committer stopped are deleted with it
    assert not (tmp_path / step_dir(3) / shard_name(0, "old")).exists()
    assert not (tmp_path / step_dir(3) / part_name("old", 0)).exists()
    ck.close()


def test_a_reset_fences_the_save_in_flight(tmp_path: Path) -> None:
    """``CheckpointSaves.reset`` (the world abandoned, a held worker going on in place)
    cancels the save in flight: its late part commits nothing over the step."""
    from sailor.training_process.ckpt_glue import CheckpointSaves

    s = LocalStorage(tmp_path)
    state = _state(layers=2)
    mine = {k: p for k, p in state.items() if k.startswith("0.")}
    saves = CheckpointSaves()
    saves.save(lambda: (mine, TrainingGlobals(3, 3, {})), _two_stage_plan(), 0, None, str(s.root))
    parts = tmp_path / step_dir(3) / PARTS
    for _ in range(500):  # rank 0's part, written in the background; then its commit waits
        if found := {p.name.split("-rank")[0] for p in parts.glob("*.json")}:
            break
        time.sleep(0.02)
    (old,) = found
    (ck,) = saves._by_root.values()
    saves.reset()
    save_full(s, state, TrainingGlobals(3, 3, {}), model="toy", num_layers=2, save_id="new")
    late = {1: {k.split(".", 1)[1]: p for k, p in state.items() if k.startswith("1.")}}
    persist_layers(s, 3, old, late, rank=1)
    with pytest.raises(SaveCancelledError):
        ck.wait()
    assert read_manifest(s, 3).save_id == "new" and verify(s, 3) == []
    assert not (tmp_path / step_dir(3) / shard_name(0, old)).exists()
    ck.close()


class _Gated(LocalStorage):
    """A storage whose layer writes wait for ``gate``: a rank's write still running."""

    gate = threading.Event()
    entered = threading.Event()

    def write_all(self, *args: Any, **kwargs: Any) -> list[int]:
        self.entered.set()
        self.gate.wait(30)
        return super().write_all(*args, **kwargs)


def _copies(ck: Checkpointer) -> dict[tuple[int, str, str], torch.Tensor]:
    """The host copies ``ck`` keeps for its next save, by (layer, name, kind)."""
    return {
        (layer, name, kind): ps.tensor(kind)
        for layer, by_name in ck._spare.items()
        for name, ps in by_name.items()
        for kind in KINDS
    }


def test_a_save_while_an_abandoned_saves_write_runs_is_skipped_and_its_copies_are_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``CheckpointSaves.abandon`` (an optional save failed on a peer) while this rank still
    writes its part (a hung mount: its write may never end). Nothing waits for that write
    beyond ``ABANDONED_WAIT_S``: the IO is done at once, and the next save is skipped
    (``SaveSkippedError``, the save's failure: agreed and, optional, reported) without a
    snapshot, so the process never holds a second snapshot's worth of host memory; once
    the write ends, the next save goes ahead in the abandoned save's copies. Before, the
    save went ahead with copies of its own: two snapshots' worth while the write hung."""
    from sailor.training_process import ckpt_glue
    from sailor.training_process.ckpt_glue import CheckpointSaves

    storage = _Gated(tmp_path)
    storage.gate, storage.entered = threading.Event(), threading.Event()
    monkeypatch.setattr(ckpt_glue, "open_storage", lambda root: storage)
    monkeypatch.setattr(ckpt_glue, "ABANDONED_WAIT_S", 0.2)
    state = _state(layers=2)
    mine = {k: p for k, p in state.items() if k.startswith("0.")}
    plan, root = _two_stage_plan(), str(tmp_path)
    saves = CheckpointSaves()
    saves.save(lambda: (mine, TrainingGlobals(3, 3, {})), plan, 0, None, root)
    assert storage.entered.wait(10)  # rank 0's part is being written
    (old,) = saves._by_root.values()
    copies = _copies(old)
    assert copies
    saves.abandon()
    assert saves.done()  # not waited for: a hung write would hold every later save
    t0 = time.monotonic()
    saves.save(lambda: (mine, TrainingGlobals(4, 4, {})), plan, 0, None, root, optional=True)
    assert time.monotonic() - t0 < 5  # waited ABANDONED_WAIT_S at most, not for the write
    assert saves.done() and not old.done()
    with pytest.raises(SaveSkippedError, match="still runs"):
        saves.wait()
    assert saves._by_root == {} and saves.kept_bytes == 0  # no second snapshot taken
    storage.gate.set()
    saves.abandon()  # nothing in flight: the refused save left none
    for _ in range(500):
        if old.done():
            break
        time.sleep(0.02)
    assert old.done()
    saves.save(lambda: (mine, TrainingGlobals(5, 5, {})), plan, 0, None, root)
    (third,) = saves._by_root.values()
    reused = _copies(third)
    assert reused.keys() == copies.keys()
    assert all(reused[k] is copies[k] for k in copies)  # overwritten in place
    assert saves._abandoned == []
    saves.abandon()
    saves.close()


class _GatedFirst(LocalStorage):
    """A storage whose first layer write waits for ``gate`` (an abandoned save's write on a
    hung mount); later writes go through."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate, self.entered = threading.Event(), threading.Event()
        self._first = True
        self._lock = threading.Lock()

    def write_all(self, *args: Any, **kwargs: Any) -> list[int]:
        with self._lock:
            first, self._first = self._first, False
        if first:
            self.entered.set()
            self.gate.wait(30)
        return super().write_all(*args, **kwargs)


def test_a_required_save_under_another_root_while_an_abandoned_saves_write_runs_goes_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A required save (a reconfiguration's: its failure sends the job back to its last
    commit) under a root on another storage than the abandoned save's (another mount, per
    the mount table) is not refused while this rank still writes that save: it snapshots
    into copies of its own (a second snapshot's worth of host memory while that write runs)
    and becomes durable; the abandoned save's copies are taken back once its write ends."""
    from sailor.checkpoint.mounts import Mount
    from sailor.training_process import ckpt_glue
    from sailor.training_process.ckpt_glue import CheckpointSaves

    storage = _GatedFirst(tmp_path)
    monkeypatch.setattr(ckpt_glue, "open_storage", lambda root: storage)
    monkeypatch.setattr(ckpt_glue, "ABANDONED_WAIT_S", 0.2)
    state = _state(layers=2)
    mine = {k: p for k, p in state.items() if k.startswith("0.")}
    plan, root = _two_stage_plan(), str(tmp_path)
    other = root + "/../" + Path(root).name + "-elsewhere"  # one storage here, two roots
    mounted = str(tmp_path.parent / (tmp_path.name + "-elsewhere"))  # as the table says
    table = (Mount("/", "8:1", "ext4", "/dev/sda1"), Mount(mounted, "0:99", "tmpfs", "t"))
    saves = CheckpointSaves(mounts=lambda: table)
    saves.save(lambda: (mine, TrainingGlobals(3, 3, {})), plan, 0, None, root, optional=True)
    assert storage.entered.wait(10)
    (old,) = saves._by_root.values()
    copies = _copies(old)
    assert copies
    saves.abandon()
    saves.save(lambda: (mine, TrainingGlobals(4, 4, {})), plan, 0, None, other)
    (new,) = saves._by_root.values()
    assert new is not old and not old.done()
    parts = tmp_path / step_dir(4) / PARTS
    for _ in range(500):  # rank 0's part of step 4, written beside the hung write
        if found := {p.name.split("-rank")[0] for p in parts.glob("*.json")}:
            break
        time.sleep(0.02)
    (sid,) = found
    late = {1: {k.split(".", 1)[1]: p for k, p in state.items() if k.startswith("1.")}}
    persist_layers(storage, 4, sid, late, rank=1)
    saves.wait()  # committed, not skipped (SaveSkippedError before)
    assert 4 in committed_steps(storage) and verify(storage, 4) == []
    ours = _copies(new)
    assert ours.keys() == copies.keys()
    assert all(ours[k] is not copies[k] for k in copies)  # copies of its own
    assert not old.done()
    storage.gate.set()
    for _ in range(500):
        if old.done():
            break
        time.sleep(0.02)
    assert old.done()
    saves.close()


def test_a_required_save_under_the_root_an_abandoned_save_still_writes_fails_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A required save (the training config's after its failures in a row, the hold's)
    under the root whose abandoned write still runs on this rank is refused after
    ``ABANDONED_WAIT_S`` with ``AbandonedWriteError`` naming it: that storage is not known
    good, and a write there would hang the same way in a wait nothing bounds. Nothing is
    snapshotted (no second copies). Before, it took copies of its own and wrote into the
    hung mount."""
    from sailor.checkpoint.errors import AbandonedWriteError
    from sailor.training_process import ckpt_glue
    from sailor.training_process.ckpt_glue import CheckpointSaves

    storage = _GatedFirst(tmp_path)
    monkeypatch.setattr(ckpt_glue, "open_storage", lambda root: storage)
    monkeypatch.setattr(ckpt_glue, "ABANDONED_WAIT_S", 0.2)
    state = _state(layers=2)
    mine = {k: p for k, p in state.items() if k.startswith("0.")}
    plan, root = _two_stage_plan(), str(tmp_path)
    saves = CheckpointSaves()
    saves.save(lambda: (mine, TrainingGlobals(3, 3, {})), plan, 0, None, root, optional=True)
    assert storage.entered.wait(10)
    (old,) = saves._by_root.values()
    saves.abandon()
    t0 = time.monotonic()
    # the same root spelled otherwise (file://, a trailing slash) is the same root
    saves.save(lambda: (mine, TrainingGlobals(4, 4, {})), plan, 0, None, f"file://{root}/")
    assert time.monotonic() - t0 < 5  # ABANDONED_WAIT_S, not the write
    assert saves.done() and not old.done() and not saves._by_root  # nothing snapshotted
    with pytest.raises(AbandonedWriteError, match="still runs") as got:
        saves.wait()
    assert str(tmp_path) in str(got.value) and "not known good" in str(got.value)
    assert got.value.retryable is False
    assert 4 not in committed_steps(storage)
    storage.gate.set()
    for _ in range(500):
        if old.done():
            break
        time.sleep(0.02)
    # the write ended: the next required save under that root goes ahead with its copies
    saves.save(lambda: (mine, TrainingGlobals(5, 5, {})), plan, 0, None, root)
    (new,) = saves._by_root.values()
    assert new is not old
    saves.abandon()  # rank 1's part never comes here
    saves.close()


class _CancelledMidWrite(LocalStorage):
    """A writer's storage: its checkpointer is cancelled while it writes its layers (its
    rank saw the world fail; the committer's had not yet)."""

    ck: Checkpointer | None = None

    def write_all(self, *args: Any, **kwargs: Any) -> list[int]:
        assert self.ck is not None
        self.ck.cancel()
        return super().write_all(*args, **kwargs)


def test_a_writer_cancelled_mid_persist_leaves_a_live_committers_commit_whole(
    tmp_path: Path,
) -> None:
    """Ranks cancel when each sees the failure: a writer cancelled while it persists a
    save whose committer goes on (not cancelled yet, every part there) must not delete the
    save's files, which the committer commits; it reports the cancel. Before, its discard
    could delete the shards of the step just committed."""
    s = LocalStorage(tmp_path)
    state = _state(layers=2)
    plan = _two_stage_plan()
    committer = Checkpointer(s, plan, 0, keep=None, commit_timeout_s=60)
    slow = _CancelledMidWrite(tmp_path)
    writer = Checkpointer(slow, plan, 1, keep=None)
    slow.ck = writer
    g = TrainingGlobals(3, 3, {})
    writer.save({k: p for k, p in state.items() if k.startswith("1.")}, g, save_id="sid")
    with pytest.raises(SaveCancelledError):
        writer.wait()
    committer.save({k: p for k, p in state.items() if k.startswith("0.")}, g, save_id="sid")
    res = committer.wait()
    assert res is not None and res.manifest is not None
    assert committed_steps(s) == [3] and verify(s, 3) == []
    writer.close()
    committer.close()
