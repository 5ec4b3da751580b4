"""Every rank of a world waits for the others on the rendezvous store, not in NCCL.

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
The same wait stands before the world's first collective (:meth:`LoadBarrier.formed`, under
the process groups' ``--timeout-s``): a rank failing between ``init_process_group`` and that
collective (its groups, DeepSpeed's module and optimizer) ended the others only at NCCL's
timeout.

A rank that fails while its barrier is pending (from its world's start to the release)
writes its error to the store (:meth:`LoadBarrier.fail`, from the worker's top-level
handler); every rank waiting raises :class:`~sailor.megatron_patch.errors.PeerFailedError`
naming that rank, its host and its error (``origin="peer"``: not charged to its node). A
rank held elsewhere — in a collective, inside ``deepspeed.initialize``, in its load's reads
— learns of it at its heartbeat thread's next beat, which ends it with that error
(``on_peer_failure``: :func:`record_peer_failure` in a worker, then ``exit_status``). That
end runs on the thread's own connection (the main thread's may be held for minutes in a
blocking store call: gloo's ``new_group``, NCCL's unique-id exchange), writes the error file
before rank 0 lingers, and is serialised with the main thread's handler (:meth:`fail`,
:meth:`peer_cause`): the handler waits for a heartbeat that is ending the rank, and records
the peer's failure, not the closed socket it met meanwhile.

A rank that closes its barrier (its load done) marks itself closed on the store as its
heartbeat stops: its watchers, maybe still pending, do not take its silence for a death.
The mark is written by the heartbeat thread, on its own connection, and :meth:`close`
waits for it :data:`STORE_WAIT_S` at most: on a hung store (rank 0 stopped, not dead) the
rank goes on and the daemon thread finishes the mark once the store answers.

A rank can also fail without writing anything: killed with no Python exception (the host's
OOM killer, SIGKILL, a segfault in a reader). Its gloo peers see the closed socket, NCCL
peers time out, a store wait sees neither. So from the world's start a thread of each rank
bumps its heartbeat counter on the store every ``liveness_s / 5`` seconds and, at each beat,
reads the counters of the :data:`WATCHED` ranks after it on the ring (:func:`watched`): every
rank is watched by the ``WATCHED`` ranks before it from the start, whatever they are doing.
A counter that has not moved for ``liveness_s`` (``--load-liveness-s``, :data:`LIVENESS_S`)
is a dead rank: the watcher writes its failure for the others. So a dead rank is found
``liveness_s`` plus at most one beat period after it died, at any world size. (When the
waiters did the watching, at each poll, a dead rank whose three watchers were still
loading was found only by every waiter's one extra read per poll in turn: ``world_size - 4``
polls, 17 minutes at 1024 ranks; ``benchmarks/load_barrier_scale.py`` measures both.) A
rank hung in a read keeps beating (the thread is its own): that is the load timeout's case,
not this one's. The thread has a store connection of its own (``Store.clone``): the c10d
client answers one request at a time, so a beat on the main thread's connection would wait
behind any blocking ``get``/``wait`` there; a failed beat is retried on a new connection
until the barrier ends.

If the store is gone (rank 0, whose process serves it, failed and exited) the waiting ranks
raise ``PeerFailedError`` saying the store stopped answering, naming rank 0's host and the
store's address, with rank 0's own error where this rank can read it (its error file, on
rank 0's node or a shared directory: :func:`rank0_error_file`). So that this is rare, rank 0
ending with a failure (its own or another's) keeps its process, and the store, up until
every other rank is counted out, or for two of their polls or beats (:meth:`LoadBarrier.
fail`): the others read the failure, not the silence, and a rank in a collective with rank
0 is not ended by rank 0's closed socket first. A rank is counted out once
(:func:`_count_out`): by itself, after reading a failure or as it closes its barrier (a
closed rank reads no failure here: nothing to wait for), or by the watchers that found it
dead (a killed rank never counts itself out). Rank 0 waits the full two polls or beats
only for a rank neither out nor yet found dead, or found dead and beating again (it was
stalled, not dead: :class:`_Stalled`); a stalled rank that finds the store gone says it was
stalled, not that rank 0 failed.

This module never touches a device or a collective; it takes any object with the c10d
store's ``add``/``set``/``get``/``multi_get``/``check`` and ``clone``
(``torch.distributed.Store``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from sailor.megatron_patch.errors import (
    PeerFailedError,
    classify,
    failure_record,
    read_error_file,
    write_error_file,
)

__all__ = [
    "FIRST_POLL_S",
    "LIVENESS_S",
    "LOAD_POLL_S",
    "LOAD_TIMEOUT_S",
    "RECORD_WAIT_S",
    "WATCHED",
    "LoadBarrier",
    "LoadTimeoutError",
    "Phase",
    "Store",
    "await_loads",
    "loaded_together",
    "rank0_error_file",
    "record_peer_failure",
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
"""Default silence after which a rank is taken for dead: far below the load timeout, far
above what a live rank's heartbeat thread can miss. The thread beats every
``liveness_s / 5`` (12 s); what could hold it up is the GIL held by one long C call of the
load (a copy of a single tensor of a few GB takes a second or two) and a slow store round
trip — not tens of seconds (and no store call of the main thread: the beat has its own
connection). A rank dead for 60 s is found at most one beat period later by its watchers
(:func:`watched`), at any world size and whatever they are doing, not after the 2 h
timeout."""

LOAD_POLL_S = 1.0
"""A worker's longest wait between two reads of its world's arrivals and failures
(``--load-poll-s``): loads take seconds to hours and every waiting rank polls rank 0's store,
one request a poll (1024 requests a second from 1024 waiting ranks, besides their beats:
:data:`WATCHED`); a rank is released, or reads a failure, at most this long after it is on
the store. The waits start at :data:`FIRST_POLL_S` and double up to it. Tests of the worker
poll faster (their worlds have two or three ranks)."""

FIRST_POLL_S = 0.02
"""The first wait of a rank's polls, doubled at each poll up to ``poll_s``. A world whose
ranks arrive within moments of each other (an in-place relayout's loads, the formation of a
world whose ranks started together) is released within tens of milliseconds, not at the
next whole poll: with 1 s polls the two waits of an in-place LOAD (the world's formation,
then the loads) cost ~2 s of a ~2.7 s no-step gap in the demo. A long wait polls as before
after ~1.3 s (six more requests per rank and wait than 1 s polls)."""

BEATS_PER_LIVENESS = 5
"""Heartbeats a live rank sends within one ``liveness_s``: four can be lost or late before
it is taken for dead."""

WATCHED = 3
"""Ranks whose counters each rank's heartbeat thread reads at every beat (its successors on
the ring), so each rank has this many watchers from the world's start: one of three alive
is enough for a dead rank to be found. The thread's store load is ``WATCHED + 2`` requests
(its beat, these reads, the failures counter — that one not while the rank waits, as its
wait reads it) per ``liveness_s / 5``: 0.33-0.42 a second per rank at the default 60 s; a
waiting rank adds one request per poll (1 s in a worker): ~1.4k requests a second on rank
0's store at 1024 ranks, where waiters that read the counters themselves each poll made
~6.2k (``benchmarks/load_barrier_scale.py`` measures both; the store serves either on this
machine, at p50 latencies under a millisecond)."""

RECORD_WAIT_S = 10.0
"""How long a rank ending of a peer's failure waits for its error record to be written
before it counts out and exits all the same (a hard-mounted NFS whose server is gone never
answers). A local write takes milliseconds."""

STORE_WAIT_S = 2.0
"""How long the main thread waits for a store call it can go on without — the closed mark
and count-out of :meth:`LoadBarrier.close`, the worker's handler's look for a peer's failure
(:meth:`LoadBarrier.peer_cause`), a failing rank's own failure and count-out
(:meth:`LoadBarrier.fail`, but rank 0's) — before it goes on and leaves the call to finish on a
daemon thread. A store that answers does so in milliseconds (p99 at most 21 ms, max 25 ms, at
64 and 256 ranks in ``benchmarks/load_barrier_scale.py`` on this loaded shared machine; the
look is a new connection and four requests at any world size, 0.7 s over a 100 ms link in a
test with a delaying proxy); a hung one (rank
0's process stopped, its host frozen, its network gone without a reset) holds a call at
least for the client's timeout (the process groups', up to 30 min), and c10d's client
waited on for good: in the tests an ``add`` to a stopped server still waited minutes past
its 10 s timeout. Not measured on a cluster."""

_PREFIX = "sailor/loaded"

Phase = Literal["formed", "loaded"]
"""A point every rank of a world waits at for the others: ``formed``, before its first
collective (after ``init_process_group`` and its groups); ``loaded``, after its load."""

_PHASES: dict[str, tuple[str, str, str]] = {
    # phase: (what a rank waits for, what the late ranks did not do, what the count counts)
    "formed": (
        "every rank to reach the world's first collective",
        "did not reach the world's first collective",
        "arrived",
    ),
    "loaded": ("every rank's load", "did not finish loading their stage", "loaded"),
}


class Store(Protocol):
    """The part of ``torch.distributed.Store`` used here."""

    def add(self, key: str, value: int) -> int: ...

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...

    def check(self, keys: list[str]) -> bool: ...

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...


class LoadTimeoutError(PeerFailedError):
    """Some ranks did not finish their load (or reach the first collective) within their
    timeout (raised by the ranks that did: the slow ones' node is to blame, not theirs)."""


class _EndRank(Protocol):
    """Where a rank is, for the failure record (``boundary.Status``)."""

    rank: int
    step: int
    in_training: bool
    error_file: str | None

    @property
    def failed_step(self) -> int: ...


def _failures_key(world: str) -> str:
    return f"{_PREFIX}/{world}/failures"


def _phase_keys(world: str, phase: Phase) -> tuple[str, str]:
    """The phase's arrival counter and the prefix of its per-rank marks (``loaded``'s keep
    the names they had before there were phases)."""
    base = f"{_PREFIX}/{world}" if phase == "loaded" else f"{_PREFIX}/{world}/{phase}"
    return f"{base}/count", f"{base}/done/"


def _ended_key(world: str) -> str:
    return f"{_PREFIX}/{world}/ended"


def _beat_key(world: str, rank: int) -> str:
    return f"{_PREFIX}/{world}/beat/{rank}"


def _host_key(world: str, rank: int) -> str:
    return f"{_PREFIX}/{world}/host/{rank}"


def _closed_key(world: str, rank: int) -> str:
    return f"{_PREFIX}/{world}/closed/{rank}"


def _out_key(world: str, rank: int) -> str:
    return f"{_PREFIX}/{world}/out/{rank}"


def _first_failed_key(world: str) -> str:
    return f"{_PREFIX}/{world}/first_failed"


def _found_count_key(world: str) -> str:
    return f"{_PREFIX}/{world}/found"


def _found_key(world: str, n: int) -> str:
    return f"{_PREFIX}/{world}/found/{n}"


def _check_args(rank: int, world_size: int, timeout_s: float, liveness_s: float) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} outside a world of world_size={world_size}")
    if timeout_s <= 0:
        raise ValueError(f"load timeout_s={timeout_s}: must be > 0")
    if liveness_s <= 0:
        raise ValueError(f"load liveness_s={liveness_s}: must be > 0")


@dataclass
class _StoreHost:
    """What a rank knows of the store's server, rank 0, to name it once the store is gone."""

    master: str | None = None
    """The store's address (the worker's ``--master``)."""
    host: str | None = None
    """Rank 0's host name, as it wrote it on the store (read while the store answered)."""
    error_file: str | None = None
    """Rank 0's error file as this rank would find it (:func:`rank0_error_file`)."""
    since: float = 0.0
    """Wall-clock start of this barrier: an older record in the error file is not rank 0's
    failure in this world."""
    liveness_s: float = LIVENESS_S
    stalled_s: float = 0.0
    """The longest this rank's heartbeat was held past ``liveness_s`` (its process stopped,
    its host frozen): its watchers took it for dead and failed the world, and rank 0 may
    have closed its store for that, not of a failure of its own."""
    pausing: float | None = None
    """When the heartbeat thread's current pause between beats began (None: beating)."""

    def held(self, seconds: float) -> None:
        """The heartbeat thread's pause between two beats took ``seconds``."""
        self.pausing = None
        if seconds >= self.liveness_s:  # the whole process did not run: its watchers took
            self.stalled_s = max(self.stalled_s, seconds)  # it for dead

    def gone(self, rank: int, during: str, exc: BaseException) -> PeerFailedError:
        """The error of a rank whose store calls failed ``during`` something."""
        pausing = self.pausing  # the main thread may run first after a stall
        if pausing is not None:
            self.held(time.monotonic() - pausing)
        if self.stalled_s:
            return PeerFailedError(
                f"rank {rank}: the rendezvous store stopped answering {during} "
                f"({type(exc).__name__}: {exc}) after this rank itself did not run for "
                f"{self.stalled_s:.0f} s (its process stopped or its host frozen, past "
                "--load-liveness-s): its watchers took it for dead and failed its world, "
                "whose rank 0 then closed the store"
            )
        where = ", ".join(
            x
            for x in (
                f"host {self.host}" if self.host else "",
                f"store {self.master}" if self.master else "",
            )
            if x
        )
        return PeerFailedError(
            f"rank {rank}: the rendezvous store stopped answering {during} "
            f"({type(exc).__name__}: {exc}); its server, rank 0"
            f"{f' ({where})' if where else ''}, has likely failed or been killed"
            f"{self._rank0_error()}"
        )

    def _rank0_error(self) -> str:
        if not self.error_file:
            return ""
        record = read_error_file(self.error_file)
        # the agent and launch_local write a generation's files afresh; an older record (a
        # file kept from another world) is not news of this one
        if record is None or float(record.get("time", 0.0)) < self.since - _CLOCK_SLACK_S:
            return (
                "; no error of rank 0's found here (a kill writes none; or it is on another host)"
            )
        return f"; rank 0's error ({self.error_file}): {record.get('error_type')}: " + str(
            record.get("message", "")
        )


_CLOCK_SLACK_S = 60.0
"""How much earlier than this rank's barrier began rank 0's error may be dated and still be
of this world: ranks start their barriers within the rendezvous of one
``init_process_group``, seconds apart; a kept file of an earlier world is minutes older."""


class LoadBarrier:
    """One rank's part in its world's barriers, from the world's start to its release.

    :meth:`start` it as soon as the world exists (its heartbeat and its watch of its
    :func:`watched` ranks begin), wait at :meth:`formed` before the world's first
    collective, run the load in :meth:`loading`, and send any failure of the rank before
    then through :meth:`fail` (the worker's top-level handler does). :meth:`close` (also at
    the end of ``loading``) stops the heartbeat; a world whose ranks load nothing closes it
    at once.

    ``on_peer_failure`` (the worker's :func:`record_peer_failure`) is called from the
    heartbeat thread when another rank's failure is on the store, or the store has not
    answered for ``liveness_s``, while this rank is pending and not in one of its own waits
    (which raise it themselves): in a collective (NCCL's waits for its timeout), inside
    ``deepspeed.initialize``, or in its load. The thread then counts this rank out (rank 0
    keeps its store up for the others, :meth:`_leave`) and, with ``exit_status`` (a
    worker: 1), ends the process (``os._exit``: the main thread may be in a collective).
    ``master`` and ``rank0_error_file`` name the store's server in the error of a rank
    whose store stopped answering."""

    def __init__(
        self,
        store: Store,
        rank: int,
        world_size: int,
        world: str,
        timeout_s: float = LOAD_TIMEOUT_S,
        liveness_s: float = LIVENESS_S,
        poll_s: float = 0.05,
        on_peer_failure: Callable[[PeerFailedError], None] | None = None,
        master: str | None = None,
        rank0_error_file: str | None = None,
        exit_status: int | None = None,
    ) -> None:
        _check_args(rank, world_size, timeout_s, liveness_s)
        if poll_s <= 0:
            raise ValueError(f"load poll_s={poll_s}: must be > 0")
        self.store, self.rank, self.world_size, self.world = store, rank, world_size, world
        self.timeout_s, self.liveness_s, self.poll_s = timeout_s, liveness_s, poll_s
        self.on_peer_failure = on_peer_failure
        self.exit_status = exit_status
        self._store_host = _StoreHost(master, None, rank0_error_file, time.time(), liveness_s)
        self._pending = False
        self._waiting = False
        self._closing = False
        """Set by :meth:`close` while pending: the heartbeat thread's last act is to mark
        this rank closed and count it out, on its own connection."""
        self._peer_error: PeerFailedError | None = None
        self._handled = False
        """Set by :meth:`claim_end`: the worker's handler ends this rank (its own record and
        event), and the heartbeat thread no longer ends it of a peer's failure."""
        # one rank's end at a time: the heartbeat's ``_tell`` and the main thread's ``fail``,
        # ``close`` and ``peer_cause`` (a handler arriving while the heartbeat ends this rank
        # waits for it, and no exit fires once ``close`` has returned)
        self._ending = threading.RLock()
        self._conn: Store | None = None
        """The heartbeat thread's own connection (None until made, or after it failed)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> bool:
        """Started and not yet released, failed or closed: a failure now is the others' news."""
        return self._pending

    def start(self) -> LoadBarrier:
        """Begin beating and watching (this rank's host first, for the others' errors).
        A barrier runs once: started again after :meth:`close` (or :meth:`fail`) it raises,
        as its heartbeat would stop at once and count the rank out a second time."""
        if self._stop.is_set():
            raise RuntimeError(
                f"rank {self.rank}: the load barrier of world {self.world!r} was closed; "
                "a barrier runs once (make a new one for a new world)"
            )
        self._pending = True
        self._store_host.since = time.time()
        with suppress(Exception):  # a store already gone: the waiters say so themselves
            self.store.set(_host_key(self.world, self.rank), socket.gethostname())
        self._thread = threading.Thread(
            target=self._beat, name=f"sailor-load-heartbeat-{self.rank}", daemon=True
        )
        self._thread.start()
        return self

    def _beat(self) -> None:
        key, every = _beat_key(self.world, self.rank), self.liveness_s / BEATS_PER_LIVENESS
        watch = _Watch(self.rank, self.world_size, self.world, self.liveness_s, time.monotonic)
        failed, silent_since = 0, 0.0
        while not self._stop.is_set():
            try:
                if self._conn is None:  # its own: never behind the main thread's blocking calls
                    self._conn = _connect(self.store)
                conn = self._conn
                conn.add(key, 1)
                if self._stop.is_set():  # closed while the beat waited (a slow or hung
                    continue  # store): no watching, no peer's failure; the mark, below
                self._learn_store_host(conn)
                watch.next_dead(conn)  # a dead one's failure goes on the store for all
                if self._peer_failed(conn):
                    return
            except Exception as exc:  # retried until stopped, on a new connection
                self._conn = None
                failed += 1
                if failed == 1:  # one line per outage, not one per beat
                    silent_since = time.monotonic()
                    print(
                        f"rank {self.rank}: load heartbeat failed ({type(exc).__name__}: "
                        f"{exc}); retrying every {every:g} s",
                        file=sys.stderr,
                        flush=True,
                    )
                elif time.monotonic() - silent_since >= self.liveness_s and self._tell(
                    self._store_host.gone(self.rank, "to its heartbeat", exc), None
                ):
                    return
            else:
                if failed:
                    print(
                        f"rank {self.rank}: load heartbeat back after {failed} failed beats",
                        file=sys.stderr,
                        flush=True,
                    )
                failed = 0
            self._store_host.pausing = paused = time.monotonic()
            self._stop.wait(every)
            self._store_host.held(time.monotonic() - paused)
        if self._closing:
            self._mark_closed()

    def _mark_closed(self) -> None:
        """Mark this rank closed and count it out, on the heartbeat's connection (the
        thread's last act, for :meth:`close`; best effort: the store may be gone)."""
        with suppress(Exception):
            conn = self._conn if self._conn is not None else _connect(self.store)
            conn.set(_closed_key(self.world, self.rank), "1")
            _count_out(conn, self.world, self.rank)

    def _learn_store_host(self, conn: Store) -> None:
        if self._store_host.host is None and self.rank != 0:
            key = _host_key(self.world, 0)
            if conn.check([key]):
                self._store_host.host = conn.get(key).decode(errors="replace")
        elif self.rank == 0:
            self._store_host.host = socket.gethostname()

    def _peer_failed(self, conn: Store) -> bool:
        """Whether another rank's failure was on the store and was passed on (the thread is
        done then)."""
        if (
            self.on_peer_failure is None
            or self._waiting
            or conn.add(_failures_key(self.world), 0) == 0
        ):
            return False
        return self._tell(_peer_failure(conn, self.world, self.world_size), conn)

    def _tell(self, err: PeerFailedError, conn: Store | None) -> bool:
        """End this rank of another's failure ``err``, from the heartbeat thread, on its own
        connection ``conn`` (None: the store is gone). Everything here stays off the main
        thread's connection, which may be held for minutes in a blocking ``get``/``wait``
        (gloo's ``new_group``, NCCL's unique-id exchange), and off its error: the peer's is
        kept for :meth:`peer_cause`, ``on_peer_failure`` writes it before rank 0 lingers,
        and the main thread's ``fail``/``close``/``peer_cause`` wait until this is done."""
        if self.on_peer_failure is None or self._waiting or not self._pending or self._handled:
            return False  # (read unlocked first: a ``fail`` lingering holds the lock)
        with self._ending:
            if self._waiting or not self._pending or self._handled:
                return False
            self._pending = False  # this rank is ending of another's failure: not news
            self._peer_error = err
            # the record is written on a thread of its own, waited for a bounded time: a
            # write that fails (a full disk) or hangs (a hard-mounted NFS whose server is
            # gone) still ends the rank, counted out, without holding the lock for good
            writer = threading.Thread(
                target=_quietly,
                args=(self.on_peer_failure, err),
                name="sailor-load-record",
                daemon=True,
            )
            writer.start()
            writer.join(RECORD_WAIT_S)
            if conn is not None:
                self._leave(conn)
            if self.exit_status is not None:
                os._exit(self.exit_status)  # the main thread may be in a collective
        return True

    def _leave(self, store: Store) -> None:
        """Count this rank out of a failed world; rank 0, whose process serves the store,
        keeps it up until every other rank is out (read the failure, closed its barrier, or
        found dead by its watchers: :func:`_count_out`) or :meth:`_linger_s` has passed
        (best effort: the store may be gone)."""
        with suppress(Exception):
            _count_out(store, self.world, self.rank)
            if self.rank != 0:
                return
            deadline = time.monotonic() + self._linger_s()
            # a rank found dead may have been only stalled (SIGSTOP, a frozen VM, swap): once
            # it runs again its counter moves, and rank 0 stays (to the cap) until it has
            # had its chance to read the failure, not the store's end
            stalled = _Stalled(self.world, self._linger_s() / 2, time.monotonic)
            while time.monotonic() < deadline:
                if store.add(_ended_key(self.world), 0) >= self.world_size and not (
                    stalled.moving(store)
                ):
                    return
                time.sleep(0.05)

    def _linger_s(self) -> float:
        """Two of the others' chances to read a failure: their polls if waiting, their
        heartbeat threads' beats if held elsewhere (24 s at the worker's defaults). A rank
        killed without a word is counted out by the watchers that find it dead; one not
        found yet (killed less than ``liveness_s`` before), or found dead and beating again
        (it was stalled, not dead), keeps rank 0 this long."""
        return 2 * max(self.poll_s, self.liveness_s / BEATS_PER_LIVENESS)

    def peer_cause(self, exc: BaseException) -> BaseException:
        """``exc``, or the failure of another rank that caused it: while pending, an error
        that reads as a peer's (``errors.classify``: a connection closed or reset, a
        timeout — gloo's in a collective whose peer exited) is that rank's failure when one
        is on the store (it wrote it before exiting). For the worker's handler, before it
        writes the first cause; a store that does not answer leaves ``exc``. Once the
        heartbeat thread has taken up another rank's failure (it ends this rank), that
        failure is the cause (waiting for the heartbeat, if it is ending this rank now)."""
        if isinstance(exc, PeerFailedError) or classify(exc, False) != "peer":
            return exc
        with self._ending:
            told = self._peer_error
        if told is not None:
            err = type(told)(str(told))
            err.__cause__ = exc
            return err
        if not self._pending:
            return exc
        found = self._failure_on_store()
        if found is None:
            return exc
        found.__cause__ = exc
        return found

    def _failure_on_store(self) -> PeerFailedError | None:
        """Another rank's failure on the store (None: none, or no answer within
        :data:`STORE_WAIT_S`). Read on a connection and a daemon thread of its own, so a
        hung store delays the worker's error record by that much, not as long as it hangs;
        the main thread's connection may be spoiled by the error being handled (a store
        wait that timed out), and is not left busy for the handler's next calls."""
        got: list[PeerFailedError] = []

        def look() -> None:
            with suppress(Exception):
                conn = _connect(self.store)
                if conn.add(_failures_key(self.world), 0) > 0:
                    got.append(_peer_failure(conn, self.world, self.world_size))

        reader = threading.Thread(target=look, name=f"sailor-load-cause-{self.rank}", daemon=True)
        reader.start()
        reader.join(STORE_WAIT_S)
        return got[0] if got else None

    def fail(self, exc: BaseException) -> None:
        """Tell the others this rank failed (while the barrier is pending; best effort),
        then stop beating. Another rank's failure (a ``PeerFailedError``) is on the store
        already, or is the store's. Rank 0, whose process serves the store, returns once
        every other rank has read a failure, or after :meth:`_linger_s` (:meth:`_leave`).
        Another rank writes and counts out on a connection and a daemon thread of its own,
        waited for :data:`STORE_WAIT_S` at most: on a hung store (rank 0 stopped) the worker
        still exits, its event printed, rather than wait for the store for good."""
        with self._ending:  # not while the heartbeat ends this rank of a peer's failure
            pending, self._pending = self._pending, False
        if pending and self.rank == 0:  # its process serves the store: it stays, lingering
            self._tell_others(self.store, exc)
        elif pending:
            teller = threading.Thread(
                target=self._tell_others,
                args=(None, exc),
                name=f"sailor-load-fail-{self.rank}",
                daemon=True,
            )
            teller.start()
            teller.join(STORE_WAIT_S)
        self.close()

    def _tell_others(self, store: Store | None, exc: BaseException) -> None:
        """Write this rank's failure ``exc`` (unless a peer's, already on the store) and
        count it out (:meth:`_leave`), on ``store`` or a new connection (None; best effort)."""
        with suppress(Exception):
            conn = store if store is not None else _connect(self.store)
            if not isinstance(exc, PeerFailedError):
                _publish_failure(conn, self.rank, self.world, exc)
            self._leave(conn)

    def claim_end(self, exc: BaseException) -> BaseException:
        """The worker's handler's first call: this rank's failure ``exc`` or the peer's that
        caused it (:meth:`peer_cause`), this rank's end claimed for the handler first, so
        that the heartbeat thread does not end it of a peer's failure read after (its event
        printed after the handler's, of another cause, would be the one the agent keeps, and
        disagree with the error file the handler writes)."""
        with self._ending:  # after a heartbeat ending this rank now (its cause is the one)
            self._handled = True
        return self.peer_cause(exc)

    def close(self) -> None:
        """Stop beating; the barrier is over for this rank. The heartbeat thread, as it
        stops, marks the rank closed on the store, so that its watchers, still pending, do
        not take its silence for a death, and counts it out, so that a failing rank 0 does
        not keep its store up for it (best effort, on the thread's own connection). This
        waits for that :data:`STORE_WAIT_S` at most: on a hung store the thread (a daemon)
        finishes it once the store answers, or the process exits without it. Once this
        returns, no peer's failure ends this rank from its heartbeat thread."""
        with self._ending:
            self._closing = self._closing or self._pending  # a second close keeps the mark
            self._pending = False
            self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=STORE_WAIT_S)

    def formed(self, timeout_s: float, flag: str = "--timeout-s") -> float:
        """Wait until every rank of the world is here, before the world's first collective
        (its process groups built); returns the seconds waited. A rank that failed since the
        world's start (its groups, its module, its optimizer: written by :meth:`fail`) or
        died ends the wait with its error, where the collective would have waited for the
        process groups' timeout under NCCL. ``timeout_s`` (named ``flag`` in the error):
        the process groups' own, the bound the collective had."""
        if not timeout_s > 0:
            raise ValueError(f"{flag}={timeout_s}: must be > 0 seconds")
        return self._wait("formed", timeout_s, flag)

    def _wait(self, phase: Phase, timeout_s: float, flag: str) -> float:
        self._waiting = True
        try:
            return _await_all(
                self.store, self.rank, self.world_size, self.world, phase, timeout_s, flag,
                self.poll_s, time.monotonic, time.sleep, self._store_host,
            )  # fmt: skip
        except BaseException as exc:
            self._waiting = False
            self.fail(exc)  # not written again (a peer's, or the store's); counted out
            raise
        finally:
            self._waiting = False

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
            self._wait("loaded", self.timeout_s, "--load-timeout-s")
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


