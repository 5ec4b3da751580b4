"""A worker's output file is capped: a runaway writer cannot fill the agent's disk."""

from __future__ import annotations

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
    assert (tmp_path / "r.log").read_text() == ("first\nsecond\n[sailor: log capped at 20 bytes]\n")
    assert log.capped and log.written == len("first\nsecond\n")


def test_an_unwritable_place_is_given_up(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    log = RankLog(tmp_path / "dir")  # a directory: cannot be opened for appending
    log.write(b"lost")
    log.close()
    with pytest.raises(ValueError, match="cap_bytes=0"):
        RankLog(tmp_path / "r.log", cap_bytes=0)
