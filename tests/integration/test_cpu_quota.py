"""CPU quotas on this machine, with real cgroups and real processes (no mocks).

* A worker the agent's supervisor starts under a node's quota joins the node's cgroup before
  its own code runs, uses about the quota's share of a core, and speeds up when the quota is
  raised while it runs; the cgroup is gone after the stop.
* With ``cpu_quota_from='ready'`` a worker starts unthrottled and joins when it reports ready.
* An agent of a CPU kind with a quota reports it in its join event and its status (the
  controller's audit and etcd), changes it at run time, and removes its cgroup on stop.

Skipped, with the reason, where this host has no writable cpu controller (not root, a
read-only /sys/fs/cgroup, cgroup v2 without the cpu controller).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from sailor.agent.agent_config import AgentConfig
from sailor.agent.cpu_quota import CpuQuota, detect, node_cgroup
from sailor.agent.daemon import Agent
from sailor.agent.supervisor import Supervisor
from sailor.coordination import Keys, NatsEventBus, connect_etcd, connect_nats
from sailor.localservers import LocalServers
from sailor.schemas.commands import Launch
from sailor.schemas.events import EventAdapter, NodeJoined
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.runtime import AgentStatus
from tests.integration.test_worker_signals import launch_of

_WHERE = detect()
needs_cgroup = pytest.mark.skipif(
    isinstance(_WHERE, str), reason=f"CPU quotas cannot be tested here: {_WHERE}"
)

BUSY = (sys.executable, "-c", "while True: pass")
"""A worker that computes as fast as it is allowed to."""

PLAN = Plan(
    model="tiny-gpt",
    global_batch_size=1,
    pipelines=(
        Pipeline(
            stages=(
                Stage(
                    first_layer=0,
                    last_layer=5,
                    replica=ReplicaGroup(gpu_type="cpu-slow", zone="z", gpus_per_node=1),
                ),
            ),
            microbatch_size=1,
            num_microbatches=1,
        ),
    ),
)


def _launch() -> Launch:
    """Generation 1 of the one-rank plan on n1."""
    return launch_of(PLAN)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (proc(5): fields 14 and 15 of stat)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _share(pid: int, seconds: float) -> float:
    """Cores' worth ``pid`` used over ``seconds`` of wall time."""
    c0, t0 = _cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return (_cpu_seconds(pid) - c0) / (time.monotonic() - t0)


