"""Leader election on the state store; the epoch is the leader key's create revision.

A candidate creates the leader key bound to its own lease in one transaction, only if the
key is absent. The create revision of that key is the epoch: it grows with every new leader
(etcd revisions never go back), so it is a fencing token for guarded writes and commands.
A standby polls until the key is gone (the old leader's lease expired or was revoked), so a
new leader takes over within about one lease TTL plus one poll period.
"""

from __future__ import annotations

from sailor.coordination.clock import Clock, SystemClock
from sailor.coordination.errors import TemporaryError, UnavailableError
from sailor.coordination.etcd_store import EtcdLease, EtcdStore

__all__ = ["Leadership", "campaign"]


class Leadership:
    """What a won election gives: the epoch and the lease that holds it."""

    def __init__(self, key: str, identity: str, epoch: int, lease: EtcdLease) -> None:
        self.key = key
        self.identity = identity
        self.epoch = epoch
        self.lease = lease

    @property
    def held(self) -> bool:
        return self.lease.alive

    @property
    def fresh(self) -> bool:
        """Held, and its lease refreshed within its TTL (``EtcdLease.fresh``): a leader cut
        off from etcd may have been replaced, so it sends no command and takes no event."""
        return self.lease.fresh

    async def resign(self) -> None:
        await self.lease.revoke()

    async def abandon(self) -> None:
        """Stop the keepalive without revoking (simulates a crash; for tests)."""
        await self.lease.stop_keepalive()


async def campaign(
    store: EtcdStore,
    key: str,
    identity: str,
    ttl: int,
    timeout: float,
    poll_s: float = 0.2,
    clock: Clock | None = None,
) -> Leadership:
    """Become leader or raise UnavailableError after ``timeout`` seconds."""
    clock = clock or SystemClock()
    give_up = clock.now() + timeout
    lease: EtcdLease | None = None
    try:
        while clock.now() < give_up:
            try:
                if lease is None or not lease.alive:
                    lease = await store.lease(ttl)
                kv = await store.create_if_absent(key, identity.encode(), lease)
            except TemporaryError:
                await clock.sleep(poll_s)
                continue
            if kv is not None and kv.lease == lease.id:
                won, lease = Leadership(key, identity, kv.create_revision, lease), None
                return won
            await clock.sleep(poll_s)
    finally:
        if lease is not None:
            await lease.revoke()
    raise UnavailableError("not elected before timeout", key=key, timeout=timeout)
