"""In-place reconfiguration through the real control plane (nats-server, etcd, controller,
agents) with toy workers: the worker processes survive every change the controller makes,
joins wait for the new node's warm spare, a loss without notice rolls the survivors back to
the last commit in process, and a failure of the in-place path falls back to the restart
path once. The audit records which path each generation took, and ``sailor audit`` passes.
(The real worker's side of the protocol: tests/integration/test_in_place_worker.py.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sailor.controller.audit import read_records
from sailor.localservers import LocalServers
from sailor.schemas.runtime import Phase
from tests.integration.cluster_kit import Cluster

pytestmark = pytest.mark.usefixtures("no_task_leak")


@pytest.fixture
async def cluster(tmp_path: Path, servers: LocalServers) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path, servers) as c:
        c.in_place, c.warm_spares = True, 1
        yield c


def _pids(cluster: Cluster, node: str) -> set[int]:
    return {w.proc.pid for w in cluster.agents[node][0].supervisor.workers}


def _launches(cluster: Cluster) -> list[dict[str, object]]:
    recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
    return [r for r in recs if r["kind"] == "phase" and r["phase"] == "launch"]


async def _spares_up(cluster: Cluster, node: str, timeout: float = 30) -> None:
    sup = cluster.agents[node][0].supervisor
    for _ in range(int(timeout / 0.05)):
        if sup.spares_ready >= 1:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{node}: no warm spare")


async def test_notice_join_and_loss_keep_the_worker_processes(cluster: Cluster) -> None:
    cluster.start_controller("c1")
    cluster.start_agent("n1", watch_file=True)
    cluster.start_agent("n2")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40)
    while sorted(ctl.desired.placement) != ["n1", "n2"]:
        ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=ctl.desired.generation)
    d = ctl.desired
    await cluster.wait_step(ctl, ["n1", "n2"], d.load_step + 2, 15)
    kept = _pids(cluster, "n2")

    # notice on n1: checkpoint, then n2 goes on in the same process
    (cluster.tmp / "preempt-n1").write_text(json.dumps({"in_s": 20}))
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=d.generation)
    d1 = ctl.desired
    assert list(d1.placement) == ["n2"] and d1.path == "in_place"
    assert d1.load_step > d.load_step
    assert _pids(cluster, "n2") == kept

    # join: n3 counts once its spare is up; the spare becomes its rank
    cluster.start_agent("n3")
    await _spares_up(cluster, "n3")
    spare = {w.proc.pid for w in cluster.agents["n3"][0].supervisor.spares}
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=d1.generation)
    d2 = ctl.desired
    assert sorted(d2.placement) == ["n2", "n3"] and d2.path == "in_place"
    assert _pids(cluster, "n2") == kept and _pids(cluster, "n3") == spare

    # loss without notice of n3: n2's worker is asked to hold, rolls back to the commit
    await cluster.wait_step(ctl, ["n2", "n3"], d2.load_step + 3, 15)
    await cluster.stop_agent("n3", crash=True)
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=d2.generation)
    d3 = ctl.desired
    assert list(d3.placement) == ["n2"] and d3.path == "in_place"
    assert d3.load_step == d2.load_step  # nothing newer was committed
    assert _pids(cluster, "n2") == kept
    paths = [r.get("path") for r in _launches(cluster)]
    assert paths[-3:] == ["in_place"] * 3, paths
    await cluster.audit()


async def test_a_failed_in_place_launch_falls_back_to_restart(cluster: Cluster) -> None:
    cluster.warm_spares = 0
    cluster.start_controller("c1")
    cluster.start_agent("n1", watch_file=True)
    cluster.start_agent("n2")
    ctl = await cluster.wait_phase(Phase.RUNNING, 40)
    while sorted(ctl.desired.placement) != ["n1", "n2"]:
        ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=ctl.desired.generation)
    gen = ctl.desired.generation
    await cluster.wait_step(ctl, ["n1", "n2"], ctl.desired.load_step + 2, 15)
    held = cluster.agents["n2"][0].supervisor
    # n2's held worker cannot rebuild: its directive will name a checkpoint that is not there
    original = held._hand_over

    def broken(w, rank, generation, argv, gen_dir):  # type: ignore[no-untyped-def]
        bad = tuple("/nonexistent" if a == str(cluster.tmp / "ckpt") else a for a in argv)
        bad = tuple(
            a if i == 0 or argv[i - 1] != "--load-step" else "999999" for i, a in enumerate(bad)
        )
        original(w, rank, generation, bad, gen_dir)
        held._hand_over = original  # once

    held._hand_over = broken  # type: ignore[method-assign]
    (cluster.tmp / "preempt-n1").write_text(json.dumps({"in_s": 30}))
    ctl = await cluster.wait_phase(Phase.RUNNING, 60, after_gen=gen + 1)
    d = ctl.desired
    assert list(d.placement) == ["n2"] and d.path == "restart"
    assert "fallback" in d.path_reason
    launches = _launches(cluster)
    assert [r.get("path") for r in launches[-2:]] == ["in_place", "restart"], launches
    await cluster.audit()
