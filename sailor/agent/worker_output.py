"""What a worker process tells its supervisor: the JSON progress lines on its stdout
(``ready``, ``step``, ``saved``, ``save_failed``, ``stopped``, ``held``, ``warm``; every line
is kept in its capped log), the tail of its stderr, and its exit. The generation's first
abnormal exit is the supervisor's failure (the worker's error file, else its stderr tail); a
worker killed by a signal before it could write its error file gets one written here
(:func:`~sailor.megatron_patch.errors.signal_failure_record`). A spare that exits is
replaced, and counted when it failed.

``WorkerOutput`` is a part of :class:`sailor.agent.supervisor.Supervisor` (a mixin: it updates
the ``WorkerView``s and the supervisor's failure, and wakes ``changed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from sailor.agent.killed_groups import KilledGroups
from sailor.agent.rank_log import RankLog
from sailor.agent.run_dir_io import RunDirIO, RunDirTimeoutError
from sailor.agent.step_timings import bad_timing
from sailor.agent.stream_lines import lines
from sailor.agent.worker_view import WorkerView
from sailor.coordination import TaskSet
from sailor.megatron_patch.errors import (
    MAX_RANK,
    fault_path,
    read_error_file,
    signal_failure_record,
    write_error_file,
)

__all__ = ["WorkerOutput"]

_log = structlog.get_logger("sailor.agent")

_EXIT_POLL_S = 0.2
"""How often a worker's exit is looked for beside ``Process.wait``, which returns only once
the worker's stdout and stderr are closed too (Python 3.11's asyncio): a child of the worker
that inherited them keeps them open after the worker died, and its death went unseen (the
worker counted as running) until that child ended."""

_READERS_S = 2.0
"""How long an exited worker's output readers may take to reach the end of its pipes (its
last lines: a ``failed`` event, a ``stopped``) before they are stopped: a child of it that
holds the pipes open is being killed meanwhile (``KilledGroups.sweep``)."""

_LOG_CLOSE_S = 2.0
"""How long an exited worker's logs may take to write their last lines before its exit is
told all the same (a local file takes milliseconds; a hung mount, forever)."""


class WorkerOutput:
    """The reading of :class:`~sailor.agent.supervisor.Supervisor`'s workers' output and exits."""

    changed: asyncio.Event
    on_ready: Callable[[int], Awaitable[None]] | None
    warm_spares: int
    workers: list[WorkerView]
    spares: list[WorkerView]
    _tasks: TaskSet
    in_place: bool
    expect_exit: bool
    closed: bool
    failure: str
    run_dir: Path
    run_dir_io: RunDirIO
    io_wait_s: float
    killed_groups: KilledGroups
    generation: int
    _spare_failures: int

    if TYPE_CHECKING:

        async def top_up_spares(self) -> None:
            """:meth:`Supervisor.top_up_spares` (the spares are the supervisor's)."""

    async def _read_stdout(self, w: WorkerView) -> None:
        assert_stream = w.proc.stdout
        if assert_stream is None:
            return
        async for raw in lines(assert_stream):
            if w.out_log is not None:
                w.out_log.write(raw)
            try:
                msg = json.loads(raw)
            except (ValueError, RecursionError):  # nested past json's recursion limit:
                continue  # it ended this reader, and the worker blocked on a full pipe
            if not isinstance(msg, dict):
                continue
            try:
                await self._on_line(w, msg)
            except (ValueError, TypeError) as exc:  # a field of the wrong type: skip the line
                _log.warning(
                    "worker_line_malformed", rank=w.rank, line=str(raw[:300]), error=str(exc)
                )
            self.changed.set()

    async def _on_line(self, w: WorkerView, msg: dict[str, Any]) -> None:
        """One progress line of a worker (``{"event": ...}``)."""
        ev = msg.get("event")
        if ev == "ready":
            w.started = True
            changed = msg.get("data_changed")
            if changed and w.rank == 0:  # resumed under allow_data_change: in the agent's log
                _log.warning("worker_data_changed", rank=w.rank, changes=str(changed)[:2000])
            if self.on_ready is not None:
                await self.on_ready(w.proc.pid)
            if self.warm_spares and self.workers and all(x.started for x in self.workers):
                self._tasks.spawn("spares", self.top_up_spares())
        elif ev == "step":
            w.started = True
            w.step = _step_of(msg, w.step)
            loss = msg.get("loss")
            # a diverged run reports NaN or inf (JSON has neither: the status refused it)
            if isinstance(loss, int | float) and math.isfinite(loss):
                w.loss = float(loss)
            if w.timings is not None:
                w.timings.add(msg)
            why = bad_timing(msg)
            if why:  # the step counts; its timing is left out of the calibration
                raise ValueError(f"step {w.step}'s timing not taken: {why}")
        elif ev == "saved":
            w.saved_step = _step_of(msg, w.saved_step)
            if msg.get("deleted"):  # saves the controller gave up on, deleted (drop_steps)
                _log.info(
                    "checkpoint_unrecorded_deleted", step=w.saved_step, deleted=msg["deleted"]
                )
        elif ev == "save_failed":  # an optional save (a periodic one): the workers train on
            w.save_failed_step = _step_of(msg, w.save_failed_step)
            w.save_failure = str(msg.get("error", ""))[:1024]
            _log.warning(
                "worker_save_failed", rank=w.rank, step=w.save_failed_step, error=w.save_failure
            )
        elif ev == "stopped":
            if not self.in_place:
                self.expect_exit = True
        elif ev == "held":
            held_step = _step_of(msg, -1)
            w.held = True
            w.held_step = held_step
            w.broken = str(msg.get("cause", "")) if msg.get("broken") else ""
            w.culprit = _culprit(msg) if w.broken else -1
            if w.broken:
                _log.warning("worker_held_broken", rank=w.rank, cause=w.broken[:300])
        elif ev == "warm":
            w.warm = True

    async def _read_stderr(self, w: WorkerView) -> None:
        if w.proc.stderr is None:
            return
        async for raw in lines(w.proc.stderr):
            if w.err_log is not None:
                w.err_log.write(raw)
            w.stderr_tail = [*w.stderr_tail[-19:], raw.decode(errors="replace").rstrip()]

    async def _wait(self, w: WorkerView) -> None:
        code = await exit_of(w.proc)
        w.exit_code = code
        # what it left in its process group (its own children) goes with it; a sweep that
        # fails is logged, never skips the exit (its failure unrecorded, the view stale)
        try:
            self.killed_groups.sweep(w)
        except Exception:
            _log.exception("worker_sweep_failed", pid=w.proc.pid, rank=w.rank, code=code)
        if w.readers:  # its last lines, unless a child of it holds its pipes open still
            await asyncio.wait(w.readers, timeout=_READERS_S)
        if w.tasks is not None:
            await w.tasks.close(timeout=2.0)
        logs = [log for log in (w.out_log, w.err_log) if log is not None]
        for log in logs:
            log.close()
        await self._exited(w, code)
        # their last lines in the files before the exit is told (bounded: a hung mount)
        if logs:
            await asyncio.to_thread(_logs_closed, logs, _LOG_CLOSE_S)
        self.changed.set()

    async def _exited(self, w: WorkerView, code: int) -> None:
        """A worker's exit: a spare replaced, a failed worker's cause the failure."""
        if w in self.spares and not self.closed:
            # a spare that left on its own (its directive never came, or it failed): another
            # takes its place, unless they keep failing
            if code != 0 or not w.warm:  # warm or not: a spare that fails counts
                self._spare_failures += 1
                _log.warning("spare_exited", code=code, warm=w.warm, in_a_row=self._spare_failures)
            self._tasks.spawn("spares", self.top_up_spares())
        if w not in self.workers:  # a spare, or a worker already let go
            return
        if code != 0 and not self.expect_exit:
            generation = self.generation
            err = w.error_file or self.run_dir / f"error-{w.rank}.json"
            cause, why = "", ""
            try:
                # off the loop, bounded: the run directory may be on a mount that hangs
                cause, line = await self.run_dir_io.run(
                    lambda: _failure_cause(w, code, err),
                    f"error file {err} unreadable",
                    self.io_wait_s,
                )
            except RunDirTimeoutError as exc:
                why = str(exc)
                line = ""
            if line:
                w.stderr_tail = [*w.stderr_tail[-19:], line]
            # an abort or a launch meanwhile ended this generation here: not this exit's to fail
            if not self.failure and generation == self.generation and w in self.workers:
                tail = " | ".join(w.stderr_tail[-3:])
                detail = f"{why}; stderr: {tail}" if why else tail
                self.failure = cause or f"rank {w.rank} exit {code}: {detail}"
                _log.warning("worker_failed", rank=w.rank, code=code, cause=self.failure[:300])


def _step_of(msg: dict[str, Any], default: int) -> int:
    """The ``step`` of a progress line (``default`` without one): an integer from -1 (none),
    as the agent's status carries it; else ``ValueError`` naming the field and value (the
    line is skipped and logged). Before, a step of -5 reached the status record, which
    refuses it, and the agent's status loop crashed until the agent exited; ``Infinity``
    (JSON as Python writes it) raised ``OverflowError`` and ended the stdout reader, and
    the worker blocked on a full pipe."""
    v = msg.get("step", default)
    try:
        step = int(v)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"step={v!r}: not a step number") from exc
    if step < -1:
        raise ValueError(f"step={v!r}: a step number is at least -1 (none)")
    return step


