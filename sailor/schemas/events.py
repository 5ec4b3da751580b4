"""Events published on NATS by agents (and by the controller about itself).

Events only wake the controller; it reconciles from etcd state, so a lost, duplicated or
reordered event is harmless. Each event has a unique id, used for JetStream deduplication.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from sailor.schemas._base import WireMessage
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.node_check import NodeFacts

__all__ = [
    "Event",
    "EventAdapter",
    "Heartbeat",
    "NodeJoined",
    "NodeLeft",
    "PreemptionNotice",
    "WorkerFailed",
]


class _EventBase(WireMessage):
    event_id: str = Field(min_length=1, max_length=128, description="Unique id (dedup key).")
    node_id: str = Field(min_length=1, max_length=128, description="Node the event is about.")
    time: float = Field(ge=0, description="Unix time the event was produced, s.")


class NodeJoined(_EventBase):
    """A node registered and can take work."""

    kind: Literal["node_joined"] = Field(default="node_joined", description="Event kind.")
    node: NodeSpec = Field(description="The node that joined.")
    facts: NodeFacts | None = Field(
        default=None,
        description="What the agent's start-up check found (CUDA, devices, NCCL, servers); "
        "None from an agent that does not report it.",
    )


class NodeLeft(_EventBase):
    """A node left (clean shutdown or lease expiry)."""

    kind: Literal["node_left"] = Field(default="node_left", description="Event kind.")
    reason: str = Field(default="", max_length=512, description="Why it left.")


class PreemptionNotice(_EventBase):
    """The cloud will reclaim a spot node at ``deadline``."""

    kind: Literal["preemption_notice"] = Field(
        default="preemption_notice", description="Event kind."
    )
    deadline: float = Field(ge=0, description="Unix time the node will be gone.")
    source: str = Field(default="", max_length=64, description="Watcher that saw it.")


class WorkerFailed(_EventBase):
    """A training worker on the node exited abnormally."""

    kind: Literal["worker_failed"] = Field(default="worker_failed", description="Event kind.")
    plan_id: str = Field(default="", description="Plan the worker ran.")
    rank: int = Field(default=-1, description="Global rank of the worker.")
    cause: str = Field(default="", max_length=4096, description="First cause reported.")
    culprit: int = Field(
        default=-1,
        ge=-1,
        description="Global rank the first cause names as guilty (its record's ``culprit``: "
        "the rank that sent bytes that do not decode, an oversized size or an object of the "
        "wrong shape); -1: none. The controller charges that rank's node, not this one.",
    )


class Heartbeat(_EventBase):
    """Periodic progress of the workers on a node."""

    kind: Literal["heartbeat"] = Field(default="heartbeat", description="Event kind.")
    plan_id: str = Field(default="", description="Plan running.")
    step: int = Field(default=0, ge=0, description="Last completed step.")
    loss: float | None = Field(default=None, description="Loss of the last step.")
    samples_per_s: float = Field(default=0.0, ge=0, description="Throughput.")


Event = Annotated[
    NodeJoined | NodeLeft | PreemptionNotice | WorkerFailed | Heartbeat,
    Field(discriminator="kind"),
]
EventAdapter: TypeAdapter[Event] = TypeAdapter(Event)
