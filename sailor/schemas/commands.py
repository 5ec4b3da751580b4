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
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, model_validator

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

    Hashed as ``schema_version`` 1, whatever version wrote it: a reader of an older release
    makes a newer config its own version (``_newer``), so an agent of the release that wrote
    version 1 computes this digest of a newer controller's config too, while the config's
    fields are the same (its own configs, and those it reads, are version 1 already).
    Hashing the writer's version refused every launch of a newer controller with a training
    config on such agents ("training config digest mismatch"), in the upgrade order the
    operations guide gives (controllers first).
    """
    as_v1 = config.model_copy(update={"schema_version": 1})
    return hashlib.sha256(as_v1.model_dump_json().encode()).hexdigest()


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
