"""Supervises the training workers of one node: launch, progress, stop, kill, first failure.

Workers are separate processes started with explicit ranks and rendezvous (no torchrun):
``worker_argv`` is a template whose ``{plan} {rank} {world_size} {master} {control}
{load_dir} {load_step} {error_file} {run_dir}`` are filled per rank. A launch with a training
config writes it to ``{run_dir}/training.json`` and appends ``--train-config`` and that file to
every worker's argv, whatever the template (the real worker and the toy trainer both take it;
argparse's last occurrence wins, so the controller's config overrides one a template names).
Progress arrives as JSON lines on stdout (see ``sailor.megatron_patch.rank_main`` and
``toy_trainer``); stop and save requests go through a control file the workers re-read at
every iteration boundary, written durably. The timings of each rank's last steps are kept
(:mod:`step_timings`) for the status record. On abort or deadline the workers' process groups
get SIGTERM, then SIGKILL after ``kill_grace_s``, and no worker or spare starts until every
process of those groups is gone (:mod:`killed_groups`: a rank in the GPU driver's teardown
outlives SIGKILL for tens of seconds and holds its GPU meanwhile). One still there past
``teardown_timeout_s`` is reported as the failure (``retry=False``) and this node starts no
rank until it is gone: it is probed again at each launch and abort and every ``recheck_s``,
and once it is gone the failure is withdrawn and the spares come back. A restarted agent
(``restore_killed``) finds the groups its previous incarnation killed and did not see go
(``killed.json`` in the run directory). ``abort(wait=False)`` returns once the signals are
sent, the kill going on in a task (its workers leave the generation at once; ``killing``
counts their groups). A worker that exits without a kill (it failed, was SIGKILLed by the
OOM killer or an operator, or ended its run) has what it left in its process group killed
the same way (``KilledGroups.sweep``). The first abnormal exit's cause (error file, else the
stderr tail) is kept for the agent to report. Every write and read in the run directory
during a run (the generation's files, control files, a failed worker's error file, the
workers' logs, ``killed.json``) runs off the event loop (:mod:`run_dir_io`,
:mod:`rank_log`): the directory may be on a mount that hangs, and the loop carries the
agent's heartbeats, status and commands. Each piece is waited ``io_wait_s`` at most; past it
the launch or the command fails with the cause, a failed worker's failure says its error
file was unreadable, and a kill signals its groups all the same, their record to follow
(``KilledGroups._term``). ``killed.json`` is read back on the loop once, at the agent's
start (``restore_killed``), before it takes commands. A worker that dies
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
The worker's command line is :mod:`worker_argv`; what the supervisor knows of each worker and
what they add up to for the status record, :mod:`worker_view`; reading their progress lines and
exits, :mod:`worker_output`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import structlog

from sailor.agent.killed_groups import (
    KILLED_FILE,
    TEARDOWN_TIMEOUT_S,
    Killable,
    KilledGroups,
    WorkerTeardownError,
)
from sailor.agent.rank_log import RankLog
from sailor.agent.run_dir_io import RUN_DIR_WAIT_S, RunDirIO
from sailor.agent.step_timings import StepWindow
from sailor.agent.worker_argv import DEFAULT_WORKER_ARGV, worker_options
from sailor.agent.worker_output import WorkerOutput
from sailor.agent.worker_view import SupervisorStatus, WorkerView
from sailor.coordination import TaskSet
from sailor.durable import write_durably
from sailor.megatron_patch.devices import worker_env
from sailor.megatron_patch.held_match import match_held
from sailor.megatron_patch.parent_death import PARENT_ENV
from sailor.megatron_patch.relayout import kept_layers
from sailor.schemas.commands import Launch, plan_digest
from sailor.schemas.device_kind import is_cpu_type
from sailor.schemas.plan import Plan
from sailor.schemas.training import TrainingConfig

__all__ = [
    "KILLED_FILE",
    "TEARDOWN_TIMEOUT_S",
    "Supervisor",
    "SupervisorClosedError",
    "WorkerTeardownError",
]

_log = structlog.get_logger("sailor.agent")


class SupervisorClosedError(RuntimeError):
    """A launch or a spare asked to start a worker after :meth:`Supervisor.close`."""


_spare_ids = itertools.count()

T = TypeVar("T")


def _gpu_of(plan: Plan, rank: int) -> int:
    """``rank``'s node-local GPU under ``plan`` (-1 on a CPU kind: no GPU to keep)."""
    pi, si, _ = plan.ranks()[rank]
    if is_cpu_type(plan.pipelines[pi].stages[si].replica.gpu_type):
        return -1
    return plan.local_gpu(rank)


