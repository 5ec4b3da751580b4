"""An agent's Abort is acked once its kill has begun, not once it is over.

A real agent (real secure nats-server and etcd, a real worker process) is sent its commands
over NATS as the controller sends them. Its worker is killed at an Abort; the probe reports
the worker's process still there in state D for ``STUCK_S`` after its SIGKILL (what a rank
in the GPU driver's teardown shows; none outlives SIGKILL on this machine), which is shorter
than the teardown bound: it goes in the end, as most do.

Before, the Abort's ack came once the kill was over (grace period + the driver's teardown,
up to ~126 s on a GPU node), and every command to the node waited behind it (the agent's
command lock, and the NATS subscription, which hands its messages over one at a time): a
Stop sent meanwhile was answered only after it. Now the ack comes once the signals are sent
and says so; the node's status tells the rest (``killing``: the process groups still going,
then idle); a Launch meanwhile is refused at once with the reason, and starts nothing on the
GPU until the process is gone.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sailor.agent.agent_config import AgentConfig
from sailor.agent.daemon import Agent
from sailor.agent.teardown import group_members
from sailor.coordination import Keys, NatsCommands, connect_etcd, connect_nats
from sailor.schemas.commands import Abort, CommandAdapter, Launch, Stop
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import AgentStatus, CommandAck
from tests.integration.cluster_kit import Cluster, event_stream, until
from tests.integration.test_worker_signals import PLAN, launch_of

pytestmark = pytest.mark.usefixtures("no_task_leak")

STUCK_S = 4.0
"""How long the killed worker's process stays (simulated) in state D after its SIGKILL."""

_SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)")


def _stuck_for(seconds: float) -> tuple[Callable[..., dict[int, dict[int, str]]], list[float]]:
    """The real probe, but the killed groups have their leader still there in state D (past
    SIGTERM and SIGKILL) until ``seconds`` after the first probe (the kill's); and that time."""
    first: list[float] = []

    def probe(pgids: list[int], born_by: dict[int, int] | None = None) -> dict[int, dict[int, str]]:
        found = group_members(pgids, born_by) if born_by else group_members(pgids)
        first[:] = first or [time.monotonic()]
        if time.monotonic() - first[0] < seconds:
            for pgid in pgids:
                found.setdefault(pgid, {})[pgid] = "D"
        return found

    return probe, first


async def _request(commands: NatsCommands, cmd: Any, timeout: float = 30.0) -> CommandAck:
    raw = await commands.request(cmd.node_id, CommandAdapter.dump_json(cmd), timeout)
    return CommandAck.model_validate_json(raw)


