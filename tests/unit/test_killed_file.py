"""The agent's record of the process groups it killed (``agent/killed_file.py``) and the
scan of a group's members (``agent/teardown.group_members``) on ids no worker's group has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor.agent.killed_file import KILLED_FILE, KilledGroup, load_killed, save_killed
from sailor.agent.teardown import boot_id, group_members


@pytest.mark.parametrize("pgid", [0, 1, -5])
def test_a_record_naming_no_workers_group_is_unreadable_not_signalled(
    tmp_path: Path, pgid: int
) -> None:
    """pgid 0 is the agent's own group (a SIGKILL to it kills the agent), 1 init's, a
    negative one none (``killpg`` raised EINVAL at every start: the agent crash-looped;
    review). The file is read as unreadable: logged and left for a look."""
    save_killed(tmp_path, [KilledGroup(4242, 0, 3, 1, 1.0)])
    data = json.loads((tmp_path / KILLED_FILE).read_text())
    assert load_killed(tmp_path) is not None
    data["groups"][0]["pgid"] = pgid
    (tmp_path / KILLED_FILE).write_text(json.dumps(data))
    assert load_killed(tmp_path) is None
    assert (tmp_path / KILLED_FILE).exists()
    assert data.get("boot_id", boot_id()) == boot_id()


def test_the_member_scan_skips_ids_no_workers_group_has() -> None:
    assert group_members([0, 1, -5]) == {}


@pytest.mark.parametrize("field", ["pgid", "rank", "step", "born_by"])
def test_an_infinite_number_in_the_record_is_unreadable_not_a_crash(
    tmp_path: Path, field: str
) -> None:
    """``Infinity`` (JSON as Python reads and writes it) in an integer field raised
    ``OverflowError`` out of ``load_killed``, which the agent's start did not survive."""
    save_killed(tmp_path, [KilledGroup(4242, 0, 3, 1, 1.0)])
    data = json.loads((tmp_path / KILLED_FILE).read_text())
    data["groups"][0][field] = float("inf")
    (tmp_path / KILLED_FILE).write_text(json.dumps(data))
    assert load_killed(tmp_path) is None
    assert (tmp_path / KILLED_FILE).exists()
