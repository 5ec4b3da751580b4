"""A leader failover in LAUNCH, through the real control plane (nats-server, etcd, two
controllers, agents with toy workers): the leader that adopts the phase sends each node its
Launch again under ids of its own epoch, and the agents acknowledge the launch their
workers already run without applying it again. Applied again, the in-place path killed the
workers just handed their ranks and started new processes; the restart path's abort killed
the ranks that had just started. On either path the ranks started by the first Launch are
the ones that train on, and a Launch of an earlier generation is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from sailor.agent.agent_config import AgentConfig
from sailor.agent.daemon import Agent
from sailor.coordination import Keys, connect_etcd
from sailor.localnet import free_port
from sailor.localservers import LocalServers
from sailor.schemas.commands import Abort, CommandAdapter, Launch, plan_digest
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.runtime import CommandAck, DesiredState, Phase
from tests.integration.cluster_kit import WORKER, Cluster, until

pytestmark = pytest.mark.usefixtures("no_task_leak")


@pytest.fixture
async def cluster(tmp_path: Path, servers: LocalServers) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path, servers) as c:
        yield c


def _pids(cluster: Cluster, node: str) -> set[int]:
    return {w.proc.pid for w in cluster.agents[node][0].supervisor.workers}


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "restart"])
async def test_a_failover_in_launch_keeps_the_launched_ranks(
    cluster: Cluster, in_place: bool
) -> None:
    cluster.in_place = in_place
    cluster.start_controller("c1")
    cluster.start_agent("n1", watch_file=True)
    agent = cluster.start_agent("n2")
    # n2 answers the Launch of the generation after the notice only once the test says
    # so: the leader is crashed after n2 applied it and before it read the ack
    target = {"generation": -1}
    applied, answer = asyncio.Event(), asyncio.Event()
    launches: list[tuple[int, str]] = []
    handle: Callable[[bytes], Awaitable[bytes]] = agent._on_command

    async def gated(data: bytes) -> bytes:
        out = await handle(data)
        cmd = CommandAdapter.validate_json(data)
        if isinstance(cmd, Launch):
            launches.append((cmd.generation, CommandAck.model_validate_json(out).reason))
            if cmd.generation == target["generation"]:
                target["generation"] = -1  # once
                applied.set()
                await answer.wait()
        return out

    agent._on_command = gated  # type: ignore[method-assign]  # bound by serve() at run

    ctl = await cluster.wait_phase(Phase.RUNNING, 40)
    while sorted(ctl.desired.placement) != ["n1", "n2"]:
        ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=ctl.desired.generation)
    gen = ctl.desired.generation
    await cluster.wait_step(ctl, ["n1", "n2"], ctl.desired.load_step + 2, 15)
    cluster.start_controller("c2")  # the standby
    target["generation"] = gen + 1
    (cluster.tmp / "preempt-n1").write_text(json.dumps({"in_s": 20}))
    await asyncio.wait_for(applied.wait(), 40)
    first = _pids(cluster, "n2")
    assert first and agent.supervisor.generation == gen + 1
    leader = cluster.leader()
    name = next(n for n, (c, _) in cluster.controllers.items() if c is leader)
    assert leader.desired is not None and leader.desired.phase is Phase.LAUNCH
    await cluster.stop_controller(name, crash=True)
    await until(lambda: any(c.leadership for c, _ in cluster.controllers.values()), 20, "a leader")
    answer.set()

    ctl = await cluster.wait_phase(Phase.RUNNING, 60, after_gen=gen)
    d = ctl.desired
    assert ctl is not leader and d.generation == gen + 1 and list(d.placement) == ["n2"]
    assert d.path == ("in_place" if in_place else "restart")
    await cluster.wait_step(ctl, ["n2"], d.load_step + 2, 15)
    assert _pids(cluster, "n2") == first, launches  # the ranks the first Launch started
    assert agent.supervisor.generation == gen + 1

    # a Launch of an earlier generation (a controller that missed this one) is refused
    old = Launch(
        command_id="older",
        epoch=d.epoch,
        node_id="n2",
        plan_id="p",
        plan_sha256="x",
        ranks=(0,),
        world_size=1,
        master="127.0.0.1:1",
        generation=gen,
    )
    ack = CommandAck.model_validate_json(await handle(old.model_dump_json().encode()))
    assert not ack.accepted and f"generation {gen} is older" in ack.reason, ack
    assert _pids(cluster, "n2") == first
    await cluster.audit()


def _one_rank_plan(microbatches: int = 2) -> Plan:
    """A plan of one CPU rank (the toy worker's)."""
    replica = ReplicaGroup(gpu_type="cpu", zone="z", gpus_per_node=1)
    stage = Stage(first_layer=0, last_layer=5, replica=replica)
    pipe = Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=microbatches)
    plan = Plan(model="tiny-gpt", global_batch_size=microbatches, pipelines=(pipe,))
    return plan.model_copy(update={"plan_id": f"p-toy-{microbatches}"})


