"""Launch by reference (plan and training config): the schemas' compatibility and the agent's
PlanSource."""

from __future__ import annotations

import hashlib
import json
import typing

import pytest
from pydantic import BaseModel, Field, ValidationError

from sailor.agent.plan_source import PlanSource, PlanUnavailableError
from sailor.controller.planning import DataParallelPlanner
from sailor.coordination import KeyValue
from sailor.schemas import SCHEMA_VERSION, _base
from sailor.schemas import training as training_schema
from sailor.schemas.commands import (
    _FIELDS_AT_V1,
    CommandAdapter,
    Launch,
    plan_digest,
    training_digest,
)
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan
from sailor.schemas.runtime import DesiredState
from sailor.schemas.training import (
    BuiltinModel,
    CheckpointConfig,
    EvalConfig,
    HuggingFaceModel,
    IndexedData,
    OptimizerConfig,
    SpecFileModel,
    TrainingConfig,
)


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


def _training(seed: int = 0) -> TrainingConfig:
    return TrainingConfig(model=BuiltinModel(name="tiny-gpt"), seed=seed)


def test_older_messages_without_a_training_config_still_parse() -> None:
    """A desired state and a Launch written before training configs existed."""
    plan = _plan()
    old_desired = DesiredState(epoch=1, plan=plan).model_dump(mode="json")
    del old_desired["training"]
    assert DesiredState.model_validate(old_desired).training is None
    old_launch = json.loads(CommandAdapter.dump_json(_launch(plan)))
    del old_launch["training_sha256"]
    assert CommandAdapter.validate_python(old_launch).training_sha256 == ""  # type: ignore[union-attr]
    # the digest survives the trip through etcd (JSON and back)
    t = _training(5)
    again = DesiredState.model_validate_json(DesiredState(epoch=1, training=t).model_dump_json())
    assert again.training == t and training_digest(again.training) == training_digest(t)


