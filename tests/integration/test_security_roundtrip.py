"""The real controller and agents over TLS with logins, permissions and etcd RBAC.

register (etcd, agent's own keys) -> NodeJoined (NATS, agent's own event subject) -> Launch
(command, controller only) -> workers step; then ``sailor audit`` passes, and neither the audit
log nor the captured logs contain a NATS password.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import structlog

from sailor.agent.daemon import Agent, AgentConfig
from sailor.controller.audit import check, read_records
from sailor.controller.config import ControllerConfig
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import Phase
from tests.integration.conftest import Server
from tests.integration.secure_servers import CONTROLLER, JOB, NODES, Pki
from tests.integration.test_runtime_scenarios import Cluster

pytestmark = pytest.mark.usefixtures("no_task_leak")


class SecureCluster(Cluster):
    def __init__(self, tmp: Path, nats_url: str, etcd: str, pki: Pki) -> None:
        super().__init__(tmp, nats_url, etcd)
        self.pki = pki

    def ctl_config(self, name: str) -> ControllerConfig:
        return (
            super()
            .ctl_config(name)
            .model_copy(update={"job": JOB, "security": self.pki.security(name)})
        )

    def start_agent(self, node_id: str, gpu: str = "A100-40", watch_file: bool = False) -> Agent:
        cfg = AgentConfig(
            job=JOB,
            node=NodeSpec(node_id=node_id, gpu_type=gpu, gpus=1, zone="z-a-1", address="127.0.0.1"),
            nats_url=self.nats_url,
            etcd_endpoint=self.etcd,
            lease_ttl_s=1,
            work_dir=self.tmp / "agents",
            worker_argv=self.worker,
            security=self.pki.security(node_id),
        )
        agent = Agent(cfg)
        self.agents[node_id] = (agent, asyncio.create_task(agent.run(), name=f"test-{node_id}"))
        return agent


async def test_controller_and_agents_round_trip_over_tls(
    secure_nats_server: Server, secure_etcd_server: Server, pki: Pki, tmp_path: Path
) -> None:
    cluster = SecureCluster(
        tmp_path,
        f"nats://127.0.0.1:{secure_nats_server.port}",
        f"127.0.0.1:{secure_etcd_server.port}",
        pki,
    )
    passwords = [
        json.loads((pki.dir / f"{n}.nats.json").read_text())["password"]
        for n in (CONTROLLER, *NODES)
    ]
    with structlog.testing.capture_logs() as logs:
        try:
            cluster.start_controller(CONTROLLER)
            for n in NODES:
                cluster.start_agent(n)
            ctl = await cluster.wait_phase(Phase.RUNNING, 40)
            await cluster.wait_step(ctl, list(NODES), 2, 30)
        finally:
            await cluster.close()
    records = read_records([tmp_path / f"audit-{CONTROLLER}.jsonl"])
    assert check(records).ok
    audit_text = (tmp_path / f"audit-{CONTROLLER}.jsonl").read_text()
    log_text = repr(logs)
    for pw in passwords:
        assert pw not in audit_text
        assert pw not in log_text