@contextlib.asynccontextmanager
async def _agent(
    tmp: Path, servers: LocalServers | None = None, argv: tuple[str, ...] = WORKER
) -> AsyncIterator[Agent]:
    """An agent of node n1 (job ``t``) whose toy workers the test launches by calling its
    command handler; with ``servers``, reading the desired state from their etcd (a Launch
    that names its plan), as its node's identity. Its workers are killed at the end."""
    node = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="z")
    agent = Agent(AgentConfig(node=node, job="t", work_dir=tmp, worker_argv=argv))
    store = None
    if servers is not None:
        store = await connect_etcd(servers.etcd_endpoint, security=servers.security("n1"))
        agent._store = store
    try:
        yield agent
    finally:
        await agent.supervisor.close()
        if store is not None:
            await store.close()


async def _publish(servers: LocalServers, plan: Plan, generation: int) -> None:
    """The desired state a controller writes before it sends a Launch naming ``plan``."""
    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    try:
        desired = DesiredState(epoch=1, generation=generation, plan=plan)
        await store.put(Keys(job="t").desired, desired.model_dump_json().encode())
    finally:
        await store.close()


def _launch(
    plan: Plan, epoch: int, generation: int, master: str, tag: str = "", named: bool = False
) -> Launch:
    """Launch of ``plan``'s one rank; ``named``: by reference, as a controller now sends it,
    else inline, as an older controller did."""
    by = {"plan_id": plan.plan_id, "plan_sha256": plan_digest(plan)} if named else {"plan": plan}
    return Launch(
        command_id=f"e{epoch}-g{generation}-launch{tag}-n1",
        epoch=epoch,
        node_id="n1",
        ranks=(0,),
        world_size=1,
        master=master,
        generation=generation,
        **by,
    )


async def _send(agent: Agent, cmd: Launch) -> CommandAck:
    raw = await agent._on_command(cmd.model_dump_json().encode())
    return CommandAck.model_validate_json(raw)


