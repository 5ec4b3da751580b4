"""Killed workers' process groups until they are gone: the kill, the wait, those that linger.

A worker runs in a process group of its own (:mod:`teardown`). :meth:`KilledGroups.kill`
sends its group SIGTERM, then SIGKILL after ``kill_grace_s``, then waits until every process
of the group is gone, at most ``teardown_timeout_s`` (a rank in the GPU driver's teardown
outlives SIGKILL for tens of seconds and holds its GPU meanwhile). No worker may start
meanwhile (:meth:`KilledGroups.gate`). A group still there then *lingers*: its record
(:func:`~sailor.megatron_patch.errors.outlived_kill_record`, ``retry=False``, one record for
every lingering group) is this node's failure and no worker starts until it is gone. The
lingering groups are probed again at each launch and abort (the supervisor calls
:meth:`KilledGroups.recheck`) and every ``recheck_s``; once none is left the record is
withdrawn. The groups signalled and not yet found gone are kept in ``killed.json`` in the run
directory (:data:`KILLED_FILE`) from their SIGTERM on, so that a restarted agent
(:meth:`KilledGroups.restore`) starts no rank on a GPU its previous incarnation's rank still
holds: it SIGKILLs the groups whose kill was cut short before their SIGKILL, goes on killing
those SIGKILLed less than ``teardown_timeout_s`` ago (within what is left of that bound:
``going`` counts them, as the kills it began itself) and lets the others linger. The file is
written on the run directory's thread (:mod:`run_dir_io`), never on the loop: the record a
SIGTERM needs is waited ``io_wait_s`` at most, then the groups are signalled all the same
(an agent restarted before the late record lands does not know them: a member that ignores
SIGTERM gets no SIGKILL from it, and its launch does not wait for them; its own read of the
file on that hung mount would not answer either).

A worker that exits with no kill under way is *swept* as it is reaped (:meth:`KilledGroups.sweep`):
what it left in its group (its own children) is killed the same way, and no worker starts
meanwhile. One ``killpg(pgid, 0)`` tells an empty group (the common case) at once.

The supervisor owns the workers and the failure it reports; this module tells it through
two callbacks (the record changed; every lingering group is gone) and never starts a worker,
reads its output nor decides which workers to kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog

from sailor.agent.killed_file import KILLED_FILE, KilledGroup, load_killed, save_killed
from sailor.agent.run_dir_io import RUN_DIR_WAIT_S, RunDirIO, RunDirTimeoutError
from sailor.agent.teardown import (
    GONE_STATES,
    Teardown,
    boot_ticks,
    group_members,
    teardown_verdict,
)
from sailor.coordination import TaskSet
from sailor.megatron_patch.errors import outlived_kill_record

__all__ = [
    "KILLED_FILE",
    "TEARDOWN_TIMEOUT_S",
    "Killable",
    "KilledGroups",
    "Probe",
    "WorkerTeardownError",
]

_log = structlog.get_logger("sailor.agent")


TEARDOWN_TIMEOUT_S = 120.0
"""How long killed workers' processes may take to go after SIGKILL before the node is
reported failed. A guess with its reasons, not a measurement here: the GPU driver's
teardown of a rank after an XID error or an NCCL hang is reported to take tens of seconds,
and a bound too short fails a node that would have recovered (``AgentConfig`` sets it)."""

_PROBE_S = 0.2
"""The longest pause between two probes of killed workers' groups (the first pauses are
shorter: 10 ms, doubling): a ``killpg`` each and, while one has members, a ``/proc`` scan
in a thread (~2 ms for 70 processes): cheap, and the next launch starts at most this late
after the last process went."""

_PROBE_TIMEOUT_S = 5.0
"""A probe that takes longer (a ``/proc`` read stuck behind a process's kernel locks) counts
as finding every group still there, state unreadable; the teardown's bound still holds."""

_LOG_EVERY_S = 10.0
"""How often a process outliving SIGKILL is logged again (first: ``kill_grace_s`` after)."""

_RECHECK_S = 5.0
"""How often a process that outlived the teardown bound is probed again (besides each
launch and abort): a ``killpg`` per group and, while one has a member, a ``/proc`` scan in
a thread. The node takes ranks again at most this late after it went, against the
controller's exclusion of a node that reported it (600 s)."""


class WorkerTeardownError(RuntimeError):
    """A launch or a spare asked to start a worker while a killed worker's process outlived
    the teardown bound and is still there (the message is the failure record, JSON)."""


Probe = Callable[[list[int], Mapping[int, int]], dict[int, dict[int, str]]]
"""Which of the given process groups still have members (started by the given time, if one
is given), with their states: ``{pgid: {pid: state}}`` (:func:`teardown.group_members`)."""


class Killable(Protocol):
    """What a kill reads of a worker (``worker_view.WorkerView``)."""

    @property
    def rank(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def exit_code(self) -> int | None:
        """Set once the worker has been reaped (None until then)."""

    @property
    def proc(self) -> asyncio.subprocess.Process:
        """The worker, the leader of its process group (its pid is the group's id)."""


class KilledGroups:
    """The process groups of one supervisor's killed workers, from SIGTERM until gone."""

    def __init__(
        self,
        run_dir: Path,
        tasks: TaskSet,
        on_record: Callable[[str, str, bool], None],
        on_gone: Callable[[], None],
        teardown_timeout_s: float = TEARDOWN_TIMEOUT_S,
        io: RunDirIO | None = None,
    ) -> None:
        self.run_dir = run_dir
        """Where :data:`KILLED_FILE` is kept."""
        self._io = io or RunDirIO(f"sailor-killed-{run_dir.name}")
        """Writes :data:`KILLED_FILE`, off the loop (the supervisor's run-directory thread:
        in order with its other file work there)."""
        self.io_wait_s = RUN_DIR_WAIT_S
        """How long a write of :data:`KILLED_FILE` is waited for (``Supervisor.io_wait_s``)."""
        self.kill_grace_s = 3.0
        """After SIGTERM, how long a worker's group may take to go before its SIGKILL."""
        self.teardown_timeout_s = teardown_timeout_s
        """After SIGKILL, how long killed workers' processes may take to go (``kill``)."""
        self.recheck_s = _RECHECK_S
        """How often processes that outlived the teardown bound are probed again."""
        self.probe: Probe = group_members
        """``teardown.group_members`` (tests stand in a process that outlives SIGKILL: none
        can on a machine without a GPU)."""
        self.closed = False
        """The supervisor is closing: a kill waits ``kill_grace_s`` after SIGKILL, no more,
        one under way too (nothing starts after a close, and the agent's stop must stay
        short)."""
        self._tasks = tasks
        """The supervisor's: the periodic recheck runs there (its close ends it)."""
        self._on_record = on_record
        """Called with the old record, the new one and whether the new one is to be
        reported at once, whenever the record is stated again."""
        self._on_gone = on_gone
        """Called when a recheck (one that may notify) found every lingering group gone."""
        self._killing = 0
        """Kills under way: while any is, no worker starts (``gate``)."""
        self._killed = asyncio.Event()
        self._killed.set()
        self._going: set[int] = set()
        """The process groups of the kills under way (``going``)."""
        self._sigkilled: dict[int, KilledGroup] = {}
        """Process groups signalled and not yet found gone, by pgid (in ``KILLED_FILE``)."""
        self._restored: list[KilledGroup] = []
        """A previous agent's groups :meth:`restore` found still being killed, until
        :meth:`finish_restored`."""
        self._lingering: dict[int, KilledGroup] = {}
        """Those of them past the teardown bound: no worker starts while one is there."""
        self._record = ""
        self._rechecking: asyncio.Task[Any] | None = None
        self._sweeps: set[asyncio.Task[None]] = set()
        """The sweeps under way (:meth:`sweep`), until their kill is over (:meth:`sweeps_over`)."""

    @property
    def record(self) -> str:
        """The failure record (JSON) of the lingering groups ('' if none). It is the
        supervisor's failure once reported (at once, but for held workers let go after an
        in-place launch: at the next launch or abort)."""
        return self._record

    @property
    def going(self) -> int:
        """Process groups being killed now: signalled, neither found gone yet nor past the
        teardown bound (those linger: ``record``). The agent's status reports it."""
        return len(self._going)

    @property
    def killing(self) -> bool:
        """A kill is under way: no worker may start (``gate`` waits for it)."""
        return self._killing > 0

    async def kill(self, workers: Sequence[Killable], report: bool = True) -> None:
        """SIGTERM ``workers``' process groups; SIGKILL the groups not gone after the grace
        period; then wait until every process of them is gone, at most ``teardown_timeout_s``
        (``kill_grace_s`` once closed: nothing starts after a close, and the agent's stop
        must stay short). No worker starts meanwhile. A process still there then lingers
        (its record the failure at once if ``report``), and no worker starts until it is
        gone. :meth:`signal` and :meth:`finish`, one after the other.

        Only the groups of workers not yet reaped are signalled: the pid of one reaped
        earlier may belong to another process by now (one is swept as it is reaped:
        :meth:`sweep`)."""
        await self.finish(self.begin(workers), report, term=True)

    def begin(self, workers: Sequence[Killable]) -> list[Killable]:
        """The start of a kill, at once (no await): the workers of ``workers`` not yet
        reaped, returned, are this kill's; from now until :meth:`finish` of them has
        returned no worker starts (``gate``). Their record and SIGTERM are ``finish``'s
        first acts (``term=True``), or :meth:`signal`'s. Each call with workers to kill must
        be followed by :meth:`finish` of what it returned (it ends the kill)."""
        alive = [w for w in workers if w.exit_code is None]
        if alive:
            self._begin(alive)
        return alive

    async def signal(self, workers: Sequence[Killable]) -> list[Killable]:
        """:meth:`begin`, then the groups' record and SIGTERM (:meth:`_term`); the workers
        signalled are returned, for :meth:`finish` (without ``term``)."""
        alive = self.begin(workers)
        if alive:
            try:
                await self._term(alive)
            except BaseException:
                self._ended(alive)
                raise
        return alive

    def sweep(self, w: Killable) -> None:
        """Worker ``w`` exited (reaped) with no kill of its group under way: it failed, the
        OOM killer or someone else SIGKILLed it, or it ended its run. What it left in its
        process group (its children: data loader workers, compile workers, a launcher's
        processes; anything it started that did not leave the group) is killed as a kill's
        workers are (SIGTERM, SIGKILL after the grace period, the wait, lingering past the
        bound: the failure), in a task; no worker starts meanwhile. Before, nothing
        signalled them: a worker's death left its children running, holding memory, GPU
        and ports, and the next launch did not wait for them. Nothing is done when the group
        is empty (one ``killpg(pgid, 0)``: the common case) or already being killed.

        The group's id is not another's while a member of it lives (the kernel frees a pid
        only once no process has it as its pid, group or session id), and this runs as the
        worker is reaped; the probes after it count only members started by the signal
        (``born_by``)."""
        pgid = w.proc.pid
        if w.exit_code is None or pgid in self._going or pgid in self._sigkilled:
            return
        try:
            os.killpg(pgid, 0)
        except PermissionError:  # a member we may not signal: there all the same
            pass
        except OSError:  # ProcessLookupError: nothing left
            return
        _log.warning("worker_left_processes", pid=pgid, rank=w.rank, code=w.exit_code)
        self._begin([w])
        task = self._tasks.spawn(f"sweep-{pgid}", self.finish([w], term=True))
        self._sweeps.add(task)
        task.add_done_callback(self._sweeps.discard)

    async def sweeps_over(self) -> None:
        """Until the sweeps under way are over (not cancelled with the caller): the
        supervisor's close waits for them as for its kills, else closing its tasks cancelled
        a sweep within its grace period and a child that ignores SIGTERM outlived the agent's
        stop. Once :attr:`closed`, each ends within ``kill_grace_s`` after its SIGKILL."""
        while self._sweeps:
            await asyncio.wait([asyncio.shield(t) for t in list(self._sweeps)])

    def _begin(self, alive: Sequence[Killable]) -> None:
        """``alive``'s groups are being killed from now on (``going``, no worker starts),
        recorded in memory; :meth:`_term` writes the record and signals them."""
        self._killing += 1
        self._killed.clear()
        born_by, now = boot_ticks(), time.time()
        for w in alive:
            self._going.add(w.proc.pid)
            self._sigkilled[w.proc.pid] = KilledGroup(
                w.proc.pid, w.rank, w.step, born_by, now, sigkilled=False, proc=w.proc
            )

    async def _term(self, alive: Sequence[Killable]) -> None:
        """SIGTERM to the groups of ``alive``, recorded first (``KILLED_FILE``): an agent
        killed in between still finds the groups and sends the SIGKILL they are owed
        (restore). The record's write is waited ``io_wait_s`` at most (it goes through the
        run directory's thread: a hung mount there must not hold the loop); past it the
        groups are signalled all the same, the record to follow whenever the mount answers:
        leaving workers running (their GPUs, the next launch) for a record that may never be
        written costs more than what a restart before it lands would miss (the SIGKILL a
        SIGTERM-proof child is owed, and the wait for these groups to go)."""
        try:
            await self._save(before="SIGTERM")
        finally:  # whatever ended the wait (its bound, a cancel): the signals go
            # EPERM (every member left is another user's: a setuid helper, root's sudo) is
            # no error here: the probes still find them, and past the bound they linger as
            # any process that outlives its kill (teardown.group_members takes it so too)
            for w in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(w.proc.pid, signal.SIGTERM)

    def _ended(self, alive: Sequence[Killable]) -> None:
        """A kill of ``alive`` is over (gone, lingering, or given up): ``going`` no more."""
        self._going.difference_update(w.proc.pid for w in alive)
        self._killing -= 1
        if not self._killing:
            self._killed.set()

    async def finish(
        self,
        alive: Sequence[Killable],
        report: bool = True,
        term: bool = False,
        sent: asyncio.Event | None = None,
    ) -> None:
        """The rest of the kill :meth:`begin` (or :meth:`signal`) began on ``alive``: with
        ``term``, their record and SIGTERM first (``sent`` is set once they are sent); then
        the grace period, SIGKILL, the wait for the groups to go (see :meth:`kill`)."""
        if not alive:
            if sent is not None:
                sent.set()
            return
        try:
            if term:
                try:
                    await self._term(alive)
                finally:
                    if sent is not None:
                        sent.set()
            # a group whose leader was reaped (``sweep``) counts only members started by
            # its SIGTERM: its id may be another group's once ours are all gone
            reaped = {
                w.proc.pid: self._sigkilled[w.proc.pid].born_by
                for w in alive
                if w.exit_code is not None and w.proc.pid in self._sigkilled
            }
            left, _ = await self._until_gone(
                _ranks(alive), _procs(alive), self.kill_grace_s, born_by=reaped or None
            )
            for w in alive:
                if w.proc.pid not in left:
                    self._sigkilled.pop(w.proc.pid, None)
            if not left:
                await self._save()
                return
            born_by, now = boot_ticks(), time.time()
            for w in alive:
                if w.proc.pid in left:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(w.proc.pid, signal.SIGKILL)
                    self._sigkilled[w.proc.pid] = KilledGroup(
                        w.proc.pid, w.rank, w.step, born_by, now, proc=w.proc
                    )
            await self._save()  # a restarted agent must know them (restore)
            killed = [w for w in alive if w.proc.pid in left]
            bound = self.kill_grace_s if self.closed else self.teardown_timeout_s
            left, elapsed = await self._until_gone(
                _ranks(killed),
                _procs(killed),
                bound,
                born_by={w.proc.pid: born_by for w in killed},
                after_kill=True,
            )
            for w in killed:
                if w.proc.pid not in left:
                    self._sigkilled.pop(w.proc.pid, None)
            if left:
                self._linger(left, elapsed, report)
            await self._save()
        finally:
            self._ended(alive)

    async def _until_gone(
        self,
        rank_of: Mapping[int, int],
        procs: Sequence[asyncio.subprocess.Process],
        bound_s: float,
        born_by: Mapping[int, int] | None = None,
        after_kill: bool = False,
    ) -> tuple[dict[int, dict[int, str]], float]:
        """Wait until every process of the groups ``rank_of`` (``{pgid: rank}``) is gone, at
        most ``bound_s``: the groups with a live member still (``{pgid: {pid: state}}``, {}
        if none) and the seconds waited. A worker of ``procs`` (our children, the groups'
        leaders; none for a previous agent's) is there until reaped (a process whose main
        thread ended reads ``Z`` while another thread runs on; it cannot be reaped then).
        Wakes when the workers have exited, else after 10 ms, doubling up to ``_PROBE_S``:
        a worker that goes at once (its children with it) costs no sleep. ``born_by``: the
        groups' members started later are not theirs (``teardown.group_members``).
        ``after_kill``: log the processes outliving SIGKILL, and their end."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        waits = [asyncio.ensure_future(p.wait()) for p in procs if p.returncode is None]
        outlived: dict[int, int] = {}  # pid -> rank, of those logged as outliving SIGKILL
        next_log = self.kill_grace_s
        delay = 0.01
        try:
            while True:
                if self.closed:  # closing meanwhile: the agent's stop must stay short
                    bound_s = min(bound_s, self.kill_grace_s)
                pending = [f for f in waits if not f.done()]
                if pending:
                    left_s = start + bound_s - loop.time()
                    await asyncio.wait(pending, timeout=max(0.0, min(delay, left_s)))
                groups = await self._probe(list(rank_of), born_by or {})
                elapsed = loop.time() - start
                there = {  # pid -> (pgid, state)
                    pid: (pgid, state)
                    for pgid, members in groups.items()
                    for pid, state in members.items()
                    if state not in GONE_STATES
                }
                for p in procs:
                    if p.returncode is None and p.pid not in there:
                        # not reaped: a zombie leader (its last thread is ending) or a
                        # member the probe missed; there all the same, state unknown
                        there[p.pid] = (p.pid, "")
                if after_kill:
                    for pid in [p for p in outlived if p not in there]:
                        _log.info(
                            "worker_gone_after_sigkill",
                            pid=pid,
                            rank=outlived.pop(pid),
                            seconds=round(elapsed, 1),
                        )
                    if there and elapsed >= next_log:
                        next_log = elapsed + _LOG_EVERY_S
                        for pid, (pgid, state) in there.items():
                            outlived[pid] = rank_of.get(pgid, -1)
                            _log.warning(
                                "worker_outlived_sigkill",
                                pid=pid,
                                rank=outlived[pid],
                                seconds=round(elapsed, 1),
                                state=state,
                            )
                verdict = teardown_verdict({p: s for p, (_, s) in there.items()}, elapsed, bound_s)
                if verdict is Teardown.GONE:
                    return {}, elapsed
                if verdict is Teardown.STUCK:
                    left: dict[int, dict[int, str]] = {}
                    for pid, (pgid, state) in there.items():
                        left.setdefault(pgid, {})[pid] = state
                    return left, elapsed
                if not pending:
                    await asyncio.sleep(min(delay, start + bound_s - loop.time()))
                delay = min(2 * delay, _PROBE_S)
        finally:
            for f in waits:
                f.cancel()

    async def _probe(
        self, pgids: list[int], born_by: Mapping[int, int]
    ) -> dict[int, dict[int, str]]:
        """``self.probe`` in a thread (it reads ``/proc``), at most ``_PROBE_TIMEOUT_S``."""
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(self.probe, pgids, born_by), _PROBE_TIMEOUT_S
            )
        except TimeoutError:
            _log.warning("worker_probe_slow", pgids=pgids, timeout_s=_PROBE_TIMEOUT_S)
            return {g: {g: ""} for g in pgids}

    def _linger(
        self, groups: dict[int, dict[int, str]], elapsed: float, report: bool = True
    ) -> None:
        """Killed workers' processes (``{pgid: {pid: state}}``) outlived the teardown bound:
        their GPUs are not free. They join those already lingering (one record names them
        all: an earlier group still there must not be forgotten); the record is the
        failure if ``report`` (or if the earlier one was). No worker starts until they are
        gone; they are probed again every ``recheck_s``."""
        for pgid, members in groups.items():
            k = self._sigkilled[pgid]
            k.processes = tuple(sorted(members.items()))
            k.seconds = max(k.seconds, elapsed)  # a restored one's counts from its SIGKILL
            self._lingering[pgid] = k
        self._restate(report)
        _log.error(
            "worker_outlived_teardown",
            processes=[
                f"pid {p} rank {self._lingering[g].rank} state {s or '?'}"
                for g, members in groups.items()
                for p, s in members.items()
            ],
            seconds=round(elapsed, 1),
        )
        if self._rechecking is None or self._rechecking.done():
            self._rechecking = self._tasks.spawn("recheck", self._recheck_until_gone())

    def _restate(self, report: bool = False) -> None:
        """The record from ``_lingering`` again, told to the supervisor (``on_record``: the
        failure too if it was the old record, or if ``report``)."""
        old = self._record
        procs = [
            (pid, k.rank, state) for k in self._lingering.values() for pid, state in k.processes
        ]
        procs.sort(key=lambda p: (p[2] != "D", p[0] not in self._lingering, p[0]))
        self._record = ""
        if procs:
            seconds = max(k.seconds for k in self._lingering.values())
            step = max(k.step for k in self._lingering.values())
            self._record = json.dumps(outlived_kill_record(procs, seconds, step))
        self._on_record(old, self._record, report)

    async def recheck(self, notify: bool = True) -> None:
        """Probe the lingering groups again and forget those gone. Once none is left, the
        record is withdrawn (``on_record``) and, if ``notify``, ``on_gone`` is called (the
        supervisor tops its spares up; not when a worker is about to start: its start
        does)."""
        if not self._lingering:
            return
        pgids = list(self._lingering)
        groups = await self._probe(pgids, {g: self._lingering[g].born_by for g in pgids})
        gone = []
        for g in pgids:
            k = self._lingering.get(g)
            if k is None:  # another recheck found it gone meanwhile
                continue
            if k.proc is not None and k.proc.returncode is None:
                continue  # not reaped: its last thread has not ended
            if all(s in GONE_STATES for s in groups.get(g, {}).values()):
                gone.append(g)
                del self._lingering[g]
                self._sigkilled.pop(g, None)
        if not gone:
            return
        _log.info("worker_gone_after_teardown", pgids=gone, left=sorted(self._lingering))
        await self._save()
        self._restate()
        if not self._lingering and notify:
            self._on_gone()

    async def _recheck_until_gone(self) -> None:
        while self._lingering and not self.closed:
            await asyncio.sleep(self.recheck_s)
            await self.recheck()

    async def gate(self) -> None:
        """Return once no kill is under way and no killed worker's process holds on
        (probed again here: it may have gone since); else raise WorkerTeardownError."""
        async with asyncio.timeout(self.teardown_timeout_s + 2 * self.kill_grace_s + 10):
            await self._killed.wait()  # every kill ends within its bounds
        await self.recheck(notify=False)  # a worker is about to start: it tops them up
        if self._record:
            raise WorkerTeardownError(self._record)

    async def _save(self, before: str = "") -> None:
        """``_sigkilled`` as it is now into ``KILLED_FILE`` (``killed_file.save_killed``),
        on the run directory's thread (in order with the other saves), waited ``io_wait_s``
        at most; not at all while that thread is stuck past it on earlier work (queued
        behind it: written once the mount answers, or superseded). ``before``: the signal
        the record must precede (logged if it could not)."""
        groups = [dataclasses.replace(k) for k in self._sigkilled.values()]
        write = functools.partial(save_killed, self.run_dir, groups)
        what = f"{self.run_dir / KILLED_FILE} not written"
        try:
            if self._io.held_s() > self.io_wait_s:
                self._io.submit(write, what)
                raise RunDirTimeoutError(what, self.io_wait_s)
            await self._io.run(write, what, self.io_wait_s)
        except (RunDirTimeoutError, RuntimeError) as exc:  # stuck, or closed
            _log.warning(
                "killed_groups_record_late",
                before=before or None,
                pgids=sorted(self._sigkilled),
                error=str(exc),
            )

    async def restore(self) -> None:
        """At an agent's start: the process groups its previous incarnation signalled and
        did not see go (``KILLED_FILE``), those still there (members started by their last
        signal, in this boot) as if this agent had signalled them. One whose kill was cut
        short before its SIGKILL gets it now. One SIGKILLed less than
        ``teardown_timeout_s`` ago is still being killed (``going``; no worker starts
        meanwhile): :meth:`finish_restored` waits for it within what is left of the bound.
        The others linger: the failure is theirs and no worker starts until they are gone.
        """
        saved = load_killed(self.run_dir)
        if saved is None:  # none, or unreadable (logged)
            return
        if saved:
            groups = await self._probe([k.pgid for k in saved], {k.pgid: k.born_by for k in saved})
            there = {
                g: {p: s for p, s in members.items() if s not in GONE_STATES}
                for g, members in groups.items()
            }
            now = time.time()
            late: dict[int, dict[int, str]] = {}
            for k in (k for k in saved if there.get(k.pgid)):
                if not k.sigkilled:  # the kill was cut short: its SIGKILL is due
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(k.pgid, signal.SIGKILL)
                    k.born_by, k.killed_at, k.sigkilled = boot_ticks(), now, True
                self._sigkilled[k.pgid] = k
                k.seconds = max(0.0, now - k.killed_at)
                if k.seconds < self.teardown_timeout_s:
                    self._restored.append(k)
                else:
                    late[k.pgid] = there[k.pgid]
            if self._sigkilled:
                _log.warning(
                    "killed_groups_restored",
                    going=sorted(k.pgid for k in self._restored),
                    lingering=sorted(late),
                )
            if late:
                self._linger(late, 0.0)
            if self._restored:
                self._killing += 1
                self._killed.clear()
                self._going.update(k.pgid for k in self._restored)
        await self._save()

    async def finish_restored(self) -> None:
        """The rest of the kills :meth:`restore` found under way: wait until their groups
        are gone, each at most until ``teardown_timeout_s`` after its SIGKILL; those still
        there then linger (their record the failure at once), as :meth:`finish`'s do."""
        restored, self._restored = self._restored, []
        if not restored:
            return
        try:
            by_kill: dict[float, list[KilledGroup]] = {}
            for k in restored:  # one wait per SIGKILL time: each has its own bound
                by_kill.setdefault(k.killed_at, []).append(k)
            waits = [
                self._until_gone(
                    {k.pgid: k.rank for k in ks},
                    (),
                    max(0.0, self.teardown_timeout_s - (time.time() - killed_at)),
                    born_by={k.pgid: k.born_by for k in ks},
                    after_kill=True,
                )
                for killed_at, ks in by_kill.items()
            ]
            left: dict[int, dict[int, str]] = {}
            for found, _ in await asyncio.gather(*waits):
                left.update(found)
            now = time.time()
            for k in restored:
                if k.pgid not in left:
                    self._sigkilled.pop(k.pgid, None)
                k.seconds = max(k.seconds, now - k.killed_at)
            if left:
                self._linger(left, max(k.seconds for k in restored if k.pgid in left))
            await self._save()
        finally:
            self._going.difference_update(k.pgid for k in restored)
            self._killing -= 1
            if not self._killing:
                self._killed.set()


def _ranks(workers: Sequence[Killable]) -> dict[int, int]:
    """``{pgid: rank}`` of ``workers`` (a worker's pid is its group's id)."""
    return {w.proc.pid: w.rank for w in workers}


def _procs(workers: Sequence[Killable]) -> list[asyncio.subprocess.Process]:
    return [w.proc for w in workers]
