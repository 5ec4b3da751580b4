"""Supervises the training workers of one node: launch, progress, stop, kill, first failure.

Workers are separate processes started with explicit ranks and rendezvous (no torchrun):
``worker_argv`` is a template whose ``{plan} {rank} {world_size} {master} {control}
{load_dir} {load_step} {error_file} {run_dir}`` are filled per rank. A launch with a training
config writes it to ``{run_dir}/training.json`` and appends ``--train-config`` and that file to
every worker's argv, whatever the template (the real worker and the toy trainer both take it;
argparse's last occurrence wins, so the controller's config overrides one a template names).
Progress arrives as JSON lines on stdout (see ``sailor.megatron_patch.rank_main`` and
``toy_trainer``); stop and save requests go through a control file the workers re-read at
every iteration boundary, written atomically. The timings of each rank's last steps are kept
(:mod:`step_timings`) for the status record. On abort or deadline the workers get SIGTERM,
then SIGKILL after ``kill_grace_s``. The first abnormal exit's cause (error file, else the
stderr tail) is kept for the agent to report. A worker that dies
without writing its error file (killed by a signal: NCCL's watchdog aborts a rank from a C++
thread) gets one written here, with the signal, the last step it reported and the Python
stacks its ``faulthandler`` left (:func:`~sailor.megatron_patch.errors.signal_failure_record`).
A node with a CPU quota sets ``exec_prefix`` (``cpu_quota.CpuQuota.exec_prefix``): each worker
is started through it and joins the node's cgroup before its own code runs; the prefix ends
in an ``exec``, so the worker keeps the pid the supervisor signals and waits for. Or the
quota applies from the worker's ``ready`` report on (``on_ready`` moves its pid in), leaving
its start-up unthrottled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from sailor.agent.step_timings import StepWindow
from sailor.coordination import TaskSet
from sailor.megatron_patch.errors import (
    fault_path,
    read_error_file,
    signal_failure_record,
    write_error_file,
)
from sailor.schemas.commands import Launch
from sailor.schemas.online_calibration import RankTimings
from sailor.schemas.training import TrainingConfig

__all__ = ["DEFAULT_WORKER_ARGV", "TOY_TRAINER_ARGV", "Supervisor", "WorkerView"]

_log = structlog.get_logger("sailor.agent")

DEFAULT_WORKER_ARGV: tuple[str, ...] = (
    sys.executable,
    "-m",
    "sailor.training_process",
    "--plan",
    "{plan}",
    "--rank",
    "{rank}",
    "--world-size",
    "{world_size}",
    "--master",
    "{master}",
    "--control",
    "{control}",
    "--ckpt-dir",
    "{load_dir}",
    "--load-step",
    "{load_step}",
    "--error-file",
    "{error_file}",
    "--progress",
    "{run_dir}/progress-{rank}.jsonl",
)
"""The real training worker (``sailor.training_process``: sailor.megatron_patch with layer-keyed
checkpoints). ``TOY_TRAINER_ARGV`` is the torch-free stand-in for protocol tests."""

TOY_TRAINER_ARGV: tuple[str, ...] = (
    sys.executable,
    "-m",
    "sailor.agent.toy_trainer",
    "--plan",
    "{plan}",
    "--rank",
    "{rank}",
    "--world-size",
    "{world_size}",
    "--master",
    "{master}",
    "--control",
    "{control}",
    "--load-dir",
    "{load_dir}",
    "--load-step",
    "{load_step}",
    "--error-file",
    "{error_file}",
)


@dataclass
class WorkerView:
    rank: int
    proc: asyncio.subprocess.Process
    argv: tuple[str, ...] = ()
    step: int = -1
    loss: float | None = None
    saved_step: int = -1
    started: bool = False
    exit_code: int | None = None
    stderr_tail: list[str] = field(default_factory=list)
    timings: StepWindow | None = None


class Supervisor:
    """Workers of the current generation on this node."""

    def __init__(
        self,
        run_dir: Path,
        worker_argv: tuple[str, ...] = DEFAULT_WORKER_ARGV,
        exec_prefix: tuple[str, ...] = (),
    ) -> None:
        self.run_dir = run_dir
        self.worker_argv = worker_argv
        self.exec_prefix = exec_prefix
        """Put before every worker's argv (a CPU quota's cgroup join); () for none."""
        self.on_ready: Callable[[int], Awaitable[None]] | None = None
        """Called with a worker's pid when it reports ready to train (a CPU quota that
        applies from then on: ``AgentConfig.cpu_quota_from='ready'``); None for nothing."""
        self.kill_grace_s = 3.0
        self.generation = -1
        self.plan_id = ""
        self.start_step = -1
        self.workers: list[WorkerView] = []
        self.failure = ""
        self.expect_exit = False
        self.changed = asyncio.Event()
        self._tasks = TaskSet("supervisor")
        self._control: Path | None = None
        self._control_state: dict[str, object] = {}

    @property
    def state(self) -> str:
        if self.failure:
            return "failed"
        if not self.workers:
            return "idle"
        if all(w.exit_code is not None for w in self.workers):
            return "stopped"
        return "running" if all(w.started for w in self.workers) else "starting"

    @property
    def step(self) -> int:
        return min((w.step for w in self.workers), default=-1)

    @property
    def saved_step(self) -> int:
        return min((w.saved_step for w in self.workers), default=-1)

    @property
    def loss(self) -> float | None:
        return self.workers[0].loss if self.workers else None

    def pids(self) -> list[int]:
        """Process ids of the workers still running."""
        return [w.proc.pid for w in self.workers if w.exit_code is None]

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

    async def launch(self, cmd: Launch, training: TrainingConfig | None = None) -> None:
        """Start this node's ranks of ``cmd.plan`` (the agent resolves a plan reference first),
        with ``training`` (resolved from ``cmd.training_sha256``) if the job has one."""
        if cmd.plan is None:
            raise ValueError(f"launch {cmd.command_id}: plan {cmd.plan_id} not resolved")
        await self.abort()
        gen_dir = self.run_dir / f"gen-{cmd.generation:05d}"
        gen_dir.mkdir(parents=True, exist_ok=True)
        plan_path = gen_dir / "plan.json"
        plan_path.write_text(cmd.plan.model_dump_json())
        extra: tuple[str, ...] = ()
        if training is not None:
            train_path = gen_dir / "training.json"
            train_path.write_text(training.model_dump_json(indent=1))
            extra = ("--train-config", str(train_path))
        self._control = gen_dir / "control.json"
        self._control_state = {}
        self._write_control()
        self.generation, self.plan_id, self.failure = cmd.generation, cmd.plan_id, ""
        self.start_step = cmd.load_step
        self.expect_exit = False
        self.workers = []
        for rank in cmd.ranks:
            subst = {
                "plan": str(plan_path),
                "rank": str(rank),
                "world_size": str(cmd.world_size),
                "master": cmd.master,
                "control": str(self._control),
                "load_dir": cmd.checkpoint,
                "load_step": str(cmd.load_step),
                "error_file": str(gen_dir / f"error-{rank}.json"),
                "run_dir": str(gen_dir),
            }
            argv = (*(a.format(**subst) for a in self.worker_argv), *extra)
            proc = await asyncio.create_subprocess_exec(
                *self.exec_prefix,
                *argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            view = WorkerView(rank=rank, proc=proc, argv=argv, timings=StepWindow(rank))
            self.workers.append(view)
            self._tasks.spawn(f"rank-{rank}-out", self._read_stdout(view))
            self._tasks.spawn(f"rank-{rank}-err", self._read_stderr(view))
            self._tasks.spawn(f"rank-{rank}-wait", self._wait(view, gen_dir))
        self.changed.set()

    def _write_control(self) -> None:
        if self._control is None:
            return
        tmp = self._control.with_name("control.json.tmp")
        tmp.write_text(json.dumps(self._control_state))
        tmp.replace(self._control)

    def stop_at(self, step: int) -> None:
        self._control_state["stop_at_step"] = step
        self._write_control()

    def save_at(self, step: int, directory: str) -> None:
        self._control_state["save_step"] = step
        self._control_state["save_dir"] = directory
        self._write_control()

    async def _read_stdout(self, w: WorkerView) -> None:
        assert_stream = w.proc.stdout
        if assert_stream is None:
            return
        async for raw in assert_stream:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            ev = msg.get("event")
            if ev == "ready":
                w.started = True
                if self.on_ready is not None:
                    await self.on_ready(w.proc.pid)
            elif ev == "step":
                w.started = True
                w.step = int(msg.get("step", w.step))
                loss = msg.get("loss")
                w.loss = float(loss) if isinstance(loss, int | float) else w.loss
                if w.timings is not None:
                    w.timings.add(msg)
            elif ev == "saved":
                w.saved_step = int(msg.get("step", w.saved_step))
            elif ev == "stopped":
                self.expect_exit = True
            self.changed.set()

    async def _read_stderr(self, w: WorkerView) -> None:
        if w.proc.stderr is None:
            return
        async for raw in w.proc.stderr:
            w.stderr_tail = [*w.stderr_tail[-19:], raw.decode(errors="replace").rstrip()]

    async def _wait(self, w: WorkerView, gen_dir: Path) -> None:
        code = await w.proc.wait()
        w.exit_code = code
        if code != 0 and not self.expect_exit:
            err = gen_dir / f"error-{w.rank}.json"
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
        """The error record of a worker that could not write its own (killed by a signal)."""
        fault = ""
        with contextlib.suppress(OSError):
            fault = fault_path(err).read_text(errors="replace")
        record = signal_failure_record(
            w.rank, code, w.step, fault, stderr_tail="\n".join(w.stderr_tail), pid=w.proc.pid
        )
        with contextlib.suppress(OSError):
            write_error_file(err, record)
        line = json.dumps({"event": "failed", **record})
        w.stderr_tail = [*w.stderr_tail[-19:], line]
        _log.warning("worker_killed", rank=w.rank, signal=record["signal"], step=w.step)

    async def abort(self) -> None:
        """SIGTERM every worker, SIGKILL after the grace period; then forget them."""
        self.expect_exit = True
        alive = [w for w in self.workers if w.exit_code is None]
        for w in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGTERM)
        if alive:
            _done, pending = await asyncio.wait(
                [asyncio.ensure_future(w.proc.wait()) for w in alive], timeout=self.kill_grace_s
            )
            for w in alive:
                if w.exit_code is None and w.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(w.proc.pid, signal.SIGKILL)
            if pending:
                await asyncio.wait(pending, timeout=self.kill_grace_s)
        await self._tasks.close(timeout=2.0)
        self.workers = []
        self.failure = ""
        self.changed.set()
