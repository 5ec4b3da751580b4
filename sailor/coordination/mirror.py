"""An in-memory copy of every key under one etcd prefix, kept current by a watch.

``PrefixMirror`` reads the prefix once (one range, at revision R) and then applies the watch
deltas from R + 1 on, in order, so its copy is the prefix's state at its ``revision``; etcd
guarantees a watch from a revision delivers every later change under the prefix exactly once
and in order, so the copy misses nothing while the watch lives. The controller built its
observed state from four full prefix reads per reconcile pass before (2 × 512 keys at 512
nodes, read and compared on every pass); with the mirror a pass reads no key at all.

What can go wrong, and what the mirror does:

- the watch breaks (etcd restart, network, a compaction past our revision): the watch task
  sees an error, waits ``retry_s`` and reads the whole prefix again (a *resync*: the keys that
  differ are marked changed), then watches from the new revision;
- the watch stops silently (aetcd does not report every broken stream): ``check()``, called
  periodically by the owner, compares the copy's (key count, highest mod revision) with the
  server's (``EtcdStore.prefix_fingerprint``, one small range call). A copy that stopped at
  some revision (it lacks every change after it: a stalled watch) differs from the server
  whenever their keys differ: a key written since is newer than any the copy holds, and
  with none written since the server holds a subset of the copy's keys, unchanged, so
  only a delete is missing and the counts differ. A copy that dropped one change but
  applied a later one is *not* told apart: one of two keys a transaction wrote (they
  share its revision: the copy's count and highest revision are the server's), or a put
  on an existing key followed by any later change. ``_apply`` must never drop a delta;
  the fingerprint is no check of that. If they keep differing for ``stale_after_s``
  with no delta arriving, the mirror resyncs. Not sooner: etcd feeds a watcher that fell behind in
  catch-up rounds every 100 ms, and in the 10,000-event burst (benchmarks/runtime_burst.py)
  a two-polls rule re-read healthy but lagging prefixes dozens of times;
- a delta for a key outside the prefix (a watch reply matched to the wrong watch, an aetcd
  race on a shared stream) is never applied: the watch is treated as broken.

Readers take ``changed()``: the keys that changed since their last call (``None`` before
the first read: everything). ``on_delete`` is told each key that disappears (a watch delta or
a resync), for an owner whose urgency depends on which key went (the controller: a node of
the running layout). Never writes to etcd.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from sailor.coordination.api import KeyValue
from sailor.coordination.errors import TemporaryError
from sailor.coordination.etcd_store import EtcdStore
from sailor.coordination.tasks import TaskSet

__all__ = ["PrefixMirror"]

_log = structlog.get_logger("sailor.etcd")


class PrefixMirror:
    """The keys under ``prefix``, as of ``revision``; call ``start`` then ``check`` often."""

    def __init__(
        self,
        store: EtcdStore,
        prefix: str,
        on_change: Callable[[], None] | None = None,
        retry_s: float = 0.2,
        stale_after_s: float = 1.0,
        on_delete: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.on_change = on_change
        self.on_delete = on_delete  # called with each key that disappears, before on_change
        self.retry_s = retry_s
        self.stale_after_s = stale_after_s
        self.revision = 0
        self._read_revision = 0  # the last full read's: its deltas are in the copy
        self.resyncs = 0  # measurement: full re-reads after the first
        self.deltas = 0  # measurement: watch changes applied
        self._kvs: dict[str, KeyValue] = {}
        self._changed: set[str] = set()
        self._suspect_since: float | None = None
        self._deltas_at_suspect = -1
        self._creating = False  # a watch is being created: not safe to cancel
        self._tasks = TaskSet(f"mirror:{prefix}")
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Read the prefix and start watching; TemporaryError if etcd did not answer."""
        await self._read()
        # a crash that is no broken watch (a bug, a refusal) restarts it with backoff; the
        # copy stays as it was meanwhile, and ``check`` sees it fall behind
        self._watch = self._tasks.keep("watch", self._follow, max_crashes=0)

    def get(self, key: str) -> KeyValue | None:
        return self._kvs.get(key)

    def items(self) -> dict[str, KeyValue]:
        """Every key and value (the mirror's own dict: do not modify)."""
        return self._kvs

    def changed(self) -> set[str]:
        """Keys changed (put or deleted) since the last call; clears the set."""
        out, self._changed = self._changed, set()
        return out

    async def _read(self) -> None:
        rev, kvs = await self.store.get_prefix_at(self.prefix)
        fresh = {kv.key: kv for kv in kvs}
        for key in self._kvs.keys() | fresh.keys():
            old, new = self._kvs.get(key), fresh.get(key)
            if old is None or new is None or old.mod_revision != new.mod_revision:
                self._changed.add(key)
        gone = self._kvs.keys() - fresh.keys()
        self._kvs = fresh
        self.revision = self._read_revision = rev
        self._suspect_since = None
        if self.on_delete is not None:
            for key in sorted(gone):
                self.on_delete(key)
        if self.on_change is not None and self._changed:
            self.on_change()

    def _apply(self, key: str, kv: KeyValue | None, rev: int) -> None:
        if rev <= self._read_revision:
            return  # already in the copy (a delta the read that preceded the watch saw)
        # Not ``rev <= self.revision``: the keys one transaction changes share its
        # revision, and every delta after the first was dropped (a re-point of two commit
        # records left the second under its old directory; ``check`` agreed, the copy's
        # count and highest mod revision being the server's, so it stayed so)
        if kv is None:
            if self._kvs.pop(key, None) is not None and self.on_delete is not None:
                self.on_delete(key)
        else:
            self._kvs[key] = kv
        self.revision = rev
        self.deltas += 1
        self._changed.add(key)

    async def _follow(self) -> None:
        """Apply watch deltas; on a broken watch, re-read and watch again (forever)."""
        first = True
        while True:
            try:
                if not first:
                    self.resyncs += 1
                    await self._read()
                first = False
                self._creating = True
                changes = self.store.watch_prefix(self.prefix, self.revision + 1)
                async for key, kv, rev in changes:
                    self._creating = False
                    if not key.startswith(self.prefix):
                        _log.warning("mirror_foreign_key", prefix=self.prefix, key=key)
                        break
                    self._apply(key, kv, rev)
                    if self.on_change is not None:
                        self.on_change()
                await changes.aclose()
            except TemporaryError as exc:
                _log.info("mirror_watch_broken", prefix=self.prefix, error=str(exc))
            self._creating = False
            await asyncio.sleep(self.retry_s)

    async def check(self) -> bool:
        """Compare with the server; resync after ``stale_after_s`` of mismatch with no delta.

        Returns True if the copy agreed with the server (or the server could not be asked).
        """
        try:
            count, top = await self.store.prefix_fingerprint(self.prefix)
        except TemporaryError:
            return True
        mine_top = max((kv.mod_revision for kv in self._kvs.values()), default=0)
        if (count, top) == (len(self._kvs), mine_top):
            self._suspect_since = None
            return True
        now = asyncio.get_running_loop().time()
        if self._suspect_since is None or self.deltas != self._deltas_at_suspect:
            self._suspect_since, self._deltas_at_suspect = now, self.deltas  # lag, so far
            return False
        if now - self._suspect_since < self.stale_after_s or self._creating:
            return False
        mine = (len(self._kvs), mine_top)
        _log.warning("mirror_stale", prefix=self.prefix, server=(count, top), mirror=mine)
        self._suspect_since = None
        await self._restart()
        return False

    async def _restart(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except asyncio.CancelledError:
                # the watch's own end, not this task's: a cancel of the caller (its check
                # task closing) was swallowed here, and the check went on re-reading
                me = asyncio.current_task()
                if me is not None and me.cancelling():
                    raise
            except Exception:  # the watch's last error: a new watch follows
                pass
        try:
            await self._read()
            self.resyncs += 1
        except TemporaryError:
            pass  # the watch task re-reads
        self._watch = self._tasks.keep("watch", self._follow, max_crashes=0)

    async def close(self) -> None:
        await self._tasks.close()
