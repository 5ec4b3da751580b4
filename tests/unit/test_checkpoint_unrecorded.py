"""Saves the controller gave up on (``checkpoint/unrecorded.py``): the retention bound of the
controller's directory after an aborted CHECKPOINT, and the commits it does not know left
alone, on a real local checkpoint directory."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from sailor.checkpoint import LocalStorage, ParamState, TrainingGlobals, committed_steps, verify
from sailor.checkpoint.checkpointer import Checkpointer
from sailor.checkpoint.format import MARKER, step_dir
from sailor.checkpoint.storage import Chunk
from sailor.checkpoint.unrecorded import apply_unrecorded, committed_markers, decide_unrecorded
from sailor.checkpoint.writer import persist_layers
from tests.unit.test_checkpoint_blocks import one_layer_plan


def _state() -> dict[str, ParamState]:
    g = torch.Generator().manual_seed(0)
    return {"0.w": ParamState(*(torch.randn(8, 4, generator=g) for _ in range(3)), tp_dim=0)}


def _save(ck: Checkpointer, step: int, **kw: object) -> tuple[int, ...]:
    ck.save(_state(), TrainingGlobals(step, step, {}), **kw)  # type: ignore[arg-type]
    res = ck.wait()
    assert res is not None and res.retention_error == "" and res.readback_error == "", res
    return res.unrecorded_deleted


def test_an_aborted_checkpoints_commit_does_not_outlive_the_bound(tmp_path: Path) -> None:
    """keep_checkpoints = 1, the controller's commands replayed against a real committer.
    Step 100 is recorded. A reconfiguration's CHECKPOINT of step 200 commits on disk, but
    the controller aborts the phase (a node missed the deadline) and never records it; the
    job relaunches from 100. Its next saves (150, then 180) prune below the recorded step
    as before; 200 is above every ``prune_below`` while the job is behind it, so with
    ``prune_below`` alone the directory held 150, 180 and 200 after the save of 180: three
    checkpoints where the bound is keep + 1 = 2. ``drop_steps`` (the saves the controller
    gave up on) lets the committer delete it."""
    s = LocalStorage(tmp_path)
    ck = Checkpointer(s, one_layer_plan(), 0, keep=None)
    assert _save(ck, 100, prune_below=-1, drop_steps=[]) == ()  # recorded: {100}
    # the aborted CHECKPOINT: committed, never recorded; the controller remembers 200
    assert _save(ck, 200, prune_below=100, drop_steps=[]) == ()
    # relaunched from 100: a reconfiguration saves 150 (recorded; 100's record dropped)
    assert _save(ck, 150, prune_below=100, drop_steps=[200]) == (200,)
    assert committed_steps(s) == [100, 150]
    assert _save(ck, 180, prune_below=150, drop_steps=[]) == ()
    ck.close()
    assert committed_steps(s) == [150, 180]  # keep + 1: the recorded one and the newest
    assert verify(s, 150) == [] and verify(s, 180) == []


def test_a_commit_the_controller_does_not_know_survives_every_save(tmp_path: Path) -> None:
    """Commits at or above every ``prune_below`` that the controller never gave up on (made
    after the etcd snapshot it was restored from, or another job's in the same directory)
    stay through every save, whatever ``drop_steps`` names: a keep-list of the recorded
    steps deleted them all at the next save."""
    s = LocalStorage(tmp_path)
    ck = Checkpointer(s, one_layer_plan(), 0, keep=None)
    _save(ck, 100)  # recorded
    other = Checkpointer(s, one_layer_plan(), 0, keep=None)  # the unknown commits
    for step in (300, 400):
        _save(other, step)
    other.close()
    assert _save(ck, 150, prune_below=100, drop_steps=[]) == ()
    assert _save(ck, 200, prune_below=150, drop_steps=[250, 120]) == ()  # neither on disk
    assert _save(ck, 250, prune_below=200, drop_steps=[]) == ()
    ck.close()
    assert committed_steps(s) == [200, 250, 300, 400]
    assert verify(s, 300) == [] and verify(s, 400) == []


def test_recorded_steps_uncommitted_saves_and_an_older_controller_are_left_alone(
    tmp_path: Path,
) -> None:
    """Never deleted: a step not in ``drop_steps``, an uncommitted step directory in it (a
    save in flight under another generation, newer or older), and anything at all when the
    Checkpoint carries no ``drop_steps`` (an older controller's: today's rule alone)."""
    s = LocalStorage(tmp_path)
    ck = Checkpointer(s, one_layer_plan(), 0, keep=None)
    for step in (10, 20, 30):
        _save(ck, step)
    persist_layers(s, 25, "inflight", {0: {"w": _state()["0.w"]}})
    persist_layers(s, 90, "inflight", {0: {"w": _state()["0.w"]}})
    assert _save(ck, 40, prune_below=10) == ()  # no drop_steps: nothing but prune_below
    assert committed_steps(s) == [10, 20, 30, 40]
    assert _save(ck, 50, prune_below=10, drop_steps=[20, 25, 90, 50]) == (20,)
    ck.close()
    assert committed_steps(s) == [10, 30, 40, 50]
    assert (tmp_path / step_dir(25)).is_dir() and (tmp_path / step_dir(90)).is_dir()


def test_only_what_was_committed_when_the_save_began_goes(tmp_path: Path) -> None:
    """A committer whose persist runs late holds a stale ``drop_steps``: a step committed
    after its save began (a later generation's save of that step, maybe recorded since) is
    never deleted, nor one committed again since (its marker changed), nor anything once it
    is cancelled, nor the step it committed."""
    s = LocalStorage(tmp_path)
    ck = Checkpointer(s, one_layer_plan(), 0, keep=None)
    for step in (1, 2, 3):
        _save(ck, step)
    seen = committed_markers(s, but=3)
    assert sorted(seen) == [1, 2] and sorted(committed_markers(s, only=[2, 3, 7])) == [2, 3]
    _save(ck, 4)  # committed after ``seen`` was taken
    (tmp_path / step_dir(2) / MARKER).write_bytes(b"another commit")
    every = [1, 2, 3, 4, 5]
    got = decide_unrecorded([1, 2, 4, 5], drop_steps=[2, 4, 5], committed_step=5, below_step=2)
    assert got == [2, 4]
    assert apply_unrecorded(s, seen, drop_steps=every, committed_step=3, below_step=-1) == [1]
    assert committed_steps(s) == [2, 3, 4]  # 2: not the commit seen, so not deleted
    seen = committed_markers(s)
    gone = apply_unrecorded(
        s, seen, drop_steps=every, committed_step=4, below_step=-1, cancelled=lambda: True
    )
    ck.close()
    assert gone == [] and committed_steps(s) == [2, 3, 4]


class _Late(LocalStorage):
    """The storage as one committer sees it: its first write of ``pause_step`` waits for
    ``resume`` (a slow mount, a node cut off from the controller); its first taking of
    ``hold_step``'s marker (a move, or the delete of older code) runs ``then`` right after."""

    def __init__(
        self,
        root: Path,
        *,
        pause_step: int = -1,
        resume: threading.Event | None = None,
        paused: threading.Event | None = None,
        hold_step: int = -1,
        then: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(root)
        self._pause, self._resume, self._paused = pause_step, resume, paused
        self._hold, self._then = hold_step, then

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        if path.startswith(step_dir(self._pause) + "/") and self._resume is not None:
            resume, self._resume = self._resume, None
            if self._paused is not None:
                self._paused.set()
            assert resume.wait(10)
        return super().write(path, chunks)

    def _taken(self, path: str) -> None:
        if path == f"{step_dir(self._hold)}/{MARKER}" and self._then is not None:
            then, self._then = self._then, None
            then()

    def move(self, src: str, dst: str) -> None:
        super().move(src, dst)
        self._taken(src)

    def delete(self, prefix: str) -> None:
        super().delete(prefix)
        self._taken(prefix)


def _given_up(tmp_path: Path) -> None:
    """Step 100 recorded, step 200 committed and given up on (an aborted CHECKPOINT)."""
    ck = Checkpointer(LocalStorage(tmp_path), one_layer_plan(), 0, keep=None)
    _save(ck, 100)
    _save(ck, 200)
    ck.close()


def test_a_late_committer_leaves_a_save_of_its_step_in_persist_alone(tmp_path: Path) -> None:
    """Generation g's committer A (step 300, ``drop_steps`` [200]) runs late; generation
    g+1, relaunched from 100, saves 200 again (B). A's deletion runs while B's shards are
    written and B's commit not begun: 200's old marker is still the one A saw
    (``writer.commit`` takes it away only when it commits). Deleting 200's directory took
    B's shards: B's commit failed, waiting for parts. Only the old commit goes now."""
    _given_up(tmp_path)
    b_persisted, a_done = threading.Event(), threading.Event()

    class _B(LocalStorage):
        def write(self, path: str, chunks: Iterable[Chunk]) -> int:
            n = super().write(path, chunks)
            if path.startswith(f"{step_dir(200)}/parts/") and not b_persisted.is_set():
                b_persisted.set()
                assert a_done.wait(10)  # B commits once A has deleted
            return n

    a = Checkpointer(
        _Late(tmp_path, pause_step=300, resume=b_persisted), one_layer_plan(), 0, keep=None
    )
    b = Checkpointer(_B(tmp_path), one_layer_plan(), 0, keep=None, commit_timeout_s=5.0)
    a.save(_state(), TrainingGlobals(300, 300, {}), prune_below=100, drop_steps=[200])
    b.save(_state(), TrainingGlobals(200, 200, {}), prune_below=100, drop_steps=[300])
    ra = a.wait()
    a_done.set()
    rb = b.wait()
    a.close()
    b.close()
    assert ra is not None and ra.unrecorded_deleted == (200,)  # the old commit of 200
    assert rb is not None and rb.manifest is not None and rb.readback_error == ""
    s = LocalStorage(tmp_path)
    assert committed_steps(s) == [100, 200, 300] and verify(s, 200) == []
    # nothing of the old save of 200 is left, nor an empty directory of it
    left = {p.name for p in (tmp_path / step_dir(200)).rglob("*") if p.is_file()}
    mine = {f"layer-00000-{rb.save_id}.bin", f"{rb.save_id}-rank00000.json"}
    assert left == {MARKER, "manifest.json"} | mine


def test_a_late_committer_leaves_a_commit_made_meanwhile_alone(tmp_path: Path) -> None:
    """As above, but B's whole commit (and its read-back) runs right after A took 200's
    old marker away: B reported its save committed (the controller records it), then A
    deleted 200's directory, B's files with it. Now A deletes the old save's files only."""
    _given_up(tmp_path)
    b_result: list[object] = []

    def b_commits() -> None:
        b = Checkpointer(LocalStorage(tmp_path), one_layer_plan(), 0, keep=None)
        b_result.append(_save(b, 200, prune_below=100, drop_steps=[]))
        b.close()

    a = Checkpointer(_Late(tmp_path, hold_step=200, then=b_commits), one_layer_plan(), 0, keep=None)
    assert _save(a, 300, prune_below=100, drop_steps=[200]) == (200,)
    a.close()
    assert b_result == [()]
    s = LocalStorage(tmp_path)
    assert committed_steps(s) == [100, 200, 300] and verify(s, 200) == []


def test_a_commit_made_after_the_save_began_is_not_deleted(tmp_path: Path) -> None:
    """The commits a committer may delete are those on disk when its save began: 200
    committed (a later generation's save of a step this committer's ``drop_steps`` names)
    while this save of 300 was writing stays. Taking that listing at deletion time instead
    deleted it."""
    ck = Checkpointer(LocalStorage(tmp_path), one_layer_plan(), 0, keep=None)
    _save(ck, 100)
    ck.close()
    paused, resume = threading.Event(), threading.Event()
    a = Checkpointer(
        _Late(tmp_path, pause_step=300, resume=resume, paused=paused),
        one_layer_plan(),
        0,
        keep=None,
    )
    a.save(_state(), TrainingGlobals(300, 300, {}), prune_below=100, drop_steps=[200])
    assert paused.wait(10)  # A's save began (its first write of 300 waits)
    b = Checkpointer(LocalStorage(tmp_path), one_layer_plan(), 0, keep=None)
    _save(b, 200, prune_below=100, drop_steps=[])
    b.close()
    resume.set()
    ra = a.wait()
    a.close()
    assert ra is not None and ra.unrecorded_deleted == ()
    assert committed_steps(LocalStorage(tmp_path)) == [100, 200, 300]


def test_decide_unrecorded_keeps_what_drop_and_below_step_leave_out() -> None:
    """Pure: only steps of ``drop_steps``, never the step committed, none below
    ``below_step`` (-1 or lower: no bound)."""
    seen = [5, 10, 20, 30, 40]
    assert decide_unrecorded(seen, drop_steps=[], committed_step=50, below_step=-1) == []
    assert decide_unrecorded(seen, drop_steps=[10, 30, 99], committed_step=50, below_step=-1) == [
        10,
        30,
    ]
    every = [5, 10, 20, 30, 40, 50]
    assert decide_unrecorded(seen, drop_steps=every, committed_step=30, below_step=20) == [20, 40]
    assert decide_unrecorded(seen, drop_steps=every, committed_step=50, below_step=-7) == seen
    assert decide_unrecorded(seen, drop_steps=every, committed_step=50, below_step=41) == []
    assert decide_unrecorded([], drop_steps=every, committed_step=50, below_step=-1) == []
