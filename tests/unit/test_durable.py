"""Small files replaced durably (``sailor/durable.py``), and the callers that moved onto it.

A crash test that kills the writer (SIGKILL) would pass with every fsync removed: the page
cache survives it. So the calls that make a write durable are recorded on a real directory
(``os.fsync`` by the path its fd is open on, ``os.replace``; each passed through to the real
one) and their order checked: the temporary file fsync'd before it is renamed over the
name, the directory fsync'd after, and a directory made for the file fsync'd in its parent.
What a failure leaves is checked on the files themselves: the old content or the new, no
temporary file, nothing of another writer's removed.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import sailor.durable
from sailor.durable import fsync_dir, make_dirs_durably, remove_durably, write_durably

Event = tuple[str, str, str]
"""("fsync", path of the fd, what ``watched`` held then: '' when not watched) or
("replace", source, destination)."""


def _record(monkeypatch: pytest.MonkeyPatch, watched: Path | None = None) -> list[Event]:
    """Record every ``os.fsync`` (by the path its fd is open on) and ``os.replace`` /
    ``os.rename`` (``Path.replace`` calls ``os.replace``; both recorded as "replace"), each
    passed through to the real call; a directory's fsync also notes what ``watched`` holds
    at that moment ('-' if absent). The one recorder of the durability tests (the
    checkpoint's, ``test_checkpoint_durability.py``, too); appends from writer threads are
    atomic under the GIL."""
    events: list[Event] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd: int) -> None:
        now = ""
        if watched is not None and stat.S_ISDIR(os.fstat(fd).st_mode):
            now = watched.read_text() if watched.exists() else "-"
        events.append(("fsync", str(Path(f"/proc/self/fd/{fd}").readlink()), now))
        real_fsync(fd)

    def replace(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        real_replace(src, dst, *a, **kw)

    def rename(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    return events


def _durable(events: list[Event], final: Path) -> str:
    """Checks that ``final`` was renamed into place once, from a temporary file fsync'd
    before, and its directory fsync'd after; the content the directory's fsync saw."""
    renames = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(final)]
    assert len(renames) == 1, events
    r = renames[0]
    tmp = events[r][1]
    assert Path(tmp).parent == final.parent, tmp
    assert any(e[:2] == ("fsync", tmp) for e in events[:r]), f"temp file not fsync'd: {events}"
    after = [e for e in events[r + 1 :] if e[:2] == ("fsync", str(final.parent))]
    assert after, f"{final.parent} not fsync'd after the rename: {events}"
    return after[0][2]


def _fsync_failing(code: int, on_dirs: bool = True) -> Callable[[int], None]:
    """``os.fsync`` failing with ``code`` on a directory (``on_dirs``) or on a file."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode) == on_dirs:
            raise OSError(code, os.strerror(code))
        real(fd)

    return fsync


@pytest.fixture
def old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[Event]]:
    """``m.json`` holding "old", under ``tmp_path``'s real path (fsyncs are recorded by real
    path), and the record of the calls made from then on (:func:`_record` watching it)."""
    path = tmp_path.resolve() / "m.json"
    path.write_text("old")
    return path, _record(monkeypatch, watched=path)


def test_a_write_is_fsynced_renamed_and_its_directory_fsynced(
    old_file: tuple[Path, list[Event]],
) -> None:
    path, events = old_file
    write_durably(path, b"new")
    assert _durable(events, path) == "new"  # the directory synced with the new entry in it
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary file's fsync fails (EIO: the disk): the name keeps its old content,
    the temporary file is gone, the caller gets the ``OSError``."""
    path = tmp_path / "m.json"
    path.write_text("old")
    monkeypatch.setattr(os, "fsync", _fsync_failing(errno.EIO, on_dirs=False))
    with pytest.raises(OSError, match="Input/output error"):
        write_durably(path, b"new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_what_stands_at_the_temporary_name_is_not_removed(tmp_path: Path) -> None:
    """A directory at ``NAME.tmp`` fails the write (``IsADirectoryError``) and stays, as
    does the old file: only a temporary file this write created is cleaned up."""
    path = tmp_path / "control-0.json"
    path.write_text("{}")
    (tmp_path / "control-0.json.tmp").mkdir()
    with pytest.raises(IsADirectoryError):
        write_durably(path, b'{"stop_at_step": 5}')
    assert path.read_text() == "{}" and (tmp_path / "control-0.json.tmp").is_dir()


def test_a_writer_of_its_own_temporary_name_leaves_another_writers_alone(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rank-1.missed"
    (tmp_path / "rank-1.missed.tmp7").write_text("another writer's")
    write_durably(path, b"why", tmp_suffix=".tmp8")
    assert path.read_text() == "why"
    assert (tmp_path / "rank-1.missed.tmp7").read_text() == "another writer's"


def test_the_directories_made_are_durable_before_the_file_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make_dirs``: each directory made has its entry fsync'd in its parent, before the
    file is renamed into the last one."""
    tmp_path = tmp_path.resolve()  # fsyncs are recorded by real path
    path = tmp_path / "a" / "b" / "f"
    events = _record(monkeypatch)
    write_durably(path, b"x", make_dirs=True)
    assert path.read_bytes() == b"x"
    r = next(i for i, e in enumerate(events) if e[0] == "replace")
    before = [e[1] for e in events[:r] if e[0] == "fsync"]
    assert before.index(str(tmp_path)) < before.index(str(tmp_path / "a")), events
    _durable(events, path)


