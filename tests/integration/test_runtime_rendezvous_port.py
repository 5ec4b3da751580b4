"""A generation's rendezvous port taken on rank 0's host, through the real control plane.

Real nats-server and etcd, one controller reconfiguring in place, two agents launching real
training workers (``sailor.training_process``, tiny-gpt, gloo). n1 trains; before n2 joins,
another process (a test's server, another job's store) listens on the port the join's
generation will rendezvous on (``base_port + generation % 1000``) on 127.0.0.1, where rank
0 runs. Rank 0's store cannot bind it (``EADDRINUSE``): nobody's fault, neither the node's
nor the in-place path's. The controller relaunches at the next generation (the next port)
on the same path: the join comes up in place, no node is charged or excluded, and the
in-place path is not marked failed. Before, the bind failure was read as a peer's failure,
the in-place launch as failed: the join fell back to a full stop and restart (measured
here: 52-63 s from the join to RUNNING, two restart generations, the first of them stalled
at its LOAD deadline; with the fix ~19 s, one relaunch in place).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sailor.agent.worker_argv import DEFAULT_WORKER_ARGV
from sailor.controller.audit import read_records
from sailor.localservers import LocalServers
from sailor.schemas.runtime import Phase
from tests.integration.cluster_kit import Cluster
from tests.integration.conftest import free_port

pytestmark = pytest.mark.usefixtures("no_task_leak")

WORKER = (*DEFAULT_WORKER_ARGV, "--min-step-s", "0.1", "--timeout-s", "60")


@pytest.fixture
async def cluster(tmp_path: Path, servers: LocalServers) -> AsyncIterator[Cluster]:
    async with Cluster(tmp_path, servers) as c:
        c.worker, c.in_place, c.warm_spares = WORKER, True, 1
        c.ctl_update = {
            "planner": "sailor",
            "model": "tiny-gpt",
            "global_batch_size": 4,
            "base_port": free_port(),
        }
        yield c


@pytest.fixture
def taken() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for s in held:
        s.close()


def _listen(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


async def _spares_up(cluster: Cluster, node: str, timeout: float = 60) -> None:
    sup = cluster.agents[node][0].supervisor
    for _ in range(int(timeout / 0.05)):
        if sup.spares_ready >= 1:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{node}: no warm spare")


async def test_a_taken_rendezvous_port_keeps_the_join_in_place(
    cluster: Cluster, taken: list[socket.socket]
) -> None:
    loop = asyncio.get_running_loop()
    cluster.start_controller("c1")
    cluster.start_agent("n1", gpu="cpu")
    ctl = await cluster.wait_phase(Phase.RUNNING, 90)
    d = ctl.desired
    await cluster.wait_step(ctl, ["n1"], d.load_step + 2, 30)
    base = ctl.cfg.base_port
    port = base + (d.generation + 1) % 1000
    taken.append(_listen(port))

    t0 = loop.time()
    cluster.start_agent("n2", gpu="cpu")
    await _spares_up(cluster, "n2")
    ctl = await cluster.wait_phase(Phase.RUNNING, 180, after_gen=d.generation)
    while sorted(ctl.desired.placement) != ["n1", "n2"]:
        ctl = await cluster.wait_phase(Phase.RUNNING, 180, after_gen=ctl.desired.generation)
    took = loop.time() - t0
    d2 = ctl.desired
    recs = read_records(sorted(cluster.tmp.glob("audit-*.jsonl")))
    launches = [r for r in recs if r["kind"] == "phase" and r["phase"] == "launch"]
    report = {
        "took_s": round(took, 1),
        "generation": d2.generation,
        "master": d2.master,
        "path": d2.path,
        "path_reason": d2.path_reason,
        "in_place_failed": d2.in_place_failed,
        "node_health": {n: (h.cause, h.origin, h.exclusions) for n, h in d2.node_health.items()},
        "launches": [(r.get("generation"), r.get("path"), r.get("path_reason")) for r in launches],
        "aborts": [
            r.get("cause")
            for r in recs
            if r["kind"] == "phase" and str(r.get("cause", "")).startswith("abort")
        ],
    }
    print(report)
    # the taken port's generation was launched and aborted; the next one came up on another
    # port, in place (rank 0's held process itself exited when its store failed: n1's rank
    # of the next generation is its warm spare, which reads the join's committed step)
    assert d2.generation >= d.generation + 2, report
    assert d2.master.rsplit(":", 1)[1] != str(port), report
    assert d2.path == "in_place" and not d2.in_place_failed, report
    assert [r.get("path") for r in launches[-2:]] == ["in_place", "in_place"], report
    assert "rendezvous port" in str(launches[-1].get("path_reason")), report
    # nobody is blamed: no node's record, no job record, nothing excluded
    assert not d2.node_health and not d2.job_health.failures, report
    await cluster.audit()
