"""Commands from the controller to one agent.

Every command carries the controller's epoch (fencing token: agents refuse a lower epoch than
the highest they have seen), the plan id and a command id (idempotency key: an agent applies a
command id at most once).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from sailor.schemas._base import WireMessage
from sailor.schemas.plan import Plan

__all__ = ["Abort", "Checkpoint", "Command", "CommandAdapter", "Launch", "Prepare", "Stop"]


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


class Launch(_CommandBase):
    """Start the workers of ``plan`` on this node with the given global ranks."""

    kind: Literal["launch"] = Field(default="launch", description="Command kind.")
    plan: Plan = Field(description="Plan to run.")
    ranks: tuple[int, ...] = Field(description="Global ranks to start on this node.")
    world_size: int = Field(gt=0, description="Total ranks.")
    master: str = Field(description="Rendezvous address host:port.")
    checkpoint: str = Field(default="", description="Checkpoint to load ('' = fresh start).")
    load_step: int = Field(
        default=-1, ge=-1, description="Committed step to load from ``checkpoint``; -1 = latest."
    )
    generation: int = Field(default=0, ge=0, description="Controller's launch counter.")


class Abort(_CommandBase):
    """Kill the workers now."""

    kind: Literal["abort"] = Field(default="abort", description="Command kind.")
    reason: str = Field(default="", description="Why.")


Command = Annotated[Prepare | Stop | Checkpoint | Launch | Abort, Field(discriminator="kind")]
CommandAdapter: TypeAdapter[Command] = TypeAdapter(Command)
