"""Runtime scenarios with real nats-server, etcd, controllers, agents and worker processes.

Workers are the light ``toy_trainer`` (real subprocesses speaking the worker protocol, with a
layout-independent loss), so each scenario takes seconds. After each, ``sailor audit`` must
pass. The servers are secure (conftest): every daemon connects with its own certificate and
NATS login, as in a deployment.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from sailor.controller.audit import read_records
from sailor.controller.phases import PhaseDeadlines
from sailor.controller.plan_deadlines import DeadlineModel
from sailor.controller.status import read_status
from sailor.coordination import connect_etcd
from sailor.localservers import ADMIN
from sailor.schemas.runtime import AgentStatus, CommitRecord, Phase
from tests.integration.cluster_kit import Cluster, until

pytestmark = pytest.mark.usefixtures("no_task_leak")


async def test_join_replan_resume_and_preemption(cluster: Cluster) -> None:
    cluster.start_controller("c1")
    cluster.start_agent("n1", watch_file=True)
    ctl = await cluster.wait_phase(Phase.RUNNING, 30)
    gen1 = ctl.desired.generation
    await cluster.wait_step(ctl, ["n1"], 3, 15)
    cluster.start_agent("n2")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=gen1)
    d = ctl.desired
    assert sorted(d.placement) == ["n1", "n2"] and d.load_step > 0
    # preemption notice with a 20 s deadline: checkpoint inside it, resume on the survivor
    t_notice = asyncio.get_running_loop().time()
    (cluster.tmp / "preempt-n1").write_text(json.dumps({"in_s": 20}))
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=d.generation)
    assert asyncio.get_running_loop().time() - t_notice < 20
    d2 = ctl.desired
    assert list(d2.placement) == ["n2"] and d2.load_step > d.load_step
    # a third save-based change: n3 joins
    cluster.start_agent("n3")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=d2.generation)
    d3 = ctl.desired
    assert sorted(d3.placement) == ["n2", "n3"] and d3.load_step > d2.load_step
    recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
    commits = [r for r in recs if r["kind"] == "commit"]
    assert [r["step"] for r in commits] == [d.load_step, d2.load_step, d3.load_step]
    # retention (keep_checkpoints=1): the third save deleted the first checkpoint once it
    # committed, and the controller its record; the newest recorded one stays beside it
    assert [r["dropped"] for r in commits] == [[], [], [d.load_step]]
    on_disk = sorted(p.name for p in (cluster.tmp / "ckpt" / "sim").iterdir())
    assert on_disk == [f"step-{d2.load_step:08d}", f"step-{d3.load_step:08d}"]
    store = await connect_etcd(cluster.etcd, security=cluster.security(ADMIN))
    try:
        records = await store.get_prefix(ctl.keys.checkpoints)
    finally:
        await store.close()
    steps = [CommitRecord.model_validate_json(r.value).step for r in records]
    assert steps == [d2.load_step, d3.load_step]
    await cluster.audit()


async def test_a_commit_the_controller_does_not_know_survives_every_save(
    cluster: Cluster,
) -> None:
    """A step committed on disk that the controller never gave up on (here made by hand
    above the job's steps, as the commits made after the etcd snapshot a cluster is
    restored from, or another job's in the same directory, would be: no ``prune_below``
    reaches it) survives every save: each Checkpoint names only the saves the controller
    gave up on (``Checkpoint.drop_steps``, none here), and an uncommitted step directory
    stays too. Each commit's audit record names what the save was asked to drop."""
    cluster.start_controller("c1")
    cluster.start_agent("n1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 30)
    sim = cluster.tmp / "ckpt" / "sim"
    unknown, inflight = sim / "step-00005000", sim / "step-00006000"
    unknown.mkdir(parents=True)
    (unknown / "state.json").write_text(json.dumps({"step": 5000, "w": [0.0] * 4}))
    (unknown / "COMMIT").write_text("5000")
    inflight.mkdir()
    (inflight / "rank-0.json").write_text("{}")
    cluster.start_agent("n2")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=ctl.desired.generation)
    first = ctl.desired.load_step
    cluster.start_agent("n3")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=ctl.desired.generation)
    d = ctl.desired
    assert "n3" in d.membership and d.load_step > first > 0  # the join's save
    assert (unknown / "COMMIT").read_text() == "5000" and inflight.is_dir()
    names = sorted(p.name for p in sim.iterdir())
    assert names == [f"step-{s:08d}" for s in (first, d.load_step, 5000, 6000)], names
    recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
    commits = [(r["step"], r["drop_steps"]) for r in recs if r["kind"] == "commit"]
    assert commits == [(first, []), (d.load_step, [])], commits
    await cluster.audit()


