"""The teardown verdict on killed workers' processes, the record of one that outlives
SIGKILL, and the process-group probe on real groups: a process whose main thread ended
while another runs on, and a group id that another session may have taken since."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from sailor.agent.teardown import GONE_STATES, Teardown, boot_ticks, group_members, teardown_verdict
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


def _leader_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_process_whose_main_thread_ended_is_not_a_zombie() -> None:
    """/proc/<pid>/stat shows the leader thread's state: Z once the main thread has ended,
    though another thread runs on (and the process holds its memory). The probe reported
    it as Z, which counts as gone; it reads the threads' states now."""
    code = (
        "import ctypes, threading, time\n"
        "threading.Thread(target=lambda: time.sleep(30)).start()\n"
        "time.sleep(0.2)\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while _leader_state(p.pid) != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        state = group_members([p.pid])[p.pid][p.pid]
        assert state not in GONE_STATES and teardown_verdict({p.pid: state}, 0, 1) is WAIT
    finally:
        p.kill()
        p.wait()


def test_members_started_after_the_kill_are_another_sessions() -> None:
    """A group probed long after its SIGKILL may have an id another session took since (its
    leader got the pid and called setsid): members started after ``born_by`` are not ours,
    and a group of such members only is left out."""
    before = boot_ticks()
    time.sleep(0.05)  # a clock tick (10 ms) and more
    p = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while p.pid not in group_members([p.pid]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.05)
        assert group_members([p.pid], {p.pid: before}) == {}
        assert list(group_members([p.pid], {p.pid: boot_ticks()})) == [p.pid]
    finally:
        p.kill()
        p.wait()