async def _exec_done(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until the join-and-exec shell has become the worker (``exec`` keeps the pid)."""
    async with asyncio.timeout(timeout_s):
        while Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] != BUSY[0].encode():
            await asyncio.sleep(0.01)


@needs_cgroup
@pytest.mark.usefixtures("favoured_cpu")  # other jobs on this machine would hide the quota
async def test_a_worker_runs_at_its_quota_and_speeds_up_when_it_is_raised(tmp_path: Path) -> None:
    job = f"t-{uuid.uuid4().hex[:8]}"
    quota = CpuQuota.start(job, "n1", 0.3)
    assert quota.available and quota.state() == pytest.approx(0.3), quota.reason
    cg = quota.cgroup
    assert cg is not None
    sup = Supervisor(tmp_path, worker_argv=BUSY, exec_prefix=quota.exec_prefix)
    launch = _launch()
    await sup.launch(launch)
    try:
        pid = sup.workers[0].proc.pid
        await _exec_done(pid)
        # the worker itself (same pid, now python) is inside: it joined before exec
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        assert any(line.endswith(f"/{cg.rel}") for line in lines), lines
        assert cg.pids() == [pid]
        await asyncio.sleep(0.3)  # past the first period, whose quota start-up spent
        n0 = cg.stat().get("nr_throttled", 0)
        throttled = await _share(pid, 2.0)
        n1 = cg.stat().get("nr_throttled", 0)
        print(f"busy loop at quota 0.3: {throttled:.3f} cores, throttled in {n1 - n0} periods")
        assert 0.15 <= throttled <= 0.45, throttled
        assert n1 - n0 >= 10  # of ~20 periods: the quota, not the other jobs, held it back

        quota.set(1.0)  # at run time: the same worker, without a restart
        assert quota.state() == pytest.approx(1.0)
        await asyncio.sleep(0.2)
        raised = await _share(pid, 1.5)
        print(f"busy loop at quota 1.0: {raised:.3f} cores")
        assert raised >= max(0.5, 1.5 * throttled), (throttled, raised)
    finally:
        await sup.abort()
        assert quota.close()
    assert not cg.path.exists()
    assert not cg.path.parent.exists()  # sailor/<job>: nothing else used it


READY_THEN_BUSY = (
    sys.executable,
    "-c",
    "import json, time\n"
    "t = time.monotonic()\n"
    "while time.monotonic() - t < 1.0: pass\n"  # start-up: a second of CPU, unthrottled
    "print(json.dumps({{'event': 'ready'}}), flush=True)\n"  # braces: argv is a template
    "while True: pass\n",
)
"""A worker that computes through its start-up, reports ready, then trains (a busy loop)."""


def _in_cgroup(pid: int, rel: object) -> bool:
    return any(
        line.endswith(f"/{rel}") for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    )


@needs_cgroup
@pytest.mark.usefixtures("favoured_cpu")
async def test_a_quota_from_ready_leaves_the_start_up_unthrottled(tmp_path: Path) -> None:
    """``cpu_quota_from='ready'``: the worker starts outside the node's cgroup (its start-up,
    torch's import and the rendezvous for a real one, runs at full speed) and is moved in when
    it reports ready; from then on it runs at the quota."""
    node = NodeSpec(node_id="n1", gpu_type="cpu-slow", gpus=1, zone="z", address="127.0.0.1")
    job = f"t-{uuid.uuid4().hex[:8]}"
    cfg = AgentConfig(
        job=job,
        node=node,
        work_dir=tmp_path,
        worker_argv=READY_THEN_BUSY,
        cpu_quota=0.3,
        cpu_quota_from="ready",
    )
    agent = Agent(cfg)
    agent.quota = CpuQuota.start(job, "n1", 0.3)
    agent._attach_workers()
    cg = agent.quota.cgroup
    assert cg is not None and agent.supervisor.exec_prefix == ()
    launch = _launch()
    sup = agent.supervisor
    await sup.launch(launch)
    try:
        pid = sup.workers[0].proc.pid
        await asyncio.sleep(0.3)
        assert not sup.workers[0].started and not _in_cgroup(pid, cg.rel)
        early = await _share(pid, 0.5)  # start-up: outside the quota
        async with asyncio.timeout(10):
            while not sup.workers[0].started:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert _in_cgroup(pid, cg.rel) and cg.pids() == [pid]
        await asyncio.sleep(0.3)
        late = await _share(pid, 2.0)
        print(f"start-up {early:.3f} cores, after ready {late:.3f} cores (quota 0.3)")
        # Unthrottled is above the quota, not a whole core: on a 2-core host another test
        # worker takes its share (0.438 seen under CI's -n 2; a throttled one reads <= 0.3).
        assert early >= 1.25 * 0.3, early
        assert 0.15 <= late <= 0.45, late
    finally:
        await sup.abort()
        assert agent.quota.close()


@needs_cgroup
@pytest.mark.usefixtures("no_task_leak")
async def test_an_agent_of_a_cpu_kind_reports_and_changes_its_quota(
    servers: LocalServers, tmp_path: Path
) -> None:
    job = "t"
    node = NodeSpec(node_id="n3", gpu_type="cpu-slow", gpus=1, zone="z", address="127.0.0.1")
    cfg = AgentConfig(
        job=job,
        node=node,
        nats_urls=servers.nats_urls,
        etcd_endpoints=servers.etcd_endpoints,
        lease_ttl_s=1,
        work_dir=tmp_path / "agents",
        security=servers.security("n3"),
        cpu_quota=0.5,
        status_interval_s=0.05,
    )
    nc = await connect_nats(servers.nats_url, "c1", security=servers.security("c1"))
    bus = NatsEventBus(nc, Keys(job=job), durable="quota-test")
    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    agent = Agent(cfg)
    task = asyncio.create_task(agent.run(), name="test-agent-n3")
    try:
        await bus.ensure_stream()
        joined: NodeJoined | None = None
        async with asyncio.timeout(30):
            while joined is None:
                for d in await bus.fetch(10, timeout=0.5):
                    await d.ack()
                    ev = EventAdapter.validate_json(d.data)
                    joined = ev if isinstance(ev, NodeJoined) else joined
        assert joined.facts is not None
        assert joined.facts.summary() == {"kind": "cpu", "cpu_quota": 0.5}
        assert node_cgroup(job, "n3").quota() == pytest.approx(0.5)

        async def status() -> AgentStatus | None:
            kv = await store.get(Keys(job=job).status("n3"))
            return None if kv is None else AgentStatus.model_validate_json(kv.value)

        async with asyncio.timeout(10):
            while (st := await status()) is None or st.cpu_quota != pytest.approx(0.5):
                await asyncio.sleep(0.05)
        assert await agent.set_cpu_quota(0.2) == pytest.approx(0.2)  # the node becomes slow
        async with asyncio.timeout(10):
            while (st := await status()) is None or st.cpu_quota != pytest.approx(0.2):
                await asyncio.sleep(0.05)
        # changed from outside the agent (a chaos scenario): the status follows the kernel
        node_cgroup(job, "n3").set_quota(0.4)
        async with asyncio.timeout(10):
            while (st := await status()) is None or st.cpu_quota != pytest.approx(0.4):
                await asyncio.sleep(0.05)
    finally:
        agent.stopping.set()
        await asyncio.wait_for(task, 15)
        await bus.close()
        await nc.close()
        await store.close()
    with pytest.raises(LookupError):
        node_cgroup(job, "n3")  # removed on stop
