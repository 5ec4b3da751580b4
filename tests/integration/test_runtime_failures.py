"""No failure passes in silence: injected crashes, a corrupted desired state, a restarted agent.

Real secure servers and daemons in process (the harness of ``test_runtime_scenarios.py``):

- a crash of any long-lived task of the controller (its event consumer, its etcd check, the
  leader's loop itself) takes it down: a ``failed`` audit record, leadership resigned,
  ``run`` raises;
- a fenced write in the event consumer ends the term (not just the consumer);
- an agent task that crashes is restarted; one that keeps crashing takes the agent down;
- a lease whose keepalive crashed is reported lost;
- an unreadable desired state on takeover: the controller refuses to lead, the key is left
  as it was;
- the agent's epoch fence survives a restart: a deposed controller's command is refused.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import pytest

import sailor.agent.daemon as agent_daemon
from sailor.controller.audit import read_records
from sailor.controller.status import Answer, read_status, request_readmit
from sailor.coordination import (
    DaemonFailedError,
    FencedError,
    Keys,
    NatsCommands,
    NatsEventBus,
    connect_etcd,
    connect_nats,
)
from sailor.coordination.mirror import PrefixMirror
from sailor.localservers import LocalServers
from sailor.schemas.commands import Abort, CommandAdapter
from sailor.schemas.events import Heartbeat
from sailor.schemas.runtime import CommandAck, DesiredState, NodeHealth, Phase
from tests.integration.cluster_kit import Cluster, until
from tests.integration.secure_servers import JOB

pytestmark = pytest.mark.usefixtures("no_task_leak")


@pytest.fixture
async def cluster(tmp_path: Path, servers: LocalServers) -> Any:
    """The default cluster, but a controller that ended by itself (a test makes it fail:
    DaemonFailedError) is not stopped again at the end."""
    async with Cluster(tmp_path, servers) as c:
        yield c
        for name in [n for n, (_, task) in c.controllers.items() if task.done()]:
            c.controllers.pop(name)


def _records(c: Cluster, name: str, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_records([c.tmp / f"audit-{name}.jsonl"]) if r["kind"] == kind]


async def _heartbeat(c: Cluster, node: str = "n1") -> None:
    """An event from ``node``'s own login, for the consumer to handle."""
    nc = await connect_nats(c.nats_url, f"{node}-beat", security=c.security(node))
    try:
        bus = NatsEventBus(nc, Keys(job=c.job), durable="unused", source=node)
        beat = Heartbeat(event_id=f"beat-{time.time_ns()}", node_id=node, time=time.time())
        await bus.publish("heartbeat", beat.model_dump_json().encode(), beat.event_id)
    finally:
        await nc.close()


