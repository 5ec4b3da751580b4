"""The agent's persisted epoch fence: raised durably, never lowered, not guessed when unreadable."""

from __future__ import annotations

from pathlib import Path

import pytest

from sailor.agent.fence import EpochFence, FenceUnreadableError


def test_the_fence_outlives_its_object_and_never_goes_down(tmp_path: Path) -> None:
    path = tmp_path / "run" / "n1.epoch"
    fence = EpochFence(path)
    assert fence.epoch == 0
    assert fence.raise_to(7)
    assert not fence.raise_to(5) and fence.epoch == 7
    assert EpochFence(path).epoch == 7  # a restarted agent
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b'{"epoch": -1}', b'{"epoch": "7"}', b"[]", b"[" * 100_000],
    ids=["empty", "cut", "negative", "string", "list", "too-deep"],
)
def test_an_unreadable_fence_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "n1.epoch"
    path.write_bytes(content)
    with pytest.raises(FenceUnreadableError):
        EpochFence(path)


async def test_a_command_that_fails_is_refused_with_its_cause(tmp_path: Path) -> None:
    """A command whose application raises (its control file cannot be written: a directory
    stands there, as a full disk would fail it) gets a refusal naming the cause; before, the
    exception went into the NATS client's callback, no reply was sent and the controller saw
    only timeouts."""
    from sailor.agent.agent_config import AgentConfig
    from sailor.agent.daemon import Agent
    from sailor.agent.worker_view import WorkerView
    from sailor.schemas.commands import Stop
    from sailor.schemas.hardware import NodeSpec
    from sailor.schemas.runtime import CommandAck

    node = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="z")
    agent = Agent(AgentConfig(node=node, work_dir=tmp_path))
    blocked = tmp_path / "control-0.json"
    (tmp_path / "control-0.json.tmp").mkdir()
    agent.supervisor.workers = [
        WorkerView(rank=0, proc=None, argv=(), control=blocked)  # type: ignore[arg-type]
    ]
    cmd = Stop(command_id="s1", epoch=1, node_id="n1", at_step=5)
    ack = CommandAck.model_validate_json(await agent._on_command(cmd.model_dump_json().encode()))
    assert not ack.accepted and ack.command_id == "s1", ack
    assert "IsADirectoryError" in ack.reason, ack.reason


async def test_a_failure_published_through_an_outage_does_not_stop_the_status_loop(
    tmp_path: Path,
) -> None:
    """The worker_failed event retries for ~5 s against an event bus that cannot store it
    (NATS reconnecting); the status loop, the agent's watchdog ping, went quiet for the
    whole time (~45 s with the real timeouts: systemd's 30 s watchdog killed the agent)."""
    import asyncio
    import itertools
    import time

    from sailor.agent.agent_config import AgentConfig
    from sailor.agent.daemon import Agent
    from sailor.coordination.errors import TemporaryError
    from sailor.schemas.hardware import NodeSpec

    class Outage:
        tries = 0

        async def publish(self, kind: str, data: bytes, msg_id: str) -> None:
            Outage.tries += 1
            await asyncio.sleep(0.1)
            raise TemporaryError("nats: no servers available")

    node = NodeSpec(node_id="n1", gpu_type="cpu", gpus=1, zone="z")
    agent = Agent(AgentConfig(node=node, work_dir=tmp_path, status_interval_s=0.05))
    agent._bus = Outage()  # type: ignore[assignment]
    agent.supervisor.failure = "rank 0 exited with code 1"
    pings: list[float] = []
    agent.sd.watchdog = lambda: pings.append(time.monotonic())  # type: ignore[method-assign]
    loop = asyncio.create_task(agent._status_loop())
    await asyncio.sleep(1.5)
    loop.cancel()
    await agent._tasks.close()
    assert Outage.tries >= 3  # the event is being retried meanwhile
    gaps = [b - a for a, b in itertools.pairwise(pings)]
    assert len(pings) >= 10 and max(gaps) < 0.5, (len(pings), max(gaps, default=None))


def test_a_boolean_epoch_is_kept_as_the_number_it_stands_for(tmp_path: Path) -> None:
    """A desired state's ``"epoch": true`` (the controller reads it as 1; the agent takes
    its fence from the raw value, ``Agent._fence_from_desired``) raised the fence to
    ``True``, written as ``{"epoch": true}``: the agent's next start refused its own fence
    file (``FenceUnreadableError``) until an operator removed it."""
    path = tmp_path / "n1.epoch"
    assert EpochFence(path).raise_to(True)
    assert EpochFence(path).epoch == 1
    assert not EpochFence(path).raise_to(True)


def test_a_fence_beyond_etcds_revision_is_lowered_and_only_then(tmp_path: Path) -> None:
    """``lower_to`` moves a fence that stands beyond etcd's current revision (no leader was
    elected there) down to the given epoch, durably; a fence within the revision, or a
    target not below it, is left alone."""
    path = tmp_path / "n1.epoch"
    fence = EpochFence(path)
    fence.raise_to(2**62)
    assert not fence.lower_to(3, revision=2**62) and fence.epoch == 2**62
    assert fence.lower_to(3, revision=40) and fence.epoch == 3
    assert EpochFence(path).epoch == 3
    assert not fence.lower_to(2, revision=40) and fence.epoch == 3  # within the revision
