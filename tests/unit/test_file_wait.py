"""``FileWait``: a wait that a rename over the file or a signal ends at once, and nothing else
before its recheck (``sailor.megatron_patch.file_wait``). Real files, real signals."""

from __future__ import annotations

import os
import signal
import struct
import sys
import threading
import time
from pathlib import Path

import pytest

from sailor.megatron_patch.file_wait import FileWait, concerns, ended

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify")


def _later(s: float, act: object) -> threading.Timer:
    t = threading.Timer(s, act)  # type: ignore[arg-type]
    t.start()
    return t


def _timed_wait(w: FileWait, timeout_s: float) -> float:
    t = time.monotonic()
    w.wait(timeout_s)
    return time.monotonic() - t


def test_a_rename_over_the_file_ends_the_wait(tmp_path: Path) -> None:
    control = tmp_path / "control.json"
    control.write_text("{}")
    tmp = tmp_path / "control.json.tmp"

    def write() -> None:
        tmp.write_text('{"relayout": {}}')
        tmp.replace(control)

    with FileWait(control, poll_s=0.02, recheck_s=10.0) as w:
        assert w.blocking
        timer = _later(0.2, write)
        took = _timed_wait(w, 10.0)
        timer.join()
    assert 0.15 < took < 2.0, took


def test_other_files_do_not_end_it_and_the_recheck_does(tmp_path: Path) -> None:
    """Progress and log files beside the control file do not wake the waiter; the recheck
    bounds the wait whatever happens (an event missed costs at most that)."""
    control = tmp_path / "control.json"
    control.write_text("{}")
    other = tmp_path / "progress-0.jsonl"

    def chatter() -> None:
        for _ in range(5):
            other.write_text("x")
            time.sleep(0.02)

    with FileWait(control, poll_s=0.02, recheck_s=0.5) as w:
        timer = _later(0.05, chatter)
        took = _timed_wait(w, 10.0)
        timer.join()
    assert 0.45 < took < 2.0, took


def test_a_signal_ends_the_wait() -> None:
    """A handler that only sets a flag (the worker's SIGTERM while it waits) is seen at once,
    not at the next recheck: Python retries an interrupted select on its own."""
    got: list[int] = []
    old = signal.signal(signal.SIGUSR2, lambda sig, _f: got.append(sig))
    try:
        with FileWait(Path("/tmp") / f"no-such-{os.getpid()}", 0.02, recheck_s=10.0) as w:
            assert w.blocking  # not the 20 ms poll, which would pass the bound below too
            timer = _later(0.2, lambda: os.kill(os.getpid(), signal.SIGUSR2))
            took = _timed_wait(w, 10.0)
            timer.join()
    finally:
        signal.signal(signal.SIGUSR2, old)
    assert got == [signal.SIGUSR2] and 0.15 < took < 2.0, took


def test_events_of_other_watches_and_names_are_not_this_files() -> None:
    def event(wd: int, mask: int, name: bytes) -> bytes:
        padded = name + b"\0" * (16 - len(name))
        return struct.pack("iIII", wd, mask, 0, len(padded)) + padded

    moved_to, close_write, ignored, overflow = 0x80, 0x8, 0x8000, 0x4000
    assert concerns(event(3, moved_to, b"control.json"), 3, b"control.json")
    assert concerns(
        event(3, close_write, b"x") + event(3, moved_to, b"control.json"), 3, b"control.json"
    )
    assert not concerns(event(3, close_write, b"control.json.tmp"), 3, b"control.json")
    assert not concerns(event(2, moved_to, b"control.json"), 3, b"control.json")  # an old watch
    assert not concerns(event(2, ignored, b""), 3, b"control.json")
    assert concerns(event(3, ignored, b""), 3, b"control.json")  # this watch is gone
    assert concerns(event(-1, overflow, b""), 3, b"control.json")
    assert not concerns(b"", 3, b"control.json")
    assert ended(event(3, ignored, b""), 3) and not ended(event(2, ignored, b""), 3)
    assert not ended(event(3, moved_to, b"control.json"), 3)


def test_a_waiter_with_more_than_1024_open_files_still_waits(tmp_path: Path) -> None:
    """``select`` refuses an fd numbered 1024 or above (a held rank of a long job holds that
    many: sockets, shared memory, data loaders): the wait raised and the rank died."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit of open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        control = tmp_path / "control.json"
        control.write_text("{}")

        def write() -> None:
            (tmp_path / "c.tmp").write_text("1")
            (tmp_path / "c.tmp").replace(control)

        with FileWait(control, poll_s=0.02, recheck_s=10.0) as w:
            assert w.blocking
            timer = _later(0.2, write)
            took = _timed_wait(w, 10.0)
            timer.join()
        assert 0.15 < took < 2.0, took
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_directory_made_anew_is_watched_again(tmp_path: Path) -> None:
    """The agent's generation directory removed and made again: its watch ended with it and
    every later directive waited for the recheck (1 s); now the wait watches the new one."""
    import shutil

    gen = tmp_path / "gen"
    gen.mkdir()
    control = gen / "control.json"
    control.write_text("{}")
    with FileWait(control, poll_s=0.02, recheck_s=10.0) as w:
        timer = _later(0.2, lambda: shutil.rmtree(gen))
        took = _timed_wait(w, 10.0)  # the directory went: look now
        timer.join()
        assert took < 2.0, took
        gen.mkdir()

        def write() -> None:
            (gen / "c.tmp").write_text("{}")
            (gen / "c.tmp").replace(control)

        timer = _later(0.2, write)
        took = _timed_wait(w, 10.0)
        timer.join()
        assert w.blocking and 0.15 < took < 2.0, took