async def test_an_aborted_checkpoints_commit_goes_with_the_next_save(cluster: Cluster) -> None:
    """keep_checkpoints = 1. n2 joins: step S1 is committed and recorded. n3 joins: its
    CHECKPOINT of S2 commits on disk, but n2's agent does not report the save (its status
    withholds it: a node whose report is lost), the phase's deadline passes and the
    controller aborts it and relaunches from S1, never recording S2. A notice on n1 then
    saves S3 > S2 with ``prune_below`` S1: S2 is above that, and with ``prune_below`` alone the
    directory held S1, S2 and S3 (the bound is keep + 1 = 2). The controller remembers S2
    as given up (``DesiredState.drop_steps``, in etcd: a standby that takes over in between
    reads it) and the notice's Checkpoint names it (``drop_steps``): its committer deletes
    S2, and the commit empties the list."""
    # CHECKPOINT's deadline in force is the derived one, 10 s (its start-up term), above
    # these 6 s: S2's is waited out, and S1's and S3's saves must finish within it. Left at
    # 10 s: at 6 s, on a host at load 22, S3's save missed it (as did 15 s ones elsewhere)
    cluster.ctl_update = {
        "deadlines": PhaseDeadlines(quiesce=15, checkpoint=6, launch=10, load=30, verify=30)
    }
    cluster.start_controller("c1")
    cluster.start_agent("n1", watch_file=True)
    ctl = await cluster.wait_phase(Phase.RUNNING, 30)
    n2 = cluster.start_agent("n2")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=ctl.desired.generation)
    s1 = ctl.desired.load_step
    assert sorted(ctl.desired.placement) == ["n1", "n2"] and s1 > 0
    report = n2.status

    def withheld() -> AgentStatus:
        st = report()
        return st.model_copy(update={"saved_step": min(st.saved_step, s1)})

    n2.status = withheld  # type: ignore[method-assign]
    cluster.start_agent("n3")
    sim = cluster.tmp / "ckpt" / "sim"

    def committed() -> list[int]:
        return sorted(int(p.parent.name[5:]) for p in sim.glob("step-*/COMMIT"))

    await until(lambda: len(committed()) == 2, 30, "the aborted CHECKPOINT's commit")
    s2 = committed()[1]
    ctl = await cluster.wait_phase(Phase.RUNNING, 60, after_gen=ctl.desired.generation)
    assert ctl.desired.load_step == s1  # S2 was never recorded
    n2.status = report  # type: ignore[method-assign]
    recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
    assert any("checkpoint deadline passed" in str(r.get("cause")) for r in recs)
    assert [r["step"] for r in recs if r["kind"] == "commit"] == [s1]
    assert "n1" in ctl.desired.placement
    assert ctl.desired.drop_steps == (s2,)
    # the leader fails over: the standby reads the steps given up from etcd
    cluster.start_controller("c2")
    await asyncio.sleep(0.5)
    await cluster.stop_controller("c1", crash=True)
    await until(lambda: cluster.controllers["c2"][0].leadership is not None, 15, "c2 leads")
    ctl = cluster.controllers["c2"][0]
    assert ctl.desired is not None and ctl.desired.drop_steps == (s2,)
    snap = await read_status(cluster.etcd, cluster.job, cluster.security("c2"))
    assert snap["given_up_checkpoints"] == [s2]  # what `sailor status --json` shows
    # past S2 (a save of S2 itself would replace it): S3 > S2 > S1 = prune_below
    await cluster.wait_step(ctl, sorted(ctl.desired.placement), s2 + 1, 30)
    (cluster.tmp / "preempt-n1").write_text(json.dumps({"in_s": 20}))
    while "n1" in ctl.desired.placement:
        ctl = await cluster.wait_phase(Phase.RUNNING, 60, after_gen=ctl.desired.generation)
    s3 = ctl.desired.load_step
    assert s3 > s2 > s1, (s1, s2, s3)
    assert committed() == [s1, s3], (s1, s2, s3)  # the recorded one and the newest
    recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
    commits = [(r["step"], r["drop_steps"]) for r in recs if r["kind"] == "commit"]
    assert commits == [(s1, []), (s3, [s2])], commits
    gave_up = [r for r in recs if r["kind"] == "phase" and r.get("drop_steps")]
    assert gave_up and all(r["drop_steps"] == [s2] for r in gave_up)
    assert ctl.desired.drop_steps == ()
    await cluster.audit()


