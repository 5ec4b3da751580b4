"""A restart launch that gives one node's rank to a warm spare and another node's to a new
process, through the real control plane (nats-server, etcd, controller, agents) with real
training workers (``sailor.training_process``, tiny-gpt, gloo).

The agent hands a restart launch's ranks to its warm spares too (sooner than a new process);
a node without a spare starts one. Both must run the restart path's protocol: the directive
of a restart launch has no ``--in-place``. Before, a spare took every directive as in place
(it ran the in-place handshake, which the new process on the other node never joins): the
world hung until the LOAD deadline, the generation was aborted and launched again (seen
after an in-place launch fell back to the restart path: 30 s lost, the deadline stretched).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sailor.agent.worker_argv import DEFAULT_WORKER_ARGV
from sailor.controller.audit import read_records
from sailor.localservers import LocalServers
from sailor.schemas.runtime import Phase
from tests.integration.cluster_kit import Cluster

pytestmark = pytest.mark.usefixtures("no_task_leak")

WORKER = (*DEFAULT_WORKER_ARGV, "--min-step-s", "0.1", "--timeout-s", "60")


@pytest.fixture
async def cluster(tmp_path: Path, servers: LocalServers) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path, servers) as c:
        c.worker, c.in_place, c.warm_spares = WORKER, False, 1
        c.ctl_update = {"planner": "sailor", "model": "tiny-gpt", "global_batch_size": 4}
        yield c


async def _spare_up(cluster: Cluster, node: str, timeout: float = 60) -> int:
    """The pid of ``node``'s warm spare, once it is warm."""
    sup = cluster.agents[node][0].supervisor
    for _ in range(int(timeout / 0.05)):
        warm = [w.proc.pid for w in sup.spares if w.warm and w.exit_code is None]
        if warm:
            return warm[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"{node}: no warm spare")


async def test_a_restart_launch_of_a_spare_and_a_new_process_comes_up(cluster: Cluster) -> None:
    cluster.start_controller("c1")
    cluster.start_agent("n1", gpu="cpu")
    ctl = await cluster.wait_phase(Phase.RUNNING, 90)
    d = ctl.desired
    await cluster.wait_step(ctl, ["n1"], d.load_step + 2, 30)
    spare = await _spare_up(cluster, "n1")
    cluster.warm_spares = 0  # n2 starts its rank as a new process
    cluster.start_agent("n2", gpu="cpu")
    ctl = await cluster.wait_phase(Phase.RUNNING, 120, after_gen=d.generation)
    d2 = ctl.desired
    recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
    aborts = [
        r["cause"]
        for r in recs
        if r["kind"] == "phase" and str(r.get("cause", "")).startswith("abort")
    ]
    # the join's generation came up at once: no abort, no second launch
    assert not aborts, aborts
    assert d2.generation == d.generation + 1 and sorted(d2.placement) == ["n1", "n2"]
    assert d2.path == "restart"
    # n1's rank of it is the spare, n2's a new process: the mix this test is about
    assert [w.proc.pid for w in cluster.agents["n1"][0].supervisor.workers] == [spare]
    await cluster.wait_step(ctl, ["n1", "n2"], d2.load_step + 2, 30)
    await cluster.audit()