def _match_held(
    held: list[WorkerView],
    ranks: list[int],
    gpu_of: dict[int, int],
    old: Plan | None = None,
    new: Plan | None = None,
) -> dict[int, WorkerView]:
    """Which held worker takes which rank (``held`` in preference order; ranks in order):
    :func:`~sailor.megatron_patch.held_match.match_held`, which the controller's in-place
    LOAD deadline uses too, by the layers each keeps (``relayout.kept_layers``) when the
    plans of its held workers (``old``) and of the launch (``new``) are known."""
    kept = None
    if old is not None and new is not None:
        old_table, new_table = old.rank_table(), new.rank_table()

        def kept(i: int, r: int) -> int:
            w = held[i].rank
            return kept_layers(old_table[w], new_table[r]) if 0 <= w < len(old_table) else 0

    picked = match_held([(w.gpu, w.rank) for w in held], ranks, gpu_of, kept)
    return {r: held[i] for r, i in picked.items()}


def launch_key(cmd: Launch) -> tuple[object, ...]:
    """What makes two Launches one launch: what its workers are started with, not its
    command id, epoch or deadline (a leader that adopts a LAUNCH after a failover sends it
    again under ids of its own epoch). The plan is named by its digest: ``plan_sha256``, or
    an inline plan's own (an older controller's Launch names none, and its plan id may be
    '' too)."""
    inline = cmd.plan if not cmd.plan_sha256 else None
    return (
        cmd.generation,
        cmd.plan_id,
        plan_digest(inline) if inline is not None else cmd.plan_sha256,
        tuple(sorted(cmd.ranks)),
        cmd.world_size,
        cmd.master,
        cmd.checkpoint,
        cmd.load_step,
        cmd.training_sha256,
        cmd.in_place,
    )


