"""The only code that talks to NATS and etcd: event bus, commands, state store, leases, election.

Shared by the controller and the agent. Small protocols in ``api.py``; backends in
``etcd_store.py`` and ``nats_bus.py``; names of keys and subjects in ``keys.py``. Must never
import the controller, the agent or torch.
"""

from sailor.coordination.api import (
    CommandChannel,
    Delivery,
    EventBus,
    KeyValue,
    Lease,
    StateStore,
)
from sailor.coordination.clock import Clock, ManualClock, SystemClock
from sailor.coordination.election import Leadership, campaign
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
from sailor.coordination.etcd_store import EtcdLease, EtcdStore, connect_etcd
from sailor.coordination.keys import Keys, safe_token
from sailor.coordination.mirror import PrefixMirror
from sailor.coordination.nats_bus import (
    NatsCommands,
    NatsEventBus,
    close_nats,
    connect_nats,
    unclustered_replicas,
)
from sailor.coordination.tasks import TaskSet

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
