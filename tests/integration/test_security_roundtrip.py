"""The real controller and agents over TLS with logins, permissions and etcd RBAC.

register (etcd, agent's own keys) -> NodeJoined (NATS, agent's own event subject) -> Launch
(command, controller only) -> workers step; then ``sailor audit`` passes, and neither the audit
log nor the captured logs contain a NATS password.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog

from sailor.controller.audit import check, read_records
from sailor.localservers import LocalServers
from sailor.schemas.runtime import Phase
from tests.integration.cluster_kit import Cluster
from tests.integration.secure_servers import CONTROLLER, JOB, NODES, Pki

pytestmark = pytest.mark.usefixtures("no_task_leak")


async def test_controller_and_agents_round_trip_over_tls(
    servers: LocalServers, pki: Pki, tmp_path: Path
) -> None:
    assert servers.secure
    cluster = Cluster(tmp_path, servers, job=JOB)
    passwords = [
        json.loads((pki.dir / f"{n}.nats.json").read_text())["password"]
        for n in (CONTROLLER, *NODES)
    ]
    with structlog.testing.capture_logs() as logs:
        async with cluster:
            cluster.start_controller(CONTROLLER)
            for n in NODES:
                cluster.start_agent(n)
            ctl = await cluster.wait_phase(Phase.RUNNING, 40)
            await cluster.wait_step(ctl, list(NODES), 2, 30)
    records = read_records([tmp_path / f"audit-{CONTROLLER}.jsonl"])
    assert check(records).ok
    audit_text = (tmp_path / f"audit-{CONTROLLER}.jsonl").read_text()
    log_text = repr(logs)
    for pw in passwords:
        assert pw not in audit_text
        assert pw not in log_text
    assert not [e for e in logs if e["event"] == "running_unauthenticated"]


async def test_daemons_without_a_security_section_warn_once(
    plain_servers: LocalServers, tmp_path: Path
) -> None:
    """Plain servers (the point here): a controller and an agent started without a
    ``security:`` section each log one warning that they run unauthenticated."""
    cluster = Cluster(tmp_path, plain_servers, job="t")
    with structlog.testing.capture_logs() as logs:
        async with cluster:
            cluster.start_controller("c1")
            cluster.start_agent("n1")
            await cluster.wait_phase(Phase.RUNNING, 40)
    warned = [(e["daemon"], e["name"]) for e in logs if e["event"] == "running_unauthenticated"]
    assert sorted(warned) == [("agent", "n1"), ("controller", "c1")]
    assert all(
        "docs/operations.md#security" in e["why"]
        for e in logs
        if e["event"] == "running_unauthenticated"
    )