async def test_a_stop_that_is_a_preemption_checkpoints_first(cluster: Cluster) -> None:
    """On GCP a preemption is an ACPI shutdown: systemd stops the agent (SIGTERM) as the
    notice starts, before a watcher poll has seen it. The agent asks its watchers once,
    reports the notice and keeps its workers until the controller has checkpointed and
    stopped them: the survivor resumes from a checkpoint taken after the notice, not from
    the older one (which is what a plain stop, a lost node, would give)."""
    cluster.start_controller("c1")
    cluster.start_agent("n1", watch_file=True)
    ctl = await cluster.wait_phase(Phase.RUNNING, 30)
    cluster.start_agent("n2")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=ctl.desired.generation)
    d = ctl.desired
    assert sorted(d.placement) == ["n1", "n2"] and d.load_step > 0
    await cluster.wait_step(ctl, ["n1", "n2"], d.load_step + 2, 20)
    agent, task = cluster.agents.pop("n1")
    (cluster.tmp / "preempt-n1").write_text(json.dumps({"in_s": 20}))
    agent.stopping.set()  # in the same turn: no watcher poll has run since the file appeared
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=d.generation)
    d2 = ctl.desired
    assert list(d2.placement) == ["n2"] and d2.load_step > d.load_step, (d, d2)
    await asyncio.wait_for(task, 25)
    recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
    assert any(r.get("event_kind") == "preemption_notice" for r in recs)
    assert d2.load_step in [r["step"] for r in recs if r["kind"] == "commit"]
    await cluster.audit()


async def test_node_lost_without_notice_resumes_from_last_commit(cluster: Cluster) -> None:
    cluster.start_controller("c1")
    cluster.start_agent("n1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 30)
    cluster.start_agent("n2")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=ctl.desired.generation)
    committed = ctl.desired.load_step
    await cluster.stop_agent("n2", crash=True)
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=ctl.desired.generation)
    assert list(ctl.desired.placement) == ["n1"]
    assert ctl.desired.load_step == committed
    await cluster.audit()


async def test_leave_of_a_placed_node_is_not_debounced(cluster: Cluster) -> None:
    """A node of the running layout leaving aborts at once, not after the debounce.

    The leader debounces by 4 s from the layout's RUNNING to the abort: before and after,
    the default cluster's 0.2 s (debounced, each status change of the launches on either
    side waited 4 s: four of them, 16 s of a 17 s test)."""
    cluster.start_agent("n1")
    cluster.start_agent("n2")
    cluster.start_controller("c1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 60)
    while sorted(ctl.desired.placement) != ["n1", "n2"]:  # else n2 joins a second layout
        ctl = await cluster.wait_phase(Phase.RUNNING, 60, after_gen=ctl.desired.generation)
    gen = ctl.desired.generation
    short = ctl.cfg
    ctl.cfg = short.model_copy(update={"debounce_s": 4.0})
    await cluster.stop_agent("n2")  # NodeLeft, then the lease revoked
    await until(lambda: ctl.desired.phase is not Phase.RUNNING, 10, "the abort")
    ctl.cfg = short
    ctl.wake(urgent=True)  # a debounce of 4 s under way, if any, ends
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=gen)
    assert list(ctl.desired.placement) == ["n1"]
    recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
    left = next(r for r in recs if r["kind"] == "event" and r["event_kind"] == "node_left")
    abort = next(r for r in recs if r["kind"] == "phase" and str(r["cause"]).startswith("abort"))
    # debounced, the abort would follow the key's deletion by at least 4 s
    assert abort["time"] - left["time"] < 2.0, (left, abort)
    await cluster.audit()


