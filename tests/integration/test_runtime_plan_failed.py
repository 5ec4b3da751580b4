"""A failed search's reason (``sailor status``: "last failed search") describes the present.

Real nats-server and etcd (secure), a controller and an agent; the planner finds no layout
for any node set (a search that fails, as one for GPUs that cannot hold the model does).
While the job waits for that replan the desired state in etcd says why it failed; once the
node has left and nothing is to be planned (the job IDLE without nodes) it says nothing.
Before, only a launch or an adopted plan cleared it: the job showed the failure of a search
for nodes long gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sailor.controller.audit import read_records
from sailor.controller.daemon import Controller
from sailor.controller.planning import PlanResult
from sailor.coordination import Keys, connect_etcd
from sailor.localservers import ADMIN, LocalServers
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Plan
from sailor.schemas.precision import Precision
from sailor.schemas.runtime import DesiredState, Phase
from tests.integration.test_runtime_scenarios import Cluster

pytestmark = pytest.mark.usefixtures("no_task_leak")


class _NoLayout:
    """A planner whose every search fails, with the reason a planner gives."""

    def plan(
        self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: Precision | None = None
    ) -> PlanResult:
        raise ValueError(f"no layout fits the model on {len(nodes)} node(s)")


@pytest.fixture
async def cluster(tmp_path: Path, servers: LocalServers) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path, servers)
    try:
        yield c
    finally:
        await c.close()


async def _plan_failed(cluster: Cluster, want_empty: bool, timeout: float = 20.0) -> str:
    """The desired state's ``plan_failed`` in etcd, once it is empty (``want_empty``) or not."""
    store = await connect_etcd(cluster.etcd, security=cluster.security(ADMIN))
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            kv = await store.get(Keys(job=cluster.job).desired)
            note = DesiredState.model_validate_json(kv.value).plan_failed if kv else ""
            if (note == "") == want_empty or loop.time() > end:
                return note
            await asyncio.sleep(0.1)
    finally:
        await store.close()


async def test_a_failed_searchs_reason_goes_once_no_replan_is_wanted(cluster: Cluster) -> None:
    ctl = Controller(cluster.ctl_config("c1"), planner=_NoLayout())
    cluster.controllers["c1"] = (ctl, asyncio.create_task(ctl.run(), name="test-ctl-c1"))
    cluster.start_agent("n1")
    note = await _plan_failed(cluster, want_empty=False)
    assert "no layout fits the model on 1 node(s)" in note and "failed 1x" in note
    assert ctl.desired is not None and ctl.desired.phase is Phase.IDLE

    await cluster.stop_agent("n1")  # its registration goes: nothing left to plan for
    assert await _plan_failed(cluster, want_empty=True) == ""
    ctl.audit.sync()
    phases = [r for r in read_records([cluster.tmp / "audit-c1.jsonl"]) if r["kind"] == "phase"]
    assert any("no longer wanted (no replan is)" in str(r["cause"]) for r in phases)
    await cluster.audit()
