"""Two agents whose node ids share a NATS token (``gpu.1``, ``gpu_1``), on servers without
``security:`` (where no certificate check refuses the pair): the second refuses to start
naming both ids, serves no command and leaves no registration. Before, both ran; each
answered the other's commands, and the controller recorded the wrong agent's refusal as the
addressed node's and resent the command for ever.

Plain servers: with security on, ``certs issue`` refuses such a pair of logins already.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from sailor.agent.agent_config import AgentConfig, CheckSettings
from sailor.agent.daemon import Agent
from sailor.coordination import DaemonFailedError, Keys, connect_etcd
from sailor.localservers import LocalServers
from sailor.schemas.hardware import NodeSpec

pytestmark = pytest.mark.usefixtures("no_task_leak")

KEYS = Keys(job="clash")


def _agent(servers: LocalServers, work: Path, node_id: str) -> Agent:
    return Agent(
        AgentConfig(
            job=KEYS.job,
            node=NodeSpec(
                node_id=node_id, gpu_type="A100-40", gpus=1, zone="z-a-1", address="10.0.0.1"
            ),
            nats_url=servers.nats_url,
            etcd_endpoint=servers.etcd_endpoint,
            lease_ttl_s=2,
            work_dir=work,
            check=CheckSettings(mode="off"),
        )
    )


async def test_an_agent_whose_token_a_registered_node_shares_refuses_to_start(
    plain_servers: LocalServers, tmp_path: Path
) -> None:
    store = await connect_etcd(plain_servers.etcd_endpoint)
    first = _agent(plain_servers, tmp_path / "a", "gpu.1")
    first_task = asyncio.create_task(first.run(), name="agent-gpu.1")
    try:
        end = time.monotonic() + 15
        while await store.get(KEYS.node("gpu.1")) is None:
            assert time.monotonic() < end, "gpu.1 never registered"
            await asyncio.sleep(0.1)
        second = _agent(plain_servers, tmp_path / "b", "gpu_1")
        with pytest.raises(DaemonFailedError) as err:
            await asyncio.wait_for(second.run(), 20)
        reason = str(err.value)
        assert "'gpu_1'" in reason and "'gpu.1'" in reason and "NATS token" in reason
        assert await store.get(KEYS.node("gpu_1")) is None  # its record went with its lease
        assert await store.get(KEYS.node("gpu.1")) is not None and not first_task.done()
    finally:
        first.stopping.set()
        await asyncio.wait_for(first_task, 15)
        await store.close()
