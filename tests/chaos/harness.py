"""The chaos suite's harness: a secure one-machine cluster of real processes, faults, a verdict.

Built on what the demo already has, not a third copy: :mod:`sailor.localservers` starts
nats-server and etcd with TLS, logins, permissions and RBAC under the demo's
``ProcessRegistry`` (every child carries one marker; cleanup SIGKILLs whatever still carries
it), ``DemoCluster`` starts ``sailor controller`` / ``sailor agent`` processes whose agents
run real workers (gloo, CPU, fp32) on the demo's training config — a GPT-2 on the Python
docs prepared by ``sailor data prepare``'s code, handed to every worker by the controller
(:func:`demo_training`, prepared once per process) — and injects faults, and ``Driver``
waits on etcd and the workers' progress files as an operator would.

The verdict of one run (:class:`Outcome`) is measured, not asserted here:

- ``sailor audit`` over every controller's log (the checker of ``sailor.controller.audit``);
- every loss any generation reported, redone steps included, against an uninterrupted
  single-process run (``train_reference``, same seed and global batches) within
  ``max(LOSS_ATOL, 3 x floor) + LOSS_RTOL x |loss|``, the demo's rule, the floor being what
  reduction order alone does to the losses of uninterrupted runs over as many steps (it
  grows past LOSS_ATOL only in runs of hundreds of steps);
- the final parameters: the run ends with a drain (a preemption notice for one node), so its
  last step is committed; that checkpoint's weights must equal the reference's after as many
  steps, within ``PARAM_ATOL``, and its AdamW moments the reference's, within
  ``MOMENT_ATOL`` (nothing trains from that last checkpoint, so its weights cannot show
  moments saved wrongly);
- reconfigurations (launches after the first), the no-step downtime of each (last step of
  the older layouts -> first step of the new one), steps redone, and steps lost: a launch
  that loads an older step than the newest commit before it (must be 0).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from sailor.cli.demo.cluster import DemoCluster
from sailor.cli.demo.model import DemoTraining, demo_model, prepare_demo
from sailor.cli.demo.observe import StepPoint
from sailor.cli.demo.processes import ProcessRegistry
from sailor.cli.demo.report import LOSS_ATOL, compare_losses
from sailor.cli.demo.scenario import DemoSettings, Driver
from sailor.controller.audit import check, read_records
from sailor.controller.config import OnlineCalibrationSettings
from sailor.localservers import Identities, start_local_servers

if TYPE_CHECKING:
    import torch

    from sailor.megatron_patch.architecture import Architecture
    from sailor.megatron_patch.data import TokenSource
    from sailor.megatron_patch.engine import TrainConfig
    from sailor.megatron_patch.reference import ReferenceRun
    from sailor.schemas.model import ModelSpec

__all__ = [
    "GBS",
    "JOB",
    "MOMENT_ATOL",
    "NODES",
    "PARAM_ATOL",
    "STEP_S",
    "TABLE_ENV",
    "ChaosRun",
    "Outcome",
]

JOB = "chaos"
GBS = 4


@functools.cache
def demo_training() -> DemoTraining:
    """The demo's model, data set and training config, prepared once per process."""
    root = Path(tempfile.mkdtemp(prefix="sailor-chaos-data-"))
    atexit.register(shutil.rmtree, root, True)
    return prepare_demo(root, GBS)


class _Training(NamedTuple):
    spec: ModelSpec
    arch: Architecture
    cfg: TrainConfig
    data: TokenSource


@functools.cache
def _training() -> _Training:
    """What the workers train, for the reference: spec, architecture, settings, samples
    (read once per process: the verdict and the checkpoint comparison both ask)."""
    from sailor.megatron_patch.data import build_dataset
    from sailor.megatron_patch.engine import TrainConfig
    from sailor.schemas.training import parse_training_config

    t = demo_training()
    tc = parse_training_config(t.training_file.read_text(), str(t.training_file))
    spec, arch = demo_model(GBS)
    data = build_dataset(tc.data, spec, tc.seed, base_dir=t.training_file.parent)
    return _Training(spec, arch, TrainConfig.of(tc), data)


