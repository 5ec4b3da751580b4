"""``sailor check`` and the agent's start-up check against real servers (conftest: nats-server
and etcd with TLS, logins and RBAC): reachability with a node's own credentials, the command
with an agent config, the facts in the join event, a GPU node without a GPU refused, and the
collective probe's ranks (gloo here; NCCL on a GPU host)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from sailor.agent.agent_config import AgentConfig, CheckSettings
from sailor.agent.check_gather import probe_collectives, reach_servers
from sailor.agent.daemon import Agent
from sailor.cli.main import app
from sailor.coordination import Keys, NatsEventBus, connect_etcd, connect_nats
from sailor.localnet import free_port
from sailor.localservers import LocalServers
from sailor.schemas.events import EventAdapter, NodeJoined
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.node_check import CheckReport

pytestmark = pytest.mark.usefixtures("no_task_leak")


def _agent_config(servers: LocalServers, tmp: Path, node_id: str, gpu: str = "cpu") -> AgentConfig:
    return AgentConfig(
        job="t",
        node=NodeSpec(node_id=node_id, gpu_type=gpu, gpus=1, zone="z", address="127.0.0.1"),
        nats_url=servers.nats_url,
        etcd_endpoint=servers.etcd_endpoint,
        lease_ttl_s=1,
        work_dir=tmp / "agents",
        security=servers.security(node_id),
    )


async def test_both_servers_answer_a_node_with_its_own_credentials(servers: LocalServers) -> None:
    nats, etcd = await reach_servers(
        servers.nats_url, servers.etcd_endpoint, servers.security("n1"), "n1", timeout_s=5
    )
    assert nats.reachable and etcd.reachable, (nats, etcd)
    assert nats.tls and etcd.tls and nats.error == etcd.error == ""


async def test_servers_that_do_not_answer_are_reported_with_the_reason(
    servers: LocalServers,
) -> None:
    # nothing listens on these ports
    nats, etcd = await reach_servers(
        f"nats://127.0.0.1:{free_port()}",
        f"127.0.0.1:{free_port()}",
        servers.security("n1"),
        "n1",
        timeout_s=1,
    )
    assert not nats.reachable and not etcd.reachable
    assert nats.error and etcd.error
    # the real servers, without the node's certificate and login: refused
    nats, etcd = await reach_servers(
        servers.nats_url, servers.etcd_endpoint, None, "n1", timeout_s=1
    )
    assert not nats.reachable and not etcd.reachable, (nats, etcd)


def _write_config(cfg: AgentConfig, path: Path) -> Path:
    path.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())))
    return path


def test_sailor_check_with_an_agent_config(servers: LocalServers, tmp_path: Path) -> None:
    runner = CliRunner()
    good = _write_config(_agent_config(servers, tmp_path, "n1"), tmp_path / "agent.yaml")
    res = runner.invoke(app, ["check", "--config", str(good), "--json", "--timeout", "3"])
    assert res.exit_code == 0, res.output
    report = CheckReport.model_validate_json(res.stdout)
    verdicts = {line.check: line.verdict for line in report.lines}
    assert verdicts == {"node": "ok", "nats": "ok", "etcd": "ok"}, report.lines
    assert report.node_id == "n1" and report.facts.node_kind == "cpu"
    assert not report.facts.gathered  # a CPU node: no GPU checks, nothing spawned

    bad_cfg = _agent_config(servers, tmp_path, "n1").model_copy(
        update={"etcd_endpoints": (f"127.0.0.1:{free_port()}",)}
    )
    bad = _write_config(bad_cfg, tmp_path / "bad.yaml")
    res = runner.invoke(app, ["check", "--config", str(bad), "--json", "--timeout", "1"])
    assert res.exit_code == 1, res.output
    report = CheckReport.model_validate_json(res.stdout)
    etcd = next(line for line in report.lines if line.check == "etcd")
    assert etcd.verdict == "fail" and "etcd_endpoints" in etcd.action


async def test_the_join_event_carries_the_node_facts(servers: LocalServers, tmp_path: Path) -> None:
    nc = await connect_nats(servers.nats_url, "c1", security=servers.security("c1"))
    bus = NatsEventBus(nc, Keys(job="t"), durable="check-test")
    agent = Agent(_agent_config(servers, tmp_path, "n1"))
    task = asyncio.create_task(agent.run(), name="test-agent-n1")
    try:
        await bus.ensure_stream()
        joined: NodeJoined | None = None
        for _ in range(60):
            for d in await bus.fetch(10, timeout=0.5):
                await d.ack()
                ev = EventAdapter.validate_json(d.data)
                if isinstance(ev, NodeJoined):
                    joined = ev
            if joined is not None:
                break
        assert joined is not None, "no node_joined event"
        facts = joined.facts
        assert facts is not None and facts.node_kind == "cpu" and facts.gpu_type == "cpu"
        assert facts.nats is not None and facts.nats.reachable and facts.nats.tls
        assert facts.etcd is not None and facts.etcd.reachable
        assert not agent.refused
    finally:
        agent.stopping.set()
        await asyncio.wait_for(task, 15)
        await bus.close()
        await nc.close()


async def test_a_gpu_node_without_a_gpu_does_not_join(
    servers: LocalServers, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    cfg = _agent_config(servers, tmp_path, "n2", gpu="A100-40").model_copy(
        update={"check": CheckSettings(mode="enforce", timeout_s=120)}
    )
    agent = Agent(cfg)
    await asyncio.wait_for(agent.run(), 120)  # returns: refused before connecting
    assert "cuda: no GPU" in agent.refused
    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    try:
        assert await store.get(Keys(job="t").node("n2")) is None
    finally:
        await store.close()

    # stopped during its check: the agent leaves at once, its check process killed
    quitter = Agent(cfg)
    task = asyncio.create_task(quitter.run(), name="test-agent-quitter")
    await asyncio.sleep(0.5)
    quitter.stopping.set()
    await asyncio.wait_for(task, 5)
    assert not quitter.refused

    # report mode: the same node joins, its facts saying what is missing
    report = Agent(cfg.model_copy(update={"check": CheckSettings(mode="report")}))
    facts = await asyncio.wait_for(report.check_node(), 120)
    assert facts is not None and facts.gathered and not facts.cuda_available
    assert not report.refused


def test_the_collective_probe_ranks_check_all_reduce_and_p2p() -> None:
    probe = probe_collectives(2, "cpu", deadline_s=120)
    assert probe.error == "", probe.error
    assert probe.all_reduce_ok and probe.p2p_ok and probe.backend == "gloo"
    assert probe.bus_gbps is not None and probe.bus_gbps > 0


async def test_the_controller_audits_the_facts_of_a_join(
    servers: LocalServers, tmp_path: Path
) -> None:
    from sailor.controller.audit import read_records
    from sailor.schemas.runtime import Phase
    from tests.integration.cluster_kit import Cluster

    async with Cluster(tmp_path, servers) as cluster:
        cluster.start_controller("c1")
        cluster.start_agent("n1", gpu="cpu")
        await cluster.wait_phase(Phase.RUNNING, 30)
    joins = [
        r
        for r in read_records([tmp_path / "audit-c1.jsonl"])
        if r["kind"] == "event" and r["event_kind"] == "node_joined"
    ]
    assert joins and joins[0]["facts"] == {"kind": "cpu"}, joins