@pytest.mark.parametrize("named", [True, False], ids=["named", "inline"])
async def test_an_agent_applies_a_launch_once_whatever_its_command_id(
    tmp_path: Path, servers: LocalServers, named: bool
) -> None:
    """The agent's rule alone, with real toy workers: the Launch its workers run, sent
    again under another epoch's id, is acknowledged and changes nothing; one of the same
    generation that starts other workers (another master; inline, another plan: an older
    controller's Launch names no digest, the key takes the plan's own) is applied; an
    earlier generation's is refused with why. A named plan is read from etcd's desired
    state."""
    plan = _one_rank_plan()
    if named:
        await _publish(servers, plan, 3)
    async with _agent(tmp_path, servers if named else None) as agent:
        sup = agent.supervisor
        master = f"127.0.0.1:{free_port()}"
        assert (await _send(agent, _launch(plan, 1, 3, master, named=named))).accepted
        await until(lambda: sup.step >= 1, 30, "the first step")
        pids = {w.proc.pid for w in sup.workers}
        again = await _send(agent, _launch(plan, 2, 3, master, named=named))
        assert again.accepted and "already running" in again.reason, again
        assert {w.proc.pid for w in sup.workers} == pids and sup.state == "running"
        older = await _send(agent, _launch(plan, 2, 2, master, named=named))
        assert not older.accepted and "generation 2 is older than generation 3" in older.reason
        assert "workers live" in older.reason
        assert {w.proc.pid for w in sup.workers} == pids
        other_master = f"127.0.0.1:{free_port()}"
        other = await _send(agent, _launch(plan, 2, 3, other_master, "-b", named=named))
        assert other.accepted and not other.reason, other  # not the launch it runs
        assert {w.proc.pid for w in sup.workers}.isdisjoint(pids)
        if not named:
            plan4 = _one_rank_plan(4).model_copy(update={"plan_id": ""})
            bare = plan.model_copy(update={"plan_id": ""})
            assert (await _send(agent, _launch(bare, 2, 3, other_master, "-c"))).accepted
            await until(lambda: sup.step >= 1, 30, "the unnamed plan's first step")
            pids = {w.proc.pid for w in sup.workers}
            another = await _send(agent, _launch(plan4, 2, 3, other_master, "-d"))
            assert another.accepted and not another.reason, another  # another plan
            assert {w.proc.pid for w in sup.workers}.isdisjoint(pids)


async def test_an_idle_node_applies_a_launch_of_an_earlier_generation(tmp_path: Path) -> None:
    """A controller whose etcd was restored from a backup counts generations from an older
    number. A node whose workers were aborted applies its Launch: refused, the controller
    could launch nowhere until its count passed every node's (a LAUNCH deadline per
    generation). A node whose workers live refuses it (the test above)."""
    plan = _one_rank_plan()
    async with _agent(tmp_path) as agent:
        sup = agent.supervisor
        assert (await _send(agent, _launch(plan, 1, 7, f"127.0.0.1:{free_port()}"))).accepted
        await until(lambda: sup.step >= 1, 30, "the first step")
        abort = Abort(command_id="e1-g7-abort-n1", epoch=1, node_id="n1", reason="test")
        ack = CommandAck.model_validate_json(
            await agent._on_command(abort.model_dump_json().encode())
        )
        assert ack.accepted, ack
        await until(lambda: not sup.live and not sup.kill_under_way, 30, "the kill")
        back = await _send(agent, _launch(plan, 2, 2, f"127.0.0.1:{free_port()}", "-r"))
        assert back.accepted and not back.reason, back
        await until(lambda: sup.step >= 1 and sup.generation == 2, 30, "generation 2's step")


async def test_an_aborted_launch_is_not_applied_again_and_a_rerun_reports_its_own_failure(
    tmp_path: Path,
) -> None:
    """Launch g, its worker dies, the controller aborts the node: the same Launch sent again
    (a leader that adopted the LAUNCH) is refused; it restarted the rank into the aborted
    world's generation and master. A Launch of that generation that starts other workers
    (another master) runs in the same directory: a death of its worker is reported as its
    own, not as the earlier record that was there (first writer wins)."""
    plan = _one_rank_plan()
    async with _agent(tmp_path) as agent:
        sup = agent.supervisor
        master = f"127.0.0.1:{free_port()}"
        assert (await _send(agent, _launch(plan, 1, 3, master))).accepted
        await until(lambda: sup.step >= 1, 30, "the first step")
        pid1 = sup.workers[0].proc.pid
        os.killpg(pid1, signal.SIGKILL)
        await until(lambda: bool(sup.failure), 10, "the failure")
        abort = Abort(command_id="e1-g3-abort-n1", epoch=1, node_id="n1", reason="test")
        ack = CommandAck.model_validate_json(
            await agent._on_command(abort.model_dump_json().encode())
        )
        assert ack.accepted, ack
        await until(lambda: not sup.live and not sup.kill_under_way, 30, "the kill")
        again = await _send(agent, _launch(plan, 2, 3, master))
        assert not again.accepted and "aborted here" in again.reason, again
        assert not sup.live
        other = await _send(agent, _launch(plan, 2, 3, f"127.0.0.1:{free_port()}", "-b"))
        assert other.accepted, other
        await until(lambda: sup.step >= 1, 30, "the rerun's first step")
        pid2 = sup.workers[0].proc.pid
        os.killpg(pid2, signal.SIGKILL)
        await until(lambda: bool(sup.failure), 10, "the rerun's failure")
        assert str(pid2) in sup.failure and str(pid1) not in sup.failure, sup.failure