def _culprit(msg: dict[str, Any]) -> int:
    """The ``culprit`` of a held line: a global rank, or -1 (none, or a value that is no
    rank: a worker's line never stops its reader)."""
    v = msg.get("culprit", -1)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_RANK:
        return -1
    return v


async def exit_of(proc: asyncio.subprocess.Process) -> int:
    """``proc``'s exit status, once it is reaped (its pipes may still be open:
    :data:`_EXIT_POLL_S`)."""
    waiter = asyncio.ensure_future(proc.wait())
    try:
        while True:
            await asyncio.wait([waiter], timeout=_EXIT_POLL_S)
            if waiter.done():
                return waiter.result()
            if proc.returncode is not None:
                return proc.returncode
    finally:
        waiter.cancel()


def _logs_closed(logs: list[RankLog], timeout_s: float) -> None:
    """Wait until ``logs`` have written what they were given, ``timeout_s`` at most."""
    end = time.monotonic() + timeout_s
    for log in logs:
        log.wait_closed(max(0.0, end - time.monotonic()))


def _failure_cause(w: WorkerView, code: int, err: Path) -> tuple[str, str]:
    """A failed worker's cause, its error file as found (``''`` if unreadable), after
    writing the file of a worker that wrote none (:func:`_record_silent_death`); and the
    ``failed`` line for its stderr tail ('' if none). File work: run off the agent's loop."""
    line = ""
    if read_error_file(err) is None:
        line = _record_silent_death(w, code, err)
    cause = ""
    with contextlib.suppress(OSError):
        cause = err.read_text()[:2000]
    return cause, line