async def test_an_agent_of_the_previous_wire_version_resolves_a_newer_training_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A controller of this release names its training config by digest; an agent of the
    release before (``SCHEMA_VERSION`` one lower) reads that config as its own version
    (``_newer``) and must reach the same digest, or it refuses every launch of the run in
    the middle of a rolling upgrade (controllers first, as docs/operations.md says)."""
    plan, t = _plan(), _training(5)
    desired = DesiredState(epoch=1, plan=plan, training=t).model_dump_json().encode()
    cmd = _launch(plan, training_sha256=training_digest(t))

    async def get() -> KeyValue:
        return KeyValue("/d", desired, 1, 1)

    monkeypatch.setattr(_base, "SCHEMA_VERSION", SCHEMA_VERSION - 1)  # the older agent
    got = await PlanSource(get).training(cmd)
    assert got is not None and got.schema_version == SCHEMA_VERSION - 1
    assert got.model_copy(update={"schema_version": SCHEMA_VERSION}) == t


async def test_training_source_shares_the_plan_read_and_checks_the_digest() -> None:
    plan, t = _plan(), _training(5)
    reads = 0
    desired = DesiredState(epoch=1, plan=plan, training=t).model_dump_json().encode()

    async def get() -> KeyValue:
        nonlocal reads
        reads += 1
        return KeyValue("/d", desired, 1, 1)

    src = PlanSource(get)
    cmd = _launch(plan, training_sha256=training_digest(t))
    assert await src.resolve(cmd) == plan
    assert await src.training(cmd) == t
    assert reads == 1  # the plan's read kept the config
    assert await src.training(_launch(plan)) is None  # names none: nothing read
    with pytest.raises(PlanUnavailableError, match="training config digest mismatch"):
        await PlanSource(get).training(_launch(plan, training_sha256=training_digest(_training())))
    bare = DesiredState(epoch=1, plan=plan).model_dump_json().encode()

    async def get_bare() -> KeyValue:
        return KeyValue("/d", bare, 1, 1)

    with pytest.raises(PlanUnavailableError, match="no training config"):
        await PlanSource(get_bare).training(cmd)


def _v1_digest(config: TrainingConfig) -> str:
    """``training_digest`` as the release that wrote wire version 1 computes it (its agents
    run this): the SHA-256 of its own reading of the config, which is version 1 and has
    none of the top-level fields added since (``nonfinite``; at their defaults here)."""
    added = set(type(config).model_fields) - _FIELDS_AT_V1["TrainingConfig"]
    return hashlib.sha256(
        config.model_copy(update={"schema_version": 1})
        .model_dump_json(exclude=added or None)
        .encode()
    ).hexdigest()


def _configs() -> list[TrainingConfig]:
    spec = ModelSpec(
        name="m",
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=256,
        num_heads=4,
        seq_length=32,
        vocab_size=128,
        global_batch_size=8,
    )
    return [
        _training(5),
        TrainingConfig(model=SpecFileModel(spec=spec), data=IndexedData(prefix="/d/x")),
        TrainingConfig(
            model=HuggingFaceModel(path="/m/hf"),
            optimizer=OptimizerConfig(lr=1e-3, no_decay=("bias",)),
            eval=EvalConfig(every_steps=10),
            checkpoint=CheckpointConfig(dir="/ck", every_steps=5),
        ),
    ]


def test_the_training_digest_of_every_config_is_the_previous_releases() -> None:
    """Unchanged for every config this release can write: an agent of the previous release
    resolves this controller's Launch, and a Launch written before the upgrade (a
    generation still in LAUNCH when the new leader re-sends it) names the same digest."""
    for t in _configs():
        assert training_digest(t) == _v1_digest(t), t


def _newer_release() -> tuple[type[TrainingConfig], type[OptimizerConfig]]:
    """The classes of a later release that adds a field (with a default) at the top and
    inside a nested model, under the same names (as a release's own classes are)."""

    class OptimizerConfig(training_schema.OptimizerConfig):
        foreach: bool = Field(default=True, description="A field of a later release.")

    class TrainingConfig(training_schema.TrainingConfig):
        accumulate: int = Field(default=1, description="A field of a later release.")
        optimizer: OptimizerConfig = Field(  # type: ignore[assignment]
            default_factory=OptimizerConfig, description="Optimizer."
        )

    return TrainingConfig, OptimizerConfig


async def test_a_newer_writers_new_fields_at_their_default_keep_the_digest() -> None:
    """The first release that adds a TrainingConfig field must not refuse every launch on
    this release's agents (their reading drops the field: ``_newer``). A new field at its
    default is left out of the digest; one set away from it changes the digest, and this
    agent refuses the launch rather than run without it."""
    newer, newer_opt = _newer_release()
    plan = _plan()
    for accumulate, foreach, resolves in ((1, True, True), (4, True, False), (1, False, False)):
        t = newer(model=BuiltinModel(name="tiny-gpt"), seed=5, accumulate=accumulate)
        t = t.model_copy(update={"optimizer": newer_opt(foreach=foreach)})
        raw = DesiredState(epoch=1, plan=plan).model_dump(mode="json")
        raw["training"] = t.model_dump(mode="json") | {"schema_version": SCHEMA_VERSION + 1}
        raw["schema_version"] = SCHEMA_VERSION + 1
        data = json.dumps(raw).encode()

        async def get(data: bytes = data) -> KeyValue:
            return KeyValue("/d", data, 1, 1)

        cmd = _launch(plan, training_sha256=training_digest(t))
        if resolves:
            got = await PlanSource(get).training(cmd)
            assert got is not None and got.seed == 5
            assert training_digest(t) == training_digest(_training(5))
        else:
            with pytest.raises(PlanUnavailableError, match="digest mismatch"):
                await PlanSource(get).training(cmd)


def test_every_field_listed_at_wire_version_1_still_exists() -> None:
    """A field listed at version 1 that was renamed or removed is no additive change."""
    seen: dict[str, type[BaseModel]] = {}

    def walk(t: object) -> None:
        if isinstance(t, type) and issubclass(t, BaseModel):
            if t.__name__ in seen:
                return
            seen[t.__name__] = t
            for f in t.model_fields.values():
                walk(f.annotation)
        for arg in typing.get_args(t):
            walk(arg)

    walk(TrainingConfig)
    for name, fields in _FIELDS_AT_V1.items():
        assert name in seen, name
        assert fields <= set(seen[name].model_fields), (name, fields - set(seen[name].model_fields))


def test_a_discriminator_is_hashed_even_at_its_default() -> None:
    """Two model kinds added after wire version 1, both at their defaults, must not share a
    digest: their ``kind`` is always in the hashed JSON, their other new fields are not."""
    from typing import Literal

    from pydantic import BaseModel

    from sailor.schemas.commands import _added_at_default

    class LaterA(BaseModel):
        kind: Literal["later-a"] = "later-a"
        depth: int = 1

    class LaterB(BaseModel):
        kind: Literal["later-b"] = "later-b"
        depth: int = 1

    a, b = LaterA(), LaterB()
    assert _added_at_default(a) == {"depth": True}
    assert a.model_dump_json(exclude=_added_at_default(a)) != b.model_dump_json(
        exclude=_added_at_default(b)
    )