class Supervisor(SupervisorStatus, WorkerOutput):
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
        self._tasks = TaskSet("supervisor")
        self.run_dir_io = RunDirIO(f"sailor-run-dir-{run_dir.name}")
        """Every file read and write in the run directory (``run_dir_io``): off the loop."""
        self.killed_groups = KilledGroups(
            run_dir,
            self._tasks,
            on_record=self._on_teardown_record,
            on_gone=self._on_teardown_gone,
            teardown_timeout_s=teardown_timeout_s,
            io=self.run_dir_io,
        )
        """Killed workers' process groups until they are gone: no worker starts while one
        is being killed or lingers past the teardown bound (its record is the failure)."""
        self.io_wait_s = RUN_DIR_WAIT_S
        self._leftovers: list[WorkerView] = []
        """Held workers an in-place launch had no rank for, being killed in the background."""
        self._doomed: list[WorkerView] = []
        """Workers an abort is killing in the background (``abort(wait=False)``)."""
        self._kills: set[asyncio.Task[None]] = set()
        """The aborts' kills under way (and a previous agent's, ``restore_killed``)."""
        self._restoring = False
        """A previous agent's kill is under way (``restore_killed``)."""
        self.generation = -1
        self.plan_id = ""
        self.plan: Plan | None = None
        """The plan of the current generation's workers (the held ones' at an in-place
        launch: which layers each keeps)."""
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
        self._topping_up = asyncio.Lock()  # one top-up at a time: never more than warm_spares
        self._spare_failures = 0
        """Spares that failed (exited before they were warm, or with an error) since one was
        last handed a rank: at :data:`SPARE_FAILURES` no more are started, and none is
        wanted (``spares_wanted``)."""
        self._control_state: dict[str, object] = {}
        self._launched: tuple[object, ...] | None = None
        """:func:`launch_key` of the last launch that started all its ranks."""
        self._aborted: tuple[object, ...] | None = None
        """:func:`launch_key` of the last launch whose workers an abort ended (or held)."""

    @property
    def live(self) -> bool:
        """Some worker's process still runs (training, holding or starting)."""
        return any(w.exit_code is None for w in self.workers)

    def runs(self, cmd: Launch) -> bool:
        """Whether this node's workers run ``cmd``'s launch now (:func:`launch_key`): every
        rank it names started by that launch, alive and not held. Such a Launch applied
        again would kill them (in place: the workers just handed their ranks are not held;
        restart: its abort) and start them over."""
        return (
            self._launched == launch_key(cmd)
            and bool(self.workers)
            and all(
                w.exit_code is None and not w.held and w.generation == cmd.generation
                for w in self.workers
            )
        )

    def aborted(self, cmd: Launch) -> bool:
        """``cmd``'s launch is the last one whose workers an abort ended (or asked to hold):
        its world is gone, and its peers may hold live or dead ranks of it. Applied again,
        it restarted the ranks into that world (a new world is a new generation)."""
        return self._aborted is not None and self._aborted == launch_key(cmd)

    def ended(self, cmd: Launch) -> str:
        """Why ``cmd``'s launch, the last one this node started (:func:`launch_key`), cannot
        be applied again: this node's failure, or a worker of it that exited ('' when
        neither, or ``cmd`` is another launch). Applied again, it restarted the ranks into
        the generation and master whose world the dead worker left, and erased the failure
        the status reports (the controller's view of this node)."""
        if self._launched != launch_key(cmd):
            return ""
        if self.failure:
            return self.failure
        gone = [w for w in self.workers if w.exit_code is not None]
        if not gone:
            return ""
        return ", ".join(f"rank {w.rank} exited (code {w.exit_code})" for w in gone)

    @property
    def io_wait_s(self) -> float:
        """How long one piece of file work in the run directory may take before it counts as
        failed (``RunDirTimeoutError``: its file system does not answer); the killed groups'
        record waits as long (``KilledGroups.io_wait_s``)."""
        return self.killed_groups.io_wait_s

    @io_wait_s.setter
    def io_wait_s(self, seconds: float) -> None:
        self.killed_groups.io_wait_s = seconds

    @property
    def kill_grace_s(self) -> float:
        """How long a worker asked to go (SIGTERM) or to hold (SIGUSR1) has before it is
        SIGKILLed (``KilledGroups.kill_grace_s``)."""
        return self.killed_groups.kill_grace_s

    @kill_grace_s.setter
    def kill_grace_s(self, seconds: float) -> None:
        self.killed_groups.kill_grace_s = seconds

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
            await self.killed_groups.kill([w for w in self.workers if not w.held])
            reusable = [w for w in self.workers if w.held and w.exit_code is None]
        else:
            await self.abort()
            reusable = []
        try:
            await self.killed_groups.gate()  # no rank starts on a GPU a killed rank still holds
        except WorkerTeardownError:
            self.failure = self.killed_groups.record  # refused: it is this node's failure now
            self.changed.set()
            raise
        gen_dir, plan_path, extra = await self._in_run_dir(
            lambda: self._gen_files(cmd, training),
            f"generation files in {self.run_dir} not written",
        )
        self._control_state = {}
        held_plan, self.plan = self.plan, cmd.plan
        self.generation, self.plan_id, self.failure = cmd.generation, cmd.plan_id, ""
        self._launched = None  # until every rank of this launch has started
        self.start_step = cmd.load_step
        self.expect_exit = False
        self.in_place = cmd.in_place
        gpu_of = {r: _gpu_of(cmd.plan, r) for r in cmd.ranks}
        # A held worker keeps its GPU where it can (its CUDA context and shards live there:
        # a worker moved to another GPU keeps a context on both), then the rank whose
        # layers it keeps the most of (each kept is neither sent nor read), then any.
        reusable.sort(key=lambda w: (w.rank not in cmd.ranks, w.rank))
        matched = _match_held(reusable, sorted(cmd.ranks), gpu_of, held_plan, cmd.plan)
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
            await self._in_run_dir(
                lambda: _fresh_rank_files(gen_dir, cmd.ranks),
                f"control files in {gen_dir} not written",
            )
            for rank in sorted(cmd.ranks):
                argv = self._argv(cmd, rank, gen_dir, plan_path, extra)
                w = matched.get(rank) or (spares[0] if spares else None)
                if w is not None:
                    (reusable if w in reusable else spares).remove(w)
                    if w in self.spares:
                        self.spares.remove(w)
                        self._spare_failures = 0  # a spare that served: they work here
                    polled = w.control
                    self._hand_over(w, rank, cmd.generation, argv, gen_dir)
                    # tracked before the directive's write: out of reusable and spares, a
                    # worker whose write failed (a run directory that does not answer) must
                    # still be killed below, not left running outside every list
                    w.gpu = gpu_of[rank]
                    assigned.append(w)
                    await self._direct(w, polled)
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
                await self.killed_groups.kill([*assigned, *reusable])
            finally:
                self._leftovers = [w for w in self._leftovers if w not in leftovers]
            self.workers, self._launching = [], []
            raise
        self.workers, self._launching = assigned, []
        self._launched = launch_key(cmd)
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
        """Give a held worker or a spare the rank (the directive that tells it so is written
        next, to the file it polls: :meth:`_direct`)."""
        assert w.control is not None
        w.rank, w.argv, w.generation = rank, argv, generation
        w.control = _control_file(gen_dir, rank)
        w.error_file = gen_dir / f"error-{rank}.json"
        w.held = w.warm = w.started = False
        w.broken, w.held_step = "", -1
        w.step, w.saved_step, w.loss = -1, -1, None
        w.save_failed_step, w.save_failure = -1, ""
        w.timings = StepWindow(rank)

    async def _direct(self, w: WorkerView, polled: Path | None) -> None:
        """The directive of a worker just handed a rank (:meth:`_hand_over`: its argv and
        generation), into ``polled``, the control file it polls."""
        assert polled is not None
        directive = {"relayout": {"generation": w.generation, "argv": worker_options(w.argv)}}
        await self._in_run_dir(
            lambda: _write_atomic(polled, json.dumps(directive)),
            f"directive {polled} not written",
        )

    async def _in_run_dir(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``, file work in the run directory, off the loop (``run_dir_io``), waited
        ``io_wait_s`` at most (then ``RunDirTimeoutError``, whose message starts with ``what``).
        Refused once closed (``SupervisorClosedError``: its thread is going away)."""
        if self.closed:
            raise SupervisorClosedError(f"the supervisor is closed: {what}")
        return await self.run_dir_io.run(fn, what, self.io_wait_s)

    async def _spawn(
        self, rank: int, argv: tuple[str, ...], gen_dir: Path, generation: int
    ) -> WorkerView:
        await self.killed_groups.gate()
        if self.closed:
            raise SupervisorClosedError("the supervisor is closed: no worker starts")
        proc = await asyncio.create_subprocess_exec(
            *self.exec_prefix,
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            # the allocator's settings before the worker's Python starts (devices.worker_env);
            # the worker dies with this agent (megatron_patch.parent_death)
            env={**worker_env(os.environ), PARENT_ENV: str(os.getpid())},
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
        view.readers = [
            view.tasks.spawn("out", self._read_stdout(view)),
            view.tasks.spawn("err", self._read_stderr(view)),
        ]
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
            await self._in_run_dir(
                functools.partial(_fresh_spare_dir, d), f"spare files in {d} not written"
            )
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

    async def _write_control(self) -> None:
        """The stop/save requests, into every worker's control file (one per rank: a held
        worker's directive names that rank alone), off the loop (``RunDirTimeoutError`` if the
        run directory does not answer within ``io_wait_s``)."""
        data = json.dumps(self._control_state)
        paths = [w.control for w in self.workers if w.control is not None and w.exit_code is None]

        def write() -> None:
            for path in paths:
                _write_atomic(path, data)

        if paths:
            await self._in_run_dir(write, f"control files {paths[0].parent} not written")

    async def stop_at(self, step: int) -> None:
        self._control_state["stop_at_step"] = step
        await self._write_control()

    async def save_at(
        self,
        step: int,
        directory: str,
        prune_below: int = -1,
        optional: bool = False,
        drop_steps: tuple[int, ...] | None = None,
    ) -> None:
        """Save ``step`` under ``directory``; once it commits, delete the checkpoints below
        ``prune_below`` there (-1: none), and those of ``drop_steps`` (the steps of saves
        the controller gave up on; None: none) at or above it that were committed when the
        save began.
        ``optional`` (a periodic checkpoint's): a failure the workers report
        (``save_failed``) and train on, not fail for."""
        self._control_state["save_step"] = step
        self._control_state["save_dir"] = directory
        self._control_state["prune_below"] = prune_below
        self._control_state["save_optional"] = optional
        self._control_state["drop_steps"] = None if drop_steps is None else list(drop_steps)
        await self._write_control()

    async def restore_killed(self) -> None:
        """At an agent's start, before it takes commands: the process groups its previous
        incarnation signalled and did not see go (``KilledGroups.restore``). Those SIGKILLed
        less than ``teardown_timeout_s`` ago, or not yet (they get it now), are still being
        killed, in a task as an abort's kill is (``killing`` counts them, the state is
        ``stopped``; the spares start once it is over); those past the bound are the
        failure. No worker starts until they are gone."""
        await self.killed_groups.restore()
        if self.killed_groups.killing:
            self._restoring = True
            kill = self._tasks.spawn("restored-kill", self._end_restored())
            self._kills.add(kill)
            kill.add_done_callback(self._kills.discard)
            self.changed.set()

    async def _end_restored(self) -> None:
        """The rest of a previous agent's kills (``KilledGroups.finish_restored``); then the
        spares, if every group went (else their end brings them: ``_on_teardown_gone``)."""
        try:
            await self.killed_groups.finish_restored()
        finally:
            self._restoring = False
        if not self.killed_groups.record:
            self._on_teardown_gone()
        self.changed.set()

    def _on_teardown_record(self, old: str, new: str, report: bool) -> None:
        """The lingering groups' record changed: it is the failure if ``report``, or if the
        old record was."""
        if report or (old and self.failure == old):
            self.failure = new
        self.changed.set()

    def _on_teardown_gone(self) -> None:
        """Every lingering group is gone: the spares come back (a generation still starting
        tops them up once it has: ``_on_line``)."""
        if self.warm_spares and not self.closed and all(w.started for w in self.workers):
            self._tasks.spawn("spares", self.top_up_spares())

    async def _let_go(self, leftovers: list[WorkerView]) -> None:
        """Kill held workers an in-place launch had no rank for (after its ack). One that
        outlives the bound holds up the next launch and is reported then: the generation
        just launched runs on other GPUs."""
        try:
            await self.killed_groups.kill(leftovers, report=False)
        finally:
            self._leftovers = [w for w in self._leftovers if w not in leftovers]

    @property
    def killing(self) -> int:
        """Worker process groups being killed now (``KilledGroups.going``): signalled, not
        yet found gone nor past the teardown bound. The status reports it."""
        return self.killed_groups.going

    @property
    def kill_under_way(self) -> bool:
        """A kill is under way (an abort's, a launch's leftovers'): no worker starts until
        it is over (``KilledGroups.gate``)."""
        return self.killed_groups.killing

    async def abort(self, hold: bool = False, wait: bool = True) -> None:
        """Kill every worker (SIGTERM, SIGKILL after the grace period, then the wait until
        their processes are gone: ``KilledGroups.kill``) and forget them. With
        ``hold`` (in-place workers only): ask them to leave their world and hold instead
        (SIGUSR1), killing only those that do not hold within the grace period. Processes
        that outlived an earlier kill are probed again: the failure is theirs while they
        are there, and goes with them.

        Without ``wait``: return once the signals are sent (after the hold's grace period,
        with ``hold``); the rest of the kill goes on in a task of the supervisor's. The
        workers being killed leave ``workers`` at once; meanwhile the state is ``stopped``
        (``failed`` if a worker failed), ``killing`` counts their groups and no worker
        starts. An abort while one is under way waits for it (``wait``) or adds nothing."""
        if wait:
            await self._kills_over()
        if self.workers:
            # the launch these workers ran is over here: a Launch of it again is refused
            # (``ended``), whatever its command id (a leader that adopted its LAUNCH)
            self._aborted = self._launched
        if hold and self.in_place and self.workers:
            self.failure = self.killed_groups.record
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
            doomed = [w for w in self.workers if not w.held]
            self.workers = [w for w in self.workers if w.held and w.exit_code is None]
            for w in self.workers:  # asked to: the controller knows why (no failure report)
                w.broken = ""
        else:
            self.expect_exit = True
            doomed, self.workers = self.workers, []
        self._doomed.extend(doomed)
        alive = self.killed_groups.begin(doomed)  # no worker starts from now on
        sent = asyncio.Event()
        kill = self._tasks.spawn("abort", self._end_abort(doomed, alive, sent))
        self._kills.add(kill)
        kill.add_done_callback(self._kills.discard)
        self.changed.set()
        # the SIGTERMs, before this returns (their record first, bounded: ``io_wait_s``)
        waiter = asyncio.ensure_future(sent.wait())
        try:
            await asyncio.wait({waiter, kill}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if wait:
            await self._kills_over()

    async def _end_abort(
        self, doomed: list[WorkerView], alive: Sequence[Killable], sent: asyncio.Event
    ) -> None:
        """An abort's kill (``KilledGroups.finish``: the record and SIGTERM, ``sent`` set
        then, the rest), then the failure: a process that outlived SIGKILL stays reported."""
        try:
            await self.killed_groups.finish(alive, term=True, sent=sent)
        finally:
            self._doomed = [w for w in self._doomed if w not in doomed]
        await self.killed_groups.recheck()
        self.failure = self.killed_groups.record
        self.changed.set()

    async def _kills_over(self) -> None:
        """Until the aborts' kills under way are over (not cancelled with the caller)."""
        while self._kills:
            await asyncio.wait([asyncio.shield(t) for t in list(self._kills)])

    async def close(self) -> None:
        """Kill the workers and the spares; end every task (the agent is shutting down). A
        launch still going on starts no more workers, and those it started are killed.
        Processes that outlive it stay in ``KILLED_FILE`` for the next agent."""
        self.closed = self.killed_groups.closed = True
        await self._kills_over()  # closed: within the grace period after their SIGKILL
        # the spares hold nothing and leave at SIGTERM at once: signalled now, beside the
        # workers' grace period rather than after it
        spares = self.killed_groups.begin(self.spares)
        spares_kill = self._tasks.spawn("spares-kill", self.killed_groups.finish(spares, term=True))
        try:
            await self.killed_groups.kill(self._launching)
            await self.abort()
        finally:
            await asyncio.wait([spares_kill])
        self.spares = []
        await self.killed_groups.kill(self._leftovers)
        # a dead worker's group being swept: its SIGKILL is owed, not cancelled with the tasks
        await self.killed_groups.sweeps_over()
        await self._tasks.close(timeout=2.0)
        self.run_dir_io.close()


