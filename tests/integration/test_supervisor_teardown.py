"""Killed workers are gone before anything starts on their GPUs.

A worker runs in a process group of its own with whatever it started (data loader workers,
compile subprocesses). Before, the supervisor waited for the group leader alone, and only
``kill_grace_s`` after SIGKILL; a rank still in the GPU driver's teardown then (state ``D``,
after an NCCL hang or an XID error) held its GPU while the next generation started on it and
failed with out-of-memory or hung, and nothing said why. Now every process of the group must
be gone, within ``teardown_timeout_s`` after SIGKILL, before a rank or a spare starts; one
still there past it is the node's failure (retry false) and no rank starts on top of it.
A process that outlived the bound is probed again at each launch and abort and every
``recheck_s``: once it is gone the failure goes and the spares come back. Held workers an
in-place launch has no rank for are killed after the launch, not inside it, and their end is
not the new generation's failure. A restarted agent's supervisor finds the groups its
predecessor killed and did not see go (``killed.json``).
Real worker processes throughout (a worker whose main thread ended while another runs on
among them); only a process that outlives SIGKILL is simulated (the probe's answer), as none
can on this machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sailor.agent.killed_groups import KILLED_FILE, TEARDOWN_TIMEOUT_S, WorkerTeardownError
from sailor.agent.supervisor import Supervisor
from sailor.agent.teardown import GONE_STATES, boot_ticks, group_members
from sailor.agent.worker_view import WorkerView
from sailor.schemas.commands import Launch
from tests.integration.test_worker_signals import PLAN, launch_of

# A worker with a second member in its process group: a child that ignores SIGTERM (only the
# group's SIGKILL ends it). It names the child in {run_dir}/child.pid before "ready".
# No braces in these scripts: the supervisor formats the argv.
WITH_STUBBORN_CHILD = """
import json, subprocess, sys, time
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + (
    "print(1, flush=True); time.sleep(60)"
)
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
child.stdout.readline()  # its handler is set
with open(sys.argv[1] + "/child.pid", "w") as f:
    f.write(str(child.pid) + "\\n")
print(json.dumps(dict(event="ready", rank=0)), flush=True)
time.sleep(60)
"""

_STUBBORN_ARGV = (sys.executable, "-c", WITH_STUBBORN_CHILD, "{run_dir}")

# A worker whose child dies at SIGTERM as it does (a data loader worker, say).
_WITH_CHILD = """
import json, subprocess, sys, time
child = subprocess.Popen(["sleep", "60"])
with open(sys.argv[1] + "/child.pid", "w") as f:
    f.write(str(child.pid) + "\\n")
print(json.dumps(dict(event="ready", rank=0)), flush=True)
time.sleep(60)
"""

# Started next: appends the state of the process named in argv[1] ("gone" if none) to
# argv[2], as it finds it at its own start.
_CHECKER = """
import sys, time
pid = int(open(sys.argv[1]).read())
try:
    state = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[0]
except OSError:
    state = "gone"
with open(sys.argv[2], "a") as f:
    f.write(state + "\\n")
