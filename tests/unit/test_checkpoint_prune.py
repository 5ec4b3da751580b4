"""A committer's pruning below ``prune_below`` (``checkpoint/prune.py``) on a real local
directory: what was there when its save began goes, a save made below that step since
(a run that fell back below it, under a committer running late) stays."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

import pytest

from sailor.checkpoint import LocalStorage, TrainingGlobals, committed_steps, verify
from sailor.checkpoint.checkpointer import Checkpointer
from sailor.checkpoint.format import MARKER, step_dir
from sailor.checkpoint.prune import apply_seen_prune, seen_below, take_if
from sailor.checkpoint.storage import Chunk
from sailor.checkpoint.writer import commit, persist_layers
from tests.unit.test_checkpoint_blocks import one_layer_plan
from tests.unit.test_checkpoint_unrecorded import _save, _state


class _Slow(LocalStorage):
    """The late committer's view: its first write of ``step`` waits for ``resume``."""

    def __init__(self, root: Path, step: int, began: threading.Event, resume: threading.Event):
        super().__init__(root)
        self._step, self._began, self._resume = step, began, resume
        self._done = False

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        if path.startswith(step_dir(self._step) + "/") and not self._done:
            self._done = True
            self._began.set()
            assert self._resume.wait(10)
        return super().write(path, chunks)


def test_a_late_committers_prune_leaves_a_fallback_runs_saves_below_it(tmp_path: Path) -> None:
    """Step 100 committed; generation g's committer A saves 300 with ``prune_below`` 200
    and runs late. Meanwhile every record at or above 200 was marked unreadable and the
    job fell back below it: it commits 150 and is writing 160 when A prunes. Deleting every
    step directory below 200, A took 150's commit (recorded) and 160's shards (its commit
    then failed). Only 100, there when A's save began, goes now."""
    s = LocalStorage(tmp_path)
    ck = Checkpointer(s, one_layer_plan(), 0, keep=None)
    _save(ck, 100)
    ck.close()
    began, resume = threading.Event(), threading.Event()
    a = Checkpointer(_Slow(tmp_path, 300, began, resume), one_layer_plan(), 0, keep=None)
    a.save(_state(), TrainingGlobals(300, 300, {}), prune_below=200)
    assert began.wait(10)
    fallback = Checkpointer(s, one_layer_plan(), 0, keep=None)
    _save(fallback, 150)
    fallback.close()
    persist_layers(s, 160, "inflight", {0: {"w": _state()["0.w"]}})
    resume.set()
    ra = a.wait()
    a.close()
    assert ra is not None and ra.retention_error == "" and ra.readback_error == ""
    assert not (tmp_path / step_dir(100)).exists()
    commit(
        s,
        step=160,
        save_id="inflight",
        writer_ranks=[0],
        globals_=TrainingGlobals(160, 160, {}),
        model="toy",
        num_layers=1,
        timeout_s=2.0,
    )
    assert committed_steps(s) == [150, 160, 300]
    assert verify(s, 150) == [] and verify(s, 160) == []


def test_seen_prune_leaves_a_step_committed_again_and_new_files(tmp_path: Path) -> None:
    """Pruning by a listing: a step whose marker changed since is left whole, a file added
    to a listed directory stays (the directory with it), a directory listed goes whole
    when nothing was added, nothing at all once cancelled."""
    s = LocalStorage(tmp_path)
    ck = Checkpointer(s, one_layer_plan(), 0, keep=None)
    for step in (10, 20, 30, 40):
        _save(ck, step)
    ck.close()
    persist_layers(s, 35, "crashed", {0: {"w": _state()["0.w"]}})  # debris, uncommitted
    seen = seen_below(s, 40)
    assert sorted(seen) == [10, 20, 30, 35] and seen[35].marker is None
    assert seen_below(s, 0) == {}
    (tmp_path / step_dir(20) / MARKER).write_bytes(b"committed again")
    s.write(f"{step_dir(30)}/layer-00000-later.bin", [b"x"])
    assert apply_seen_prune(s, seen, below_step=40, committed_step=40, cancelled=lambda: True) == []
    gone = apply_seen_prune(s, seen, below_step=40, committed_step=40)
    assert gone == [f"{step_dir(10)}/", f"{step_dir(30)}/", f"{step_dir(35)}/"]
    assert not (tmp_path / step_dir(10)).exists() and not (tmp_path / step_dir(35)).exists()
    assert s.walk(step_dir(30)) == [f"{step_dir(30)}/layer-00000-later.bin"]
    assert (tmp_path / step_dir(20) / MARKER).read_bytes() == b"committed again"
    with pytest.raises(ValueError, match="below_step=50"):
        apply_seen_prune(s, seen, below_step=50, committed_step=40)


def test_take_if_deletes_only_what_it_judges_ours(tmp_path: Path) -> None:
    s = LocalStorage(tmp_path)
    s.write("d/obj", [b"mine"])
    assert not take_if(s, "d/obj", lambda now: now == b"other")
    assert s.read("d/obj") == b"mine" and s.walk("d") == ["d/obj"]  # put back, nothing left
    assert take_if(s, "d/obj", lambda now: now == b"mine") and s.walk("d") == []
    assert not take_if(s, "d/obj", lambda now: True)  # absent