def test_without_make_dirs_a_missing_directory_fails(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_durably(tmp_path / "gone" / "f", b"x")
    assert not (tmp_path / "gone").exists()


def test_a_directory_removed_before_the_write_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step directory goes between its making and the write (another committer's
    deletion of a commit given up on removed it, emptied): made again, the write done."""
    calls: list[Path] = []
    real = make_dirs_durably

    def made_then_removed(d: Path, *sync: Any) -> None:
        calls.append(d)
        real(d, *sync)
        if len(calls) == 1:
            d.rmdir()  # the cleaner

    monkeypatch.setattr(sailor.durable, "make_dirs_durably", made_then_removed)
    path = tmp_path / "step-00000003" / "rank-0.json"
    write_durably(path, b"part", make_dirs=True)
    assert path.read_bytes() == b"part" and len(calls) == 2


def test_a_directory_fsync_error_is_raised_and_unsupported_ones_skipped_on_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO from a directory's fsync is the storage failing: raised, always. EINVAL (a file
    system that cannot fsync a directory) is raised too, unless ``skip_unsupported``."""
    monkeypatch.setattr(os, "fsync", _fsync_failing(errno.EIO))
    for skip in (False, True):
        with pytest.raises(OSError, match="Input/output error"):
            fsync_dir(tmp_path, skip_unsupported=skip)
    monkeypatch.setattr(os, "fsync", _fsync_failing(errno.EINVAL))
    with pytest.raises(OSError, match="Invalid argument"):
        fsync_dir(tmp_path)
    fsync_dir(tmp_path, skip_unsupported=True)
    with pytest.raises(OSError, match="Invalid argument"):
        write_durably(tmp_path / "f", b"x")
    assert (tmp_path / "f").read_bytes() == b"x"  # renamed; only its durability unknown


def test_fsync_dir_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        fsync_dir(tmp_path / "f", skip_unsupported=True)


def test_a_removal_is_durable_and_an_absent_file_is_no_error(
    old_file: tuple[Path, list[Event]],
) -> None:
    path, events = old_file
    remove_durably(path)
    assert not path.exists()
    assert events == [("fsync", str(path.parent), "-")]
    remove_durably(path)
    assert len(events) == 1  # nothing removed, nothing synced


# The callers, each moved onto the module: what was missing is here, each test failing on
# the code before it (the fence never synced a directory it made; the supervisor's control
# files were renamed without any fsync; the toy trainer's files without their directory's).


def test_the_epoch_fence_makes_its_run_directory_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path = tmp_path.resolve()  # fsyncs are recorded by real path
    from sailor.agent.fence import EpochFence

    path = tmp_path / "work" / "n1.epoch"
    events = _record(monkeypatch, watched=path)
    EpochFence(path).raise_to(3)
    assert json.loads(_durable(events, path)) == {"epoch": 3}
    assert ("fsync", str(tmp_path), "-") in events  # the new directory's entry


async def test_the_supervisors_control_files_are_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path = tmp_path.resolve()  # fsyncs are recorded by real path
    from sailor.agent.supervisor import Supervisor
    from sailor.agent.worker_view import WorkerView

    sup = Supervisor(tmp_path / "run")
    control = tmp_path / "run" / "control-0.json"
    control.parent.mkdir()
    sup.workers = [WorkerView(rank=0, proc=None, control=control)]  # type: ignore[arg-type]
    events = _record(monkeypatch, watched=control)
    try:
        await sup.stop_at(5)
    finally:
        sup.workers = []
        await sup.close()
    assert json.loads(_durable(events, control))["stop_at_step"] == 5


def test_the_toy_trainers_checkpoint_files_are_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-rank toy save: its part, its state and its commit marker each fsync'd before
    the rename, the step directory after it, and the new step directory's entry too."""
    tmp_path = tmp_path.resolve()  # fsyncs are recorded by real path
    from sailor.agent.toy_trainer import _save

    events = _record(monkeypatch)
    _save(str(tmp_path), 4, [0.0] * 4, rank=0, world=1, timeout=5.0, prune_below=-1)
    step = tmp_path / "sim" / "step-00000004"
    for name in ("rank-0.json", "state.json", "COMMIT"):
        _durable(events, step / name)
    assert ("fsync", str(tmp_path / "sim"), "") in events
    assert sorted(p.name for p in step.iterdir()) == ["COMMIT", "rank-0.json", "state.json"]


def _write_json(path: Path) -> None:
    from sailor.cli._io import write_json

    write_json({"a": 1}, path)


def _save_db(path: Path) -> None:
    from sailor.profiler.merge import save_db
    from sailor.schemas import ProfileDB

    save_db(ProfileDB(model="tiny-gpt"), path)


def _write_result(path: Path) -> None:
    import argparse

    from sailor.profiler.procs import write_result

    write_result(argparse.Namespace(out=str(path)), {"rank": 0})


def _preempt(path: Path) -> None:
    from tests.unit.test_demo_cluster_config import _cluster

    cluster = _cluster(path.parent)
    assert cluster.notice_file("n1") == path
    cluster.preempt("n1", 30.0)


@pytest.mark.parametrize(
    "write,name,want",
    [
        (_write_json, "out/plan.json", {"a": 1}),
        (_save_db, "profiles/tiny.json", {"model": "tiny-gpt"}),
        (_write_result, "out-0.json", {"rank": 0}),
        (_preempt, "preempt-n1", {"in_s": 30.0}),
    ],
    ids=["cli-write-json", "profile-db", "rank-result", "demo-notice"],
)
def test_the_small_files_of_the_cli_profiler_and_demo_are_durable(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    write: Callable[[Path], None],
    name: str,
    want: dict[str, object],
) -> None:
    """The CLI's outputs, the profile database, a profiling rank's result and the demo's
    preemption notice: each was renamed into place without any fsync (a power loss could
    leave the name empty), and the CLI's and the database's new directories unsynced."""
    tmp_path = tmp_path.resolve()  # fsyncs are recorded by real path
    path = tmp_path / name
    events = _record(monkeypatch, watched=path)
    write(path)
    assert json.loads(_durable(events, path)).items() >= want.items()
    if path.parent != tmp_path:  # a directory the write made
        assert ("fsync", str(tmp_path), "-") in events
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_the_cli_output_errors_are_worded_as_before(tmp_path: Path) -> None:
    """``write_json`` on the durable writer: a directory is refused by name, a write that
    fails is ``cannot write`` with the system's reason, and nothing is left beside the
    name; an existing output is replaced whole."""
    from sailor.cli._io import write_json
    from sailor.cli.errors import CliError

    with pytest.raises(CliError) as info:
        write_json({"a": 1}, tmp_path)
    assert info.value.message == f"{tmp_path}: is a directory: give a file name"
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CliError) as info:
        write_json({"a": 1}, blocker / "out.json")
    assert info.value.message == f"{blocker / 'out.json'}: cannot write (File exists)"
    (tmp_path / "dir.json.tmp").mkdir()  # what stands at the temporary name stays
    with pytest.raises(CliError) as info:
        write_json({"a": 1}, tmp_path / "dir.json")
    assert info.value.message == f"{tmp_path / 'dir.json'}: cannot write (Is a directory)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.json.tmp", "file"]
    out = tmp_path / "out.json"
    out.write_text('{"old": true, "longer": "than the new content"}')
    write_json({"a": 1}, out)
    assert out.read_text() == '{\n  "a": 1\n}\n'