NODES = tuple(f"n{i}" for i in range(1, 11))
"""Node ids with a certificate and a login (the trace replay uses the most)."""
CONTROLLERS = ("c1", "c2")
PARAM_ATOL = 2e-6
"""fp32 rounding of other reduction orders across layouts after a few steps (tests/integration/
test_checkpoint_resume.py measured weight gaps <= 4.6e-7). Over longer runs the bound is
``max(PARAM_ATOL, 3 x floor)``, the floor measured in the same run (``_param_diffs``)."""
MOMENT_ATOL = 2e-6
"""AdamW moments, as for the weights: the floor (reduction order only, tiny-gpt, GBS 4) measured
4e-8 to 1.2e-7 over 3 to 100 steps, largest in the embedding's moments (~0.1-0.9); the resume
test's state gaps across layouts, moments included, <= 5.6e-7. A moment restored as zero or
from another step differs by ~its size, 1e-2 to 1 in most tensors."""
ALT_MICROBATCHES = (2, 1)
"""The uninterrupted references the floors are measured against (microbatch sizes of the
global batch): one other reduction order is one draw of rounding's spread; the demo's GPT-2 on
real text measured 1.3e-3 to 5.6e-3 between the three orders after 200 steps (lr 3e-3)."""
MOMENT_RTOL = 1e-4
"""Relative part of the moments' bound, as ``LOSS_RTOL`` for the losses: over hundreds of
steps on real text (lr 1e-3) rounding moves a moment by ~1e-5 of its size between two
single-process orders (the floor: 9.2e-7 at a moment of 0.074 after 336 steps), and a run
through a dozen layouts with TP, which the floor's orders do not have, moved one by 3.3e-6
(the trace replay, 3.6x its floor); a moment saved as zero or a step off is off by 5e-2 of
its size and more (tests/chaos/test_chaos_verdict.py)."""
STEP_S = 0.2
"""The workers' pace (``min_step_s``) of the CI scenarios, 4x slower than :class:`ChaosRun`'s
default: the verdict's three reference runs train every step the cluster took, on one of the
2 shared cores (0.03-0.05 s a step under make test's load), so at 0.05 s steps each second the
cluster trained cost 2-3 s of verdict; outages, drains and start-ups take as long at any pace.
Slower steps also leave more of the cores to the control plane and the other test files."""
TABLE_ENV = "SAILOR_CHAOS_TABLE"
"""File the runs append their outcome to (one JSON line each); tests/chaos/conftest.py
prints the table from it."""


@dataclass
class Outcome:
    """What one chaos run measured (see the module docstring)."""

    scenario: str
    faults: list[str]
    reconfigurations: int
    downtime_s: list[float]
    steps_redone: int
    steps_lost: int
    final_step: int
    commits: list[int]
    audit_ok: bool
    audit_violations: list[str]
    losses_ok: bool
    max_loss_diff: float
    loss_floor: float
    params_step: int
    params_ok: bool
    max_param_diff: float
    param_floor: float
    moments_ok: bool
    max_moment_diff: float
    moment_floor: float
    wall_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.audit_ok
            and self.losses_ok
            and self.params_ok
            and self.moments_ok
            and self.steps_lost == 0
        )

    def record(self) -> None:
        path = os.environ.get(TABLE_ENV)
        if path:
            with Path(path).open("a") as fh:
                fh.write(json.dumps({**asdict(self), "ok": self.ok}) + "\n")


def _downtimes(points: Sequence[StepPoint]) -> tuple[list[float], int]:
    """No-step seconds before each generation after the first, and steps redone in all."""
    gens = sorted({p.generation for p in points})
    out: list[float] = []
    redone = 0
    for g in gens[1:]:
        mine = [p for p in points if p.generation == g]
        first = min(mine, key=lambda p: p.time)
        older = [p for p in points if p.generation < g and p.time <= first.time]
        if older:
            out.append(round(first.time - max(p.time for p in older), 2))
            reached = max(p.step for p in older)
            redone += max(0, reached - (first.step - 1))
    return out, redone


