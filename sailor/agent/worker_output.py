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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from sailor.agent.stream_lines import lines
from sailor.agent.worker_view import WorkerView
from sailor.coordination import TaskSet
from sailor.megatron_patch.errors import (
    fault_path,
    read_error_file,
    signal_failure_record,
    write_error_file,
)

__all__ = ["WorkerOutput"]

_log = structlog.get_logger("sailor.agent")


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
            except ValueError:
                continue
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
            if self.on_ready is not None:
                await self.on_ready(w.proc.pid)
            if self.warm_spares and self.workers and all(x.started for x in self.workers):
                self._tasks.spawn("spares", self.top_up_spares())
        elif ev == "step":
            w.started = True
            w.step = int(msg.get("step", w.step))
            loss = msg.get("loss")
            # a diverged run reports NaN or inf (JSON has neither: the status refused it)
            if isinstance(loss, int | float) and math.isfinite(loss):
                w.loss = float(loss)
            if w.timings is not None:
                w.timings.add(msg)
        elif ev == "saved":
            w.saved_step = int(msg.get("step", w.saved_step))
            if msg.get("deleted"):  # the committer's commits nobody recorded (keep_steps)
                _log.info(
                    "checkpoint_unrecorded_deleted", step=w.saved_step, deleted=msg["deleted"]
                )
        elif ev == "save_failed":  # an optional save (a periodic one): the workers train on
            w.save_failed_step = int(msg.get("step", w.save_failed_step))
            w.save_failure = str(msg.get("error", ""))[:1024]
            _log.warning(
                "worker_save_failed", rank=w.rank, step=w.save_failed_step, error=w.save_failure
            )
        elif ev == "stopped":
            if not self.in_place:
                self.expect_exit = True
        elif ev == "held":
            w.held = True
            w.held_step = int(msg.get("step", -1))
            w.broken = str(msg.get("cause", "")) if msg.get("broken") else ""
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
        code = await w.proc.wait()
        w.exit_code = code
        if w.tasks is not None:
            await w.tasks.close(timeout=2.0)
        for log in (w.out_log, w.err_log):
            if log is not None:
                log.close()
        if w in self.spares and not self.closed:
            # a spare that left on its own (its directive never came, or it failed): another
            # takes its place, unless they keep failing
            if code != 0 or not w.warm:  # warm or not: a spare that fails counts
                self._spare_failures += 1
                _log.warning("spare_exited", code=code, warm=w.warm, in_a_row=self._spare_failures)
            self._tasks.spawn("spares", self.top_up_spares())
        if w not in self.workers:  # a spare, or a worker already let go
            self.changed.set()
            return
        if code != 0 and not self.expect_exit:
            err = w.error_file or self.run_dir / f"error-{w.rank}.json"
            if read_error_file(err) is None:
                self._record_silent_death(w, code, err)
            if not self.failure:
                cause = ""
                with contextlib.suppress(OSError):
                    cause = err.read_text()[:2000]
                tail = " | ".join(w.stderr_tail[-3:])
                self.failure = cause or f"rank {w.rank} exit {code}: {tail}"
                _log.warning("worker_failed", rank=w.rank, code=code, cause=self.failure[:300])
        self.changed.set()

    def _record_silent_death(self, w: WorkerView, code: int, err: Path) -> None:
        """The error record of a worker that wrote none: the ``failed`` event it printed
        last, if any (a rank ended of a peer's failure prints it before its file write,
        which may not end on a hung mount: the record is then the peer's, not this node's),
        else one of its exit (killed by a signal)."""
        printed = _failed_event(w.stderr_tail)
        if printed is not None:
            with contextlib.suppress(OSError):
                write_error_file(err, printed, writer_gone=True)
            _log.warning("worker_failed_unrecorded", rank=w.rank, origin=printed.get("origin"))
            return
        fault = ""
        with contextlib.suppress(OSError):
            fault = fault_path(err).read_text(errors="replace")
        record = signal_failure_record(
            w.rank, code, w.step, fault, stderr_tail="\n".join(w.stderr_tail), pid=w.proc.pid
        )
        with contextlib.suppress(OSError):
            write_error_file(err, record, writer_gone=True)
        line = json.dumps({"event": "failed", **record})
        w.stderr_tail = [*w.stderr_tail[-19:], line]
        _log.warning("worker_killed", rank=w.rank, signal=record["signal"], step=w.step)


def _failed_event(tail: list[str]) -> dict[str, Any] | None:
    """The last ``{"event": "failed", ...}`` line of a worker's stderr, as a record."""
    for line in reversed(tail):
        if '"failed"' not in line:
            continue
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("event") == "failed":
            return {k: v for k, v in data.items() if k != "event"}
    return None
