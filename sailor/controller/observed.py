"""The controller's observed state, read from etcd and validated only where it changed.

``ObservedCache.refresh(store)`` reads the four prefixes ``decide`` needs (nodes, statuses,
notices, checkpoint commits) concurrently and keeps, per key, the raw value and the record it
parsed to: a value that did not change since the last pass is not validated again, a value
that changed is, and a key that disappeared is dropped. The reads stay full reads — the
cache never trusts a delta it did not see, so the semantics stay level-triggered and a missed
notification cannot leave it stale — but the pydantic validation of 2 × 512 records per pass
(the larger share of the 512-node pass, docs/runtime.md) shrinks to the handful that moved.
Rejected records are reported once per distinct value, not once per pass.

Never writes to etcd; no clock; the caller stamps ``Observed.now``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from sailor.coordination import EtcdStore, Keys
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import AgentStatus, CommitRecord, NoticeRecord

__all__ = ["ObservedCache", "Snapshot"]

_M = TypeVar("_M", bound=BaseModel)

Reject = Callable[[str, str], None]
"""Called with (key, first line of the validation error) for a record that does not parse."""


class _Prefix(Generic[_M]):
    """Parsed records under one prefix, keyed by etcd key, re-validated only on change."""

    def __init__(self, model: type[_M]) -> None:
        self.model = model
        self.raw: dict[str, bytes] = {}
        self.parsed: dict[str, _M | None] = {}
        self.validated = 0

    def update(self, items: list[Any], reject: Reject) -> dict[str, _M]:
        seen: set[str] = set()
        for kv in items:
            seen.add(kv.key)
            if self.raw.get(kv.key) == kv.value:
                continue
            self.raw[kv.key] = kv.value
            self.validated += 1
            try:
                self.parsed[kv.key] = self.model.model_validate_json(kv.value)
            except ValidationError as exc:
                self.parsed[kv.key] = None
                reject(kv.key, str(exc).splitlines()[0])
        for gone in [k for k in self.raw if k not in seen]:
            del self.raw[gone]
            self.parsed.pop(gone, None)
        return {k: v for k, v in self.parsed.items() if v is not None}


@dataclass(frozen=True)
class Snapshot:
    """One refresh: the records ``Observed`` is built from."""

    nodes: dict[str, NodeSpec]
    status: dict[str, AgentStatus]
    notices: dict[str, NoticeRecord]
    commits: tuple[CommitRecord, ...]


class ObservedCache:
    """Per-key parse cache of the controller's etcd view (one per leadership term)."""

    def __init__(self, keys: Keys, reject: Reject) -> None:
        self.keys = keys
        self.reject = reject
        self._nodes = _Prefix(NodeSpec)
        self._status = _Prefix(AgentStatus)
        self._notices = _Prefix(NoticeRecord)
        self._commits = _Prefix(CommitRecord)

    @property
    def validated(self) -> int:
        """Records validated so far (a measure of the cache's effect)."""
        return sum(p.validated for p in (self._nodes, self._status, self._notices, self._commits))

    async def refresh(self, store: EtcdStore) -> Snapshot:
        k = self.keys
        nodes_kv, status_kv, notices_kv, commits_kv = await asyncio.gather(
            store.get_prefix(k.nodes),
            store.get_prefix(k.statuses),
            store.get_prefix(k.notices),
            store.get_prefix(k.checkpoints),
        )
        nodes = {
            spec.node_id: spec
            for key, spec in self._nodes.update(nodes_kv, self.reject).items()
            if key == k.node(spec.node_id)
        }
        status = {
            st.node_id: st
            for key, st in self._status.update(status_kv, self.reject).items()
            if key == k.status(st.node_id)
        }
        notices = {r.node_id: r for r in self._notices.update(notices_kv, self.reject).values()}
        commits = tuple(self._commits.update(commits_kv, self.reject).values())
        return Snapshot(nodes, status, notices, commits)
