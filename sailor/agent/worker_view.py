"""What the supervisor knows of its workers: a ``WorkerView`` per worker process (its rank,
progress, exit, held or warm state, control file, logs), and ``SupervisorStatus``, what the
generation's workers and the spares add up to for the agent's status record (state, step,
loss, held step, spares ready and wanted, per-rank step timings).

``SupervisorStatus`` is a part of :class:`sailor.agent.supervisor.Supervisor` (a mixin over its
``workers``, ``spares``, ``failure`` and spare counts). It reads them and never signals or
starts a process; its one write is ``restart_timings`` (dropping the step timings so far).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from sailor.agent.rank_log import RankLog
from sailor.agent.step_timings import StepWindow
from sailor.coordination import TaskSet
from sailor.schemas.online_calibration import RankTimings

__all__ = ["SPARE_FAILURES", "SupervisorStatus", "WorkerView"]


SPARE_FAILURES = 3
"""Spares in a row that fail to get warm before an agent stops starting them."""


@dataclass
class WorkerView:
    rank: int
    proc: asyncio.subprocess.Process
    argv: tuple[str, ...] = ()
    step: int = -1
    loss: float | None = None
    saved_step: int = -1
    save_failed_step: int = -1
    """The last step whose optional save failed (its ``save_failed`` line)."""
    save_failure: str = ""
    started: bool = False
    exit_code: int | None = None
    stderr_tail: list[str] = field(default_factory=list)
    timings: StepWindow | None = None
    control: Path | None = None
    """The control file the worker polls now (a held worker gets its directive there)."""
    error_file: Path | None = None
    generation: int = -1
    held: bool = False
    """Alive and out of any world, waiting for a directive (``--in-place``)."""
    held_step: int = -1
    broken: str = ""
    """Why its world broke, if it holds after a failure ('' after a clean stop)."""
    culprit: int = -1
    """The global rank its held line names as guilty for the break (-1: none)."""
    warm: bool = False
    """A spare that reported it is ready for a directive."""
    gpu: int = -1
    """The node-local GPU of its rank in the plan it last got (-1: a CPU plan, a spare)."""
    tasks: TaskSet | None = None
    readers: list[asyncio.Task[None]] = field(default_factory=list)
    """The tasks reading its stdout and stderr (in ``tasks``)."""
    out_log: RankLog | None = None
    """Every line of its stdout (NCCL's diagnostics among them), capped (``rank_log``)."""
    err_log: RankLog | None = None


class SupervisorStatus:
    """The status of :class:`~sailor.agent.supervisor.Supervisor`'s workers and spares."""

    workers: list[WorkerView]
    spares: list[WorkerView]
    _doomed: list[WorkerView]
    _restoring: bool
    failure: str
    generation: int
    warm_spares: int
    _spare_failures: int

    @property
    def state(self) -> str:
        if self.failure:
            return "failed"
        if not self.workers:  # a kill under way (an abort's, or one a restarted agent
            # found): its workers are not gone yet
            return "stopped" if self._doomed or self._restoring else "idle"
        alive = [w for w in self.workers if w.exit_code is None]
        if alive and all(w.held for w in alive) and len(alive) == len(self.workers):
            return "held"
        if all(w.exit_code is not None for w in self.workers):
            return "stopped"
        return "running" if all(w.started for w in self.workers) else "starting"

    def live_workers(self) -> int:
        """Workers of the current generation still running (spares aside)."""
        return sum(1 for w in self.workers if w.exit_code is None)

    @property
    def held_failure(self) -> str:
        """Why the held workers' world of this generation broke ('' if none did). Only this
        generation's: an in-place launch takes its generation number before it hands the
        held workers their new ranks, with awaits between (the hand-over hook, the run
        directory's files), and a status written meanwhile carried the new generation with
        the old world's break; the controller aborted the new generation for it."""
        return next((w.broken for w in self._held_broken()), "")

    @property
    def held_culprit(self) -> int:
        """The rank the held worker whose cause is :attr:`held_failure` names as guilty
        (-1: none)."""
        return next((w.culprit for w in self._held_broken()), -1)

    def _held_broken(self) -> list[WorkerView]:
        """The held workers of this generation whose world broke."""
        return [w for w in self.workers if w.held and w.broken and w.generation == self.generation]

    @property
    def held_step(self) -> int:
        return min((w.held_step for w in self.workers if w.held), default=-1)

    @property
    def spares_ready(self) -> int:
        return sum(1 for w in self.spares if w.warm and w.exit_code is None)

    @property
    def spares_wanted(self) -> int:
        """Spares this agent keeps: ``warm_spares``, or none once they keep failing to start
        (the controller waits for a joined node's spares; it must not wait forever)."""
        return 0 if self._spare_failures >= SPARE_FAILURES else self.warm_spares

    @property
    def step(self) -> int:
        return min((w.step for w in self.workers), default=-1)

    @property
    def saved_step(self) -> int:
        return min((w.saved_step for w in self.workers), default=-1)

    @property
    def save_failed(self) -> tuple[int, str]:
        """``(step, what failed)`` of the latest optional save its workers reported failed
        (each rank reports the save the world agreed on); ``(-1, '')``: none."""
        w = max(self.workers, key=lambda x: x.save_failed_step, default=None)
        if w is None or w.save_failed_step < 0:
            return -1, ""
        return w.save_failed_step, w.save_failure

    @property
    def loss(self) -> float | None:
        return self.workers[0].loss if self.workers else None

    def pids(self) -> list[int]:
        """Process ids of the workers (and spares) still running."""
        return [w.proc.pid for w in (*self.workers, *self.spares) if w.exit_code is None]

    def timings(self) -> tuple[RankTimings, ...]:
        """Per rank of this generation, the medians of its last steps' timings (ranks that
        reported none are left out)."""
        out = []
        for w in self.workers:
            t = w.timings.summary() if w.timings is not None else None
            if t is not None:
                out.append(t)
        return tuple(out)

    def restart_timings(self) -> None:
        """Drop the step timings so far (the node's speed changed: its quota)."""
        for w in self.workers:
            if w.timings is not None:
                w.timings.restart()