def _record_silent_death(w: WorkerView, code: int, err: Path) -> str:
    """The error record of a worker that wrote none: the ``failed`` event it printed
    first, if any (a rank ended of a peer's failure prints it before its file write,
    which may not end on a hung mount: the record is then the peer's, not this node's),
    else one of its exit (killed by a signal), whose ``failed`` line is returned for its
    stderr tail ('' for the former)."""
    printed = _failed_event(w.stderr_tail)
    if printed is not None:
        with contextlib.suppress(OSError):
            write_error_file(err, printed, writer_gone=True)
        _log.warning("worker_failed_unrecorded", rank=w.rank, origin=printed.get("origin"))
        return ""
    fault = ""
    with contextlib.suppress(OSError):
        fault = fault_path(err).read_text(errors="replace")
    record = signal_failure_record(
        w.rank, code, w.step, fault, stderr_tail="\n".join(w.stderr_tail), pid=w.proc.pid
    )
    with contextlib.suppress(OSError):
        write_error_file(err, record, writer_gone=True)
    _log.warning("worker_killed", rank=w.rank, signal=record["signal"], step=w.step)
    return json.dumps({"event": "failed", **record})


def _failed_event(tail: list[str]) -> dict[str, Any] | None:
    """The first ``{"event": "failed", ...}`` line of a worker's stderr tail, as a record:
    its first cause, as in its error file, whose first writer's record stands
    (``write_error_file``); a later event (a peer's failure read as the rank ended) is
    not the cause."""
    for line in tail:
        if '"failed"' not in line:
            continue
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(data, dict) and data.get("event") == "failed":
            return {k: v for k, v in data.items() if k != "event"}
    return None
