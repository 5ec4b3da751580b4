"""The controller's observed state: etcd mirrored by watches, validated only where it changed.

``ObservedCache`` keeps one ``PrefixMirror`` (``sailor.coordination``: one range read, then
the watch deltas from its revision) per prefix ``decide`` needs — nodes, statuses, notices,
checkpoint commits — and, per key, the record it parsed to. ``snapshot()`` does no I/O: it
re-validates only the keys the mirrors report changed since the last snapshot and drops the
ones deleted. Before, every pass read all four prefixes in full (2 × 512 keys at 512 nodes,
~4 ms of parsing per pass plus the round trips, and one etcd read per event for the
registration check); now a pass costs what changed.

Still level-triggered: the mirrors are copies of the state, not a log of events the loop
reacts to, and ``check()`` (the controller's poll) compares each with the server and re-reads
a prefix whose watch died silently, so a missed notification cannot leave the view stale.
Rejected records are reported once per distinct value, not once per pass. ``on_node_gone``
is told the id of each node whose key disappears (lease lost or revoked) as the delta
arrives, so the owner can tell a lost node of the running layout from any other change.

Never writes to etcd; no clock; the caller stamps ``Observed.now``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel, ValidationError

from sailor.coordination import EtcdStore, Keys, PrefixMirror
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import AgentStatus, CommitRecord, NoticeRecord

__all__ = ["ObservedCache", "Snapshot"]

_M = TypeVar("_M", bound=BaseModel)

Reject = Callable[[str, str], None]
"""Called with (key, first line of the validation error) for a record that does not parse."""


class _Prefix(Generic[_M]):
    """Parsed records of one mirrored prefix, keyed by etcd key, re-validated only on change."""

    def __init__(
        self, model: type[_M], mirror: PrefixMirror, key_of: Callable[[_M], str] | None = None
    ) -> None:
        self.model = model
        self.mirror = mirror
        self.key_of = key_of  # the key a record must be stored under, if fixed by its content
        self.raw: dict[str, bytes] = {}
        self.parsed: dict[str, _M] = {}
        self.validated = 0

    def update(self, reject: Reject) -> bool:
        """Apply the mirror's changes; True if any key changed."""
        changed = self.mirror.changed()
        for key in changed:
            kv = self.mirror.get(key)
            if kv is None:
                self.raw.pop(key, None)
                self.parsed.pop(key, None)
                continue
            if self.raw.get(key) == kv.value:
                continue
            self.raw[key] = kv.value
            self.validated += 1
            try:
                rec = self.model.model_validate_json(kv.value)
            except ValidationError as exc:
                self.parsed.pop(key, None)
                reject(key, str(exc).splitlines()[0])
                continue
            if self.key_of is not None and (own := self.key_of(rec)) != key:
                # A well-formed record under another node's key (a confused or hostile
                # writer): never believed, and audited once per value written.
                self.parsed.pop(key, None)
                reject(key, f"record belongs under {own!r}, not under {key!r}")
                continue
            self.parsed[key] = rec
        return bool(changed)


@dataclass(frozen=True)
class Snapshot:
    """One snapshot: the records ``Observed`` is built from (never modified once made)."""

    nodes: dict[str, NodeSpec]
    status: dict[str, AgentStatus]
    notices: dict[str, NoticeRecord]
    commits: tuple[CommitRecord, ...]


class ObservedCache:
    """Mirrored, parsed view of the controller's etcd inputs (one per leadership term)."""

    def __init__(
        self,
        store: EtcdStore,
        keys: Keys,
        reject: Reject,
        on_change: Callable[[], None] | None = None,
        on_node_gone: Callable[[str], None] | None = None,
    ) -> None:
        self.keys = keys
        self.store = store
        self.reject = reject
        gone = None
        if on_node_gone is not None:
            cut = len(keys.nodes)

            def gone(key: str) -> None:
                on_node_gone(key[cut:])

        self._nodes = _Prefix(
            NodeSpec,
            PrefixMirror(store, keys.nodes, on_change, on_delete=gone),
            lambda r: keys.node(r.node_id),
        )
        self._status = _Prefix(
            AgentStatus,
            PrefixMirror(store, keys.statuses, on_change),
            lambda r: keys.status(r.node_id),
        )
        self._notices = _Prefix(
            NoticeRecord,
            PrefixMirror(store, keys.notices, on_change),
            lambda r: keys.notice(r.node_id),
        )
        self._commits = _Prefix(CommitRecord, PrefixMirror(store, keys.checkpoints, on_change))
        self._all = (self._nodes, self._status, self._notices, self._commits)
        self._last: Snapshot | None = None

    @property
    def validated(self) -> int:
        """Records validated so far (a measure of the cache's effect)."""
        return sum(p.validated for p in self._all)

    @property
    def resyncs(self) -> int:
        """Full re-reads of a prefix after the first (broken or silently stopped watches)."""
        return sum(p.mirror.resyncs for p in self._all)

    async def start(self) -> None:
        """First read of every prefix, then watch them."""
        await asyncio.gather(*(p.mirror.start() for p in self._all))

    async def check(self) -> bool:
        """Compare every mirror with the server (re-reads the stale ones); True if all agreed."""
        ok = await asyncio.gather(*(p.mirror.check() for p in self._all))
        return all(ok)

    async def close(self) -> None:
        await asyncio.gather(*(p.mirror.close() for p in self._all))

    def registered(self, node_id: str) -> bool | None:
        """True if the mirror holds ``nodes/<id>``; None if it does not (ask etcd: the
        registration may be newer than the mirror's last delta)."""
        return True if self._nodes.mirror.get(self.keys.node(node_id)) is not None else None

    def snapshot(self) -> Snapshot:
        """The parsed state; the previous snapshot itself when no mirrored key changed."""
        changed = [p.update(self.reject) for p in self._all]  # every mirror, no short cut
        if self._last is not None and not any(changed):
            return self._last
        # every parsed record sits under its own key (``_Prefix.key_of``)
        nodes = {spec.node_id: spec for spec in self._nodes.parsed.values()}
        status = {st.node_id: st for st in self._status.parsed.values()}
        notices = {r.node_id: r for r in self._notices.parsed.values()}
        parsed = self._commits.parsed
        commits = tuple(parsed[key] for key in sorted(parsed))  # keys sort by step
        self._last = Snapshot(nodes, status, notices, commits)
        return self._last
