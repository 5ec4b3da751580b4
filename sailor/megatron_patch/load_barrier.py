"""Every rank of a world waits for the others' loads on the rendezvous store, not in NCCL.

A rank fills its stage after the world formed (its first all-reduce is done): a checkpoint
restore, an in-place relayout's reads, or Hugging Face weights. Loads differ in length (one
rank reads more layers, or from a slower object store), and the next collective — the first
boundary's ``control.agree`` or the first 1F1B exchange — is where a rank that loaded early
would wait for the slowest under the process groups' timeout (600 s by default). A resume of
a large model longer than that trips NCCL's watchdog on every rank, and every relaunch
trips it again.

So after its load each rank checks in on the c10d store the world was initialised with (a
TCP store outside NCCL, served by rank 0) and waits there, in short polls, until every rank
has loaded, under a timeout of its own (``--load-timeout-s``, :data:`LOAD_TIMEOUT_S`). No
NCCL collective waits on a load, as no collective waits on a save (``boundary._durable``).

A rank whose load fails writes its error to the store before raising it; every other rank
raises :class:`~sailor.megatron_patch.errors.PeerFailedError` naming that rank and its error
as soon as its own load is over (``origin="peer"``: not charged to its node), instead of
waiting out the process group's timeout in a collective the failed rank never reaches. A
rank still loading cannot be interrupted: it learns of the failure when its own read ends.
If the store is gone (rank 0 failed and exited), the waiting ranks raise ``PeerFailedError``
saying so.

A rank can also fail without writing anything: killed with no Python exception (the host's
OOM killer, SIGKILL, a segfault in a reader), or failing before its load began (building
its stage, the in-place handshake). Before this barrier its gloo peers saw the closed
socket at once and NCCL peers timed out; a store wait sees neither, and would wait the whole
load timeout. So a rank's part in the barrier (:class:`LoadBarrier`) starts with its world,
not with its load: from then on a thread bumps the rank's heartbeat counter on the store
every ``liveness_s / 5`` seconds until the barrier releases, and the worker writes any
failure of its own through it (``fail``, from ``rank_main.main``'s handler) until then.
The thread has a store connection of its own (``Store.clone``): the c10d client answers
one request at a time, so a beat on the main thread's connection would wait behind any
blocking ``get``/``wait`` there; a failed beat is retried on a new connection until the
barrier ends.

Each waiting rank reads, every poll, the counters of the :data:`WATCHED` ranks after it on
the ring (:func:`watched`), so every rank is watched by the ``WATCHED`` ranks before it, each
looking every poll; and one other rank's counter in turn, so that a dead rank whose watchers
are all still loading is still found, later. A counter that has not moved for
``liveness_s`` (``--load-liveness-s``, :data:`LIVENESS_S`) is a dead rank: the waiter writes
that rank's failure for the others (every waiter raises it at its next poll) and raises
``PeerFailedError`` naming it and its host. So a dead rank is found ``liveness_s`` plus a
poll or two after one of its watchers waits, whatever the world's size, at ``WATCHED + 1``
counter reads per waiter per poll (the round-robin alone, one read per poll, needed two
reads of the same rank ``liveness_s`` apart, each ``world_size - 1`` polls apart: 8 to 17
minutes at 512 ranks and 1 s polls). A rank hung in a read keeps beating (the thread is
its own): that is the load timeout's case, not this one's.

This module never touches a device or a collective; it takes any object with the c10d
store's ``add``/``set``/``get``/``check`` and ``clone`` (``torch.distributed.Store``).
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Protocol, cast

from sailor.megatron_patch.errors import PeerFailedError

__all__ = [
    "LIVENESS_S",
    "LOAD_TIMEOUT_S",
    "WATCHED",
    "LoadBarrier",
    "LoadTimeoutError",
    "Store",
    "await_loads",
    "loaded_together",
    "watched",
    "worker_barrier",
]

LOAD_TIMEOUT_S = 7200.0
"""Default wait for every rank's load: a flat 2 h, not the checkpoint's size over a bandwidth
(the size of another rank's read is not known here, and a guessed bandwidth would be the
figure to distrust). 2 h covers a rank reading 720 GB at 100 MB/s — a conservative
sustained rate from an object store — which is more than one rank of a 70B-parameter model
reads with its AdamW moments (~1.1 TB in fp32 for the whole model, split over its stages).
A load longer than that is a stuck read, and the job fails naming the ranks not loaded."""

LIVENESS_S = 60.0
"""Default silence after which a loading rank is taken for dead: far below the load timeout,
far above what a live rank's heartbeat thread can miss. The thread beats every
``liveness_s / 5`` (12 s); what could hold it up is the GIL held by one long C call of the
load (a copy of a single tensor of a few GB takes a second or two) and a slow store round
trip — not tens of seconds (and no store call of the main thread: the beat has its own
connection). A rank dead for 60 s costs about a minute once one of its watchers waits
(:func:`watched`), at any world size, not the 2 h timeout."""

BEATS_PER_LIVENESS = 5
"""Heartbeats a live rank sends within one ``liveness_s``: four can be lost or late before
it is taken for dead."""

WATCHED = 3
"""Ranks each waiting rank reads every poll (its successors on the ring), so each rank has
this many watchers: one of three waiting already is enough for a dead rank to be found in
``liveness_s``. Each waiter's store load per poll is ``WATCHED + 1`` counter reads besides
its two reads of the barrier's own counters: with the worker's 1 s polls 6 requests a second
per waiting rank, ~6k a second on rank 0's store at 1024 ranks (the round-robin alone made
it 3k, and took minutes to find a dead rank there)."""

_PREFIX = "sailor/loaded"


class Store(Protocol):
    """The part of ``torch.distributed.Store`` used here."""

    def add(self, key: str, value: int) -> int: ...

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


class LoadTimeoutError(PeerFailedError):
    """Some ranks did not finish their load within ``--load-timeout-s`` (raised by the ranks
    that did: the slow ones' node is to blame, not theirs)."""


def _keys(world: str) -> tuple[str, str]:
    return f"{_PREFIX}/{world}/count", f"{_PREFIX}/{world}/failures"


def _beat_key(world: str, rank: int) -> str:
    return f"{_PREFIX}/{world}/beat/{rank}"


def _host_key(world: str, rank: int) -> str:
    return f"{_PREFIX}/{world}/host/{rank}"


def _check_args(rank: int, world_size: int, timeout_s: float, liveness_s: float) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} outside a world of world_size={world_size}")
    if timeout_s <= 0:
        raise ValueError(f"load timeout_s={timeout_s}: must be > 0")
    if liveness_s <= 0:
        raise ValueError(f"load liveness_s={liveness_s}: must be > 0")


