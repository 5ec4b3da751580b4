"""An agent that cannot reach etcd or NATS says so, and a registered one says how long
each step took.

Seen in a fresh-clone CI under load: a demo's joining node "never registered" in 60 s, and
its agent's log held one line (its CPU quota): the connects and the claim retried failures
without a word, so the log could not tell a server out of reach from a slow start."""

from __future__ import annotations

from pathlib import Path

import structlog

from sailor.agent.agent_config import AgentConfig
from sailor.agent.daemon import RETRY_LOG_EVERY, Agent, process_age_s
from sailor.coordination import ManualClock, UnavailableError
from sailor.schemas.hardware import NodeSpec


def _agent(tmp_path: Path) -> Agent:
    node = NodeSpec(node_id="n4", gpu_type="cpu", gpus=1, zone="z", address="127.0.0.1")
    return Agent(AgentConfig(node=node, work_dir=tmp_path), clock=ManualClock())


async def test_a_connect_that_keeps_failing_is_logged_first_then_every_tenth(
    tmp_path: Path,
) -> None:
    agent = _agent(tmp_path)
    fails = 2 * RETRY_LOG_EVERY + 3

    async def connect() -> str:
        nonlocal fails
        if fails:
            fails -= 1
            raise UnavailableError("etcd unavailable", endpoint="127.0.0.1:1")
        return "connected"

    with structlog.testing.capture_logs() as logs:
        assert await agent._retry("etcd", connect) == "connected"
    retries = [e for e in logs if e["event"] == "connect_retry"]
    assert [e["tries"] for e in retries] == [1, RETRY_LOG_EVERY, 2 * RETRY_LOG_EVERY]
    assert all(e["server"] == "etcd" and e["node"] == "n4" for e in retries)
    assert "127.0.0.1:1" in retries[0]["error"], retries[0]


async def test_a_stopped_agent_stops_retrying(tmp_path: Path) -> None:
    agent = _agent(tmp_path)

    async def never() -> str:
        agent.stopping.set()
        raise UnavailableError("nats unreachable")

    with structlog.testing.capture_logs() as logs:
        assert await agent._retry("nats", never) is None
    assert [e["server"] for e in logs if e["event"] == "connect_retry"] == ["nats"]


def test_the_process_age_counts_from_the_process_start() -> None:
    age = process_age_s()
    # this test process has run for a while (pytest's start and imports) but not for days
    assert age is not None and 0.0 < age < 86400.0, age