def _quietly(record: Callable[[PeerFailedError], None] | None, err: PeerFailedError) -> None:
    """``record(err)``, its failure swallowed (the rank ends all the same)."""
    if record is not None:
        with suppress(Exception):
            record(err)


def _connect(store: Store) -> Store:
    """A new connection to ``store``, its prefix kept (``torch.distributed.Store.clone``,
    which torch's type stubs do not declare)."""
    conn: Store = cast(Any, store).clone()
    return conn


def _publish_failure(store: Store, rank: int, world: str, exc: BaseException) -> None:
    _publish(store, world, rank, socket.gethostname(), f"{type(exc).__name__}: {exc}")


def _publish(store: Store, world: str, rank: int, host: str, text: str) -> None:
    """Write ``rank``'s failure: its record, then the world's first failure if none is
    claimed yet (``compare_set`` on an absent key: one writer wins), then the failures
    counter the others poll, so a rank that reads the counter finds the claim."""
    with suppress(Exception):  # the load's own error is the one to raise
        store.set(f"{_PREFIX}/{world}/failed/{rank}", f"{host}\n{text[:2000]}")
        store.compare_set(_first_failed_key(world), "", str(rank))
        store.add(_failures_key(world), 1)


def _count_out(store: Store, world: str, rank: int, found_at: int | None = None) -> None:
    """Count ``rank`` out of its world's barrier, for rank 0's linger (:meth:`LoadBarrier.
    _leave`): by itself (failed, ended of a peer's failure, or closed its barrier) or by a
    watcher that found it dead, its heartbeat counter at ``found_at``. Once per rank
    whoever counts it, and however often: the first ``add`` to its mark counts it (a rank
    found by two watchers, or counted by a watcher and then by itself, is not counted
    twice, which would end rank 0's linger before a live rank read the failure; a
    ``compare_set`` claim named by its claimant was no claim for one claimant calling
    twice, as the value it read back was its own). A rank counted out by a watcher is
    listed, with ``found_at``, under ``found/<n>`` (``n`` from the ``found`` counter): rank
    0's linger watches those few for one that was only stalled (:class:`_Stalled`)."""
    if store.add(_out_key(world, rank), 1) != 1:
        return
    store.add(_ended_key(world), 1)
    if found_at is not None:
        n = store.add(_found_count_key(world), 1)
        store.set(_found_key(world, n), f"{rank} {found_at}")