async def _serving(commands: NatsCommands) -> None:
    """Until the agent serves its subject (a Stop with nothing running is harmless)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 20
    while True:
        try:
            await _request(commands, Stop(command_id="hello", epoch=1, node_id="n1", at_step=0), 2)
            return
        except Exception:
            assert loop.time() < end, "agent not serving"
            await asyncio.sleep(0.2)


def _launch(gen: int) -> Launch:
    return launch_of(PLAN).model_copy(update={"generation": gen, "command_id": f"launch-{gen}"})


async def test_an_abort_is_acked_once_its_kill_has_begun(cluster: Cluster) -> None:
    await event_stream(cluster.servers, cluster.job)  # no controller: its join stored at once
    agent: Agent = cluster.start_agent("n1")
    sup = agent.supervisor
    sup.worker_argv = _SLEEPER
    sup.kill_grace_s = 0.3
    sup.killed_groups.teardown_timeout_s = 3 * STUCK_S  # it goes before the bound
    sup.killed_groups.probe, probed = _stuck_for(STUCK_S)
    nc = await connect_nats(cluster.nats_url, "c-test", security=cluster.security("c1"))
    etcd = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        commands = NatsCommands(nc, Keys(job=cluster.job))
        await _serving(commands)
        key = Keys(job=cluster.job).status("n1")

        async def in_etcd() -> AgentStatus | None:
            kv = await etcd.get(key)
            return None if kv is None else AgentStatus.model_validate_json(kv.value)

        async def written(pred: Callable[[AgentStatus], bool]) -> None:
            while (st := await in_etcd()) is None or not pred(st):
                await asyncio.sleep(0.05)

        # the status loop runs (it starts once the agent has registered and announced
        # its join)
        await asyncio.wait_for(written(lambda st: True), 20)
        assert (await _request(commands, _launch(1))).accepted
        await until(lambda: bool(sup.workers) and sup.workers[0].proc.pid > 0, 10, "worker")
        pid = sup.workers[0].proc.pid

        t0 = time.monotonic()
        abort = Abort(command_id="abort-1", epoch=1, node_id="n1", reason="test")
        sent = asyncio.create_task(_request(commands, abort))
        await asyncio.sleep(0.1)
        stop = Stop(command_id="stop-1", epoch=1, node_id="n1", at_step=9)
        stop_ack = await _request(commands, stop)
        stop_s = time.monotonic() - t0
        ack = await sent
        ack_s = time.monotonic() - t0  # at most stop_s: the ack came first
        print(f"abort acked after {ack_s:.2f} s, a Stop sent 0.1 s after it after {stop_s:.2f} s")
        assert ack.accepted and stop_ack.accepted
        assert ack.reason.startswith("signals sent: workers being killed: 1 process group")

        # the truth is in the status: the group is still going, the node is not idle
        assert agent.status().killing == 1 and agent.status().state != "idle"
        await asyncio.wait_for(written(lambda st: st.killing == 1 and st.state != "idle"), 5)

        # a Launch while the killed worker's process holds its GPU: refused at once, with
        # the reason; nothing starts
        t1 = time.monotonic()
        refused = await _request(commands, _launch(2))
        launch_s = time.monotonic() - t1
        assert not refused.accepted and "being killed" in refused.reason, refused
        assert sup.generation == 1

        # the controller reads the kill's end in the status: idle, nothing killing
        await asyncio.wait_for(written(lambda st: st.state == "idle"), 3 * STUCK_S)
        gone_s = time.monotonic() - t0
        assert agent.status().killing == 0 and agent.status().failure == ""
        assert (await _request(commands, _launch(2))).accepted
        assert sup.generation == 2 and sup.workers[0].proc.pid != pid
        print(
            f"a Launch during the kill refused in {launch_s:.2f} s, "
            f"kill over (idle) {gone_s:.2f} s (first probe at {probed[0] - t0:.2f} s)"
        )
        # ratios, not absolute times (a loaded 2-core host): the acks come well before the
        # kill is over, which takes the grace period plus STUCK_S
        assert gone_s >= STUCK_S
        assert stop_s < gone_s / 4 and launch_s < gone_s / 4, (ack_s, stop_s, launch_s, gone_s)
    finally:
        await etcd.close()
        await nc.close()


@pytest.mark.parametrize("version", [3, 4])
async def test_an_older_controllers_abort_is_acked_once_the_kill_is_over(
    tmp_path: Path, version: int
) -> None:
    """A controller of wire version 3 drops ``AgentStatus.killing``: in an in-place
    TEARDOWN it takes a node reporting ``held`` (as it does while its workers that did not
    hold are killed) for done, and sends an in-place Launch. Before, the agent acked its
    Abort at once all the same and refused that Launch (its LAUNCH deadline then charged
    the node). Now an Abort below version 4 is acked once the kill is over, as before, and
    such a controller's Launch waits for a kill under way instead of being refused; a
    version-4 controller's Abort is acked once the signals are sent."""
    node = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="z")
    agent = Agent(AgentConfig(node=node, work_dir=tmp_path, worker_argv=_SLEEPER))
    sup = agent.supervisor
    sup.kill_grace_s = 0.3
    stuck_s = 1.5
    sup.killed_groups.teardown_timeout_s = 10 * stuck_s  # it goes before the bound
    sup.killed_groups.probe, _ = _stuck_for(stuck_s)

    async def send(cmd: Any) -> tuple[CommandAck, float]:
        t0 = time.monotonic()
        raw = await agent._on_command(
            cmd.model_copy(update={"schema_version": version}).model_dump_json().encode()
        )
        return CommandAck.model_validate_json(raw), time.monotonic() - t0

    try:
        assert (await send(_launch(1)))[0].accepted
        abort = Abort(command_id="abort-1", epoch=1, node_id="n1", reason="test")
        ack, ack_s = await send(abort)
        assert ack.accepted, ack
        if version < 4:  # once the kill is over: nothing being killed, the node idle
            assert ack.reason == "" and ack_s >= stuck_s, (ack, ack_s)
            assert agent.status().killing == 0 and agent.status().state == "idle"
            assert (await send(_launch(2)))[0].accepted
            # a kill under way (begun otherwise): its Launch waits for it, as it did
            sup.killed_groups.probe, _ = _stuck_for(stuck_s)
            await sup.abort(wait=False)
            assert sup.kill_under_way
            launch, launch_s = await send(_launch(3))
            assert launch.accepted and launch_s >= stuck_s, (launch, launch_s)
            assert sup.generation == 3 and sup.killing == 0
        else:  # once the signals are sent: the status tells the rest
            assert ack.reason.startswith("signals sent: workers being killed: 1"), ack
            assert ack_s < stuck_s and agent.status().killing == 1
            refused, _ = await send(_launch(2))
            assert not refused.accepted and "being killed" in refused.reason, refused
            await until(lambda: agent.status().state == "idle", 10 * stuck_s, "kill over")
            assert (await send(_launch(2)))[0].accepted
    finally:
        await sup.close()