@pytest.mark.parametrize("where", ["events", "etcd-check", "loop"])
async def test_a_crashed_controller_task_takes_the_controller_down(
    cluster: Cluster, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl = cluster.start_controller("c1")
    cluster.start_agent("n1")
    await cluster.wait_phase(Phase.RUNNING, 40)
    if where == "events":

        async def broken(*args: Any, **kw: Any) -> Any:
            raise OSError(28, "No space left on device")  # e.g. the audit log's disk

        monkeypatch.setattr(ctl, "_apply_event", broken)
        await _heartbeat(cluster)
    elif where == "loop":

        def broken_decide(*args: Any, **kw: Any) -> Any:
            raise KeyError("a bug in decide")

        monkeypatch.setattr("sailor.controller.daemon.decide", broken_decide)
        ctl.wake(urgent=True)
    else:

        async def broken_check(self: Any) -> bool:
            raise PermissionError("etcd permission denied")

        monkeypatch.setattr("sailor.controller.observed.ObservedCache.check", broken_check)
    _, task = cluster.controllers["c1"]
    with pytest.raises(DaemonFailedError):
        await asyncio.wait_for(asyncio.shield(task), 20)
    assert ctl.failure is not None and where in ctl.failure
    failed = _records(cluster, "c1", "failed")
    assert failed and where in failed[0]["reason"]
    if where == "events":
        assert _records(cluster, "c1", "event_failed")
    # it resigned: the leader key is gone at once, a standby need not wait for the lease
    store = await connect_etcd(cluster.etcd, security=cluster.security("c2"))
    try:
        assert await store.get(Keys(job=cluster.job).leader) is None
    finally:
        await store.close()


async def test_a_fenced_event_write_ends_the_term(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl = cluster.start_controller("c1")
    cluster.start_agent("n1")
    await cluster.wait_phase(Phase.RUNNING, 40)
    first = ctl.leadership
    assert first is not None
    calls = 0
    real = ctl._apply_event

    async def fenced_once(*args: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise FencedError("guarded write refused", key="notices/n1", epoch=first.epoch)
        return await real(*args, **kw)

    monkeypatch.setattr(ctl, "_apply_event", fenced_once)
    await _heartbeat(cluster)
    # the term ends and the controller campaigns again: a new epoch, leading again
    await until(
        lambda: ctl.leadership is not None and ctl.leadership.epoch > first.epoch,
        20,
        "the term did not end after the consumer was fenced",
    )
    assert _records(cluster, "c1", "fenced")
    assert not cluster.controllers["c1"][1].done()
    await cluster.wait_phase(Phase.RUNNING, 40)
    await cluster.audit()


async def test_a_crashing_agent_task_is_restarted_then_takes_the_agent_down(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_daemon, "TASK_BACKOFF_S", 0.05)
    cluster.start_controller("c1")
    agent = cluster.start_agent("n1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40)
    real = agent.status
    crashes = 0
    mode = "once"

    def status() -> Any:
        nonlocal crashes
        if mode == "always" or crashes == 0:
            crashes += 1
            raise RuntimeError("injected")
        return real()

    monkeypatch.setattr(agent, "status", status)
    # one crash: the status loop is restarted and the run goes on
    await until(lambda: crashes >= 1, 10, "status loop not run")
    step = agent.supervisor.step
    await cluster.wait_step(ctl, ["n1"], step + 3, 30)
    assert not cluster.agents["n1"][1].done() and agent.failure is None
    # crashing for good: restarted with backoff, then the agent gives up with an error
    mode = "always"
    _, task = cluster.agents["n1"]
    with pytest.raises(DaemonFailedError):
        await asyncio.wait_for(asyncio.shield(task), 20)
    cluster.agents.pop("n1")
    assert crashes >= agent_daemon.TASK_MAX_CRASHES
    assert agent.failure is not None and "status" in agent.failure


async def test_a_lease_whose_keepalive_crashed_is_reported_lost(cluster: Cluster) -> None:
    store = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        lease = await store.lease(1)

        async def broken() -> Any:
            raise RuntimeError("injected")

        # the keepalive's one round trip (EtcdLease._refresh, its own LeaseKeepAlive call)
        lease._refresh = broken  # type: ignore[method-assign]
        await until(lambda: not lease.alive, 5, "a dead keepalive left the lease 'alive'")
        await lease.revoke()
    finally:
        await store.close()


async def test_a_crashed_mirror_watch_is_restarted(cluster: Cluster) -> None:
    store = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    prefix = Keys(job=cluster.job).statuses
    seen: list[int] = []

    def on_change() -> None:
        seen.append(1)
        if len(seen) == 1:
            raise RuntimeError("injected")  # a bug in the owner's callback

    mirror = PrefixMirror(store, prefix, on_change=on_change)
    try:
        await mirror.start()
        await store.put(prefix + "a", b"1")
        await until(lambda: len(seen) >= 1, 5, "no change seen")
        await asyncio.sleep(0.7)  # the restart's backoff
        await store.put(prefix + "b", b"2")
        await until(lambda: mirror.get(prefix + "b") is not None, 10, "watch not restarted")
    finally:
        await mirror.close()
        await store.close()


async def test_an_unreadable_desired_state_is_not_replaced_by_a_blank_one(
    cluster: Cluster,
) -> None:
    keys = Keys(job=cluster.job)
    admin = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        garbage = b'{"phase": "running", "generation": "seven"'
        await admin.put(keys.desired, garbage)
        ctl = cluster.start_controller("c1")
        _, task = cluster.controllers["c1"]
        with pytest.raises(DaemonFailedError):
            await asyncio.wait_for(asyncio.shield(task), 20)
        kv = await admin.get(keys.desired)
        assert kv is not None and kv.value == garbage  # left for an operator, not reset
        assert await admin.get(keys.leader) is None  # resigned
        failed = _records(cluster, "c1", "failed")
        assert failed and "desired state unreadable" in failed[0]["reason"]
        assert ctl.leadership is None and ctl.desired is None
        assert not _records(cluster, "c1", "phase")  # nothing was written as a leader
    finally:
        await admin.close()


async def test_the_epoch_fence_survives_an_agent_restart(cluster: Cluster) -> None:
    """A command of a deposed controller is refused by a restarted agent, even once the
    desired state is gone from etcd (the fence file alone)."""
    cluster.start_controller("c1")
    cluster.start_agent("n1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40)
    epoch = ctl.leadership.epoch if ctl.leadership else 0
    await cluster.stop_controller("c1")
    await cluster.stop_agent("n1")
    admin = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        await admin.client.delete(Keys(job=cluster.job).desired.encode())
    finally:
        await admin.close()
    agent = cluster.start_agent("n1")  # a new process as far as the fence goes
    assert agent.max_epoch == epoch
    nc = await connect_nats(cluster.nats_url, "c-deposed", security=cluster.security("c1"))
    try:
        commands = NatsCommands(nc, Keys(job=cluster.job))
        stale = Abort(command_id="stale-after-restart", epoch=epoch - 1, node_id="n1", reason="x")
        loop = asyncio.get_running_loop()
        end = loop.time() + 20
        while True:  # until the agent serves its subject
            try:
                raw = await commands.request("n1", CommandAdapter.dump_json(stale), 2)
                break
            except Exception:
                assert loop.time() < end, "agent not serving"
                await asyncio.sleep(0.2)
        ack = CommandAck.model_validate_json(raw)
        assert not ack.accepted and "stale epoch" in ack.reason
    finally:
        await nc.close()


async def test_a_lost_fence_file_is_made_good_from_the_desired_state(cluster: Cluster) -> None:
    cluster.start_controller("c1")
    agent = cluster.start_agent("n1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40)
    epoch = ctl.leadership.epoch if ctl.leadership else 0
    assert agent.max_epoch == epoch
    await cluster.stop_agent("n1")
    (cluster.tmp / "agents" / "n1.epoch").unlink()  # a new run directory
    again = cluster.start_agent("n1")
    # raised before it serves commands or registers, not by the next command it accepts
    await until(lambda: again._lease is not None, 20, "agent did not register")
    assert again.max_epoch == epoch


async def test_an_epoch_beyond_etcds_revision_does_not_raise_the_fence(
    tmp_path: Path, servers: LocalServers
) -> None:
    """A command whose epoch no leader can hold (``2**62``: beyond etcd's revision, of which
    epochs are create revisions) was accepted and raised the fence for good: every real
    leader's command was refused as stale from then on. Now it is refused and the fence
    stays; an epoch within the revision is taken as before. A fence file raised that way
    before is lowered at start to the desired state's epoch."""
    from sailor.agent.agent_config import AgentConfig
    from sailor.agent.daemon import Agent
    from sailor.agent.fence import EpochFence
    from sailor.schemas.hardware import NodeSpec

    node = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="z")
    keys = Keys(job=JOB)
    admin = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("n1"))
    try:
        await admin.put(keys.desired, DesiredState(epoch=3).model_dump_json().encode())
        revision = await store.revision()
        agent = Agent(AgentConfig(node=node, job=JOB, work_dir=tmp_path))
        agent._store = store

        async def send(epoch: int, cid: str) -> CommandAck:
            cmd = Abort(command_id=cid, epoch=epoch, node_id="n1", reason="t")
            return CommandAck.model_validate_json(
                await agent._on_command(cmd.model_dump_json().encode())
            )

        huge = await send(2**62, "huge")
        assert not huge.accepted and "beyond etcd's revision" in huge.reason, huge
        assert agent.max_epoch == 0 and EpochFence(tmp_path / "n1.epoch").epoch == 0
        real = await send(revision, "real")
        assert real.accepted, real
        assert agent.max_epoch == revision == EpochFence(tmp_path / "n1.epoch").epoch
        await agent.supervisor.close()

        # an agent whose fence file an unchecked command raised before
        poisoned = tmp_path / "old"
        poisoned.mkdir()
        EpochFence(poisoned / "n1.epoch").raise_to(2**62)
        again = Agent(AgentConfig(node=node, job=JOB, work_dir=poisoned))
        again._store = store
        assert again.max_epoch == 2**62
        await again._fence_from_desired()
        assert again.max_epoch == 3 == EpochFence(poisoned / "n1.epoch").epoch
        await again.supervisor.close()
    finally:
        await store.close()
        await admin.close()


_CONFIG_ERROR_WORKER = """
import argparse, sys
from sailor.megatron_patch.errors import failure_record, write_error_file
p = argparse.ArgumentParser()
p.add_argument("--rank", type=int)
p.add_argument("--error-file")
a, _ = p.parse_known_args()
exc = ValueError("this node's worker refuses its configuration")
write_error_file(a.error_file, failure_record(exc, a.rank, -1, in_training=False))
sys.exit(1)
"""


_CONFIG_ERROR_EVERYWHERE = """
import argparse, sys, time
from pathlib import Path
from sailor.megatron_patch.errors import failure_record, write_error_file
p = argparse.ArgumentParser()
p.add_argument("--rank", type=int)
p.add_argument("--world-size", type=int)
p.add_argument("--master")
p.add_argument("--error-file")
a, _ = p.parse_known_args()
# every rank of the world reads the config before any refuses it, as real ranks of one
# world do at about the same time (here one node's worker may start seconds after the
# other's, and the abort of the first failure would stop it before it read anything)
here = Path(__file__).parent / ("started-" + a.master.replace(":", "-"))
here.mkdir(exist_ok=True)
(here / str(a.rank)).touch()
end = time.monotonic() + 30
while len(list(here.iterdir())) < a.world_size and time.monotonic() < end:
    time.sleep(0.02)
exc = ValueError("this node's worker refuses its configuration")
write_error_file(a.error_file, failure_record(exc, a.rank, -1, in_training=False))
sys.exit(1)
"""


def _placed(launch: dict[str, Any]) -> set[str]:
    return {n for p in launch["layout"] for s in p["stages"] for n in s["nodes"]}


async def test_a_node_whose_worker_always_fails_with_a_config_error_is_left_out(
    cluster: Cluster,
) -> None:
    """n2's worker fails at every launch with a configuration error (``retry: false``):
    the controller excludes n2 at the first failure and trains on n1 alone, instead of
    aborting and relaunching on n2 forever (before: 80 launches on n2 in 40 s)."""
    script = cluster.tmp / "config_error_worker.py"
    script.write_text(_CONFIG_ERROR_WORKER)
    good = cluster.worker
    cluster.start_agent("n1")
    cluster.worker = (good[0], str(script), "--rank", "{rank}", "--error-file", "{error_file}")
    cluster.start_agent("n2")
    cluster.worker = good
    cluster.start_controller("c1")

    def excluded_and_running() -> bool:
        ctl = cluster.controllers["c1"][0]
        d = ctl.desired
        return (
            d is not None
            and d.phase is Phase.RUNNING
            and list(d.placement) == ["n1"]
            and "n2" in d.node_health
        )

    await until(excluded_and_running, 40, "n2 was not left out")
    ctl = cluster.controllers["c1"][0]
    assert ctl.desired is not None
    gen, rec = ctl.desired.generation, ctl.desired.node_health["n2"]
    assert rec.exclusions == 1 and rec.excluded_until > time.time() + 500
    await asyncio.sleep(2.0)  # and it stays so: no relaunch on n2
    assert ctl.desired.generation == gen and ctl.desired.phase is Phase.RUNNING
    ctl.audit.sync()
    phases = _records(cluster, "c1", "phase")
    with_n2 = [r for r in phases if r["phase"] == "launch" and "n2" in _placed(r)]
    assert len(with_n2) == 1, with_n2
    (abort,) = [r for r in phases if "excluded n2 until" in r["cause"]]
    assert "retry false" in abort["cause"] and "refuses its configuration" in abort["cause"]
    assert "n2" in next(r for r in phases if r["generation"] == gen)["excluded"]
    snap = await read_status(cluster.etcd, cluster.job, cluster.security("c1"))
    assert list(snap["excluded"]) == ["n2"]
    assert {r["node"]: r["excluded"] != "" for r in snap["nodes"]} == {"n1": False, "n2": True}
    await cluster.audit()


async def test_a_config_every_node_refuses_holds_the_job_and_an_operator_readmits_it(
    cluster: Cluster,
) -> None:
    """Every node's worker refuses the configuration alike (``retry: false``): the job is
    held, not the nodes (before: both nodes excluded, the records kept in etcd past a
    controller restart with no way to clear them). An operator's readmit request, written
    with the controller's etcd identity as `sailor node readmit --all` writes it, ends the
    hold: the leader applies it, deletes the request and launches again (and, the config
    still refused, holds the job again)."""
    script = cluster.tmp / "config_error_worker.py"
    script.write_text(_CONFIG_ERROR_EVERYWHERE)
    cluster.worker = (
        cluster.worker[0],
        str(script),
        *("--rank", "{rank}", "--world-size", "{world_size}", "--master", "{master}"),
        *("--error-file", "{error_file}"),
    )
    cluster.start_agent("n1")
    cluster.start_agent("n2")
    ctl = cluster.start_controller("c1")

    def held(after_gen: int) -> bool:
        d = ctl.desired
        return (
            d is not None
            and d.phase is Phase.IDLE
            and d.generation > after_gen
            and d.job_health.excluded_until > time.time()
        )

    await until(lambda: held(0), 40, "the job was not held")
    assert ctl.desired is not None
    gen = ctl.desired.generation
    assert ctl.desired.node_health == {}  # neither node is at fault
    snap = await read_status(cluster.etcd, cluster.job, cluster.security("c1"))
    assert snap["excluded"] == {} and "refuses its configuration" in snap["job_excluded"]["cause"]
    await asyncio.sleep(1.5)  # and it stays so: no relaunch loop
    assert ctl.desired.generation == gen and ctl.desired.phase is Phase.IDLE
    answer = await request_readmit(
        cluster.etcd, cluster.job, (), True, "ops@test", cluster.security("c1"), wait_s=20
    )
    assert answer.outcome == "applied", "the leader did not apply the readmit request"
    assert answer.done == ("the job",) and answer.unknown == ()
    rid = answer.request_id
    await until(lambda: held(gen), 40, "the job was not launched and held again")
    ctl.audit.sync()
    phases = _records(cluster, "c1", "phase")
    (readmitted,) = [r for r in phases if "readmitted" in r["cause"]]
    assert readmitted["cause"] == f"readmitted the job (operator request {rid} by ops@test)"
    (record,) = _records(cluster, "c1", "readmit")
    assert record["request_id"] == rid and record["reason"] == "forgot the job"
    launches = [r for r in phases if r["phase"] == "launch"]
    # A hold comes at once when both refusals are read at the abort. When one node's refusal
    # is read alone (its peer stopped by the abort before its own check, or reporting late),
    # that node is excluded, and the exclusion is taken back (node_health) either at a later
    # pass of the same generation, once the peer's report shows the failure is the job's (no
    # launch more), or after the next layout (the other node alone) failed alike (one
    # launch more). Either way no node stays excluded.
    causes = [r["cause"] for r in phases]
    later = 0  # exclusions taken back only after a launch without the node
    for i, cause in enumerate(causes):
        for node in re.findall(r"excluded (n\d) until", cause):
            earlier_gen = (
                f"taken back from {node}: its configuration error of an earlier generation "
                "is the job's"
            )
            same_gen = re.compile(rf"not counted against [^:]*\b{node} \(taken back\)")
            back = next((c for c in causes[i:] if earlier_gen in c or same_gen.search(c)), None)
            assert back is not None, f"{node} stays excluded: {causes}"
            later += earlier_gen in back
    assert len(launches) == 2 + later, causes
    store = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        assert await store.get_prefix(f"/sailor/{cluster.job}/readmit/") == []
    finally:
        await store.close()
    await cluster.audit()


async def test_a_readmit_of_nothing_writes_nothing_and_an_unapplied_one_is_withdrawn(
    servers: LocalServers,
) -> None:
    """No leader runs here: a request naming only nodes without a failure record, or
    ``--all`` with none held, is not written (the CLI says so instead of "readmitted"); one
    that no leader takes in time is withdrawn, so a leader that starts later does not act
    on a request reported not applied."""
    sec, job = servers.security("c1"), JOB  # the job the servers' roles are for
    answer = await request_readmit(
        servers.etcd_endpoint, job, ("n7",), False, "ops@test", sec, wait_s=0.5
    )
    assert answer == Answer("", "nothing", unknown=("n7",))
    answer = await request_readmit(servers.etcd_endpoint, job, (), True, "ops@test", sec, 0.5)
    assert answer == Answer("", "nothing")
    store = await connect_etcd(servers.etcd_endpoint, security=sec)
    try:
        desired = f"/sailor/{job}/desired"
        held = DesiredState(epoch=1, node_health={"n7": NodeHealth(failures=1, generation=1)})
        await store.put(desired, held.model_dump_json().encode())
        answer = await request_readmit(servers.etcd_endpoint, job, (), True, "ops@test", sec, 0.5)
        assert answer.request_id and answer.outcome == "withdrawn"
        assert await store.get_prefix(f"/sailor/{job}/readmit/") == []
    finally:
        await store.delete(f"/sailor/{job}/desired")
        await store.close()
