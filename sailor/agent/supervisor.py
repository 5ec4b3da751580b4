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
(:mod:`step_timings`) for the status record. On abort or deadline the workers' process groups
get SIGTERM, then SIGKILL after ``kill_grace_s``; then the supervisor waits until every
process of those groups is gone, at most ``teardown_timeout_s`` (a rank in the GPU driver's
teardown outlives SIGKILL for tens of seconds and holds its GPU meanwhile: :mod:`teardown`),
and no worker or spare starts meanwhile. One still there then is reported as the failure
(:func:`~sailor.megatron_patch.errors.outlived_kill_record`, ``retry=False``) and this node
starts no rank until it is gone: it is probed again at each launch and abort and every
``recheck_s``, and once it is gone the failure is withdrawn and the spares come back. The
groups killed and not yet found gone are kept in ``killed.json`` in the run directory, so
that a restarted agent (``restore_killed``) does not start ranks on a GPU its previous
incarnation's rank still holds. The first abnormal exit's cause (error file, else the
stderr tail) is kept for the agent to report. A worker that dies
without writing its error file (killed by a signal: NCCL's watchdog aborts a rank from a C++
thread) gets one written here, with the signal, the last step it reported and the Python
stacks its ``faulthandler`` left (:func:`~sailor.megatron_patch.errors.signal_failure_record`).
A node with a CPU quota sets ``exec_prefix`` (``cpu_quota.CpuQuota.exec_prefix``): each worker
is started through it and joins the node's cgroup before its own code runs; the prefix ends
in an ``exec``, so the worker keeps the pid the supervisor signals and waits for. Or the
quota applies from the worker's ``ready`` report on (``on_ready`` moves its pid in), leaving
its start-up unthrottled.

