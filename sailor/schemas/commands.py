"""Commands from the controller to one agent.

Every command carries the controller's epoch (fencing token: agents refuse a lower epoch than
the highest they have seen), the plan id and a command id (idempotency key: an agent applies a
command id at most once).

A ``Launch`` names its plan by reference — ``plan_id`` and ``plan_sha256``, the SHA-256 of
the plan's JSON (:func:`plan_digest`) — and the agent reads the plan from the desired state
in etcd (``DesiredState.plan``), checking the digest. Carrying the whole plan in every Launch
made the launch fan-out quadratic in bytes (a 2,048-node plan is ~0.5 MB, sent to each of
768 placed nodes). ``plan`` stays accepted for older controllers: an agent uses it if set.
The run's training config is named the same way: ``training_sha256`` (:func:`training_digest`)
of ``DesiredState.training``; '' when the job has none (and from older controllers).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, field_validator, model_validator

from sailor.schemas._base import WireMessage, field_error
from sailor.schemas.plan import Plan
from sailor.schemas.training import TrainingConfig

__all__ = [
    "Abort",
    "Checkpoint",
    "Command",
    "CommandAdapter",
    "Launch",
    "Prepare",
    "Stop",
    "plan_digest",
    "training_digest",
]


def plan_digest(plan: Plan) -> str:
    """SHA-256 (hex) of the plan's JSON: what a Launch by reference must resolve to."""
    return hashlib.sha256(plan.model_dump_json().encode()).hexdigest()


def training_digest(config: TrainingConfig) -> str:
    """SHA-256 (hex) of the training config's JSON: what ``Launch.training_sha256`` names.

    Controller and agent both call this on their own reading of ``DesiredState.training``,
    so it must not depend on which release read it. Two things differ between releases:

    - ``schema_version``: a reader of an older release makes a newer config its own
      version (``_newer``). Hashed as 1, whatever the reader's version.
    - fields a newer release added (with a default, as every added field has): an older
      reader drops them. Those not in :data:`_FIELDS_AT_V1` are hashed only when not at
      their default, so a newer writer's config whose new fields keep their defaults has
      the digest an older reader computes; one that sets a new field away from its
      default does not, and the older agent refuses the launch (it would run without it).

    The fields of wire version 1 are hashed in full, as that release's agents hash them
    (``sha256(model_dump_json())`` of the config as version 1): its digest of every config
    it can read is this one, so an agent of the release before resolves this release's
    Launch, and a Launch written before the upgrade (a generation still in LAUNCH when the
    new leader takes over and re-sends it) names the same digest.
    """
    as_v1 = config.model_copy(update={"schema_version": 1})
    added = _added_at_default(as_v1)
    return hashlib.sha256(as_v1.model_dump_json(exclude=added or None).encode()).hexdigest()


_FIELDS_AT_V1: dict[str, frozenset[str]] = {
    name: frozenset(fields.split())
    for name, fields in {
        "TrainingConfig": "checkpoint clipping data eval loss_scaling metrics model optimizer "
        "precision schedule schema_version seed",
        "BuiltinModel": "kind name",
        "SpecFileModel": "kind path spec",
        "ModelSpec": "activation ffn_hidden_size global_batch_size hidden_size name norm "
        "num_heads num_kv_heads num_layers optimizer position_embedding precision seq_length "
        "tie_embeddings vocab_size",
        "HuggingFaceModel": "family kind load_weights path seq_length",
        "SyntheticData": "kind",
        "IndexedData": "kind manifest prefix validation_fraction",
        "OptimizerConfig": "betas eps lr no_decay weight_decay",
        "ScheduleConfig": "decay min_lr_ratio total_steps warmup_steps",
        "ClippingConfig": "max_norm",
        "LossScalingConfig": "initial_scale_power loss_scale_window min_loss_scale mode",
        "EvalConfig": "batches every_steps",
        "CheckpointConfig": "dir every_steps keep",
        "MetricsConfig": "every_steps jsonl tensorboard_dir",
    }.items()
}
"""The fields of ``TrainingConfig`` and of every model in it at wire version 1, by class
name: frozen here on purpose (not read from the classes), so that a field added later is
known as one (a model added later has none listed). Never edit an entry: a field listed
here and renamed or removed is no additive change (tests/unit/test_controller_plan_ref.py
checks each still exists)."""


def _added_at_default(model: BaseModel) -> dict[str, Any]:
    """The ``exclude`` of ``model_dump`` that leaves out every field added since wire
    version 1 (not in :data:`_FIELDS_AT_V1`) while at its default, nested models included;
    never a ``kind`` (a union's discriminator)."""
    known = _FIELDS_AT_V1.get(type(model).__name__, frozenset())
    out: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        # a discriminator is always hashed: two models added later, both at their defaults,
        # would otherwise share a digest (and the agent caches configs by digest)
        added = name not in known and name != "kind" and not info.is_required()
        if added and value == info.get_default(call_default_factory=True):
            out[name] = True
            continue
        inner = _nested(value)
        if inner:
            out[name] = inner
    return out


def _nested(value: Any) -> dict[Any, Any]:
    if isinstance(value, BaseModel):
        return _added_at_default(value)
    if isinstance(value, tuple | list):
        return {i: e for i, v in enumerate(value) if (e := _nested(v))}
    if isinstance(value, dict):
        return {k: e for k, v in value.items() if (e := _nested(v))}
    return {}


