"""The controller's periodic checkpoint through real etcd, NATS, agents and toy workers: a
node lost without notice relaunches from the last periodic commit, not from a fresh start.

Before it, commits were recorded only at reconfigurations and notices: a job that ran with
no join, leave or notice relaunched from its start (or the last reconfiguration) when a node
vanished."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sailor.controller.audit import read_records
from sailor.coordination import Keys, connect_etcd
from sailor.localservers import LocalServers
from sailor.schemas.runtime import AgentStatus, Phase
from tests.integration.cluster_kit import WORKER, Cluster, until

pytestmark = pytest.mark.usefixtures("no_task_leak")


@pytest.fixture
async def cluster(tmp_path: Path, servers: LocalServers) -> AsyncIterator[Cluster]:
    """The defaults but a periodic checkpoint every 2 s (toy steps of 0.15 s)."""
    async with Cluster(tmp_path, servers) as c:
        c.ctl_update = {"checkpoint_every_s": 2.0}
        yield c


def _periodic(cluster: Cluster) -> list[dict[str, Any]]:
    for ctl, _task in cluster.controllers.values():
        ctl.audit.sync()
    recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
    return [r for r in recs if r["kind"] == "periodic_checkpoint"]


async def test_a_node_lost_without_notice_relaunches_from_the_periodic_checkpoint(
    cluster: Cluster,
) -> None:
    cluster.start_agent("n1")
    cluster.start_agent("n2")
    cluster.start_controller("c1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 60)
    while sorted(ctl.desired.placement) != ["n1", "n2"]:  # n2 registered after the first pass
        ctl = await cluster.wait_phase(Phase.RUNNING, 60, after_gen=ctl.desired.generation)
    gen = ctl.desired.generation
    before = ctl.desired.load_step  # -1, or the commit of n2's join

    def committed() -> list[int]:
        return [
            int(r["step"])
            for r in _periodic(cluster)
            if r["outcome"] == "committed" and r["generation"] == gen
        ]

    await until(committed, 30, "a periodic checkpoint committed")
    first = committed()[0]
    assert first > max(before, 0)
    # the workers trained on past it: no stop was asked
    await cluster.wait_step(ctl, ["n1", "n2"], first + 3, 10)
    await cluster.stop_agent("n2", crash=True)  # no notice, no leave: the lease expires
    ctl = await cluster.wait_phase(Phase.RUNNING, 40, after_gen=gen)
    d = ctl.desired
    assert list(d.placement) == ["n1"]
    # the newest periodic commit of the lost generation (one in flight may have committed
    # since the first), never the start or the join's commit
    assert d.load_step == max(committed()) >= first, (d.load_step, committed())
    recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
    commits = [r for r in recs if r["kind"] == "commit" and r["step"] == d.load_step]
    assert commits and commits[0]["periodic"] is True
    # the relaunch's phase record names the directory it reads, the first launch's none
    launches = {r["generation"]: r for r in recs if r["kind"] == "phase" and r["phase"] == "launch"}
    assert launches[d.generation]["load_directory"] == str(cluster.tmp / "ckpt")
    assert launches[1]["load_directory"] == "" and launches[1]["load_step"] == -1
    await cluster.audit()


FAULT_RANK = 0
"""The rank whose part of every periodic save the storage refuses (``save_fault_worker``):
the committer, which gives the save up at once; the other rank's part is written."""


async def test_a_failed_periodic_save_reaches_the_controller_and_is_abandoned_at_once(
    cluster: Cluster,
) -> None:
    """A worker that gives a periodic save up (its storage refused a part) says so on its
    ``save_failed`` line; its agent relays that in its status (``save_failed_step``,
    ``save_failure``), which the leader reads: it abandons the save at once with what failed,
    well before the save's deadline, and the workers train on."""
    cluster.worker = (
        sys.executable,
        "-m",
        "tests.integration.save_fault_worker",
        "--fault-rank",
        str(FAULT_RANK),
        *WORKER[3:],  # the toy's options and placeholders, its 0.15 s steps
    )
    cluster.start_agent("n1")
    cluster.start_agent("n2")
    cluster.start_controller("c1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 60)
    while sorted(ctl.desired.placement) != ["n1", "n2"]:  # n2 registered after the first pass
        ctl = await cluster.wait_phase(Phase.RUNNING, 60, after_gen=ctl.desired.generation)
    gen = ctl.desired.generation
    faulty = next(n for n, ranks in ctl.desired.placement.items() if FAULT_RANK in ranks)

    def outcomes(kind: str) -> list[dict[str, Any]]:
        return [r for r in _periodic(cluster) if r["outcome"] == kind and r["generation"] == gen]

    await until(lambda: outcomes("abandoned"), 30, "a periodic checkpoint abandoned")
    gave_up = outcomes("abandoned")[0]
    step = int(gave_up["step"])
    asked = next(r for r in outcomes("requested") if r["step"] == step)
    # what failed, as the agents relayed it from their workers' save_failed lines
    assert "the save failed (" in gave_up["cause"], gave_up
    assert "injected: the checkpoint storage refused" in gave_up["cause"], gave_up
    # at once: not at the save's deadline (the steps to S, then CHECKPOINT's 15 s)
    assert gave_up["time"] - asked["time"] < 8.0, (asked, gave_up)
    assert not [r for r in outcomes("committed") if r["step"] == step]

    # the status the leader reads: the failed save's step and cause, this generation
    store = await connect_etcd(cluster.etcd, security=cluster.security("c1"))
    try:
        kv = await store.get(Keys(job=cluster.job).status(faulty))
    finally:
        await store.close()
    assert kv is not None
    st = AgentStatus.model_validate_json(kv.value)
    assert st.generation == gen and st.save_failed_step >= step, st
    assert "injected: the checkpoint storage refused" in st.save_failure, st
    # and the workers trained on: no abort, the same generation past the failed step
    await cluster.wait_step(ctl, ["n1", "n2"], step + 3, 15)
    assert ctl.desired.generation == gen and ctl.desired.phase is Phase.RUNNING
    await cluster.audit()