time.sleep(60)
"""


# A worker whose main thread ends while another thread runs on: /proc/<pid>/stat reads Z
# (the leader thread's state), yet the process is there, cannot be reaped and holds its
# memory (a CUDA rank's driver-teardown thread, say). It ignores SIGTERM.
_MAIN_THREAD_ENDS = (
    "import ctypes, signal, threading, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "threading.Thread(target=lambda: time.sleep(60)).start(); time.sleep(0.3); "
    "ctypes.CDLL(None).pthread_exit(None)"
)

SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)")


def launch_gen(n: int) -> Launch:
    return launch_of(PLAN).model_copy(update={"generation": n, "command_id": f"c{n}"})


def _in_place(n: int) -> Launch:
    return launch_gen(n).model_copy(update={"in_place": True})


Probe = Callable[..., dict[int, dict[int, str]]]


def _in_driver(stuck: Callable[[int], bool]) -> Probe:
    """The real probe, but a group for which ``stuck(pgid)`` says so has its leader still
    there in state D (in the GPU driver's teardown)."""

    def probe(pgids: list[int], born_by: dict[int, int] | None = None) -> dict[int, dict[int, str]]:
        found = group_members(pgids, born_by) if born_by else group_members(pgids)
        for pgid in pgids:
            if stuck(pgid):
                found.setdefault(pgid, {})[pgid] = "D"
        return found

    return probe


def _stat(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


async def _holding(sup: Supervisor, tmp: Path, argvs: list[tuple[str, ...]]) -> list[WorkerView]:
    """Generation 1's workers, one per argv (rank = index), holding after an in-place stop:
    real processes, started as the supervisor starts workers."""
    held = []
    for rank, argv in enumerate(argvs):
        w = await sup._spawn(rank, argv, tmp, 1)
        w.held, w.control = True, tmp / f"directive-{rank}.json"
        held.append(w)
    sup.workers, sup.in_place = list(held), True
    return held


def kill_known(pid: int) -> None:
    """SIGKILL a test's process by its pid, once known: never -1 (``kill(-1)`` signals
    every process we may, the whole machine as root) nor 0 (our own group)."""
    if pid > 0:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.02)


def _written(path: Path) -> bool:
    """A line written by another process is whole: the file exists from its open, before
    its write (a reader that waited for it alone read it empty)."""
    return path.exists() and path.read_text().endswith("\n")


def _gone(state: str) -> bool:
    return state == "gone" or state in GONE_STATES


def _group_gone(pgid: int) -> bool:
    """No process of ``pgid`` holds anything (zombies aside: init reaps those, late here)."""
    members = group_members([pgid]).get(pgid, {})
    return all(s in GONE_STATES for s in members.values())


async def _started_with_child(sup: Supervisor, gen_dir: Path) -> tuple[int, int]:
    """The first generation's worker is ready: its pid and its child's."""
    await sup.launch(launch_gen(1))
    await until(lambda: bool(sup.workers) and sup.workers[0].started)
    return sup.workers[0].proc.pid, int((gen_dir / "child.pid").read_text())


async def test_a_launch_starts_only_once_the_killed_workers_group_is_gone(
    tmp_path: Path,
) -> None:
    """The worker leaves at SIGTERM, its child does not: the abort SIGKILLs the group after
    the grace period and returns once both are gone; the next generation's worker finds the
    child gone. Before, the abort returned when the leader exited and the child lived on."""
    sup = Supervisor(tmp_path, worker_argv=_STUBBORN_ARGV)
    sup.kill_grace_s = 0.5
    child = -1
    try:
        leader, child = await _started_with_child(sup, tmp_path / "gen-00001")
        t0 = time.monotonic()
        await sup.abort()
        took = time.monotonic() - t0
        assert _group_gone(leader), group_members([leader])
        assert took >= sup.kill_grace_s  # the child needed the group's SIGKILL
        assert sup.failure == ""

        seen = tmp_path / "seen.txt"
        child_file = tmp_path / "gen-00001" / "child.pid"
        sup.worker_argv = (sys.executable, "-c", _CHECKER, str(child_file), str(seen))
        await sup.launch(launch_gen(2))
        await until(lambda: _written(seen))
        states = seen.read_text().split()
        assert len(states) == 1 and _gone(states[0]), states
    finally:
        await sup.close()
        kill_known(child)  # the old code left it behind


async def test_a_spare_asked_for_during_an_abort_starts_after_the_teardown(
    tmp_path: Path,
) -> None:
    """A spare top-up (a spare that left, a generation that came up) runs beside an abort
    of the agent's command: it starts its spare only once the killed group is gone."""
    sup = Supervisor(tmp_path, worker_argv=_STUBBORN_ARGV)
    sup.kill_grace_s = 0.5
    child = -1
    try:
        leader, child = await _started_with_child(sup, tmp_path / "gen-00001")
        seen = tmp_path / "seen.txt"
        child_file = tmp_path / "gen-00001" / "child.pid"
        sup.worker_argv = (sys.executable, "-c", _CHECKER, str(child_file), str(seen))
        sup.warm_spares = 1
        await asyncio.gather(sup.abort(), sup.top_up_spares())
        assert len(sup.spares) == 1
        await until(lambda: _written(seen))
        states = seen.read_text().split()
        assert len(states) == 1 and _gone(states[0]), states
        assert _group_gone(leader)
    finally:
        await sup.close()
        kill_known(child)


async def test_a_process_outliving_sigkill_past_the_bound_fails_the_node(tmp_path: Path) -> None:
    """No process survives SIGKILL on this machine (no GPU driver to sleep in), so the probe
    is wrapped to report the killed worker's pid still there in state 'D' (what a rank in the
    driver's teardown shows); the worker itself is real and dies. Past ``teardown_timeout_s``
    the supervisor reports the failure record (retry false: no restart here frees that GPU),
    the launch is refused and starts nothing, nor does a spare; the failure outlives an
    abort. Once the probe finds the process gone, the node takes ranks again."""
    sup = Supervisor(
        tmp_path,
        worker_argv=(sys.executable, "-c", "import time; time.sleep(60)"),
        teardown_timeout_s=1.0,
    )
    sup.kill_grace_s = 0.3
    in_driver = [True]
    sup.killed_groups.probe = _in_driver(lambda pgid: in_driver[0])
    try:
        await sup.launch(launch_gen(1))
        pid = sup.workers[0].proc.pid
        marker = tmp_path / "started"
        sup.worker_argv = (
            sys.executable,
            "-c",
            "import sys, time; open(sys.argv[1], 'a').close(); time.sleep(60)",
            str(marker),
        )
        t0 = time.monotonic()
        with pytest.raises(WorkerTeardownError):
            await sup.launch(launch_gen(2))
        assert time.monotonic() - t0 >= sup.kill_grace_s + sup.killed_groups.teardown_timeout_s
        record = json.loads(sup.failure)
        assert record["retry"] is False and record["origin"] == "local", record
        assert (record["pid"], record["rank"], record["state"]) == (pid, 0, "D"), record
        assert record["seconds"] >= sup.killed_groups.teardown_timeout_s
        assert f"process {pid} (state D" in record["message"], record["message"]
        assert sup.state == "failed" and sup.workers == []

        sup.warm_spares = 1
        await sup.top_up_spares()
        assert sup.spares == []
        await sup.abort()
        assert json.loads(sup.failure) == record  # still reported: the GPU is still taken
        await asyncio.sleep(0.3)
        assert not marker.exists()

        in_driver[0] = False  # the driver's teardown ended
        await sup.launch(launch_gen(3))
        await until(marker.exists)
        assert sup.failure == "" and len(sup.workers) == 1
    finally:
        in_driver[0] = False
        await sup.close()


async def test_a_worker_that_exits_at_sigterm_is_not_delayed(tmp_path: Path) -> None:
    """The common case: the worker and its child go at SIGTERM. The abort returns at once,
    well inside the grace period (the child, an orphaned zombie until init reaps it, holds
    nothing and is not waited for). A regression guard for the fast path: it passed before
    the teardown wait too, and must go on passing."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _WITH_CHILD, "{run_dir}"))
    assert sup.kill_grace_s == 3.0
    child = -1
    try:
        leader, child = await _started_with_child(sup, tmp_path / "gen-00001")
        t0 = time.monotonic()
        await sup.abort()
        took = time.monotonic() - t0
        assert took < sup.kill_grace_s / 3, took  # measured: under 0.1 s
        assert _group_gone(leader)
    finally:
        await sup.close()
        kill_known(child)


async def test_a_worker_whose_main_thread_ended_is_still_killed_and_waited_for(
    tmp_path: Path,
) -> None:
    """Its leader reads Z in /proc/<pid>/stat, which counted as gone: the abort returned at
    once, sent no SIGKILL and left the process running (another thread of it lived on, as
    a rank's in the GPU driver would). Now the worker is there until reaped, and a Z
    member is looked at thread by thread: it gets the SIGKILL after the grace period and
    the abort returns once it is reaped."""
    sup = Supervisor(tmp_path, worker_argv=(sys.executable, "-c", _MAIN_THREAD_ENDS))
    sup.kill_grace_s = 0.5
    pid = -1
    try:
        await sup.launch(launch_gen(1))
        proc = sup.workers[0].proc
        pid = proc.pid
        await until(lambda: _stat(pid) == "Z")  # its main thread has ended
        assert group_members([pid])[pid][pid] not in GONE_STATES  # another thread runs
        t0 = time.monotonic()
        await sup.abort()
        assert time.monotonic() - t0 >= sup.kill_grace_s  # SIGTERM ignored: SIGKILL needed
        assert proc.returncode == -signal.SIGKILL
        assert _stat(pid) == "gone" and sup.failure == ""
    finally:
        await sup.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the old code left it running


async def test_the_failure_goes_with_the_process_at_the_next_abort(tmp_path: Path) -> None:
    """After an OutlivedKill a node gets Aborts only (the controller launches nothing on a
    node that reports a failure). Before, only a Launch probed the process again, so the
    node reported the failure forever after the process went; now an abort does."""
    sup = Supervisor(tmp_path, worker_argv=SLEEPER, teardown_timeout_s=0.5)
    sup.kill_grace_s = 0.3
    in_driver = [True]
    sup.killed_groups.probe = _in_driver(lambda pgid: in_driver[0])
    try:
        await sup.launch(launch_gen(1))
        await sup.abort()
        assert sup.state == "failed" and json.loads(sup.failure)["error_type"] == "OutlivedKill"
        await sup.abort()
        assert sup.state == "failed"  # still there: still the failure
        in_driver[0] = False
        await sup.abort()
        assert (sup.state, sup.failure) == ("idle", "")
        assert not (tmp_path / KILLED_FILE).exists()
    finally:
        in_driver[0] = False
        await sup.close()


async def test_the_failure_goes_with_the_process_without_any_command(tmp_path: Path) -> None:
    """Nor does a node wait for a command: the process is probed every ``recheck_s``; once
    it is gone the node reports idle and its spares are started again (they were not while
    it held its GPU)."""
    sup = Supervisor(tmp_path, worker_argv=SLEEPER, warm_spares=1, teardown_timeout_s=0.5)
    sup.kill_grace_s = 0.3
    sup.killed_groups.recheck_s = 0.1
    in_driver = [True]
    sup.killed_groups.probe = _in_driver(lambda pgid: in_driver[0])
    try:
        await sup.launch(launch_gen(1))
        await sup.abort()  # the spare (none yet: the worker never reported ready) is refused
        await sup.top_up_spares()
        assert sup.state == "failed" and sup.spares == []
        in_driver[0] = False
        await until(lambda: sup.state == "idle" and len(sup.spares) == 1, timeout=5.0)
        assert sup.failure == ""
    finally:
        in_driver[0] = False
        await sup.close()


async def test_held_workers_a_layout_leaves_out_are_killed_after_the_launch(
    tmp_path: Path,
) -> None:
    """An in-place launch gives rank 0 to held worker 0; held worker 1 is left over. It
    outlives SIGKILL (simulated): before, the launch (and so its ack) waited for it up to
    the teardown bound and then failed the new generation with retry false. Now the launch
    returns at once and the new generation is not failed; the leftover holds up the next
    launch, which is refused with it as the node's failure, until it is gone."""
    sup = Supervisor(tmp_path, worker_argv=SLEEPER, teardown_timeout_s=0.5)
    sup.kill_grace_s = 0.3
    in_driver = [True]
    try:
        w0, w1 = await _holding(sup, tmp_path, [SLEEPER, SLEEPER])
        sup.killed_groups.probe = _in_driver(lambda pgid: in_driver[0] and pgid == w1.proc.pid)
        t0 = time.monotonic()
        await sup.launch(_in_place(2))
        assert time.monotonic() - t0 < sup.kill_grace_s
        assert sup.workers == [w0] and sup.failure == ""
        await asyncio.sleep(sup.kill_grace_s + sup.killed_groups.teardown_timeout_s + 0.5)
        assert sup.state == "starting" and sup.failure == ""  # gen 2 runs on: not its failure

        with pytest.raises(WorkerTeardownError):
            await sup.launch(launch_gen(3))
        record = json.loads(sup.failure)
        assert (record["error_type"], record["pid"], record["rank"]) == (
            "OutlivedKill",
            w1.proc.pid,
            1,
        )
        assert record["retry"] is False and sup.workers == []

        in_driver[0] = False
        await sup.launch(launch_gen(3))
        assert sup.failure == "" and len(sup.workers) == 1
    finally:
        in_driver[0] = False
        await sup.close()


async def test_a_leftover_held_worker_ending_at_sigterm_is_no_failure(tmp_path: Path) -> None:
    """Real processes: the leftover held worker exits at SIGTERM, its child needs the
    SIGKILL. Before, the launch waited for it (the grace period) with it still among the
    generation's workers, and its SIGTERM death became the new generation's failure."""
    sup = Supervisor(tmp_path, worker_argv=SLEEPER)
    sup.kill_grace_s = 0.5
    (tmp_path / "left").mkdir()
    child = -1
    try:
        stubborn = (sys.executable, "-c", WITH_STUBBORN_CHILD, str(tmp_path / "left"))
        _, w1 = await _holding(sup, tmp_path, [SLEEPER, stubborn])
        await until(lambda: _written(tmp_path / "left" / "child.pid"))
        child = int((tmp_path / "left" / "child.pid").read_text())
        t0 = time.monotonic()
        await sup.launch(_in_place(2))
        assert time.monotonic() - t0 < sup.kill_grace_s
        await until(lambda: _group_gone(w1.proc.pid) and w1.exit_code is not None)
        assert w1.exit_code == -signal.SIGTERM
        assert sup.failure == "" and sup.state == "starting"
    finally:
        await sup.close()
        kill_known(child)


async def test_a_held_break_is_not_reported_as_the_next_generations(tmp_path: Path) -> None:
    """Generation 1's world broke (a peer died): its held worker says why, and the status
    carries it. An in-place launch of generation 2 takes the generation number first and
    hands the held worker its rank later, with awaits between (the hand-over hook, the run
    directory's files): a status written in that window carried generation 2, held, with
    generation 1's break, and the controller aborted generation 2 for it ("during launch:
    worker world broke") and fell back to the restart path (seen in `sailor demo` on a
    loaded host). Now a held break is reported for its own generation only."""
    sup = Supervisor(tmp_path, worker_argv=SLEEPER)
    cause = "RuntimeError: Connection closed by peer [127.0.0.1]:49037"
    seen: list[tuple[int, str, str, int]] = []

    async def handover() -> None:  # inside the launch, as the agent's quota hook runs
        seen.append((sup.generation, sup.state, sup.held_failure, sup.held_culprit))

    try:
        (w0,) = await _holding(sup, tmp_path, [SLEEPER])
        w0.broken, w0.culprit, sup.generation = cause, 1, 1
        assert (sup.state, sup.held_failure, sup.held_culprit) == ("held", cause, 1)
        sup.on_handover = handover
        await sup.launch(_in_place(2))
        assert [s[0] for s in seen] == [2], seen  # the window: generation 2 already
        assert all(s[2:] == ("", -1) for s in seen), seen
        assert sup.workers == [w0] and (sup.held_failure, sup.failure) == ("", "")
    finally:
        await sup.close()


async def test_a_second_stuck_group_does_not_make_the_first_forgotten(tmp_path: Path) -> None:
    """A leftover of an in-place launch outlives SIGKILL, then the new generation's worker
    does too at the abort. Before, the second report replaced the first: once the second
    went, launches resumed on the GPU the first still held. Now the record names both and
    launches wait for both."""
    sup = Supervisor(tmp_path, worker_argv=SLEEPER, teardown_timeout_s=0.5)
    sup.kill_grace_s = 0.3
    stuck: set[int] = set()
    sup.killed_groups.probe = _in_driver(lambda pgid: pgid in stuck)
    try:
        w0, w1 = await _holding(sup, tmp_path, [SLEEPER, SLEEPER])
        stuck |= {w0.proc.pid, w1.proc.pid}
        await sup.launch(_in_place(2))  # w1 left over: killed, outlives SIGKILL
        await asyncio.sleep(sup.kill_grace_s + sup.killed_groups.teardown_timeout_s + 0.5)
        await sup.abort()  # w0 (rank 0 of generation 2) outlives SIGKILL too
        record = json.loads(sup.failure)
        assert {p["pid"] for p in record["processes"]} == {w0.proc.pid, w1.proc.pid}, record

        stuck.discard(w0.proc.pid)  # the second goes; the first holds on
        with pytest.raises(WorkerTeardownError):
            await sup.launch(launch_gen(3))
        record = json.loads(sup.failure)
        assert [p["pid"] for p in record["processes"]] == [w1.proc.pid], record

        stuck.clear()
        await sup.launch(launch_gen(3))
        assert sup.failure == ""
    finally:
        stuck.clear()
        await sup.close()


async def test_a_restarted_agent_knows_what_its_predecessor_killed(tmp_path: Path) -> None:
    """The process outliving SIGKILL is still there when the agent restarts (a new
    Supervisor on the same run directory). Before, the new one knew nothing of it and
    launched onto its GPU. Now it reads ``killed.json``, finds the group there: the failure
    is its record and launches are refused, until it is gone. (The new one starts after
    the bound has run out since the SIGKILL: before that, it is still being killed:
    ``test_killed_groups_restore``.)"""
    in_driver = [True]
    first = Supervisor(tmp_path, worker_argv=SLEEPER, teardown_timeout_s=0.5)
    first.kill_grace_s = 0.3
    first.killed_groups.probe = _in_driver(lambda pgid: in_driver[0])
    await first.launch(launch_gen(1))
    pid = first.workers[0].proc.pid
    await first.close()
    assert json.loads(first.failure)["pid"] == pid
    assert [g["pgid"] for g in json.loads((tmp_path / KILLED_FILE).read_text())["groups"]] == [pid]

    killed_at = json.loads((tmp_path / KILLED_FILE).read_text())["groups"][0]["killed_at"]
    await until(lambda: time.time() - killed_at > 0.5)  # the bound has run out
    sup = Supervisor(tmp_path, worker_argv=SLEEPER, teardown_timeout_s=0.5)
    sup.kill_grace_s = 0.3
    sup.killed_groups.probe = first.killed_groups.probe
    try:
        await sup.restore_killed()
        record = json.loads(sup.failure)
        assert (record["error_type"], record["pid"], record["retry"]) == (
            "OutlivedKill",
            pid,
            False,
        )
        with pytest.raises(WorkerTeardownError):
            await sup.launch(launch_gen(2))
        in_driver[0] = False
        await sup.launch(launch_gen(2))
        assert sup.failure == "" and len(sup.workers) == 1
        assert not (tmp_path / KILLED_FILE).exists()
    finally:
        in_driver[0] = False
        await sup.close()


async def test_a_restored_group_is_matched_by_its_members_start_times(tmp_path: Path) -> None:
    """No simulated probe: a real process group stands for the survivor. Recorded as killed
    after it started, it lingers; recorded as killed before it started, its id is another
    session's now (the pid reused) and it does not. Its SIGKILL is recorded past the
    teardown bound (else it would still be being killed)."""
    other = await asyncio.create_subprocess_exec("sleep", "60", start_new_session=True)
    try:
        await until(lambda: _stat(other.pid) in ("S", "R"))
        await asyncio.sleep(0.05)  # a clock tick (10 ms) past its start
        for born_by, lingers in ((boot_ticks() - 100_000, False), (boot_ticks(), True)):
            record = {"pgid": other.pid, "rank": 0, "step": 5, "born_by": born_by}
            long_ago = time.time() - 2 * TEARDOWN_TIMEOUT_S
            (tmp_path / KILLED_FILE).write_text(
                json.dumps({"boot_id": "", "groups": [{**record, "killed_at": long_ago}]})
            )
            sup = Supervisor(tmp_path, worker_argv=SLEEPER)
            try:
                await sup.restore_killed()
                assert (sup.state == "failed") is lingers, sup.failure
                assert (tmp_path / KILLED_FILE).exists() is lingers
            finally:
                await sup.close()
    finally:
        other.kill()
        await other.wait()