# a worker ended of a peer's failure whose error file write never ended (a hung mount): it
# printed its record on stderr, then exited 1 (no braces: the agent formats its argv)
_PRINTS_A_PEER_FAILURE = (
    "import json, sys; rec = dict(event='failed', rank=0, step=-1, origin='peer', "
    "retry=True, error_type='PeerFailedError', message='rank 2 (h2) failed before its "
    "world first step: MemoryError: injected'); print(json.dumps(rec), file=sys.stderr, "
    "flush=True); sys.exit(1)"
)


async def test_a_worker_that_printed_its_failure_but_wrote_no_record_is_reported_by_it(
    tmp_path: Path,
) -> None:
    """The agent's record of a worker that wrote none is the ``failed`` event the worker
    printed, when there is one: a rank ended of another rank's failure whose file write
    hung exits without a record, and the node was blamed for it (``exited with status 1
    without an error record``, origin local)."""
    plan = _one_rank_plan()
    argv = (sys.executable, "-c", _PRINTS_A_PEER_FAILURE)
    async with _agent(tmp_path, argv=argv) as agent:
        sup = agent.supervisor
        assert (await _send(agent, _launch(plan, 1, 3, f"127.0.0.1:{free_port()}"))).accepted
        await until(lambda: bool(sup.failure), 30, "the failure")
        record = json.loads(sup.failure)
        assert record["origin"] == "peer" and "rank 2 (h2)" in record["message"], record


async def test_a_launch_whose_worker_died_is_refused_and_the_failure_kept(
    tmp_path: Path,
) -> None:
    """A worker of the launch this node runs dies (its failure recorded); the same Launch
    sent again under another epoch's id (a leader that adopted the LAUNCH) is refused with
    that failure, which the status keeps. Applied again, it restarted the rank into the
    dead world's generation and master and erased the failure: the controller saw a
    healthy node."""
    plan = _one_rank_plan()
    async with _agent(tmp_path) as agent:
        sup = agent.supervisor
        master = f"127.0.0.1:{free_port()}"
        assert (await _send(agent, _launch(plan, 1, 3, master))).accepted
        await until(lambda: sup.step >= 1, 30, "the first step")
        pid = sup.workers[0].proc.pid
        os.killpg(pid, signal.SIGKILL)
        await until(lambda: bool(sup.failure), 10, "the failure")
        failure = sup.failure
        ack = await _send(agent, _launch(plan, 2, 3, master))
        assert not ack.accepted, ack
        assert "generation 3 was launched here and ended" in ack.reason, ack
        assert failure[:200] in ack.reason, (failure, ack)
        assert sup.failure == failure and sup.state == "failed"
        assert agent.status().failure == failure
        assert [w.proc.pid for w in sup.workers] == [pid]
        # a Launch that starts other workers (another master) is applied, as before
        other = await _send(agent, _launch(plan, 2, 3, f"127.0.0.1:{free_port()}", "-b"))
        assert other.accepted and sup.failure == "", other