def _steps_lost(records: Sequence[dict[str, Any]]) -> int:
    """Committed steps a launch threw away: the newest commit before it minus its load step."""
    newest = -1
    lost = 0
    for r in records:
        if r.get("kind") == "commit":
            newest = max(newest, int(r.get("step", -1)))
        elif r.get("kind") == "phase" and r.get("phase") == "launch" and newest >= 0:
            lost = max(lost, newest - int(r.get("load_step", -1)))
    return lost


class _Diffs(NamedTuple):
    """Largest |checkpoint - reference| and the floor of reduction order, per kind of state."""

    weights: float
    weight_floor: float
    moments: float
    """Over both AdamW moments (``exp_avg``, ``exp_avg_sq``)."""
    moment_floor: float
    moment_excess: float
    """Largest ``|checkpoint - reference| - MOMENT_RTOL x |reference|`` over the moments."""

    @property
    def weights_ok(self) -> bool:
        return self.weights <= max(PARAM_ATOL, 3 * self.weight_floor)

    @property
    def moments_ok(self) -> bool:
        return self.moment_excess <= max(MOMENT_ATOL, 3 * self.moment_floor)


NOISE_ONLY = (".attn_k.bias",)
"""Weights whose gradient is zero in exact arithmetic (softmax ignores a constant added to
every key): AdamW scales pure rounding noise to ~lr, so two reduction orders part by up to
~lr whatever the runtime did, and one alternative order's gap (the floor) is one draw of
that spread: the floors measured here are nearly all in them (``_param_diffs``), and a trace
replay failed once at 3.3x its floor (1.8e-3 at lr 3e-3) with its moments within theirs. In
the next replay the four largest weight gaps were key biases (2.2e-3, its floor 2.3e-3); the
largest other weight's 1.7e-4 against 3.1e-4.
Their weights are left out of the weight comparison and its floor; their AdamW moments,
which a wrong restore would move by their size, are still compared."""