class LoadBarrier:
    """One rank's part in its world's load barrier, from the world's start to its release.

    :meth:`start` it as soon as the world exists (its heartbeat begins), run the load in
    :meth:`loading`, and send any failure of the rank before then through :meth:`fail`
    (the worker's top-level handler does). :meth:`close` (also at the end of ``loading``)
    stops the heartbeat; a world whose ranks load nothing closes it at once."""

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        world: str,
        timeout_s: float = LOAD_TIMEOUT_S,
        liveness_s: float = LIVENESS_S,
        poll_s: float = 0.05,
    ) -> None:
        _check_args(rank, world_size, timeout_s, liveness_s)
        self.store, self.rank, self.world_size, self.world = store, rank, world_size, world
        self.timeout_s, self.liveness_s, self.poll_s = timeout_s, liveness_s, poll_s
        self._pending = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> bool:
        """Started and not yet released, failed or closed: a failure now is the others' news."""
        return self._pending

    def start(self) -> LoadBarrier:
        """Begin beating (this rank's host first, for the others' errors)."""
        self._pending = True
        with suppress(Exception):  # a store already gone: the waiters say so themselves
            self.store.set(_host_key(self.world, self.rank), socket.gethostname())
        self._thread = threading.Thread(
            target=self._beat, name=f"sailor-load-heartbeat-{self.rank}", daemon=True
        )
        self._thread.start()
        return self

    def _beat(self) -> None:
        key, every = _beat_key(self.world, self.rank), self.liveness_s / BEATS_PER_LIVENESS
        conn: Store | None = None
        failed = 0
        while not self._stop.is_set():
            try:
                if conn is None:  # its own: never behind the main thread's blocking calls
                    conn = _connect(self.store)
                conn.add(key, 1)
            except Exception as exc:  # retried until stopped, on a new connection
                conn = None
                failed += 1
                if failed == 1:  # one line per outage, not one per beat
                    print(
                        f"rank {self.rank}: load heartbeat failed ({type(exc).__name__}: "
                        f"{exc}); retrying every {every:g} s",
                        file=sys.stderr,
                        flush=True,
                    )
            else:
                if failed:
                    print(
                        f"rank {self.rank}: load heartbeat back after {failed} failed beats",
                        file=sys.stderr,
                        flush=True,
                    )
                failed = 0
            self._stop.wait(every)

    def fail(self, exc: BaseException) -> None:
        """Tell the waiting ranks this rank failed (while the barrier is pending; best
        effort), then stop beating."""
        if self._pending:
            _publish_failure(self.store, self.rank, self.world, exc)
        self.close()

    def close(self) -> None:
        """Stop beating; the barrier is over for this rank."""
        self._pending = False
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Run this rank's load in the ``with`` block, then wait until every rank's is done
        (:func:`await_loads`); a failure in the block goes to the others first."""
        if not self._pending:
            self.start()
        try:
            yield
        except BaseException as exc:
            self.fail(exc)
            raise
        try:
            await_loads(
                self.store,
                self.rank,
                self.world_size,
                self.world,
                self.timeout_s,
                self.poll_s,
                liveness_s=self.liveness_s,
            )
        finally:
            self.close()


@contextmanager
def loaded_together(
    store: Store,
    rank: int,
    world_size: int,
    world: str,
    timeout_s: float = LOAD_TIMEOUT_S,
    poll_s: float = 0.05,
    liveness_s: float = LIVENESS_S,
) -> Iterator[None]:
    """Run this rank's load in the ``with`` block, then wait until every rank's is done.

    ``world`` names this world's loads on the store, the same on every rank of it (the
    worker's plan id and master address: a fresh rank and held in-place ranks number their
    generations differently). A failure in the block is written to the store for the
    others (best effort: the store may be gone too) and raised; after a good load this rank
    checks in and waits (:func:`await_loads`). The heartbeat runs for the block and the
    wait (:class:`LoadBarrier`, whose ``loading`` this is)."""
    with LoadBarrier(store, rank, world_size, world, timeout_s, liveness_s, poll_s).loading():
        yield


def _connect(store: Store) -> Store:
    """A new connection to ``store``, its prefix kept (``torch.distributed.Store.clone``,
    which torch's type stubs do not declare)."""
    conn: Store = cast(Any, store).clone()
    return conn


def _publish_failure(store: Store, rank: int, world: str, exc: BaseException) -> None:
    _publish(store, world, rank, socket.gethostname(), f"{type(exc).__name__}: {exc}")


def _publish(store: Store, world: str, rank: int, host: str, text: str) -> None:
    with suppress(Exception):  # the load's own error is the one to raise
        store.set(f"{_PREFIX}/{world}/failed/{rank}", f"{host}\n{text[:2000]}")
        store.add(_keys(world)[1], 1)


def await_loads(
    store: Store,
    rank: int,
    world_size: int,
    world: str,
    timeout_s: float = LOAD_TIMEOUT_S,
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    liveness_s: float = LIVENESS_S,
) -> float:
    """Check this rank in as loaded and wait until every rank has; returns the seconds waited.

    Raises ``PeerFailedError`` once some rank's load failed (naming it, its host and its
    error), or once one rank's heartbeat has not moved for ``liveness_s`` (naming it: it
    died without a word; its failure is written for the others), ``LoadTimeoutError``
    after ``timeout_s`` naming the ranks not loaded, and ``PeerFailedError`` if the store
    stops answering (its host, rank 0, is gone)."""
    count, failures = _keys(world)
    t0 = clock()
    watch = _Watch(store, rank, world_size, world, liveness_s, clock)
    try:
        store.set(f"{_PREFIX}/{world}/done/{rank}", "1")
        n = store.add(count, 1)
        while True:
            if store.add(failures, 0) > 0:
                raise _peer_failure(store, world, world_size)
            if n >= world_size:
                return clock() - t0
            if clock() - t0 > timeout_s:
                late = [
                    r for r in range(world_size) if not store.check([f"{_PREFIX}/{world}/done/{r}"])
                ]
                raise LoadTimeoutError(
                    f"rank {rank}: ranks {late} did not finish loading their stage within "
                    f"--load-timeout-s={timeout_s:g} ({n} of {world_size} loaded)"
                )
            dead = watch.next_dead()
            if dead is not None:
                raise dead
            sleep(poll_s)
            n = store.add(count, 0)
    except PeerFailedError:
        raise
    except Exception as exc:  # the c10d store's errors: its server (rank 0) is gone
        raise PeerFailedError(
            f"rank {rank}: the rendezvous store stopped answering while waiting for every "
            f"rank's load ({type(exc).__name__}: {exc}); rank 0, its host, failed or was "
            "killed"
        ) from exc


def _peer_failure(store: Store, world: str, world_size: int) -> PeerFailedError:
    """The failure of the first rank (in rank order) whose load failed."""
    for r in range(world_size):
        key = f"{_PREFIX}/{world}/failed/{r}"
        if store.check([key]):
            host, _, text = store.get(key).decode(errors="replace").partition("\n")
            return PeerFailedError(f"rank {r} ({host}) failed to load its stage: {text}")
    return PeerFailedError("a rank failed to load its stage")


def worker_barrier(store: Store, plan_id: str, args: Any) -> LoadBarrier:
    """A worker rank's barrier for its world, started (its heartbeat begins): ``args`` is the
    worker's parsed command line (``rank_args.build_parser``: rank, world size, master,
    ``--load-timeout-s``, ``--load-liveness-s``). The world is named by the plan and the
    master address, the same on every rank of it (a fresh rank and held ones number their
    generations differently); polled every second, as loads take seconds to hours and every
    rank polls rank 0's store."""
    return LoadBarrier(
        store,
        args.rank,
        args.world_size,
        f"{plan_id}@{args.master}",
        args.load_timeout_s,
        args.load_liveness_s,
        1.0,
    ).start()


def watched(rank: int, world_size: int, k: int = WATCHED) -> list[int]:
    """The ranks ``rank`` reads every poll while it waits: the ``k`` after it on the ring
    (all the others in a world of ``k + 1`` or fewer), so each rank has ``k`` watchers, the
    ``k`` before it (pure)."""
    return [(rank + i) % world_size for i in range(1, min(k, world_size - 1) + 1)]


class _Watch:
    """A waiting rank's look at the others' heartbeats: every poll its :func:`watched` ranks,
    and one of the rest in turn (module docstring: a dead rank is found ``liveness_s`` after
    one of its watchers first looks, at any world size; by the turns later, if none waits)."""

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        world: str,
        liveness_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.store, self.rank, self.world, self.liveness_s = store, rank, world, liveness_s
        self.clock = clock
        self.near = watched(rank, world_size)
        self.rest = [
            r for r in ((rank + i) % world_size for i in range(1, world_size)) if r not in self.near
        ]
        self.turn = 0
        self.seen: dict[int, tuple[int, float]] = {}
        """Rank -> (its counter, when this rank first saw it at that value)."""

    def next_dead(self) -> PeerFailedError | None:
        """Read this poll's counters; the failure of the first rank silent for liveness_s."""
        peers = list(self.near)
        if self.rest:
            peers.append(self.rest[self.turn % len(self.rest)])
            self.turn += 1
        for peer in peers:
            dead = self._check(peer)
            if dead is not None:
                return dead
        return None

    def _check(self, peer: int) -> PeerFailedError | None:
        beats, now = self.store.add(_beat_key(self.world, peer), 0), self.clock()
        last = self.seen.get(peer)
        if last is None or last[0] != beats:
            self.seen[peer] = (beats, now)
            return None
        silent = now - last[1]
        if silent < self.liveness_s:
            return None
        host_key = _host_key(self.world, peer)
        host = self.store.get(host_key).decode() if self.store.check([host_key]) else "?"
        text = (
            f"no heartbeat for {silent:.0f} s (--load-liveness-s={self.liveness_s:g}, seen by "
            f"rank {self.rank}): the process died without a word (the host's OOM killer, "
            "SIGKILL, a crash) or stopped running"
        )
        _publish(self.store, self.world, peer, host, text)
        return PeerFailedError(f"rank {peer} ({host}) failed to load its stage: {text}")
