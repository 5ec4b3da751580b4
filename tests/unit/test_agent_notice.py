"""A preemption notice is not lost while NATS is down (issue 18, item 5).

The agent keeps the notice in its status record at once (the etcd path) and retries the
event with backoff until the notice's deadline; it used to give up after 20 tries 0.25 s
apart, so a NATS outage of more than ~5 s lost a 30 s notice. A manual clock: no sleeps.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import structlog

from sailor.agent.agent_config import AgentConfig
from sailor.agent.daemon import Agent
from sailor.agent.watchers import GCP_NOTICE_S, Notice
from sailor.coordination import ManualClock, UnavailableError
from sailor.schemas.events import PreemptionNotice
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import AgentStatus


class _Watcher:
    name = "test"

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    async def check(self) -> Notice | None:
        return Notice(self.deadline, "test")


class _Bus:
    """An event bus that is down until ``up_at`` (clock time); records what it stored.

    A deliberate fault injection, kept instead of a real NATS: the test is about the agent's
    retry schedule on the manual clock (how many tries, when the last one is, what its
    status record says at each failed try), not about the broker. A stopped nats-server
    fails each publish only after a real timeout and comes back after a real reconnect,
    neither on the manual clock; the outage through a real server restart is
    tests/integration/test_runtime_scenarios.py (docs/chaos.md)."""

    def __init__(self, clock: ManualClock, up_at: float, agent: Agent) -> None:
        self.clock = clock
        self.up_at = up_at
        self.agent = agent
        self.tries = 0
        self.stored: list[PreemptionNotice] = []
        self.status_during_outage: list[AgentStatus] = []

    async def publish(self, kind: str, data: bytes, msg_id: str) -> bool:
        self.tries += 1
        if self.clock.now() < self.up_at:
            self.status_during_outage.append(self.agent.status())
            raise UnavailableError("event publish failed", error="nats down")
        ev = PreemptionNotice.model_validate_json(data)
        assert kind == "preemption_notice" and msg_id == ev.event_id
        self.stored.append(ev)
        return True


def _agent(tmp_path: Path, clock: ManualClock) -> Agent:
    node = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="z", address="127.0.0.1")
    return Agent(AgentConfig(node=node, work_dir=tmp_path), clock=clock)


async def test_notice_is_delivered_after_a_nats_outage_longer_than_the_old_retries(
    tmp_path: Path,
) -> None:
    clock = ManualClock(1000.0)
    agent = _agent(tmp_path, clock)
    bus = _Bus(clock, up_at=1010.0, agent=agent)  # NATS down for 10 s from the notice
    agent._bus = bus  # type: ignore[assignment]
    await agent._watch(_Watcher(deadline=1030.0))  # type: ignore[arg-type]
    assert len(bus.stored) == 1, f"notice lost after {bus.tries} tries"
    assert 1010.0 <= clock.now() <= 1013.0  # backoff capped: one try soon after NATS is back
    # the etcd path: the status record carried the notice for the whole outage
    assert bus.status_during_outage
    assert all(st.notice == bus.stored[0] for st in bus.status_during_outage)
    assert agent.status().notice == bus.stored[0]


async def test_notice_retries_end_at_its_deadline(tmp_path: Path) -> None:
    clock = ManualClock(1000.0)
    agent = _agent(tmp_path, clock)
    bus = _Bus(clock, up_at=1e12, agent=agent)  # NATS never comes back
    agent._bus = bus  # type: ignore[assignment]
    await agent._watch(_Watcher(deadline=1030.0))  # type: ignore[arg-type]
    assert not bus.stored
    assert 1030.0 <= clock.now() <= 1032.0  # gave up once the deadline passed, not before
    assert agent.status().notice is not None  # still reported through etcd


@pytest.mark.parametrize(
    "deadline", [-5.0, -1e12, math.inf, math.nan], ids=["negative", "far-past", "inf", "nan"]
)
async def test_a_notice_whose_deadline_is_no_time_is_kept_at_the_default(
    tmp_path: Path, deadline: float
) -> None:
    """A watcher's notice with a deadline before 1970 (a notice file's ``{"in_s": -100}``, a
    cloud's date before the epoch) or none at all is a notice all the same: published and
    in the status record, at GCP's 30 s, with a warning naming the value. Before, the
    event's validation refused the deadline after the agent had marked itself noticed: the
    watcher task crashed, its restart saw ``noticed`` and returned, and the notice was lost."""
    clock = ManualClock(1000.0)
    agent = _agent(tmp_path, clock)
    bus = _Bus(clock, up_at=0.0, agent=agent)
    agent._bus = bus  # type: ignore[assignment]
    with structlog.testing.capture_logs() as logs:
        await agent._watch(_Watcher(deadline=deadline))  # type: ignore[arg-type]
    assert len(bus.stored) == 1 and bus.stored[0].deadline == 1000.0 + GCP_NOTICE_S
    assert agent.status().notice == bus.stored[0]
    warned = [e for e in logs if e.get("event") == "notice_deadline_unusable"]
    assert warned and warned[0]["deadline"] == repr(deadline), logs
