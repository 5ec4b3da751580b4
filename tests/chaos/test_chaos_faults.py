"""Chaos scenarios with real processes: faults injected into a running secure cluster.

Each scenario starts nats-server and etcd (TLS, logins, permissions, RBAC), one or two
``sailor controller`` processes and ``sailor agent`` processes with real tiny-gpt workers,
injects its faults, ends with a drain so that the last step is committed, and then checks
(tests/chaos/harness.py): ``sailor audit`` passes, every loss equals the uninterrupted run,
the last checkpoint's weights equal the uninterrupted run's, and no committed step was lost.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.chaos.harness import ChaosRun, Outcome

pytestmark = pytest.mark.chaos


def verdict(out: Outcome, min_reconf: int) -> None:
    detail = (
        f"{out.scenario}: audit {out.audit_violations}, loss diff {out.max_loss_diff:.2e}, "
        f"param diff {out.max_param_diff:.2e}@{out.params_step}, lost {out.steps_lost}\n"
        + "\n".join(out.notes)
    )
    assert out.audit_ok, detail
    assert out.losses_ok, detail
    assert out.params_ok, detail
    assert out.steps_lost == 0, detail
    assert out.reconfigurations >= min_reconf, detail


async def test_preemption_with_notice(tmp_path: Path) -> None:
    async with ChaosRun(tmp_path, "preemption with notice") as run:
        gen = await run.start(["n1", "n2", "n3"])
        run.fault("notice n1 (30 s)")
        gen = await run.preempt("n1", gen)
        out = await run.finish(gen, drain="n2")
    verdict(out, min_reconf=2)


async def test_agent_sigkill_without_notice(tmp_path: Path) -> None:
    async with ChaosRun(tmp_path, "agent SIGKILL") as run:
        gen = await run.start(["n1", "n2", "n3"])
        run.fault("SIGKILL agent n2 and its workers")
        run.cluster.lose("n2")
        gen = await run.running_without({"n2"})
        out = await run.finish(gen, drain="n3")
    verdict(out, min_reconf=2)


@pytest.mark.chaos_long
async def test_worker_sigkill_without_notice(tmp_path: Path) -> None:
    async with ChaosRun(tmp_path, "worker SIGKILL") as run:
        gen = await run.start(["n1", "n2", "n3"])
        run.fault("SIGKILL one worker of n2 (agent stays)")
        run.cluster.kill_worker("n2")
        gen = await run.drive.running_after(gen)
        out = await run.finish(gen, drain="n3")
    verdict(out, min_reconf=2)


@pytest.mark.chaos_long
async def test_second_preemption_during_reconfiguration(tmp_path: Path) -> None:
    async with ChaosRun(tmp_path, "2nd notice mid-reconfiguration") as run:
        gen = await run.start(["n1", "n2", "n3", "n4"])
        run.fault("notice n1")
        run.cluster.preempt("n1", 30.0)
        await run.drive.until(lambda: run.drive.view.phase != "running", "reconfiguring")
        run.fault(f"notice n2 during {run.drive.view.phase}")
        t_second = run.cluster.preempt("n2", 30.0)
        gen = await run.running_without({"n1", "n2"})
        run.reg.stop(["agent-n1", "agent-n2"], grace_s=5.0)
        phases = [
            (float(r["time"]), r["phase"])
            for r in run.records()
            if r.get("kind") == "phase" and float(r["time"]) <= t_second
        ]
        # the second notice really landed inside the first reconfiguration
        assert phases and phases[-1][1] != "running", phases[-3:]
        out = await run.finish(gen, drain="n3")
    verdict(out, min_reconf=2)


async def test_controller_failover_and_fencing(tmp_path: Path) -> None:
    async with ChaosRun(tmp_path, "controller SIGKILL + fencing") as run:
        gen = await run.start(["n1", "n2"], controllers=("c1", "c2"))
        first = run.leader()
        standby = "c2" if first == "c1" else "c1"
        run.fault(f"SIGKILL leader {first}")
        run.cluster.kill_controller(first)
        await run.drive.until(lambda: run.leader() == standby, f"{standby} leads")
        await run.advance(gen, 5)  # the run goes on under the new leader, not relaunched
        run.fault(f"{first} comes back")
        run.cluster.start_controller(first)
        await run.advance(gen, 5)
        run.fault(f"SIGSTOP leader {standby} past its lease, then SIGCONT")
        run.cluster.freeze(run.cluster.controller_process(standby))
        await run.drive.until(lambda: run.leader() == first, f"{first} leads again")
        await run.advance(gen, 3)
        run.cluster.thaw(run.cluster.controller_process(standby))
        await run.advance(gen, 8)  # the thawed old leader changes nothing
        assert await run.generation() == gen
        recs = run.records()
        assert [r["who"] for r in recs if r.get("kind") == "leader"] == [first, standby, first]
        out = await run.finish(gen, drain="n2")
    verdict(out, min_reconf=1)


async def _restart(run: ChaosRun, which: str, hard: bool) -> None:
    gen = await run.start(["n1", "n2"])
    server = run.servers.nats if which == "nats" else run.servers.etcd
    run.fault(f"{'SIGKILL' if hard else 'SIGTERM'} {which}, down 1 s, restart")
    await asyncio.to_thread(server.restart, 1.0, hard)
    await run.advance(gen, 10)  # training went on, nothing relaunched
    assert await run.generation() == gen
    out = await run.finish(gen, drain="n2")  # the control plane still reconfigures
    verdict(out, min_reconf=1)


@pytest.mark.chaos_long
async def test_nats_server_restart(tmp_path: Path) -> None:
    async with ChaosRun(tmp_path, "NATS restart") as run:
        await _restart(run, "nats", hard=False)


@pytest.mark.chaos_long
async def test_etcd_restart(tmp_path: Path) -> None:
    async with ChaosRun(tmp_path, "etcd restart") as run:
        await _restart(run, "etcd", hard=True)


@pytest.mark.chaos_long
async def test_partition_agent_from_servers(tmp_path: Path) -> None:
    """SIGSTOP of an agent: no lease renewal, no commands, no events; its workers run on."""
    async with ChaosRun(tmp_path, "partition (SIGSTOP agent)") as run:
        gen = await run.start(["n1", "n2", "n3"])
        run.fault("SIGSTOP agent n2 (workers keep running)")
        run.cluster.freeze("agent-n2")
        gen = await run.running_without({"n2"})
        await run.advance(gen, 3)
        run.fault("SIGCONT agent n2 (heals)")
        run.cluster.thaw("agent-n2")
        # it re-registers and joins again: a layout with n2 back in it
        await run.drive.until(
            lambda: run.drive.view.phase == "running" and "n2" in run.placed(), "n2 back"
        )
        gen = run.drive.view.generation
        out = await run.finish(gen, drain="n3")
    verdict(out, min_reconf=3)
