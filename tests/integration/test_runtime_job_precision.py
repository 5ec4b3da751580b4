"""The job's precision survives a leader change: a V100 that joins later is left out.

Real nats-server and etcd (secure), two controllers, toy trainers. The first launch on an
A100 fixes the job at bf16 in the desired state (etcd); the leader crashes and the standby
takes over; a V100 node joins. Before, each plan derived its own precision and the relaunch
ran fp16 with the V100 in it (a bf16 model resumed in fp16 overflows). Now the new leader
reads the job's precision back from etcd: the V100 is not admitted (the reason in the audit's
``not_admitted`` record), and the job runs on in bf16 without a reconfiguration.
"""

from __future__ import annotations

import asyncio

import pytest

from sailor.controller.audit import read_records
from sailor.schemas.runtime import Phase
from tests.integration.cluster_kit import Cluster

pytestmark = pytest.mark.usefixtures("no_task_leak")


async def test_a_new_leader_keeps_the_jobs_precision_when_a_v100_joins(cluster: Cluster) -> None:
    cluster.start_controller("c1")
    cluster.start_agent("n1", gpu="A100-40")
    ctl = await cluster.wait_phase(Phase.RUNNING, 30)
    assert ctl.desired is not None and ctl.desired.job_precision == "bf16"
    first = ctl.desired.generation
    cluster.start_controller("c2")
    await asyncio.sleep(0.5)
    await cluster.stop_controller("c1", crash=True)
    for _ in range(100):
        if cluster.controllers["c2"][0].leadership is not None:
            break
        await asyncio.sleep(0.05)
    new = cluster.controllers["c2"][0]
    assert new.leadership is not None and new.desired is not None
    assert new.desired.job_precision == "bf16"  # read back from etcd

    cluster.start_agent("n2", gpu="V100-16")
    # the V100 cannot run bf16: it is not admitted (no reconfiguration for it), the reason in
    # the new leader's audit, and the job keeps running its generation in bf16
    refused: list[dict[str, object]] = []
    for _ in range(200):
        recs = read_records([cluster.tmp / "audit-c2.jsonl"])
        refused = [r for r in recs if r["kind"] == "not_admitted" and "n2" in r["nodes"]]
        if refused:
            break
        await asyncio.sleep(0.1)
    assert refused, "n2 was never reported not admitted"
    assert "no bf16 units" in refused[-1]["nodes"]["n2"]  # type: ignore[index]
    await asyncio.sleep(2.0)  # a join would have begun a reconfiguration by now
    d = new.desired
    assert d is not None and d.phase is Phase.RUNNING and d.generation == first
    assert d.job_precision == "bf16" and set(d.placement) == {"n1"}
    await cluster.audit()