def _set_aside_errors(gen_dir: Path, rank: int) -> None:
    """Move an earlier run's error record of ``rank`` in this generation's directory (and its
    ``.fault`` stacks) aside, so the rank about to start writes its own first cause: the
    record is first-writer-wins (``write_error_file``), and the agent reports the file it
    finds. A generation's directory is used again by a Launch of an earlier generation on an
    idle node (a controller restored from an etcd backup). Kept, renamed with the time."""
    stamp = time.time_ns()
    for name in (f"error-{rank}.json", f"error-{rank}.json.fault"):
        path = gen_dir / name
        if path.exists():
            with contextlib.suppress(FileNotFoundError):
                path.rename(gen_dir / f"{name}.earlier-{stamp}")


def _fresh_rank_files(gen_dir: Path, ranks: Sequence[int]) -> None:
    """Before ``ranks`` start in ``gen_dir``: an earlier run's error records set aside
    (:func:`_set_aside_errors`) and empty control files."""
    for rank in sorted(ranks):
        _set_aside_errors(gen_dir, rank)
        _write_atomic(_control_file(gen_dir, rank), "{}")


def _fresh_spare_dir(d: Path) -> None:
    """A warm spare's directory, with its empty control file."""
    write_durably(d / "control.json", b"{}", make_dirs=True)


def _control_file(gen_dir: Path, rank: int) -> Path:
    """A rank's control file in its generation's directory."""
    return gen_dir / f"control-{rank}.json"


def _write_atomic(path: Path, data: str) -> None:
    """``path`` replaced with ``data`` durably (:func:`write_durably`): a worker polling it
    reads the old file or the new one, and a command acked as applied survives a power loss."""
    write_durably(path, data.encode())