def test_unsupported_directory_syncs_are_skipped_on_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``skip_unsupported``: on a file system that cannot fsync a directory (EINVAL) the write
    and the directories it makes succeed, as a command's output there did before it was
    durable (``write_json``, ``save_db``); EIO still fails it, and the file's own fsync is
    never skipped."""
    from sailor.cli._io import write_json
    from sailor.profiler.merge import save_db
    from sailor.schemas import ProfileDB

    monkeypatch.setattr(os, "fsync", _fsync_failing(errno.EINVAL))
    write_json({"a": 1}, tmp_path / "out" / "plan.json")
    assert json.loads((tmp_path / "out" / "plan.json").read_text()) == {"a": 1}
    save_db(ProfileDB(model="tiny-gpt"), tmp_path / "db" / "tiny.json")
    assert json.loads((tmp_path / "db" / "tiny.json").read_text())["model"] == "tiny-gpt"
    write_durably(tmp_path / "a" / "f", b"x", make_dirs=True, skip_unsupported=True)
    assert (tmp_path / "a" / "f").read_bytes() == b"x"
    monkeypatch.setattr(os, "fsync", _fsync_failing(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        write_durably(tmp_path / "g", b"x", skip_unsupported=True)
    monkeypatch.setattr(os, "fsync", _fsync_failing(errno.EINVAL, on_dirs=False))
    with pytest.raises(OSError, match="Invalid argument"):
        write_durably(tmp_path / "h", b"x", skip_unsupported=True)
    assert not (tmp_path / "h").exists()