def await_loads(
    store: Store,
    rank: int,
    world_size: int,
    world: str,
    timeout_s: float = LOAD_TIMEOUT_S,
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Check this rank in as loaded and wait until every rank has; returns the seconds waited.

    Raises ``PeerFailedError`` once some rank failed since the world's start (naming it,
    its host and its error; a dead rank's failure is written by its watchers' heartbeat
    threads, :class:`LoadBarrier`), ``LoadTimeoutError`` after ``timeout_s`` naming the
    ranks not loaded, and ``PeerFailedError`` if the store stops answering (its server,
    rank 0, is gone)."""
    return _await_all(
        store, rank, world_size, world, "loaded", timeout_s, "--load-timeout-s", poll_s,
        clock, sleep, _StoreHost(),
    )  # fmt: skip


def _await_all(
    store: Store,
    rank: int,
    world_size: int,
    world: str,
    phase: Phase,
    timeout_s: float,
    flag: str,
    poll_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    server: _StoreHost,
) -> float:
    """Check in at ``phase`` and wait for every rank there: one store request a poll (the
    arrivals and the failures, read together)."""
    count, done = _phase_keys(world, phase)
    failures = _failures_key(world)
    waiting_for, late_text, counted = _PHASES[phase]
    t0 = clock()
    try:
        failed = store.add(failures, 0)  # created: the polls read it with the count
        store.set(f"{done}{rank}", "1")
        n = store.add(count, 1)
        wait = min(FIRST_POLL_S, poll_s)
        while True:
            if failed > 0:
                raise _peer_failure(store, world, world_size)
            if n >= world_size:
                return clock() - t0
            if clock() - t0 > timeout_s:
                late = [r for r in range(world_size) if not store.check([f"{done}{r}"])]
                raise LoadTimeoutError(
                    f"rank {rank}: ranks {late} {late_text} within {flag}={timeout_s:g} "
                    f"({n} of {world_size} {counted})"
                )
            sleep(wait)
            wait = min(2 * wait, poll_s)
            n, failed = (int(v) for v in store.multi_get([count, failures]))
    except PeerFailedError:
        raise
    except Exception as exc:  # the c10d store's errors: its server (rank 0) is gone
        raise server.gone(rank, f"while waiting for {waiting_for}", exc) from exc


def _peer_failure(store: Store, world: str, world_size: int) -> PeerFailedError:
    """The failure of the first rank to write one (:func:`_publish`'s claim): three store
    round trips whatever the world's size and the rank (a look at each rank's key in turn
    cost one per rank up to the failed one: 4 s at 40 ranks over a 100 ms link, past
    :data:`STORE_WAIT_S`). Without a claim (a writer cut off between its record and its
    claim) the first rank in rank order with a record, as before there were claims."""
    first = _first_failed_key(world)
    if store.check([first]):
        r = int(store.get(first))
        return _failure_of(store, world, r)
    for r in range(world_size):
        if store.check([f"{_PREFIX}/{world}/failed/{r}"]):
            return _failure_of(store, world, r)
    return PeerFailedError("a rank failed before its world's first step")


def _failure_of(store: Store, world: str, r: int) -> PeerFailedError:
    host, _, text = (
        store.get(f"{_PREFIX}/{world}/failed/{r}").decode(errors="replace").partition("\n")
    )
    return PeerFailedError(f"rank {r} ({host}) failed before its world's first step: {text}")


def rank0_error_file(error_file: str | None, rank: int) -> str | None:
    """Where this rank would find rank 0's error file (pure): ``error_file`` is the worker's
    ``--error-file``, a template with ``{rank}`` (``launch_local``) or this rank's own path;
    the agent writes each rank's as ``error-{rank}.json`` in one directory per generation
    and node (``agent.supervisor``), so rank 0's is beside it when rank 0 ran on this node.
    None when neither: its name cannot be known."""
    if not error_file:
        return None
    if "{rank}" in error_file:
        return error_file.replace("{rank}", "0")
    path = Path(error_file)
    if path.name == f"error-{rank}.json":
        return str(path.with_name("error-0.json"))
    return None


def record_peer_failure(status: _EndRank) -> Callable[[PeerFailedError], None]:
    """What a worker does first when its barrier's heartbeat thread learns of another rank's
    failure while its main thread is held elsewhere (a collective, ``deepspeed.initialize``,
    its load): write the failure as this rank's first cause (``origin="peer"``) where the
    worker's handler would. The barrier then counts this rank out (rank 0 keeps the store
    up for the others) and exits (``exit_status``), as that handler does."""

    def end(err: PeerFailedError) -> None:
        record = failure_record(
            err, status.rank, status.failed_step, status.in_training, last_step=status.step
        )
        # the event first: stderr is a pipe to the agent, the file may be on a mount that
        # hangs (the rank then exits after RECORD_WAIT_S, and the agent takes the event)
        print(json.dumps({"event": "failed", **record}), file=sys.stderr, flush=True)
        write_error_file(status.error_file, record)

    return end


def worker_barrier(
    store: Store, plan_id: str, args: Any, status: _EndRank | None = None
) -> LoadBarrier:
    """A worker rank's barrier for its world, started (its heartbeat begins): ``args`` is the
    worker's parsed command line (``rank_args.build_parser``: rank, world size, master,
    ``--error-file``, ``--load-timeout-s``, ``--load-liveness-s``, ``--load-poll-s``). The
    world is named by the plan and the master address, the same on every rank of it (a fresh
    rank and held ones number their generations differently); polled every
    :data:`LOAD_POLL_S` unless the command line says otherwise. With ``status`` a peer's
    failure ends this rank wherever its main thread is (:func:`record_peer_failure`, then
    exit status 1)."""
    return LoadBarrier(
        store,
        args.rank,
        args.world_size,
        f"{plan_id}@{args.master}",
        args.load_timeout_s,
        args.load_liveness_s,
        getattr(args, "load_poll_s", LOAD_POLL_S),
        on_peer_failure=record_peer_failure(status) if status is not None else None,
        master=args.master,
        rank0_error_file=rank0_error_file(getattr(args, "error_file", None), args.rank),
        exit_status=1 if status is not None else None,
    ).start()


def watched(rank: int, world_size: int, k: int = WATCHED) -> list[int]:
    """The ranks ``rank``'s heartbeat thread reads at every beat: the ``k`` after it on the
    ring (all the others in a world of ``k + 1`` or fewer), so each rank has ``k`` watchers,
    the ``k`` before it (pure)."""
    return [(rank + i) % world_size for i in range(1, min(k, world_size - 1) + 1)]


class _Watch:
    """A rank's look at its :func:`watched` ranks' heartbeats, at each of its own beats: a
    counter that has not moved for ``liveness_s`` is a dead rank."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        world: str,
        liveness_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.rank, self.world, self.liveness_s, self.clock = rank, world, liveness_s, clock
        self.near = watched(rank, world_size)
        self.seen: dict[int, tuple[int, float]] = {}
        """Rank -> (its counter, when this rank first saw it at that value)."""
        self.found: set[int] = set()
        """Ranks this watch found dead (their failure written once)."""

    def next_dead(self, store: Store) -> PeerFailedError | None:
        """Read the watched counters; the first rank silent for ``liveness_s``, its failure
        written on ``store`` for every rank."""
        for peer in self.near:
            if peer in self.found:
                continue
            dead = self._check(store, peer)
            if dead is not None:
                return dead
        return None

    def _check(self, store: Store, peer: int) -> PeerFailedError | None:
        beats, now = store.add(_beat_key(self.world, peer), 0), self.clock()
        last = self.seen.get(peer)
        if last is None or last[0] != beats:
            self.seen[peer] = (beats, now)
            return None
        silent = now - last[1]
        if silent < self.liveness_s:
            return None
        if store.check([_closed_key(self.world, peer)]):  # it closed its barrier: not dead
            self.found.add(peer)  # (read only for a silent rank: no traffic per beat)
            return None
        return self._found(store, peer, beats, silent)

    def _found(self, store: Store, peer: int, beats: int, silent: float) -> PeerFailedError:
        """Write ``peer``'s death (its counter ``beats``, silent ``silent`` s) for all."""
        host_key = _host_key(self.world, peer)
        host = store.get(host_key).decode() if store.check([host_key]) else "?"
        text = (
            f"no heartbeat for {silent:.0f} s (--load-liveness-s={self.liveness_s:g}, seen by "
            f"rank {self.rank}): the process died without a word (the host's OOM killer, "
            "SIGKILL, a crash) or stopped running"
        )
        _publish(store, self.world, peer, host, text)
        with suppress(Exception):  # its own count-out will never come: rank 0 need not
            _count_out(store, self.world, peer, beats)  # keep its store up for it
        self.found.add(peer)
        return PeerFailedError(f"rank {peer} ({host}) failed before its world's first step: {text}")