async def test_standby_takes_over_and_deposed_leader_is_refused(cluster: Cluster) -> None:
    from sailor.coordination import NatsCommands, connect_nats
    from sailor.schemas.commands import Abort, CommandAdapter
    from sailor.schemas.runtime import CommandAck

    cluster.start_controller("c1")
    cluster.start_agent("n1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 30)
    old_epoch = ctl.leadership.epoch if ctl.leadership else 0
    cluster.start_controller("c2")
    await asyncio.sleep(0.5)
    await cluster.stop_controller("c1", crash=True)
    new = None
    for _ in range(100):
        c2 = cluster.controllers["c2"][0]
        if c2.leadership is not None:
            new = c2
            break
        await asyncio.sleep(0.05)
    assert new is not None and new.leadership is not None
    assert new.leadership.epoch > old_epoch
    # the run goes on under the new leader without a relaunch
    assert new.desired is not None
    await cluster.wait_step(new, ["n1"], cluster.agents["n1"][0].supervisor.step + 2, 15)
    # make the agent see the new epoch, then replay a command of the old epoch
    agent = cluster.agents["n1"][0]
    agent.max_epoch = max(agent.max_epoch, new.leadership.epoch)
    # the deposed leader's own login (only a controller may publish commands)
    nc = await connect_nats(cluster.nats_url, "c1-again", security=cluster.security("c1"))
    try:
        stale = Abort(command_id="stale-1", epoch=old_epoch, node_id="n1", reason="deposed")
        raw = await NatsCommands(nc, new.keys).request("n1", CommandAdapter.dump_json(stale), 2)
        ack = CommandAck.model_validate_json(raw)
        assert not ack.accepted and "stale epoch" in ack.reason
    finally:
        await nc.close()
    assert agent.supervisor.state == "running"
    await cluster.audit()


async def test_forged_and_malformed_events_are_rejected(cluster: Cluster) -> None:
    from sailor.coordination import NatsEventBus, connect_nats

    cluster.start_controller("c1")
    cluster.start_agent("n1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 30)
    # a hostile agent: n1's own login may publish only on n1's event subjects
    nc = await connect_nats(cluster.nats_url, "forger", security=cluster.security("n1"))
    try:
        bus = NatsEventBus(nc, ctl.keys, durable="x", source="n1")
        await bus.publish("node_joined", b"not json", msg_id="bad-1")
        await bus.publish("node_left", b'{"kind":"node_left","schema_version":99}', msg_id="bad-2")
        forged = {
            "kind": "preemption_notice",
            "event_id": "forged-1",
            "node_id": "ghost",
            "time": 1.0,
            "deadline": 2.0,
        }
        await bus.publish("preemption_notice", json.dumps(forged).encode(), msg_id="forged-1")
        far = {**forged, "event_id": "forged-2", "node_id": "n1", "deadline": 9e9}
        await bus.publish("preemption_notice", json.dumps(far).encode(), msg_id="forged-2")
    finally:
        await nc.close()
    await asyncio.sleep(1.5)
    recs = read_records([cluster.tmp / "audit-c1.jsonl"])
    assert sum(r["kind"] == "event_rejected" for r in recs) == 4
    assert cluster.controllers["c1"][0].desired.phase is Phase.RUNNING
    await cluster.audit()


async def test_an_agent_cannot_speak_for_another_node(cluster: Cluster) -> None:
    """n1, with its own certificate and login, sends events about n2 on its own subjects (the
    only ones NATS lets it publish on) and tries to write n2's status: nothing changes but
    one audit record per event, each naming the subject it came on."""
    import time

    from sailor.coordination import (
        Keys,
        NatsEventBus,
        PermanentError,
        TemporaryError,
        connect_etcd,
        connect_nats,
    )
    from sailor.schemas.events import (
        Heartbeat,
        NodeJoined,
        NodeLeft,
        PreemptionNotice,
        WorkerFailed,
    )
    from sailor.schemas.runtime import AgentStatus

    cluster.start_controller("c1")
    cluster.start_agent("n1")
    cluster.start_agent("n2")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40)
    while sorted(ctl.desired.placement) != ["n1", "n2"]:
        ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=ctl.desired.generation)
    before = ctl.desired
    keys = Keys(job=cluster.job)
    now = time.time()
    n2 = cluster.agents["n2"][0].node
    forged = [
        (
            "preemption_notice",
            PreemptionNotice(
                event_id="f-notice", node_id="n2", time=now, deadline=now + 30, source="forged"
            ),
        ),
        ("node_joined", NodeJoined(event_id="f-join", node_id="n2", time=now, node=n2)),
        ("node_left", NodeLeft(event_id="f-leave", node_id="n2", time=now, reason="forged")),
        (
            "worker_failed",
            WorkerFailed(
                event_id="f-fail",
                node_id="n2",
                time=now,
                plan_id=before.plan.plan_id if before.plan else "",
                cause="forged",
            ),
        ),
        ("heartbeat", Heartbeat(event_id="f-beat", node_id="n2", time=now, step=10**6)),
    ]
    nc = await connect_nats(cluster.nats_url, "n1-forger", security=cluster.security("n1"))
    store = await connect_etcd(cluster.etcd, security=cluster.security("n1"))
    try:
        bus = NatsEventBus(nc, keys, durable="unused", source="n1")
        for kind, ev in forged:
            await bus.publish(kind, ev.model_dump_json().encode(), ev.event_id)
        # n2's subjects are not n1's to publish on (NATS refuses), nor n2's status to write
        other = NatsEventBus(nc, keys, durable="unused", source="n2", op_timeout=0.5)
        with pytest.raises(TemporaryError):
            await other.publish("node_left", forged[2][1].model_dump_json().encode(), "f-2")
        status = AgentStatus(node_id="n2", epoch=before.epoch, state="failed", time=now)
        with pytest.raises(PermanentError):
            await store.put(keys.status("n2"), status.model_dump_json().encode())
    finally:
        await store.close()
        await nc.close()

    ids = {ev.event_id for _, ev in forged}

    def rejected() -> dict[str, dict[str, object]]:
        recs = read_records([cluster.tmp / "audit-c1.jsonl"])
        return {
            str(r["event_id"]): r
            for r in recs
            if r["kind"] == "event_rejected" and r.get("event_id") in ids
        }

    loop = asyncio.get_running_loop()
    end = loop.time() + 15
    while set(rejected()) != ids:
        assert loop.time() < end, f"not all refused: {sorted(ids - set(rejected()))}"
        await asyncio.sleep(0.1)
    for r in rejected().values():
        assert str(r["subject"]).startswith(f"sailor.{cluster.job}.events.n1.")
        assert "n1" in str(r["reason"]) and r["node_id"] == "n2"
    await asyncio.sleep(1.5)  # time for a wrong reaction to show
    recs = read_records([cluster.tmp / "audit-c1.jsonl"])
    assert not [r for r in recs if r["kind"] == "event" and r.get("event_id") in ids]
    after = cluster.controllers["c1"][0].desired
    assert after.phase is Phase.RUNNING and after.generation == before.generation
    assert sorted(after.placement) == ["n1", "n2"]
    store = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        assert await store.get(keys.notice("n2")) is None
    finally:
        await store.close()
    # every accepted event kept its subject, and it was its own node's
    assert all(
        str(r.get("subject", "")).startswith(f"sailor.{cluster.job}.events.{r['node_id']}.")
        for r in recs
        if r["kind"] == "event"
    )
    await cluster.audit()


