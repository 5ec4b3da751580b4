"""A worker's output file is capped: a runaway writer cannot fill the agent's disk; and a
file that does not answer never blocks the writer (the agent's event loop)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from sailor.agent.rank_log import RankLog


def test_lines_are_kept_until_the_cap_then_one_marker(tmp_path: Path) -> None:
    log = RankLog(tmp_path / "r.log", cap_bytes=20)
    log.write(b"first")
    log.write(b"second\n")
    log.write(b"third line that does not fit")
    log.write(b"x")  # nothing more once capped
    log.close()
    log.write(b"after close")
    assert log.wait_closed(5.0)
    assert (tmp_path / "r.log").read_text() == ("first\nsecond\n[sailor: log capped at 20 bytes]\n")
    assert log.capped and log.written == len("first\nsecond\n")


def test_an_unwritable_place_is_given_up(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    log = RankLog(tmp_path / "dir")  # a directory: cannot be opened for appending
    log.write(b"lost")
    log.close()
    with pytest.raises(ValueError, match="cap_bytes=0"):
        RankLog(tmp_path / "r.log", cap_bytes=0)


def test_a_file_that_does_not_answer_never_blocks_the_writer(tmp_path: Path) -> None:
    """The log's file is a FIFO nobody reads: opening it for writing blocks in the kernel,
    as a file on a hard-mounted NFS whose server went away does. Writes return at once
    (before, the first one blocked the agent's event loop for as long as the open did);
    past the pending cap lines are dropped, counted, and said so once the file answers (by
    the close here: no line comes after them)."""
    fifo = tmp_path / "hung.log"
    os.mkfifo(fifo)
    log = RankLog(fifo, pending_cap_bytes=100)
    t0 = time.monotonic()
    for i in range(50):
        log.write(b"line %02d" % i)  # 8 bytes each: 12 fit under the pending cap
    assert log.dropped == 8 * (50 - 12)
    log.close()
    assert time.monotonic() - t0 < 0.5
    assert not log.wait_closed(0.2)  # its thread is still stuck in the open

    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()  # the file system answers: what was queued is written
    assert log.wait_closed(5.0)
    reader.join(5.0)
    text = got[0].decode()
    assert text.startswith("line 00\n") and "line 11\n" in text and "line 12" not in text
    # no line came after the drops: the close says so (before: the file ended at line 11)
    assert text.endswith("line 11\n[sailor: 304 bytes not kept: the log file did not keep up]\n")


def test_lines_dropped_while_the_file_lagged_are_counted_in_it(tmp_path: Path) -> None:
    """A line that comes once the queue drained again is preceded by the count of what was
    dropped meanwhile."""
    fifo = tmp_path / "slow.log"
    os.mkfifo(fifo)
    log = RankLog(fifo, pending_cap_bytes=16)
    log.write(b"aaaaaaa")
    log.write(b"bbbbbbb")
    log.write(b"ccccccc")  # dropped: 24 > 16
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    deadline = time.monotonic() + 5.0
    while log._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    log.write(b"ddddddd")
    log.close()
    assert log.wait_closed(5.0)
    reader.join(5.0)
    assert got[0].decode() == (
        "aaaaaaa\nbbbbbbb\n[sailor: 8 bytes not kept: the log file did not keep up]\nddddddd\n"
    )