class _Stalled:
    """Rank 0's look, as it lingers, at the ranks its world's watchers found dead (few:
    ``found/<n>``, :func:`_count_out`): one whose heartbeat counter moves past its verdict
    was stalled, not dead, and is running again."""

    def __init__(self, world: str, window_s: float, clock: Callable[[], float]) -> None:
        self.world, self.window_s, self.clock = world, window_s, clock
        self.read = 0
        """Entries of ``found/`` read so far."""
        self.beats: dict[int, tuple[int, float | None]] = {}
        """Rank -> (its counter last read, when it last moved; None: not since its verdict)."""

    def moving(self, store: Store) -> bool:
        """Whether a rank found dead has beaten within ``window_s`` (one of its chances to
        read the world's failure: a poll or a beat); reads the ``found`` counter, entries
        not read yet, and each found rank's counter (one request each)."""
        for n in range(self.read + 1, store.add(_found_count_key(self.world), 0) + 1):
            key = _found_key(self.world, n)
            if not store.check([key]):  # counted, not yet listed: read at the next look
                break
            found, _, at = store.get(key).decode().partition(" ")
            self.beats[int(found)] = (int(at), None)
            self.read = n
        now, moving = self.clock(), False
        for rank, (last, moved) in self.beats.items():
            beats = store.add(_beat_key(self.world, rank), 0)
            if beats != last:
                last, moved = beats, now
                self.beats[rank] = (last, moved)
            moving = moving or (moved is not None and now - moved < self.window_s)
        return moving