async def test_nats_and_etcd_restart_mid_run(
    cluster: Cluster, nats_server: object, etcd_server: object
) -> None:
    cluster.start_controller("c1")
    cluster.start_agent("n1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 30)
    gen = ctl.desired.generation
    await asyncio.to_thread(nats_server.restart)  # type: ignore[attr-defined]
    await asyncio.to_thread(etcd_server.restart)  # type: ignore[attr-defined]
    step = cluster.agents["n1"][0].supervisor.step
    await cluster.wait_step(ctl, ["n1"], step + 5, 20)
    # still the same layout, and the controller still reconciles: a join is picked up
    cluster.start_agent("n2")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=gen)
    assert sorted(ctl.desired.placement) == ["n1", "n2"]
    await cluster.audit()


async def test_notice_while_nats_is_down_goes_through_etcd(
    cluster: Cluster, nats_server: object
) -> None:
    """Issue 18, item 5: NATS down when the notice arrives. The leader learns it from the
    agent's status record at once (QUIESCE while NATS is still down); the event follows once
    NATS is back and is a duplicate. The outage is 4 s here (the chaos scenario *notice during
    NATS outage* has the 10 s one, and checks that the checkpoint commits before the deadline
    with real workers: this sim worker saves only at the exact step asked, which the outage
    lets it pass): its CHECKPOINT's deadline is waited out, 6 s here (derived, it was the
    default cluster's 15 s), which still ends 2 s after NATS is back."""
    cluster.ctl_update = {
        "deadlines": PhaseDeadlines(
            quiesce=15,
            checkpoint=6,
            launch=10,
            load=30,
            verify=30,
            derive=DeadlineModel(enabled=False),
        )
    }
    cluster.start_controller("c1")
    cluster.start_agent("n1", watch_file=True)
    cluster.start_agent("n2")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40)
    while sorted(ctl.desired.placement) != ["n1", "n2"]:
        ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=ctl.desired.generation)
    gen = ctl.desired.generation
    await asyncio.to_thread(nats_server.stop)  # type: ignore[attr-defined]
    loop = asyncio.get_running_loop()
    t_down = loop.time()
    (cluster.tmp / "preempt-n1").write_text(json.dumps({"deadline": time.time() + 25}))
    while ctl.desired.phase is Phase.RUNNING and loop.time() - t_down < 4:
        await asyncio.sleep(0.05)
    assert ctl.desired.phase is not Phase.RUNNING, "notice not acted on while NATS was down"
    assert "preemption notice" in ctl.desired.cause
    await asyncio.sleep(max(0.0, 4 - (loop.time() - t_down)))
    await asyncio.to_thread(nats_server.start)  # type: ignore[attr-defined]
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=gen)
    assert list(ctl.desired.placement) == ["n2"]
    for _ in range(100):  # the agent's retried publish arrives once NATS is back
        recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
        if any(r["kind"] == "event_duplicate" for r in recs):
            break
        await asyncio.sleep(0.1)
    notices = [r for r in recs if r["kind"] == "event" and r["event_kind"] == "preemption_notice"]
    assert len(notices) == 1, notices  # applied once
    assert any(r["kind"] == "event_duplicate" for r in recs)
    await cluster.audit()