In-place reconfiguration (``Launch.in_place``, docs/runtime.md#in-place-reconfiguration):
workers are started with ``--in-place`` and, instead of exiting at the stop step (or when
their world breaks: a peer died), print ``held`` and wait. An in-place Launch hands each of
this node's ranks to a held worker, else to a warm spare (``--warm``: a process started ahead
of need, torch imported, nothing built), else to a new process, by writing a *directive*
``{"relayout": {"generation", "argv"}}`` into the control file the worker polls: ``argv`` is
the options a new process would have been started with for that rank. Workers left over
are let go (SIGTERM, SIGKILL after the grace period) after the launch, in the background:
the launch's ack does not wait for them, and one that outlives SIGKILL holds up the next
launch, not this one. ``abort(hold=True)`` asks the running workers to leave their world and
hold (SIGUSR1: a rank blocked on a peer that failed leaves its wait at once) and kills those
that do not within the grace period. ``warm_spares`` processes are kept ready for the next
in-place launch (started after a generation's workers are all up, so that their start-up
stays out of a reconfiguration's critical path).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from sailor.agent.rank_log import RankLog
from sailor.agent.step_timings import StepWindow
from sailor.agent.stream_lines import lines
from sailor.agent.teardown import (
    GONE_STATES,
    Teardown,
    boot_id,
    boot_ticks,
    group_members,
    teardown_verdict,
)
from sailor.coordination import TaskSet
from sailor.megatron_patch.errors import (
    fault_path,
    outlived_kill_record,
    read_error_file,
    signal_failure_record,
    write_error_file,
)
from sailor.megatron_patch.parent_death import PARENT_ENV
from sailor.schemas.commands import Launch
from sailor.schemas.device_kind import is_cpu_type
from sailor.schemas.online_calibration import RankTimings
from sailor.schemas.plan import Plan
from sailor.schemas.training import TrainingConfig

__all__ = [
    "DEFAULT_WORKER_ARGV",
    "KILLED_FILE",
    "TEARDOWN_TIMEOUT_S",
    "TOY_TRAINER_ARGV",
    "Supervisor",
    "SupervisorClosedError",
    "WorkerTeardownError",
    "WorkerView",
    "worker_options",
]

_log = structlog.get_logger("sailor.agent")


SPARE_FAILURES = 3
"""Spares in a row that fail to get warm before an agent stops starting them."""


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

KILLED_FILE = "killed.json"
"""In the run directory: the process groups SIGKILLed and not yet found gone, for a
restarted agent (:meth:`Supervisor.restore_killed`)."""


class SupervisorClosedError(RuntimeError):
    """A launch or a spare asked to start a worker after :meth:`Supervisor.close`."""


class WorkerTeardownError(RuntimeError):
    """A launch or a spare asked to start a worker while a killed worker's process outlived
    the teardown bound and is still there (the message is the failure record, JSON)."""


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


def worker_options(argv: tuple[str, ...]) -> list[str]:
    """The options of a worker's command line: from its first ``--`` argument on (what a
    held worker re-parses; the program part, e.g. ``python -m sailor.training_process``, is
    the process it already is)."""
    for i, a in enumerate(argv):
        if a.startswith("--"):
            return list(argv[i:])
    return []


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
    control: Path | None = None
    """The control file the worker polls now (a held worker gets its directive there)."""
    error_file: Path | None = None
    generation: int = -1
    held: bool = False
    """Alive and out of any world, waiting for a directive (``--in-place``)."""
    held_step: int = -1
    broken: str = ""
    """Why its world broke, if it holds after a failure ('' after a clean stop)."""
    warm: bool = False
    """A spare that reported it is ready for a directive."""
    gpu: int = -1
    """The node-local GPU of its rank in the plan it last got (-1: a CPU plan, a spare)."""
    tasks: TaskSet | None = None
    out_log: RankLog | None = None
    """Every line of its stdout (NCCL's diagnostics among them), capped (``rank_log``)."""
    err_log: RankLog | None = None


@dataclass
class _Killed:
    """A killed worker's process group, SIGKILLed and not yet found gone."""

    pgid: int
    rank: int
    step: int
    born_by: int
    """Its members had started by then (the SIGKILL, in ``teardown.boot_ticks``): one
    started later is another session's that got the id once ours had gone."""
    killed_at: float
    """Wall-clock time of the SIGKILL (a restarted agent's record counts from it)."""
    proc: asyncio.subprocess.Process | None = None
    """The worker, there until reaped (None: a previous agent's)."""
    processes: tuple[tuple[int, str], ...] = ()
    """``(pid, state)`` of its members still there at the verdict."""
    seconds: float = 0.0
    """How long after the SIGKILL they were still there."""

    def saved(self) -> dict[str, Any]:
        return {
            "pgid": self.pgid,
            "rank": self.rank,
            "step": self.step,
            "born_by": self.born_by,
            "killed_at": self.killed_at,
        }


_spare_ids = itertools.count()


def _gpu_of(plan: Plan, rank: int) -> int:
    """``rank``'s node-local GPU under ``plan`` (-1 on a CPU kind: no GPU to keep)."""
    pi, si, _ = plan.ranks()[rank]
    if is_cpu_type(plan.pipelines[pi].stages[si].replica.gpu_type):
        return -1
    return plan.local_gpu(rank)


def _match_held(
    held: list[WorkerView], ranks: list[int], gpu_of: dict[int, int]
) -> dict[int, WorkerView]:
    """Which held worker takes which rank: one on the rank's GPU with the same rank, then
    one on its GPU, then one with its rank, then any (``held`` in preference order; ranks
    in order); ranks left over go to spares or new processes."""
    free = list(held)
    out: dict[int, WorkerView] = {}
    passes: tuple[Callable[[WorkerView, int], bool], ...] = (
        lambda w, r: gpu_of[r] >= 0 and w.gpu == gpu_of[r] and w.rank == r,
        lambda w, r: gpu_of[r] >= 0 and w.gpu == gpu_of[r],
        lambda w, r: w.rank == r,
        lambda w, r: True,
    )
    for ok in passes:
        for r in ranks:
            if r in out:
                continue
            w = next((w for w in free if ok(w, r)), None)
            if w is not None:
                out[r] = w
                free.remove(w)
    return out


class Supervisor:
    """Workers of the current generation on this node (and its warm spares)."""

    def __init__(
        self,
        run_dir: Path,
        worker_argv: tuple[str, ...] = DEFAULT_WORKER_ARGV,
        exec_prefix: tuple[str, ...] = (),
        warm_spares: int = 0,
        teardown_timeout_s: float = TEARDOWN_TIMEOUT_S,
    ) -> None:
        self.run_dir = run_dir
        self.worker_argv = worker_argv
        self.exec_prefix = exec_prefix
        """Put before every worker's argv (a CPU quota's cgroup join); () for none."""
        self.on_ready: Callable[[int], Awaitable[None]] | None = None
        """Called with a worker's pid when it reports ready to train (a CPU quota that
        applies from then on: ``AgentConfig.cpu_quota_from='ready'``); None for nothing."""
        self.on_handover: Callable[[], Awaitable[None]] | None = None
        """Called before held workers or spares are handed ranks (an in-place relayout:
        a quota that applies from ``ready`` on is lifted until they report ready again)."""
        self.warm_spares = warm_spares
        """Spare worker processes kept ready for in-place launches."""
        self.kill_grace_s = 3.0
        self.teardown_timeout_s = teardown_timeout_s
        """After SIGKILL, how long killed workers' processes may take to go (``_kill``)."""
        self.recheck_s = _RECHECK_S
        """How often processes that outlived the teardown bound are probed again."""
        self.probe: Callable[[list[int], Mapping[int, int]], dict[int, dict[int, str]]] = (
            group_members
        )
        """Which of the given process groups still have members (started by the given
        time, if one is given), with their states: ``teardown.group_members`` (tests stand
        in a process that outlives SIGKILL: none can on a machine without a GPU)."""
        self._killing = 0
        """Kills under way: while any is, no worker starts (``_after_teardown``)."""
        self._killed = asyncio.Event()
        self._killed.set()
        self._sigkilled: dict[int, _Killed] = {}
        """Process groups SIGKILLed and not yet found gone, by pgid (in ``KILLED_FILE``)."""
        self._lingering: dict[int, _Killed] = {}
        """Those of them past the teardown bound: no worker starts while one is there."""
        self._stuck = ""
        """The failure record (JSON) of ``_lingering`` ('' if none). It is the failure once
        reported (at once, but for held workers let go after an in-place launch: at the
        next launch or abort)."""
        self._rechecking: asyncio.Task[Any] | None = None
        self._leftovers: list[WorkerView] = []
        """Held workers an in-place launch had no rank for, being killed in the background."""
        self.generation = -1
        self.plan_id = ""
        self.start_step = -1
        self.workers: list[WorkerView] = []
        self.spares: list[WorkerView] = []
        self.closed = False
        """Closed (the agent is going away): no worker or spare starts any more."""
        self._launching: list[WorkerView] = []
        self.failure = ""
        self.expect_exit = False
        self.in_place = False
        """The current generation's workers were started able to hold."""
        self.changed = asyncio.Event()
        self._tasks = TaskSet("supervisor")
        self._topping_up = asyncio.Lock()  # one top-up at a time: never more than warm_spares
        self._spare_failures = 0
        """Spares that failed (exited before they were warm, or with an error) since one was
        last handed a rank: at :data:`SPARE_FAILURES` no more are started, and none is
        wanted (``spares_wanted``)."""
        self._control_state: dict[str, object] = {}

    @property
    def state(self) -> str:
        if self.failure:
            return "failed"
        if not self.workers:
            return "idle"
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
        """Why the held workers' world broke ('' if none did)."""
        return next((w.broken for w in self.workers if w.held and w.broken), "")

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

    def _gen_files(
        self, cmd: Launch, training: TrainingConfig | None
    ) -> tuple[Path, Path, tuple[str, ...]]:
        """The generation's directory with its plan (and training config) written, its
        control file, and the options every worker gets beyond the template."""
        assert cmd.plan is not None
        gen_dir = self.run_dir / f"gen-{cmd.generation:05d}"
        gen_dir.mkdir(parents=True, exist_ok=True)
        plan_path = gen_dir / "plan.json"
        plan_path.write_text(cmd.plan.model_dump_json())
        extra: tuple[str, ...] = ()
        if training is not None:
            train_path = gen_dir / "training.json"
            train_path.write_text(training.model_dump_json(indent=1))
            extra = ("--train-config", str(train_path))
        if cmd.in_place:
            extra = (*extra, "--in-place")
        return gen_dir, plan_path, extra

    def _argv(
        self, cmd: Launch, rank: int, gen_dir: Path, plan_path: Path, extra: tuple[str, ...]
    ) -> tuple[str, ...]:
        subst = {
            "plan": str(plan_path),
            "rank": str(rank),
            "world_size": str(cmd.world_size),
            "master": cmd.master,
            "control": str(_control_file(gen_dir, rank)),
            "load_dir": cmd.checkpoint,
            "load_step": str(cmd.load_step),
            "error_file": str(gen_dir / f"error-{rank}.json"),
            "run_dir": str(gen_dir),
        }
        return (*(a.format(**subst) for a in self.worker_argv), *extra)

    async def launch(self, cmd: Launch, training: TrainingConfig | None = None) -> None:
        """Start this node's ranks of ``cmd.plan`` (the agent resolves a plan reference first),
        with ``training`` (resolved from ``cmd.training_sha256``) if the job has one. In
        place: hand them to held workers and warm spares first."""
        if cmd.plan is None:
            raise ValueError(f"launch {cmd.command_id}: plan {cmd.plan_id} not resolved")
        if self.closed:
            raise SupervisorClosedError(f"launch {cmd.command_id}: the supervisor is closed")
        if cmd.in_place:
            # running (not held) workers cannot take a directive: the controller asks them
            # to hold first; any left over are killed
            await self._kill([w for w in self.workers if not w.held])
            reusable = [w for w in self.workers if w.held and w.exit_code is None]
        else:
            await self.abort()
            reusable = []
        try:
            await self._after_teardown()  # no rank starts on a GPU a killed rank still holds
        except WorkerTeardownError:
            self.failure = self._stuck  # refused: it is this node's failure now
            self.changed.set()
            raise
        gen_dir, plan_path, extra = self._gen_files(cmd, training)
        self._control_state = {}
        self.generation, self.plan_id, self.failure = cmd.generation, cmd.plan_id, ""
        self.start_step = cmd.load_step
        self.expect_exit = False
        self.in_place = cmd.in_place
        gpu_of = {r: _gpu_of(cmd.plan, r) for r in cmd.ranks}
        # A held worker keeps its GPU where it can (its CUDA context and shards live there:
        # a worker moved to another GPU keeps a context on both), then its rank (it holds
        # those layers), then any.
        reusable.sort(key=lambda w: (w.rank not in cmd.ranks, w.rank))
        matched = _match_held(reusable, sorted(cmd.ranks), gpu_of)
        # Held workers this layout has no rank for leave the generation now: asked to go,
        # their end is no failure of this one (they are killed once it is launched)
        leftovers = [w for w in reusable if w not in matched.values()]
        self.workers = [w for w in self.workers if w not in leftovers]
        self._leftovers.extend(leftovers)
        # A spare still starting takes its directive too (it reads it once warm): sooner
        # than a new process, which would also compete with it for the cores.
        spares = sorted((w for w in self.spares if w.exit_code is None), key=lambda w: not w.warm)
        if (reusable or spares) and self.on_handover is not None:
            await self.on_handover()
            spares = [w for w in spares if w.exit_code is None]  # one may have left meanwhile
        assigned: list[WorkerView] = []
        self._launching = assigned  # what close() must kill if it comes mid-launch
        fresh = reused = 0
        try:
            for rank in sorted(cmd.ranks):
                _write_atomic(_control_file(gen_dir, rank), "{}")
                argv = self._argv(cmd, rank, gen_dir, plan_path, extra)
                w = matched.get(rank) or (spares[0] if spares else None)
                if w is not None:
                    (reusable if w in reusable else spares).remove(w)
                    if w in self.spares:
                        self.spares.remove(w)
                        self._spare_failures = 0  # a spare that served: they work here
                    self._hand_over(w, rank, cmd.generation, argv, gen_dir)
                    reused += 1
                else:
                    w = await self._spawn(rank, argv, gen_dir, cmd.generation)
                    fresh += 1
                w.gpu = gpu_of[rank]
                assigned.append(w)
        except Exception:
            # half a generation must not run (a full disk, a failed fork): the ranks it
            # started are killed, not left behind out of the list (each retry of the
            # command started another set); the caller refuses the command with the cause
            try:
                await self._kill([*assigned, *reusable])
            finally:
                self._leftovers = [w for w in self._leftovers if w not in leftovers]
            self.workers, self._launching = [], []
            raise
        self.workers, self._launching = assigned, []
        if leftovers and not self.closed:  # after the ack: the new ranks need not wait for them
            self._tasks.spawn("let-go", self._let_go(leftovers))
        if self.closed:  # close() came mid-launch and killed what it had started
            raise SupervisorClosedError(f"launch {cmd.command_id}: the supervisor closed")
        path = f"in_place reused={reused} new={fresh}" if cmd.in_place else "restart"
        _log.info("launched", generation=cmd.generation, path=path)
        self.changed.set()

    def _hand_over(
        self, w: WorkerView, rank: int, generation: int, argv: tuple[str, ...], gen_dir: Path
    ) -> None:
        """Give a held worker or a spare the rank: the directive in the file it polls."""
        assert w.control is not None
        directive = {"relayout": {"generation": generation, "argv": worker_options(argv)}}
        _write_atomic(w.control, json.dumps(directive))
        w.rank, w.argv, w.generation = rank, argv, generation
        w.control = _control_file(gen_dir, rank)
        w.error_file = gen_dir / f"error-{rank}.json"
        w.held = w.warm = w.started = False
        w.broken, w.held_step = "", -1
        w.step, w.saved_step, w.loss = -1, -1, None
        w.timings = StepWindow(rank)

    async def _spawn(
        self, rank: int, argv: tuple[str, ...], gen_dir: Path, generation: int
    ) -> WorkerView:
        await self._after_teardown()
        if self.closed:
            raise SupervisorClosedError("the supervisor is closed: no worker starts")
        proc = await asyncio.create_subprocess_exec(
            *self.exec_prefix,
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            # the worker dies with this agent (megatron_patch.parent_death)
            env={**os.environ, PARENT_ENV: str(os.getpid())},
        )
        if self.closed:  # closed while it started: close() cannot have seen it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise SupervisorClosedError("the supervisor closed while a worker started")
        name = f"rank-{rank}" if rank >= 0 else "spare"
        view = WorkerView(
            rank=rank,
            proc=proc,
            argv=argv,
            timings=StepWindow(rank),
            control=_control_file(gen_dir, rank),
            error_file=gen_dir / f"error-{rank}.json",
            generation=generation,
            tasks=TaskSet(f"worker-{proc.pid}"),
            out_log=RankLog(gen_dir / f"{name}-{proc.pid}.stdout.log"),
            err_log=RankLog(gen_dir / f"{name}-{proc.pid}.stderr.log"),
        )
        assert view.tasks is not None
        view.tasks.spawn("out", self._read_stdout(view))
        view.tasks.spawn("err", self._read_stderr(view))
        self._tasks.spawn(f"wait-{proc.pid}", self._wait(view))
        return view

    async def top_up_spares(self) -> None:
        """Start warm spares until ``warm_spares`` are alive (a spare's options are the
        template's with placeholders and ``--warm --in-place``: its real ones come with
        the directive that gives it a rank)."""
        async with self._topping_up:
            # closing, or a killed worker's process still holds a GPU: no spare is wanted
            with contextlib.suppress(SupervisorClosedError, WorkerTeardownError):
                await self._top_up()

    async def _top_up(self) -> None:
        self.spares = [w for w in self.spares if w.exit_code is None]
        while len(self.spares) < self.spares_wanted and not self.closed:
            d = self.run_dir / "spares" / f"spare-{next(_spare_ids):04d}-{os.getpid()}"
            d.mkdir(parents=True, exist_ok=True)
            _write_atomic(d / "control.json", "{}")
            subst = {
                "plan": "",
                "rank": "-1",
                "world_size": "1",
                "master": "",
                "control": str(d / "control.json"),
                "load_dir": "",
                "load_step": "-1",
                "error_file": str(d / "error.json"),
                "run_dir": str(d),
            }
            argv = (*(a.format(**subst) for a in self.worker_argv), "--warm", "--in-place")
            w = await self._spawn(-1, argv, d, -1)
            w.control = d / "control.json"
            self.spares.append(w)

    def _write_control(self) -> None:
        """The stop/save requests, into every worker's control file (one per rank: a held
        worker's directive names that rank alone)."""
        data = json.dumps(self._control_state)
        for w in self.workers:
            if w.control is not None and w.exit_code is None:
                _write_atomic(w.control, data)

    def stop_at(self, step: int) -> None:
        self._control_state["stop_at_step"] = step
        self._write_control()

    def save_at(self, step: int, directory: str, prune_below: int = -1) -> None:
        """Save ``step`` under ``directory``; once it commits, delete the checkpoints below
        ``prune_below`` there (-1: none)."""
        self._control_state["save_step"] = step
        self._control_state["save_dir"] = directory
        self._control_state["prune_below"] = prune_below
        self._write_control()

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

    async def _kill(self, workers: list[WorkerView], report: bool = True) -> None:
        """SIGTERM ``workers``' process groups; SIGKILL the groups not gone after the grace
        period; then wait until every process of them is gone, at most ``teardown_timeout_s``
        (``kill_grace_s`` once closed: nothing starts after a close, and the agent's stop
        must stay short). No worker starts meanwhile. A process still there then is
        ``_stuck`` (the failure at once if ``report``), and no worker starts until it is
        gone.

        Only the groups of workers not yet reaped are signalled: the pid of one reaped
        earlier may belong to another process by now."""
        alive = [w for w in workers if w.exit_code is None]
        if not alive:
            return
        self._killing += 1
        self._killed.clear()
        try:
            for w in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(w.proc.pid, signal.SIGTERM)
            left, _ = await self._until_gone(alive, self.kill_grace_s)
            if not left:
                return
            born_by, now = boot_ticks(), time.time()
            for w in alive:
                if w.proc.pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(w.proc.pid, signal.SIGKILL)
                    self._sigkilled[w.proc.pid] = _Killed(
                        w.proc.pid, w.rank, w.step, born_by, now, proc=w.proc
                    )
            self._save_killed()  # a restarted agent must know them (restore_killed)
            killed = [w for w in alive if w.proc.pid in left]
            bound = self.kill_grace_s if self.closed else self.teardown_timeout_s
            left, elapsed = await self._until_gone(
                killed, bound, born_by={w.proc.pid: born_by for w in killed}, after_kill=True
            )
            for w in killed:
                if w.proc.pid not in left:
                    self._sigkilled.pop(w.proc.pid, None)
            if left:
                self._report_stuck(left, elapsed, report)
            self._save_killed()
        finally:
            self._killing -= 1
            if not self._killing:
                self._killed.set()

    async def _until_gone(
        self,
        workers: list[WorkerView],
        bound_s: float,
        born_by: Mapping[int, int] | None = None,
        after_kill: bool = False,
    ) -> tuple[dict[int, dict[int, str]], float]:
        """Wait until every process of ``workers``' groups is gone, at most ``bound_s``:
        the groups with a live member still (``{pgid: {pid: state}}``, {} if none) and the
        seconds waited. A worker itself is there until reaped (a process whose main thread
        ended reads ``Z`` while another thread runs on; it cannot be reaped then). Wakes
        when the workers have exited, else after 10 ms, doubling up to ``_PROBE_S``: a
        worker that goes at once (its children with it) costs no sleep. ``born_by``: the
        groups' members started later are not theirs (``teardown.group_members``).
        ``after_kill``: log the processes outliving SIGKILL, and their end."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        waits = [asyncio.ensure_future(w.proc.wait()) for w in workers if w.proc.returncode is None]
        rank_of = {w.proc.pid: w.rank for w in workers}
        outlived: dict[int, int] = {}  # pid -> rank, of those logged as outliving SIGKILL
        next_log = self.kill_grace_s
        delay = 0.01
        try:
            while True:
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
                for w in workers:
                    if w.proc.returncode is None and w.proc.pid not in there:
                        # not reaped: a zombie leader (its last thread is ending) or a
                        # member the probe missed; there all the same, state unknown
                        there[w.proc.pid] = (w.proc.pid, "")
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

    def _report_stuck(
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
        """``_stuck`` from ``_lingering`` again; the failure too if it was the old one (or
        if ``report``)."""
        old = self._stuck
        procs = [
            (pid, k.rank, state) for k in self._lingering.values() for pid, state in k.processes
        ]
        procs.sort(key=lambda p: (p[2] != "D", p[0] not in self._lingering, p[0]))
        self._stuck = ""
        if procs:
            seconds = max(k.seconds for k in self._lingering.values())
            step = max(k.step for k in self._lingering.values())
            self._stuck = json.dumps(outlived_kill_record(procs, seconds, step))
        if report or (old and self.failure == old):
            self.failure = self._stuck
        self.changed.set()

    async def _recheck(self, top_up: bool = True) -> None:
        """Probe the lingering groups again and forget those gone. Once none is left, the
        failure they were is withdrawn and (``top_up``, unless a generation is starting:
        its start tops them up) the spares come back."""
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
        self._save_killed()
        self._restate()
        # a generation still starting tops them up once it has (``_on_line``)
        wanted = top_up and self.warm_spares and not self.closed
        if not self._lingering and wanted and all(w.started for w in self.workers):
            self._tasks.spawn("spares", self.top_up_spares())

    async def _recheck_until_gone(self) -> None:
        while self._lingering and not self.closed:
            await asyncio.sleep(self.recheck_s)
            await self._recheck()

    def _save_killed(self) -> None:
        """``_sigkilled`` into ``KILLED_FILE`` (atomically; removed when empty). Not synced
        to disk: a power loss is a reboot, which ends those processes anyway."""
        path = self.run_dir / KILLED_FILE
        try:
            if self._sigkilled:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                groups = [k.saved() for k in self._sigkilled.values()]
                _write_atomic(path, json.dumps({"boot_id": boot_id(), "groups": groups}))
            else:
                path.unlink(missing_ok=True)
        except OSError as exc:  # a restarted agent would not know them: say so
            _log.warning("killed_groups_not_saved", path=str(path), error=str(exc))

    async def restore_killed(self) -> None:
        """At an agent's start: the process groups its previous incarnation SIGKILLed and
        did not see go (``KILLED_FILE``). Those still there (members started by their
        SIGKILL, in this boot) linger: the failure is theirs and no worker starts until
        they are gone, as if this agent had killed them."""
        path = self.run_dir / KILLED_FILE
        try:
            data = json.loads(path.read_text())
            saved_boot, this_boot = str(data.get("boot_id", "")), boot_id()
            same_boot = not saved_boot or not this_boot or saved_boot == this_boot
            saved = [
                _Killed(
                    int(g["pgid"]),
                    int(g["rank"]),
                    int(g["step"]),
                    int(g["born_by"]),
                    float(g["killed_at"]),
                )
                for g in data["groups"]
            ]
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            _log.warning("killed_groups_unreadable", path=str(path), error=repr(exc)[:300])
            return
        if same_boot and saved:
            groups = await self._probe([k.pgid for k in saved], {k.pgid: k.born_by for k in saved})
            there = {
                g: {p: s for p, s in members.items() if s not in GONE_STATES}
                for g, members in groups.items()
            }
            now = time.time()
            for k in saved:
                if there.get(k.pgid):
                    self._sigkilled[k.pgid] = k
                    k.seconds = max(0.0, now - k.killed_at)
            if self._sigkilled:
                _log.warning("killed_groups_restored", pgids=sorted(self._sigkilled))
                self._report_stuck({g: there[g] for g in self._sigkilled}, 0.0)
        self._save_killed()

    async def _let_go(self, leftovers: list[WorkerView]) -> None:
        """Kill held workers an in-place launch had no rank for (after its ack). One that
        outlives the bound holds up the next launch and is reported then: the generation
        just launched runs on other GPUs."""
        try:
            await self._kill(leftovers, report=False)
        finally:
            self._leftovers = [w for w in self._leftovers if w not in leftovers]

    async def _after_teardown(self) -> None:
        """Return once no kill is under way and no killed worker's process holds on
        (probed again here: it may have gone since); else raise WorkerTeardownError."""
        async with asyncio.timeout(self.teardown_timeout_s + 2 * self.kill_grace_s + 10):
            await self._killed.wait()  # every kill ends within its bounds
        await self._recheck(top_up=False)  # a worker is about to start: it tops them up
        if self._stuck:
            raise WorkerTeardownError(self._stuck)

    async def abort(self, hold: bool = False) -> None:
        """Kill every worker (SIGTERM, SIGKILL after the grace period, then the wait until
        their processes are gone: ``_kill``) and forget them. With
        ``hold`` (in-place workers only): ask them to leave their world and hold instead
        (SIGUSR1), killing only those that do not hold within the grace period. Processes
        that outlived an earlier kill are probed again: the failure is theirs while they
        are there, and goes with them."""
        if hold and self.in_place and self.workers:
            self.failure = self._stuck
            waiting = [w for w in self.workers if w.exit_code is None and not w.held]
            for w in waiting:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGUSR1)
            end = asyncio.get_running_loop().time() + self.kill_grace_s
            while any(not w.held and w.exit_code is None for w in waiting):
                left = end - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                self.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), left)
            self.expect_exit = True
            await self._kill([w for w in self.workers if not w.held])
            self.workers = [w for w in self.workers if w.held and w.exit_code is None]
            for w in self.workers:  # asked to: the controller knows why (no failure report)
                w.broken = ""
            await self._recheck()
            self.failure = self._stuck
            self.changed.set()
            return
        self.expect_exit = True
        await self._kill(self.workers)
        self.workers = []
        await self._recheck()
        self.failure = self._stuck  # a process that outlived SIGKILL stays reported
        self.changed.set()

    async def close(self) -> None:
        """Kill the workers and the spares; end every task (the agent is shutting down). A
        launch still going on starts no more workers, and those it started are killed.
        Processes that outlive it stay in ``KILLED_FILE`` for the next agent."""
        self.closed = True
        await self._kill(self._launching)
        await self.abort()
        await self._kill(self.spares)
        self.spares = []
        await self._kill(self._leftovers)
        await self._tasks.close(timeout=2.0)


def _control_file(gen_dir: Path, rank: int) -> Path:
    """A rank's control file in its generation's directory."""
    return gen_dir / f"control-{rank}.json"


def _write_atomic(path: Path, data: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(data)
    tmp.replace(path)