class _CommandBase(WireMessage):
    command_id: str = Field(min_length=1, max_length=128, description="Idempotency key.")
    epoch: int = Field(ge=0, description="Controller epoch (leader key create revision).")
    plan_id: str = Field(default="", description="Plan this command belongs to.")
    node_id: str = Field(min_length=1, description="Target node.")
    deadline: float = Field(default=0.0, ge=0, description="Unix time to finish by; 0 = none.")


class Prepare(_CommandBase):
    """Get ready for a new plan (e.g. fetch checkpoint metadata)."""

    kind: Literal["prepare"] = Field(default="prepare", description="Command kind.")


class Stop(_CommandBase):
    """Stop training after step ``at_step`` completes."""

    kind: Literal["stop"] = Field(default="stop", description="Command kind.")
    at_step: int = Field(ge=0, description="Last step to complete.")


class Checkpoint(_CommandBase):
    """Save this node's share of the checkpoint of ``step``."""

    kind: Literal["checkpoint"] = Field(default="checkpoint", description="Command kind.")
    step: int = Field(ge=0, description="Step to checkpoint.")
    directory: str = Field(description="Checkpoint root (path or URL).")
    prune_below: int = Field(
        default=-1,
        ge=-1,
        description="Once this checkpoint commits, delete every step below this one under "
        "``directory`` (the oldest commit the controller has recorded and keeps); -1: none.",
    )
    periodic: bool = Field(
        default=False,
        description="The controller's periodic checkpoint of the RUNNING job: a save whose "
        "failure the workers report (``AgentStatus.save_failed_step``) and train on; False: a "
        "reconfiguration's, whose failure fails them (wire version 7).",
    )
    drop_steps: tuple[int, ...] | None = Field(
        default=None,
        max_length=4096,
        description="Steps of saves the controller gave up on (an aborted CHECKPOINT, a "
        "periodic save abandoned or superseded; never a step it recorded, nor ``step``): once "
        "this checkpoint commits, its committer also deletes those of them under "
        "``directory`` at or above ``prune_below`` that were committed when the save began, "
        "their commit marker unchanged; never an uncommitted one, never another step. None: "
        "no such deletion (an older controller's, or ``keep_checkpoints`` null) (wire "
        "version 8).",
    )

    @field_validator("drop_steps")
    @classmethod
    def _steps_sorted(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is None:
            return None
        bad = [s for s in v if s < 0]
        if bad:
            raise field_error("drop_steps", v, f"steps are >= 0, not {bad[0]}")
        return tuple(sorted(set(v)))

    @model_validator(mode="after")
    def _prune_not_past_step(self) -> Checkpoint:
        if self.prune_below > self.step:
            raise ValueError(
                f"prune_below={self.prune_below}: must be <= step ({self.step}); the "
                "checkpoint being saved is never pruned"
            )
        return self


class Launch(_CommandBase):
    """Start the workers of plan ``plan_id`` on this node with the given global ranks."""

    kind: Literal["launch"] = Field(default="launch", description="Command kind.")
    plan: Plan | None = Field(
        default=None,
        description="Plan to run, inline (older controllers); None: read it from the desired "
        "state in etcd by ``plan_id`` and check ``plan_sha256``.",
    )
    plan_sha256: str = Field(
        default="", description="plan_digest() of the plan to run; '' only with ``plan`` inline."
    )
    ranks: tuple[int, ...] = Field(description="Global ranks to start on this node.")
    world_size: int = Field(gt=0, description="Total ranks.")
    master: str = Field(description="Rendezvous address host:port.")
    checkpoint: str = Field(default="", description="Checkpoint to load ('' = fresh start).")
    load_step: int = Field(
        default=-1, ge=-1, description="Committed step to load from ``checkpoint``; -1 = latest."
    )
    generation: int = Field(default=0, ge=0, description="Controller's launch counter.")
    training_sha256: str = Field(
        default="",
        description="training_digest() of the desired state's training config, which the "
        "workers are given; '' = none (the workers' own defaults).",
    )
    in_place: bool = Field(
        default=False,
        description="Reconfigure in place: hand the ranks to this node's held or warm worker "
        "processes (they rebuild for the new plan and fetch the layers they gain from their "
        "peers), starting new processes only for ranks left over; every worker is started "
        "able to hold (``--in-place``). False: today's restart path (kill, start, load).",
    )

    @model_validator(mode="after")
    def _plan_named(self) -> Launch:
        if self.plan is None and not (self.plan_id and self.plan_sha256):
            raise field_error("plan", None, "absent: then plan_id and plan_sha256 are required")
        return self


class Abort(_CommandBase):
    """Kill the workers now."""

    kind: Literal["abort"] = Field(default="abort", description="Command kind.")
    reason: str = Field(default="", description="Why.")
    hold: bool = Field(
        default=False,
        description="Abandon the current world but keep the worker processes, holding for an "
        "in-place Launch (workers that do not hold within the grace period are killed); "
        "False: kill them.",
    )


Command = Annotated[Prepare | Stop | Checkpoint | Launch | Abort, Field(discriminator="kind")]
CommandAdapter: TypeAdapter[Command] = TypeAdapter(Command)