async def test_a_launch_during_the_agents_shutdown_starts_no_worker(cluster: Cluster) -> None:
    """A Launch handled while the agent shuts down is refused, or its workers are killed
    with the rest: no worker process (nor its reader tasks) outlives the agent."""
    from sailor.schemas.commands import Launch
    from sailor.schemas.runtime import CommandAck

    cluster.start_controller("c1")
    agent = cluster.start_agent("n1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 30)
    await cluster.wait_step(ctl, ["n1"], 1, 15)
    d = ctl.desired
    assert d is not None and d.plan is not None
    launch = (
        Launch(
            command_id="late",
            epoch=d.epoch,
            node_id="n1",
            plan=d.plan,
            ranks=(0,),
            world_size=1,
            master="127.0.0.1:1",
            generation=d.generation + 1,
        )
        .model_dump_json()
        .encode()
    )
    _, raw = await asyncio.gather(agent._close_supervisor(), agent._on_command(launch))
    ack = CommandAck.model_validate_json(raw)
    live = [w for w in agent.supervisor.workers if w.exit_code is None]
    assert not live, (ack, live)
    raw = await agent._on_command(launch.replace(b'"late"', b'"later"'))
    ack = CommandAck.model_validate_json(raw)
    assert not ack.accepted and ack.reason == "agent shutting down", ack
    assert not [w for w in agent.supervisor.workers if w.exit_code is None]
