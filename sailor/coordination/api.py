"""The small interfaces of the coordination layer; backends live in their own modules.

- ``StateStore``: a key-value store with leases and writes guarded by a fencing epoch
  (backend: etcd, ``etcd_store.py``).
- ``Election``: leader election whose epoch is a fencing token (``election.py``, on the store).
- ``EventBus``: a durable, deduplicated stream of events, acknowledged after handling
  (backend: NATS JetStream, ``nats_bus.py``).
- ``CommandChannel``: per-node request/reply commands; the reply is the ack (NATS core).

Each has one contract test against its real server (tests/integration/test_runtime_contract.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "CommandChannel",
    "CommandHandler",
    "Delivery",
    "EventBus",
    "KeyValue",
    "Lease",
    "StateStore",
]


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One stored key: value bytes and its etcd revisions."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


class Lease(Protocol):
    """A lease kept alive in the background until revoked or lost."""

    @property
    def id(self) -> int: ...

    @property
    def alive(self) -> bool:
        """False once the server said the lease is gone (keys bound to it were deleted)."""
        ...

    async def revoke(self) -> None: ...


class StateStore(Protocol):
    """Key-value state with leases and epoch-guarded writes."""

    async def get(self, key: str) -> KeyValue | None: ...

    async def get_prefix(self, prefix: str) -> list[KeyValue]: ...

    async def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        """Unconditional write (agents' own keys); returns the new revision."""
        ...

    async def put_guarded(
        self, key: str, value: bytes, guard_key: str, epoch: int, lease: Lease | None = None
    ) -> int:
        """Write only if ``guard_key`` still has create revision ``epoch``; else FencedError."""
        ...

    async def put_all_guarded(
        self,
        items: Sequence[tuple[str, bytes]],
        guard_key: str,
        epoch: int,
        delete: Sequence[str] = (),
        expect: Mapping[str, int] | None = None,
        marks: Sequence[str] = (),
        lease: Lease | None = None,
    ) -> int:
        """Like ``put_guarded`` for several keys (and deletions) in one transaction; with
        ``expect`` (key -> mod revision), only while each of those keys is as it was
        (``ChangedError`` if one changed or went); ``marks``: empty keys written with them,
        bound to ``lease`` (required with marks)."""
        ...

    async def delete(self, key: str) -> None:
        """Delete ``key``, unguarded (a key its writer owns, e.g. an operator's request)."""
        ...

    async def delete_guarded(self, key: str, guard_key: str, epoch: int) -> None: ...

    async def delete_unchanged(self, key: str, mod_revision: int) -> bool:
        """Delete ``key`` only if its mod revision is still ``mod_revision``, unguarded (an
        operator withdrawing its own request); whether it was deleted."""
        ...

    async def put_witnessed(self, key: str, value: bytes, witness: str, lease: Lease) -> int | None:
        """Write ``key`` and an empty ``witness`` bound to ``lease`` in one transaction,
        only while ``witness`` does not exist; the revision, or None when it exists (an
        earlier write committed, whether or not ``key`` is still there)."""
        ...

    async def create_if_absent(self, key: str, value: bytes, lease: Lease) -> KeyValue | None:
        """Create ``key`` bound to ``lease`` unless it exists; returns the stored key or None."""
        ...

    async def lease(self, ttl: int) -> Lease:
        """Grant a lease and keep it alive in the background (every ttl/3 s)."""
        ...

    async def revision(self) -> int: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Delivery:
    """One event delivered from the bus; ``ack`` it after handling, or ``nak`` it to retry."""

    data: bytes
    msg_id: str
    subject: str
    redelivered: int
    ack: Callable[[], Awaitable[None]]
    nak: Callable[[float], Awaitable[None]]
    """Give the event back for redelivery after the given delay, s (not after ``ack_wait``)."""


class EventBus(Protocol):
    """Durable event stream with publisher-side deduplication by message id."""

    async def publish(self, subject_kind: str, data: bytes, msg_id: str) -> bool:
        """Publish; returns False when the stream dropped it as a duplicate."""
        ...

    async def fetch(self, batch: int, timeout: float) -> list[Delivery]:
        """Up to ``batch`` events for the durable consumer; [] after ``timeout``."""
        ...

    async def close(self) -> None: ...


CommandHandler = Callable[[bytes], Awaitable[bytes]]


class CommandChannel(Protocol):
    """Commands to one node, acknowledged by the reply."""

    async def request(self, node_id: str, data: bytes, timeout: float) -> bytes:
        """Send and wait for the reply; UnavailableError on timeout or no responder."""
        ...

    async def serve(self, node_id: str, handler: CommandHandler) -> None:
        """Handle commands for ``node_id`` until ``close``."""
        ...

    async def close(self) -> None: ...