async def test_the_controller_keeps_an_agents_refusal_until_the_launch_is_taken(
    cluster: Cluster,
) -> None:
    """The executor sends a Launch (as a pass does) to a real agent whose killed worker is
    still there: the agent refuses it with the reason, which the executor now keeps for the
    next pass (``refused_view``, ``Observed.refused``: ``decide`` then waits for the kill's
    end instead of re-sending blindly, and names the refusal at the LAUNCH deadline); once
    the kill is over the Launch sent again is taken, and the refusal is forgotten. Before,
    the reason reached the audit log only, never the decision."""
    from sailor.controller.audit import AuditLog
    from sailor.controller.decision_types import Send
    from sailor.controller.executor import Executor
    from sailor.controller.planning import DataParallelPlanner
    from sailor.coordination import SystemClock, TaskSet, campaign
    from sailor.schemas.runtime import DesiredState

    await event_stream(cluster.servers, cluster.job)  # no controller: its join stored at once
    agent: Agent = cluster.start_agent("n1")
    sup = agent.supervisor
    sup.worker_argv = _SLEEPER
    sup.kill_grace_s = 0.3
    sup.killed_groups.teardown_timeout_s = 3 * STUCK_S
    sup.killed_groups.probe, _ = _stuck_for(STUCK_S)
    keys = Keys(job=cluster.job)
    nc = await connect_nats(cluster.nats_url, "c-test", security=cluster.security("c1"))
    etcd = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    tasks = TaskSet("test-refusal")
    audit = AuditLog(cluster.tmp / "audit-c1.jsonl")
    lead = await campaign(etcd, keys.leader, "c1", 5, timeout=10)
    try:
        commands = NatsCommands(nc, keys)
        await _serving(commands)
        assert (await _request(commands, _launch(1))).accepted
        await until(lambda: bool(sup.workers) and sup.workers[0].proc.pid > 0, 10, "worker")
        abort = Abort(command_id="abort-1", epoch=1, node_id="n1", reason="test")
        assert (await _request(commands, abort)).accepted
        assert agent.status().killing == 1

        planner = DataParallelPlanner("tiny-gpt", 4, global_batch_size=8)
        ex = Executor(
            etcd, commands, keys, audit, lead, planner, SystemClock(), tasks, lambda u: None
        )
        launch = _launch(2).model_copy(update={"epoch": lead.epoch, "command_id": "e-launch-2"})
        desired = DesiredState(epoch=lead.epoch, generation=2)
        await ex.apply([Send(launch)], desired)
        await until(lambda: ex.sends.inflight == 0, 10, "the refusal")
        assert "being killed" in ex.sends.refused_view.get("e-launch-2", ""), ex.sends.refused_view
        assert "e-launch-2" not in ex.sends.acked_view

        await until(lambda: agent.status().state == "idle", 3 * STUCK_S, "kill over")
        await ex.apply([Send(launch)], desired)  # the pass the kill's end woke
        await until(lambda: "e-launch-2" in ex.sends.acked_view, 10, "the Launch taken")
        assert ex.sends.refused_view == {} and sup.generation == 2
    finally:
        await tasks.close()
        audit.close()
        await lead.resign()
        await etcd.close()
        await nc.close()
