"""A rank's writes of saves it no longer waits for (``CheckpointSaves``: abandoned, or of a
world abandoned in place) are tracked for as long as they run, whatever happens to the IO
meanwhile, and judged by the storage they write to, not by the text of their root.

- ``reset`` (a broken world, the worker held in place) keeps tracking the writes still
  running: the save in flight at the break and any abandoned before. The next world's saves
  meet the same rules as before the reset (optional skipped, required on that storage
  refused); a write that has ended is dropped, with its host copies.
- ``close`` (a worker that stopped in place, its step durable) does not wait for a write
  still running: it stays tracked for the next generation.
- two roots on one mounted file system (``/nfs/a``, ``/nfs/b``) are one storage: a required
  save under the second is refused while the first's write runs.

One process plays rank 0 (the committer) of a two-rank plan whose rank 1 never writes: a
save it makes is in flight until it is abandoned. Its storage's first layer write hangs
(``_GatedFirst``) until the test opens the gate.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from sailor.checkpoint import TrainingGlobals
from sailor.checkpoint.errors import AbandonedWriteError, SaveSkippedError
from sailor.checkpoint.mounts import Mount
from sailor.training_process import ckpt_glue
from sailor.training_process.ckpt_glue import CheckpointSaves
from tests.unit.test_checkpoint_durability import _copies, _GatedFirst, _two_stage_plan
from tests.unit.test_checkpoint_local import _state

_MINE = {k: p for k, p in _state(layers=2).items() if k.startswith("0.")}


def _state_at(step: int) -> object:
    return lambda: (_MINE, TrainingGlobals(step, step, {}))


def _until(cond: object, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def hung(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_GatedFirst]:
    storage = _GatedFirst(tmp_path)
    monkeypatch.setattr(ckpt_glue, "open_storage", lambda root: storage)
    monkeypatch.setattr(ckpt_glue, "ABANDONED_WAIT_S", 0.2)
    yield storage
    storage.gate.set()  # whatever failed: no thread of the test left hanging


def _end(saves: CheckpointSaves, hung: _GatedFirst) -> None:
    """Drop whatever is in flight (rank 1's part never comes) and let tracked writes end."""
    hung.gate.set()
    saves.abandon()
    assert _until(lambda: all(ck.done() for _, ck in saves._abandoned))
    saves.close()


def test_a_reset_keeps_tracking_the_broken_worlds_write_that_still_runs(
    hung: _GatedFirst, tmp_path: Path
) -> None:
    """The world breaks while the hold's save is in flight and this rank's write of it hangs;
    ``reset``. The next world's required save under that root is refused after
    ``ABANDONED_WAIT_S`` (``AbandonedWriteError``), an optional one skipped, neither
    snapshotting; once the write has ended, the next save goes ahead and the old save is
    no longer tracked. Before, ``reset`` forgot the write: the required save went ahead
    into the hung mount, bounded only by the controller's CHECKPOINT deadline."""
    plan, root = _two_stage_plan(), str(tmp_path)
    saves = CheckpointSaves()
    try:
        saves.save(_state_at(3), plan, 0, None, root)  # the hold's save, required
        assert hung.entered.wait(10)
        (old,) = saves._by_root.values()
        saves.reset()  # the world broke: nothing waits for it, it is fenced
        t0 = time.monotonic()
        saves.save(_state_at(3), plan, 0, None, root)  # the next world's
        assert time.monotonic() - t0 < 5 and saves.done() and not saves._by_root
        with pytest.raises(AbandonedWriteError, match="still runs"):
            saves.wait()
        saves.save(_state_at(4), plan, 0, None, root, optional=True)
        with pytest.raises(SaveSkippedError, match="still runs"):
            saves.wait()
        assert saves.kept_bytes == 0 and not old.done()  # no second snapshot taken
        hung.gate.set()
        assert _until(old.done)
        saves.save(_state_at(5), plan, 0, None, root)  # the write ended: goes ahead
        assert saves._abandoned == [] and not saves.done()
    finally:
        _end(saves, hung)


def test_a_reset_drops_a_tracked_write_that_has_ended_with_its_host_copies(
    hung: _GatedFirst, tmp_path: Path
) -> None:
    """An abandoned save whose write still runs is kept across a reset (an optional save of
    the next world is skipped); once it has ended, the next reset drops it and nothing
    keeps its host copies."""
    plan, root = _two_stage_plan(), str(tmp_path)
    saves = CheckpointSaves()
    try:
        saves.save(_state_at(3), plan, 0, None, root, optional=True)
        assert hung.entered.wait(10)
        (old,) = saves._by_root.values()
        refs = [weakref.ref(t) for t in _copies(old).values()]
        assert refs
        saves.abandon()
        saves.reset()
        saves.save(_state_at(4), plan, 0, None, root, optional=True)
        assert saves.done()  # refused before it began, not in flight
        with pytest.raises(SaveSkippedError):
            saves.wait()
        assert [ck for _, ck in saves._abandoned] == [old]
        hung.gate.set()
        assert _until(old.done)
        saves.reset()
        assert saves._abandoned == []
        del old
        gc.collect()
        assert all(r() is None for r in refs)  # the copies went with it
    finally:
        _end(saves, hung)


def test_close_does_not_wait_for_an_abandoned_write_that_still_runs(
    hung: _GatedFirst, tmp_path: Path
) -> None:
    """A worker stopped in place (its step durable) closes its IO before it reports
    ``held``: a write of an abandoned save hung on the mount must not hold it there. The
    write stays tracked: the next generation's required save under that root is refused.
    Before, ``close`` waited for it (here 30 s: for good on a hung mount)."""
    plan, root = _two_stage_plan(), str(tmp_path)
    saves = CheckpointSaves()
    try:
        saves.save(_state_at(3), plan, 0, None, root, optional=True)
        assert hung.entered.wait(10)
        (old,) = saves._by_root.values()
        saves.abandon()
        closing = threading.Thread(target=saves.close, daemon=True)
        closing.start()
        closing.join(5)
        assert not closing.is_alive(), "close waited for the hung write"
        assert [ck for _, ck in saves._abandoned] == [old]
        saves.save(_state_at(4), plan, 0, None, root)
        with pytest.raises(AbandonedWriteError):
            saves.wait()
    finally:
        _end(saves, hung)


def test_a_required_save_under_another_directory_of_the_hung_mount_is_refused(
    hung: _GatedFirst, tmp_path: Path
) -> None:
    """Two roots in one mounted file system (this process's real mount table: both under
    the test's directory): a required save under the second is refused while the first's
    write runs there. Before, the roots were compared as text, and the save went ahead
    into the hung mount."""
    plan = _two_stage_plan()
    saves = CheckpointSaves()
    try:
        saves.save(_state_at(3), plan, 0, None, str(tmp_path / "a"), optional=True)
        assert hung.entered.wait(10)
        saves.abandon()
        saves.save(_state_at(4), plan, 0, None, str(tmp_path / "b"))
        assert saves.done() and not saves._by_root  # nothing snapshotted
        with pytest.raises(AbandonedWriteError, match="not known good"):
            saves.wait()
    finally:
        _end(saves, hung)


def test_roots_are_one_storage_by_mount_device_or_network_server(
    hung: _GatedFirst, tmp_path: Path
) -> None:
    """As the mount table says: a root on a mount from the hung root's NFS server is refused
    (another export of the same server), one on a local disk mounted elsewhere goes
    ahead."""
    plan = _two_stage_plan()
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    table = (
        Mount("/", "8:1", "ext4", "/dev/sda1"),
        Mount(a, "0:50", "nfs4", "filer:/export/one"),
        Mount(b, "0:51", "nfs", "filer:/export/two"),
        Mount(c, "8:17", "ext4", "/dev/sdb1"),
    )
    saves = CheckpointSaves(mounts=lambda: table)
    try:
        saves.save(_state_at(3), plan, 0, None, a, optional=True)
        assert hung.entered.wait(10)
        saves.abandon()
        saves.save(_state_at(4), plan, 0, None, b + "/run1")
        with pytest.raises(AbandonedWriteError, match="not known good"):
            saves.wait()
        saves.save(_state_at(4), plan, 0, None, c)  # another mount: goes ahead
        assert not saves.done() and len(saves._by_root) == 1
    finally:
        _end(saves, hung)


def test_the_mount_table_is_read_again_at_a_save_while_a_write_is_tracked(
    hung: _GatedFirst, tmp_path: Path
) -> None:
    """Two NFS servers mounted after the first save (an automounter mounts each at its first
    use): a required save on the other server goes ahead while the first's write hangs.
    Before, the table was not read again while a write was tracked: the one read before,
    without those mounts, put both roots on the root file system and refused the save."""
    a, b = str(tmp_path / "hostA" / "ckpt"), str(tmp_path / "hostB" / "ckpt")
    before = (Mount("/", "8:1", "ext4", "/dev/sda1"),)
    after = (
        *before,
        Mount(str(tmp_path / "hostA"), "0:50", "nfs4", "hostA:/"),
        Mount(str(tmp_path / "hostB"), "0:51", "nfs4", "hostB:/"),
    )
    reads = [before]
    saves = CheckpointSaves(mounts=lambda: reads[-1])
    try:
        saves.save(_state_at(3), _two_stage_plan(), 0, None, a, optional=True)
        assert hung.entered.wait(10)
        reads.append(after)
        saves.abandon()
        saves.save(_state_at(4), _two_stage_plan(), 0, None, b)
        assert not saves.done()  # in flight: not refused
    finally:
        _end(saves, hung)


def test_roots_under_an_automounter_trigger_are_told_apart_by_path(
    hung: _GatedFirst, tmp_path: Path
) -> None:
    """Both roots under an autofs trigger (``/net``) whose servers' mounts are not in the
    table: they are judged by path, and a required save under the other server's goes
    ahead. Before, both were on the trigger's device: refused."""
    net = str(tmp_path / "net")
    table = (Mount("/", "8:1", "ext4", "/dev/sda1"), Mount(net, "0:40", "autofs", "-hosts"))
    saves = CheckpointSaves(mounts=lambda: table)
    try:
        saves.save(_state_at(3), _two_stage_plan(), 0, None, f"{net}/hostA/ckpt", optional=True)
        assert hung.entered.wait(10)
        saves.abandon()
        saves.save(_state_at(4), _two_stage_plan(), 0, None, f"{net}/hostB/ckpt")
        assert not saves.done()  # in flight: not refused
    finally:
        _end(saves, hung)


def test_a_mount_table_that_does_not_answer_holds_a_save_no_longer_than_its_bound(
    hung: _GatedFirst, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table's read blocks (an unmount stuck on the namespace's lock): the save waits
    ``MOUNTS_WAIT_S`` for it, then judges by the table read before (here: both roots from
    one NFS server, refused), and the stuck read is not started again at the next save."""
    monkeypatch.setattr(ckpt_glue, "MOUNTS_WAIT_S", 0.2)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    table = (
        Mount("/", "8:1", "ext4", "/dev/sda1"),
        Mount(a, "0:50", "nfs4", "filer:/one"),
        Mount(b, "0:51", "nfs4", "filer:/two"),
    )
    stuck = threading.Event()
    calls: list[int] = []

    def read() -> tuple[Mount, ...]:
        calls.append(1)
        if len(calls) > 1:
            stuck.wait(30)
        return table

    saves = CheckpointSaves(mounts=read)
    try:
        saves.save(_state_at(3), _two_stage_plan(), 0, None, a, optional=True)
        assert hung.entered.wait(10)
        saves.abandon()
        for step in (4, 5):
            t0 = time.monotonic()
            saves.save(_state_at(step), _two_stage_plan(), 0, None, b)
            assert time.monotonic() - t0 < 0.2 + 0.2 + 1.0  # the bound, ABANDONED_WAIT_S
            with pytest.raises(AbandonedWriteError):
                saves.wait()
        assert len(calls) == 2  # the stuck read is waited for again, not started again
    finally:
        stuck.set()
        _end(saves, hung)