def _param_diffs(ckpt: Path, step: int, ref: ReferenceRun, alts: Sequence[ReferenceRun]) -> _Diffs:
    """Checkpoint ``step``'s weights and AdamW moments against the reference's (``ref`` and
    ``alts`` trained with ``params_at=step``), with floors.

    A floor is the same difference between uninterrupted references, what reduction order
    alone produces: the reference trained with the whole global batch at once against the
    same trained in smaller microbatches (:data:`ALT_MICROBATCHES`), the largest gap of any.
    Measured here for the weights (synthetic tokens): 1.5e-6 after 10 steps, 5.7e-6 to 1.1e-5
    after 40, 2.9e-5 after 80, nearly all in the attention key biases, whose gradient is zero
    in exact arithmetic (softmax ignores a constant added to every key), so AdamW scales pure
    rounding noise to ~lr. The moments' floor stays ~1e-7.
    """
    from sailor.checkpoint import LocalStorage, load

    spec = _training().spec
    got = load(LocalStorage(ckpt), range(spec.num_all_layers), step=step).params
    missing = sorted(set(ref.params_at) - set(got))
    if missing:
        raise AssertionError(f"checkpoint {step} lacks {missing[:5]}")

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max())

    def excess(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(((a - b).abs() - MOMENT_RTOL * b.abs()).max())

    compared = [k for k in ref.params_at if not k.endswith(NOISE_ONLY)]
    return _Diffs(
        weights=max(gap(got[k].weight, ref.params_at[k]) for k in compared),
        weight_floor=max(gap(alt.params_at[k], ref.params_at[k]) for alt in alts for k in compared),
        moments=max(
            max(gap(got[k].exp_avg, m), gap(got[k].exp_avg_sq, v))
            for k, (m, v) in ref.moments_at.items()
        ),
        moment_floor=max(
            max(gap(alt.moments_at[k][0], m), gap(alt.moments_at[k][1], v))
            for alt in alts
            for k, (m, v) in ref.moments_at.items()
        ),
        moment_excess=max(
            max(excess(got[k].exp_avg, m), excess(got[k].exp_avg_sq, v))
            for k, (m, v) in ref.moments_at.items()
        ),
    )


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch on one thread for the verdict's reference runs. Its default (one per core)
    spins at a barrier each op waiting for the other thread; on the shared 2 cores (load
    average 20 from other work) 20 tiny-gpt steps took 80-119 s on two threads and 1.4-1.9 s
    on one, and the reference runs were most of a scenario's wall time."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class ChaosRun:
    """One scenario's cluster: ``async with ChaosRun(...) as run:`` then faults, then ``finish``.

    Everything it started is ended on exit, failure or not (marker scan included).
    """

    def __init__(
        self,
        tmp: Path,
        scenario: str,
        steps_between: int = 8,
        nats_servers: int = 1,
        etcd_members: int = 1,
        min_step_s: float = 0.05,
        cluster: Mapping[str, Any] | None = None,
    ) -> None:
        self.scenario = scenario
        self.cluster_options = dict(cluster or {})
        """DemoCluster fields beyond the harness's own (node kinds and quotas, prior profiles,
        online calibration settings: tests/chaos/closed_loop.py)."""
        self.cluster_sizes = (nats_servers, etcd_members)  # > 1: server clusters on loopback
        self.root = tmp / "run"
        self.reg = ProcessRegistry(log_dir=self.root / "logs")
        self.settings = DemoSettings(
            steps_between=steps_between, min_step_s=min_step_s, phase_timeout_s=120.0, poll_s=0.2
        )
        self.faults: list[str] = []
        self.t0 = time.time()

    async def __aenter__(self) -> ChaosRun:
        def spawn(name: str, argv: Sequence[str], _log: Path) -> subprocess.Popen[bytes]:
            return self.reg.start(name, argv)

        # a job of the run's own: its nodes' CPU quota cgroups (sailor/<job>/<node> on the
        # host) are then its own when two scenarios run at once (make test's workers)
        self.job = f"{JOB}-{secrets.token_hex(3)}"
        ids = Identities(jobs=(self.job,), controllers=CONTROLLERS, agents=NODES)
        try:
            n_nats, n_etcd = self.cluster_sizes
            self.servers = start_local_servers(
                self.root, ids, secure=True, spawn=spawn, nats_servers=n_nats, etcd_members=n_etcd
            )
            options: dict[str, Any] = {
                "training_file": demo_training().training_file,
                "model": str(demo_training().spec_file),
                # fits and plans with them, but the scenario's faults are the only changes
                "online_calibration": OnlineCalibrationSettings(replan=False),
                # in place, without warm spares (a join starts its worker then): each spare
                # is one more torch import per agent on the 2 cores; scenarios that join
                # ask for them
                "warm_spares": 0,
                **self.cluster_options,
            }
            self.cluster = DemoCluster(
                reg=self.reg,
                servers=self.servers,
                root=self.root,
                global_batch_size=GBS,
                min_step_s=self.settings.min_step_s,
                job=self.job,
                **options,
            )
            self.drive = Driver(cluster=self.cluster, settings=self.settings, t0=self.t0)
        except BaseException:
            self.reg.kill_all()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            await self.drive.state.close()
        try:
            self.cluster.stop()
            members = [*self.servers.nats_members, *self.servers.etcd_members]
            # 1 s, then SIGKILL: nothing reads them any more (the verdict is taken); a lone
            # server stops in ~0.3 s, but a member of the 3-member etcd cluster, all of them
            # told at once, waited out all of the 5 s it was given (cluster member losses)
            self.reg.stop([m.name for m in members], grace_s=1.0)
        finally:
            left = self.reg.kill_all()
            if exc[0] is None and not left and not os.environ.get("SAILOR_CHAOS_KEEP"):
                shutil.rmtree(self.root, ignore_errors=True)

    # -- driving --------------------------------------------------------------------------

    def fault(self, text: str) -> None:
        self.faults.append(text)
        self.drive.note(f"FAULT {text}")

    async def start(self, nodes: Sequence[str], controllers: Sequence[str] = ("c1",)) -> int:
        """Agents first (so the first plan uses them all), then the controllers; RUNNING."""
        for n in nodes:
            self.cluster.start_agent(n)
        await self.drive.until(lambda: len(self.drive.view.nodes) >= len(nodes), "registered")
        for c in controllers:
            self.cluster.start_controller(c)
        gen = await self.drive.running_after(-1)
        await self.drive.train(gen, self.settings.steps_between)
        return gen

    async def preempt(self, node: str, gen: int, notice_s: float = 30.0) -> int:
        """A spot notice for ``node``; RUNNING without it; its VM then goes (agent stopped).

        A node the layout does not use needs no reconfiguration: the notice only shrinks the
        membership, so the same generation runs on.
        """
        gen = await self.drive.current(gen)  # a replan may have relaunched since ``gen``
        used = node in self.placed()
        self.cluster.preempt(node, notice_s)
        if used:
            gen = await self.drive.running_after(gen)
        else:
            self.drive.note(f"{node} is not in the layout: no reconfiguration expected")
        self.reg.stop([f"agent-{node}"], grace_s=5.0)
        return gen

    async def join(self, node: str, gen: int) -> int:
        gen = await self.drive.current(gen)
        self.cluster.start_agent(node)
        return await self.drive.running_after(gen)

    async def generation(self) -> int:
        await self.drive.tick()
        return self.drive.view.generation

    def top_step(self, gen: int) -> int:
        self.drive.steps.poll()
        pts = self.drive.steps.points.values()
        return max((p.step for p in pts if p.generation == gen), default=-1)

    async def advance(self, gen: int, steps: int) -> None:
        """Wait until generation ``gen`` trains ``steps`` more steps (no relaunch meanwhile)."""
        target = self.top_step(gen) + steps
        await self.drive.until(lambda: self.top_step(gen) >= target, f"gen {gen} to {target}")

    def placed(self) -> set[str]:
        """The nodes the desired layout uses. Not the registered nodes with ranks: a frozen
        agent's registration expires before the controller has moved the layout off it, and
        a wait for "RUNNING without it" then returned the old generation (seen once in
        ``make chaos``: the partition scenario waited for steps of an aborted generation)."""
        return set(self.drive.view.placement)

    async def running_without(self, gone: set[str]) -> int:
        """RUNNING in a layout that uses none of ``gone``; return its generation."""
        v = self.drive

        def ok() -> bool:
            return v.view.phase == "running" and bool(self.placed()) and not self.placed() & gone

        await v.until(ok, f"RUNNING without {sorted(gone)}")
        v.note(f"RUNNING generation {v.view.generation}: {v.view.plan}")
        return v.view.generation

    def leader(self) -> str:
        """The controller whose audit log holds the newest ``leader`` record."""
        best = (-1.0, "")
        for path in self.cluster.audit_logs():
            for r in read_records([path]):
                if r.get("kind") == "leader":
                    best = max(best, (float(r["time"]), path.stem.removeprefix("audit-")))
        if not best[1]:
            raise LookupError("no leader recorded yet")
        return best[1]

    def records(self) -> list[dict[str, Any]]:
        return read_records(self.cluster.audit_logs())

    # -- verdict --------------------------------------------------------------------------

    async def finish(self, gen: int, drain: str) -> Outcome:
        """Train, drain a node (its notice commits the last step), train again, measure.

        The drained node must be in the layout (a notice for a node the plan leaves out
        changes nothing, so nothing would be committed): ``drain`` if it is, else another.
        """
        await self.drive.train(gen, self.settings.steps_between)
        placed = sorted(self.placed())
        if drain not in placed:
            self.drive.note(f"{drain} is not in the layout ({placed}): draining {placed[-1]}")
            drain = placed[-1]
        gen = await self.preempt(drain, gen)
        await self.drive.train(gen, 3)
        self.cluster.stop()
        return self.outcome()

    def outcome(self) -> Outcome:
        from sailor.megatron_patch.reference import train_reference

        records = read_records(self.cluster.audit_logs())
        report = check(records)
        self.drive.steps.poll()
        points = self.drive.steps.series()
        last = max((p.step for p in points), default=0)
        tr = _training()
        commits = sorted({int(r["step"]) for r in records if r.get("kind") == "commit"})
        p_step = commits[-1] if commits else -1
        # one pair of reference runs for both checks: losses to the last step, weights at
        # the last commit (it was four runs; they dominated a scenario's time under load)
        at = p_step if 0 < p_step <= last else None
        with _one_torch_thread():
            ref = train_reference(
                tr.spec, GBS, last, tr.cfg, arch=tr.arch, data=tr.data, params_at=at
            )
            alts = [
                train_reference(
                    tr.spec,
                    GBS,
                    last,
                    tr.cfg,
                    microbatch_size=mbs,
                    arch=tr.arch,
                    data=tr.data,
                    params_at=at,
                )
                for mbs in ALT_MICROBATCHES
            ]
        loss_floor = max(
            (abs(a - b) for alt in alts for a, b in zip(ref.losses, alt.losses, strict=True)),
            default=0.0,
        )
        # the demo's rule: max(LOSS_ATOL, 3 x floor) + LOSS_RTOL x |loss| (the relative part
        # for what the single-process floors cannot show: TP's split softmax, other layouts)
        losses = compare_losses(points, ref.losses, commits, max(LOSS_ATOL, 3 * loss_floor))
        downtimes, redone = _downtimes(points)
        launches = sum(r.get("kind") == "phase" and r.get("phase") == "launch" for r in records)
        inf = float("inf")
        diffs = (
            _param_diffs(self.root / "ckpt", p_step, ref, alts)
            if at is not None
            else _Diffs(inf, 0.0, inf, 0.0, inf)
        )
        out = Outcome(
            scenario=self.scenario,
            faults=self.faults,
            reconfigurations=max(0, launches - 1),
            downtime_s=downtimes,
            steps_redone=redone,
            steps_lost=_steps_lost(records),
            final_step=last,
            commits=commits,
            audit_ok=report.ok,
            audit_violations=list(report.violations),
            losses_ok=losses.ok,
            max_loss_diff=losses.max_abs_diff,
            loss_floor=loss_floor,
            params_step=p_step,
            params_ok=diffs.weights_ok,
            max_param_diff=diffs.weights,
            param_floor=diffs.weight_floor,
            moments_ok=diffs.moments_ok,
            max_moment_diff=diffs.moments,
            moment_floor=diffs.moment_floor,
            wall_s=round(time.time() - self.t0, 1),
            notes=list(self.drive.log),
        )
        out.record()
        return out


def verdict(out: Outcome, min_reconf: int) -> None:
    """Assert what every scenario must show (the notes explain a failure)."""
    detail = (
        f"{out.scenario}: audit {out.audit_violations}, loss diff {out.max_loss_diff:.2e}, "
        f"param diff {out.max_param_diff:.2e}@{out.params_step}, "
        f"moment diff {out.max_moment_diff:.2e}, lost {out.steps_lost}\n" + "\n".join(out.notes)
    )
    assert out.audit_ok, detail
    assert out.losses_ok, detail
    assert out.params_ok, detail
    assert out.moments_ok, detail
    assert out.steps_lost == 0, detail
    assert out.reconfigurations >= min_reconf, detail
