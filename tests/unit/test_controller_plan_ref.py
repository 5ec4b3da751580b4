"""Launch by plan reference: the schema's compatibility and the agent's PlanSource."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sailor.agent.plan_source import PlanSource, PlanUnavailableError
from sailor.controller.planning import DataParallelPlanner
from sailor.coordination import KeyValue
from sailor.schemas.commands import CommandAdapter, Launch, plan_digest
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Plan
from sailor.schemas.runtime import DesiredState


def _plan(n: int = 2) -> Plan:
    nodes = tuple(NodeSpec(node_id=f"n{i}", gpu_type="cpu", gpus=1, zone="z") for i in range(n))
    return DataParallelPlanner("tiny-gpt", 4, 8).plan(nodes, None).plan


def _launch(ref: Plan, **kw: object) -> Launch:
    base: dict[str, object] = {
        "command_id": "c1",
        "epoch": 1,
        "plan_id": ref.plan_id,
        "node_id": "n0",
        "ranks": (0,),
        "world_size": 2,
        "master": "127.0.0.1:1",
        "plan_sha256": plan_digest(ref),
    }
    base.update(kw)
    return Launch(**base)  # type: ignore[arg-type]


def test_launch_by_reference_round_trips_and_inline_still_parses() -> None:
    plan = _plan()
    ref = _launch(plan)
    assert ref.plan is None
    assert CommandAdapter.validate_json(CommandAdapter.dump_json(ref)) == ref
    old = _launch(plan, plan=plan, plan_sha256="")  # an older controller's Launch
    assert CommandAdapter.validate_json(CommandAdapter.dump_json(old)).plan == plan
    with pytest.raises(ValidationError, match="plan_sha256"):
        _launch(plan, plan_sha256="")


async def test_plan_source_reads_once_checks_digest_and_refuses_unknown() -> None:
    plan = _plan()
    reads = 0
    desired = DesiredState(epoch=1, plan=plan).model_dump_json().encode()

    async def get() -> KeyValue:
        nonlocal reads
        reads += 1
        return KeyValue("/d", desired, 1, 1)

    src = PlanSource(get)
    assert await src.resolve(_launch(plan)) == plan
    assert await src.resolve(_launch(plan, command_id="c2")) == plan
    assert reads == 1
    with pytest.raises(PlanUnavailableError, match="digest"):
        await PlanSource(get).resolve(_launch(plan, plan_sha256="0" * 64))
    with pytest.raises(PlanUnavailableError, match="not in the desired state"):
        await src.resolve(_launch(_plan(1)))
