"""A restarted agent goes on with the kills its predecessor left under way.

The killed workers' process groups are in ``killed.json`` from their SIGTERM until they are
found gone. Before, a group was written there only once SIGKILLed, and a restarted agent
(a new Supervisor on the same run directory) took every group still there for one past the
teardown bound: an agent restarted 2 s after a SIGKILL reported ``killing: 0`` and the
``OutlivedKill`` failure (retry false: the controller excludes the node for 600 s) though
the 120 s bound had not run out, and a group whose kill was cut short before its SIGKILL
was not known at all (its processes that ignore SIGTERM lived on). Now the restarted agent
SIGKILLs the latter, counts both as still being killed (``killing``, state ``stopped``) and
gives them what is left of the bound since their SIGKILL.
Real worker processes; a process that outlives SIGKILL is simulated (the probe's answer:
none can on this machine).
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

from sailor.agent.killed_groups import KILLED_FILE
from sailor.agent.supervisor import Supervisor
from sailor.agent.teardown import GONE_STATES, group_members
from tests.integration.test_supervisor_teardown import (
    SLEEPER,
    WITH_STUBBORN_CHILD,
    launch_gen,
    until,
)


def _in_driver(stuck: list[bool]) -> Callable[..., dict[int, dict[int, str]]]:
    """The real probe, but while ``stuck[0]`` every group has its leader still there in
    state D (in the GPU driver's teardown)."""

    def probe(pgids: list[int], born_by: dict[int, int] | None = None) -> dict[int, dict[int, str]]:
        found = group_members(pgids, born_by) if born_by else group_members(pgids)
        for pgid in pgids:
            if stuck[0]:
                found.setdefault(pgid, {})[pgid] = "D"
        return found

    return probe


def _saved(run_dir: Path) -> list[dict[str, object]]:
    groups: list[dict[str, object]] = json.loads((run_dir / KILLED_FILE).read_text())["groups"]
    return groups


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in GONE_STATES


async def _killed_by_a_previous_agent(tmp_path: Path, stuck: list[bool]) -> tuple[int, float]:
    """A worker SIGKILLed by an agent that stopped then (its close waits the grace period
    after the SIGKILL, no more): its pid and the time of its SIGKILL, from ``killed.json``."""
    first = Supervisor(tmp_path, worker_argv=SLEEPER, teardown_timeout_s=60.0)
    first.kill_grace_s = 0.3
    first.killed_groups.probe = _in_driver(stuck)
    await first.launch(launch_gen(1))
    pid = first.workers[0].proc.pid
    await first.close()
    (saved,) = _saved(tmp_path)
    assert (saved["pgid"], saved.get("sigkilled", True)) == (pid, True)
    return pid, float(str(saved["killed_at"]))


async def test_a_restarted_agent_goes_on_killing_what_was_sigkilled_within_the_bound(
    tmp_path: Path,
) -> None:
    stuck = [True]
    pid, _ = await _killed_by_a_previous_agent(tmp_path, stuck)
    sup = Supervisor(tmp_path, worker_argv=SLEEPER, teardown_timeout_s=60.0)
    sup.kill_grace_s = 0.3
    sup.killed_groups.probe = _in_driver(stuck)
    try:
        await sup.restore_killed()
        # still being killed, no failure: the bound has not run out
        assert (sup.killing, sup.failure, sup.state) == (1, "", "stopped")
        assert sup.kill_under_way
        stuck[0] = False  # the driver lets it go
        await until(lambda: not sup.kill_under_way, 20)
        assert (sup.killing, sup.failure, sup.state) == (0, "", "idle")
        assert not (tmp_path / KILLED_FILE).exists()
        await sup.launch(launch_gen(2))
        assert sup.failure == "" and sup.workers[0].proc.pid != pid
    finally:
        stuck[0] = False
        await sup.close()


async def test_a_restored_kill_that_outlives_what_is_left_of_the_bound_lingers(
    tmp_path: Path,
) -> None:
    stuck = [True]
    pid, killed_at = await _killed_by_a_previous_agent(tmp_path, stuck)
    bound = 2.0
    sup = Supervisor(tmp_path, worker_argv=SLEEPER, teardown_timeout_s=bound)
    sup.kill_grace_s = 0.3
    sup.killed_groups.probe = _in_driver(stuck)
    try:
        await sup.restore_killed()
        assert (sup.killing, sup.failure) == (1, "")
        await until(lambda: bool(sup.failure), 10 * bound)
        after_s = time.time() - killed_at
        record = json.loads(sup.failure)
        assert (record["error_type"], record["pid"], record["retry"]) == (
            "OutlivedKill",
            pid,
            False,
        )
        # the failure is recorded first, then the kill's count drops (its record written)
        await until(lambda: sup.killing == 0 and not sup.kill_under_way, 5.0)
        # the bound counts from the previous agent's SIGKILL (generous: a loaded host)
        assert bound <= after_s < bound + 5.0, after_s
        assert [g["pgid"] for g in _saved(tmp_path)] == [pid]
    finally:
        stuck[0] = False
        await sup.close()


async def test_a_restarted_agent_sigkills_what_an_interrupted_kill_left(tmp_path: Path) -> None:
    """The agent stops after its SIGTERM, before the SIGKILL (a crash: ``signal`` alone
    stands for it): the worker exits, its child that ignores SIGTERM lives on."""
    first = Supervisor(
        tmp_path, worker_argv=(sys.executable, "-c", WITH_STUBBORN_CHILD, "{run_dir}")
    )
    child = -1
    sup = Supervisor(tmp_path, worker_argv=SLEEPER)
    try:
        await first.launch(launch_gen(1))
        await until(lambda: bool(first.workers) and first.workers[0].started)
        leader = first.workers[0].proc.pid
        child = int((tmp_path / "gen-00001" / "child.pid").read_text())
        await first.killed_groups.signal(first.workers)  # SIGTERM sent; no SIGKILL will follow
        (saved,) = _saved(tmp_path)
        assert (saved["pgid"], saved["sigkilled"]) == (leader, False)
        await until(lambda: _gone(leader))  # a zombie: its child holds its stderr open
        assert not _gone(child)

        await sup.restore_killed()
        await until(lambda: _gone(child), 10)
        await until(lambda: not sup.kill_under_way, 10)
        assert (sup.killing, sup.failure, sup.state) == (0, "", "idle")
        assert not (tmp_path / KILLED_FILE).exists()
    finally:
        await sup.close()
        await first.close()
        if child > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


async def test_an_agent_sends_the_owed_sigkill_before_its_node_check(tmp_path: Path) -> None:
    """A restarted agent SIGKILLs what its predecessor's interrupted kill left before the
    node check and the connections (review: it came after them, so a check that failed on
    the GPU the leftover held, or an etcd outage, kept the leftover alive)."""
    from sailor.agent.agent_config import AgentConfig
    from sailor.agent.daemon import Agent
    from sailor.schemas.hardware import NodeSpec

    node = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="z", address="127.0.0.1")
    run_dir = tmp_path / "n1"
    run_dir.mkdir()
    first = Supervisor(
        run_dir, worker_argv=(sys.executable, "-c", WITH_STUBBORN_CHILD, "{run_dir}")
    )
    child = -1
    agent = Agent(AgentConfig(job="j", node=node, work_dir=tmp_path, worker_argv=SLEEPER))
    checked: list[bool] = []

    async def refuse() -> None:  # the node check fails: the agent does not join
        end = time.monotonic() + 5  # the SIGKILL was sent before: the child goes meanwhile
        while not _gone(child) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        checked.append(_gone(child))

    agent.check_node = refuse  # type: ignore[method-assign,assignment]
    try:
        await first.launch(launch_gen(1))
        await until(lambda: bool(first.workers) and first.workers[0].started)
        leader = first.workers[0].proc.pid
        child = int((run_dir / "gen-00001" / "child.pid").read_text())
        await first.killed_groups.signal(first.workers)
        await until(lambda: _gone(leader))
        assert not _gone(child)
        await agent._run()
        await until(lambda: _gone(child), 10)
        assert checked == [True]  # gone while the check ran: the SIGKILL came first
    finally:
        await agent.supervisor.close()
        await first.close()
        if child > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
