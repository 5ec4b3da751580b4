"""The only code that talks to NATS and etcd: event bus, commands, state store, leases, election.

Shared by the controller and the agent. Small protocols in ``api.py``; backends in
``etcd_store.py`` and ``nats_bus.py``; names of keys and subjects in ``keys.py``. Must never
import the controller, the agent or torch.

The backends' names (from :mod:`etcd_store`, :mod:`nats_bus`, :mod:`election` and
:mod:`mirror`) are imported on first use: a command that talks to no server (``sailor
certs``, ``sailor audit``) uses the light names (keys, errors, clock) without loading
nats-py, aiohttp and aetcd (~0.2 CPU-s of its start-up).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sailor.coordination.api import (
    CommandChannel,
    Delivery,
    EventBus,
    KeyValue,
    Lease,
    StateStore,
)
from sailor.coordination.clock import Clock, ManualClock, SystemClock
from sailor.coordination.errors import (
    ChangedError,
    CoordinationError,
    DaemonFailedError,
    EventTooLargeError,
    FencedError,
    PermanentError,
    ReplicasExceedClusterError,
    StreamConflictError,
    StreamNotPlacedError,
    StreamStorageError,
    TemporaryError,
    UnavailableError,
)
from sailor.coordination.keys import Keys, safe_token
from sailor.coordination.tasks import TaskSet

if TYPE_CHECKING:
    from sailor.coordination.election import Leadership, campaign
    from sailor.coordination.etcd_store import EtcdLease, EtcdStore, connect_etcd
    from sailor.coordination.mirror import PrefixMirror
    from sailor.coordination.nats_bus import (
        NatsCommands,
        NatsEventBus,
        close_nats,
        connect_nats,
        unclustered_replicas,
    )

_BACKENDS = {
    "Leadership": "election",
    "campaign": "election",
    "EtcdLease": "etcd_store",
    "EtcdStore": "etcd_store",
    "connect_etcd": "etcd_store",
    "PrefixMirror": "mirror",
    "NatsCommands": "nats_bus",
    "NatsEventBus": "nats_bus",
    "close_nats": "nats_bus",
    "connect_nats": "nats_bus",
    "unclustered_replicas": "nats_bus",
}
"""A backend's name -> the module (of this package) that defines it."""

__all__ = [
    "ChangedError",
    "Clock",
    "CommandChannel",
    "CoordinationError",
    "DaemonFailedError",
    "Delivery",
    "EtcdLease",
    "EtcdStore",
    "EventBus",
    "EventTooLargeError",
    "FencedError",
    "KeyValue",
    "Keys",
    "Leadership",
    "Lease",
    "ManualClock",
    "NatsCommands",
    "NatsEventBus",
    "PermanentError",
    "PrefixMirror",
    "ReplicasExceedClusterError",
    "StateStore",
    "StreamConflictError",
    "StreamNotPlacedError",
    "StreamStorageError",
    "SystemClock",
    "TaskSet",
    "TemporaryError",
    "UnavailableError",
    "campaign",
    "close_nats",
    "connect_etcd",
    "connect_nats",
    "safe_token",
    "unclustered_replicas",
]


def __getattr__(name: str) -> Any:
    """A backend's name (:data:`_BACKENDS`), its module imported on this first use."""
    if name in _BACKENDS:
        return getattr(importlib.import_module(f"{__name__}.{_BACKENDS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
