"""The teardown verdict on killed workers' processes, the record of one that outlives
SIGKILL, and the process-group probe on a real group."""

from __future__ import annotations

import subprocess
import time

import pytest

from sailor.agent.teardown import Teardown, group_members, teardown_verdict
from sailor.megatron_patch.errors import outlived_kill_record

GONE, WAIT, STUCK = Teardown.GONE, Teardown.WAIT, Teardown.STUCK


@pytest.mark.parametrize(
    ("states", "elapsed", "bound", "expected"),
    [
        ({}, 0.0, 120.0, GONE),  # nothing left
        ({}, 500.0, 120.0, GONE),
        ({7: "Z", 8: "X"}, 0.0, 120.0, GONE),  # zombies hold nothing: not ours to reap
        ({7: "D"}, 5.0, 120.0, WAIT),  # in the driver's teardown, within the bound
        ({7: "S", 8: "Z"}, 119.9, 120.0, WAIT),
        ({7: ""}, 1.0, 120.0, WAIT),  # state unreadable: counted as there
        ({7: "D"}, 120.0, 120.0, STUCK),
        ({7: "Z", 8: "R"}, 130.0, 120.0, STUCK),
        ({7: "S"}, 0.0, 0.0, STUCK),  # a bound of 0: one look
    ],
)
def test_verdict(states: dict[int, str], elapsed: float, bound: float, expected: Teardown) -> None:
    assert teardown_verdict(states, elapsed, bound) is expected


def test_the_record_names_the_first_process_and_asks_for_no_retry() -> None:
    rec = outlived_kill_record([(41, 3, "D"), (42, 3, "S")], 120.04, step=17)
    assert (rec["pid"], rec["rank"], rec["state"], rec["step"]) == (41, 3, "D", 17)
    assert rec["retry"] is False and rec["origin"] == "local"
    assert rec["seconds"] == 120.0 and len(rec["processes"]) == 2
    assert "process 41 (state D: uninterruptible sleep" in rec["message"]
    assert "and 1 more process(es) outlived SIGKILL for 120 s" in rec["message"]
    assert "state ?: state unreadable" in outlived_kill_record([(5, 0, "")], 1.0)["message"]
    with pytest.raises(ValueError, match="processes is empty"):
        outlived_kill_record([], 1.0)


def test_group_members_of_a_real_group() -> None:
    p = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while group_members([p.pid]).get(p.pid, {}).get(p.pid) not in ("S", "R"):
            assert time.monotonic() < deadline, group_members([p.pid])
            time.sleep(0.01)
        assert list(group_members([p.pid, 1 << 22])) == [p.pid]  # an unused pgid: left out
    finally:
        p.kill()
        p.wait()
    assert group_members([p.pid]) == {}
