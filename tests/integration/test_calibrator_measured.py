"""What online calibration hands the deadlines: ``Calibrator.measured``, over a real etcd.

QUIESCE and VERIFY are sized by the iteration time the cluster measured for the same plan
(``MeasuredIteration``, ``DecideConfig.measured``; docs/runtime.md, Phase deadlines). The
daemon takes it from its ``Calibrator`` each pass. The contract read here: a fit sets it to
that fit's plan and measured step (``fit of generation <g>``); the next fit replaces it, so
a new layout's first fit names the new plan and the old plan's time is gone; a fit of a plan
without an id sets none; a new leader's calibrator reads the kept record's back (``calibration
v<n>``), and a calibrator that has fitted itself keeps its own, fresher, one. A measurement
for one plan never sizes another's deadlines (``plan_deadlines.iteration_time``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from sailor.controller.audit import AuditLog, read_records
from sailor.controller.config import ControllerConfig, OnlineCalibrationSettings
from sailor.controller.decision_types import DecideConfig, Observed, phase_deadline
from sailor.controller.online_calibration import Calibrator
from sailor.controller.plan_deadlines import MeasuredIteration
from sailor.controller.planning import PlanResult, SailorPlanner, load_model_spec
from sailor.coordination import Keys, SystemClock, TaskSet, campaign, connect_etcd
from sailor.localservers import LocalServers
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.online_calibration import RankTimings
from sailor.schemas.plan import Plan
from sailor.schemas.runtime import AgentStatus, DesiredState, Phase
from sailor.simulator.fit_corners import with_constant
from sailor.simulator.synthetic_timings import expected_rank_timings
from tests.integration.cluster_kit import until

pytestmark = pytest.mark.usefixtures("no_task_leak")

NODES = (
    NodeSpec(node_id="n1", gpu_type="A100-40", gpus=1, zone="z-a-1", address="h1"),
    NodeSpec(node_id="n2", gpu_type="V100-16", gpus=1, zone="z-a-1", address="h2"),
)


def _config(tmp: Path, job: str, name: str) -> ControllerConfig:
    return ControllerConfig(
        job=job,
        identity=name,
        audit_log=tmp / f"audit-{name}.jsonl",
        planner="sailor",
        model="OPT-350",
        global_batch_size=32,
        # no replan verdict: what is tested is the measurement, not the planner's search;
        # a version kept at the first fit (not after three that agree)
        online_calibration=OnlineCalibrationSettings(
            min_steps=3, interval_s=0.01, replan=False, stable_reports=1
        ),
    )


def _running(res: PlanResult, gen: int) -> DesiredState:
    return DesiredState(
        epoch=1,
        generation=gen,
        phase=Phase.RUNNING,
        plan=res.plan,
        placement=res.placement,
        membership=("n1", "n2"),
    )


def _observed(d: DesiredState, last_step: int, timings: tuple[RankTimings, ...]) -> Observed:
    """Every placed rank reporting its ``timings`` (by rank) over 5 steps up to
    ``last_step``."""
    status = {
        node: AgentStatus(
            node_id=node,
            generation=d.generation,
            state="running",
            step=last_step,
            timings=tuple(
                timings[r].model_copy(update={"steps": 5, "last_step": last_step}) for r in ranks
            ),
        )
        for node, ranks in d.placement.items()
    }
    return Observed(now=0.0, nodes={n.node_id: n for n in NODES}, status=status)


def _cluster_timings(
    cal: Calibrator, plan: Plan, slow_scale: float, step_s: float | None = None
) -> tuple[RankTimings, ...]:
    """What a cluster whose V100 computes ``slow_scale`` times its configured scale reports
    (the cost model's own timings, ``synthetic_timings``); ``step_s``: every rank's step
    measured so instead (a step the compute does not account for)."""
    inp = cal.inputs
    assert inp is not None
    slow = inp.calibration.for_gpu("V100-16").compute_scale * slow_scale
    truth = with_constant(inp.calibration, "V100-16", compute_scale=slow)
    out = expected_rank_timings(
        plan, inp.model, inp.profiles, inp.network, inp.prices,
        calibration=truth, gpu_specs=inp.gpu_specs,
    )  # fmt: skip
    if step_s is None:
        return out
    return tuple(t.model_copy(update={"step_s": step_s}) for t in out)


async def test_measured_follows_the_latest_fit_and_a_new_leader_reads_it_back(
    servers: LocalServers, tmp_path: Path
) -> None:
    job = "t"
    planner = SailorPlanner.from_files("OPT-350", 32)
    res = planner.plan(NODES, None)
    assert res.plan.plan_id
    cfg = _config(tmp_path, job, "c1")
    audit = AuditLog(cfg.audit_log)
    cal = Calibrator(cfg, planner, audit, SystemClock())
    assert cal.enabled and cal.measured is None  # nothing measured yet: deadlines predict
    # the V100 computes 1.5x its configured scale: a version is kept (to be read back)
    timings = _cluster_timings(cal, res.plan, 1.5)
    step_s = statistics.median(t.step_s for t in timings)  # the fit's measured iteration
    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    tasks = TaskSet("test-calibrator")
    try:
        lead = await campaign(store, Keys(job=job).leader, "c1", 5, timeout=10)

        async def fit(d: DesiredState, last_step: int) -> None:
            fits = cal.fits
            cal.note(d)
            started = cal.maybe_fit(
                d, _observed(d, last_step, timings), tasks, store, lead, lambda _: None, _fenced
            )
            assert started, "no fit started"
            await until(lambda: cal.fits > fits, 30, f"a fit of generation {d.generation}")
            await until(lambda: not tasks.names, 30, "the fit's end (its kept version)")

        # a fit of the running plan: its plan, its measured step, which fit
        d2 = _running(res, 2)
        await fit(d2, 10)
        here = MeasuredIteration(
            plan_id=res.plan.plan_id, iteration_s=step_s, source="fit of generation 2"
        )
        assert cal.measured == here
        assert cal.version == 1  # kept in etcd, for the next leader

        # what decide makes of it: this plan's QUIESCE and VERIFY are sized by it, another
        # plan's by its prediction
        model = load_model_spec("OPT-350", 32)
        dc = DecideConfig(checkpoint_dir="ck", model=model, measured=cal.measured)
        for phase in (Phase.QUIESCE, Phase.VERIFY):
            need = phase_deadline(d2, phase, dc).need
            assert need is not None and need.iteration_s == step_s, need
            assert need.basis == "measured, fit of generation 2"
        other = res.plan.model_copy(update={"plan_id": "p-other"})
        need = phase_deadline(d2.model_copy(update={"plan": other}), Phase.VERIFY, dc).need
        assert need is not None and need.basis == "predicted", need

        # a new leader's calibrator reads the kept record's back; this one keeps its own
        c2 = Calibrator(_config(tmp_path, job, "c2"), planner, audit, SystemClock())
        assert c2.measured is None
        await c2.restore(store, lead)
        assert c2.measured == here.model_copy(update={"source": "calibration v1"})
        await cal.restore(store, lead)
        assert cal.measured == here

        # the next layout's first fit replaces it: the old plan's time sizes nothing now
        new = res.plan.model_copy(update={"plan_id": "p-next"})
        d3 = _running(res, 3).model_copy(update={"plan": new})
        await fit(d3, 20)
        assert cal.measured == MeasuredIteration(
            plan_id="p-next", iteration_s=step_s, source="fit of generation 3"
        )

        # a plan without an id (the data-parallel stand-in's) is measured for no plan
        d4 = _running(res, 4).model_copy(
            update={"plan": res.plan.model_copy(update={"plan_id": ""})}
        )
        await fit(d4, 30)
        assert cal.measured is None
    finally:
        await tasks.close()
        await store.close()
        audit.close()
    kept = [r for r in read_records([cfg.audit_log]) if r["kind"] == "calibration"]
    assert kept and kept[0]["measured_step_s"] == step_s


def _fenced(exc: Exception) -> None:
    raise AssertionError(f"fenced: {exc}")


async def test_a_version_is_kept_only_from_stable_fits_that_predict_no_worse(
    servers: LocalServers, tmp_path: Path
) -> None:
    """The first version as every later one: kept once ``stable_reports`` fits in a row
    agree, and only when the fit predicts the running plan no worse than the kept
    calibration (or within the tolerance). Before, the first fit was kept whatever it was,
    and a later one whose constants moved was kept even when it predicted worse: every
    plan after it, membership replans included, was priced by it."""
    job = "t"
    planner = SailorPlanner.from_files("OPT-350", 32)
    res = planner.plan(NODES, None)
    cfg = _config(tmp_path, job, "c1")
    two = cfg.online_calibration.model_copy(update={"stable_reports": 2})
    cfg = cfg.model_copy(update={"online_calibration": two})
    audit = AuditLog(cfg.audit_log)
    cal = Calibrator(cfg, planner, audit, SystemClock())
    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    tasks = TaskSet("test-calibrator")
    try:
        lead = await campaign(store, Keys(job=job).leader, "c1", 5, timeout=10)

        async def fit(d: DesiredState, last_step: int, timings: tuple[RankTimings, ...]) -> None:
            fits = cal.fits
            cal.note(d)
            o = _observed(d, last_step, timings)
            assert cal.maybe_fit(d, o, tasks, store, lead, lambda _: None, _fenced)
            await until(lambda: cal.fits > fits, 30, f"a fit of generation {d.generation}")
            await until(lambda: not tasks.names, 30, "the fit's end")

        slow = _cluster_timings(cal, res.plan, 1.5)
        d2 = _running(res, 2)
        await fit(d2, 10, slow)
        assert cal.version == 0  # one fit: not stable yet
        await fit(d2, 11, slow)
        assert cal.version == 1
        kept = cal.calibration
        assert kept is not None

        # the V100's compute says 1.8x more, but every step takes what the kept version
        # predicts: the fitted constants add up to a worse prediction, and are not kept
        d3 = _running(res, 3)
        as_kept = _cluster_timings(cal, res.plan, 1.5)
        step = statistics.median(t.step_s for t in as_kept)
        odd = _cluster_timings(cal, res.plan, 2.7, step_s=step)
        await fit(d3, 20, odd)
        await fit(d3, 21, odd)
        assert cal._stable >= 2 and cal.last_fit is not None
        assert abs(cal.last_fit.error_after) > abs(cal.last_fit.error_before) + 0.1
        assert cal.version == 1 and cal.calibration == kept
    finally:
        await tasks.close()
        await store.close()
        audit.close()
    versions = [r["version"] for r in read_records([cfg.audit_log]) if r["kind"] == "calibration"]
    assert versions == [1]


async def test_a_kind_far_from_its_profile_is_kept_as_measured_and_judged(
    servers: LocalServers, tmp_path: Path
) -> None:
    """The V100 computes 3x its configured scale (an analytic profile off by more than one
    device's clock range; the closed loop's slow kind measures 40x): once the fits agree,
    the version kept holds the measured scale, the running layout is judged on it, and a
    later fit of the same timings keeps nothing more. A bound on how far one version moved
    a scale (x2) kept a scale the measurement said fell short, re-fitted the other constants
    around it, and judged no layout until a later version reached the measurement, which
    the no-worse guard could refuse for good."""
    job = "t"
    planner = SailorPlanner.from_files("OPT-350", 32)
    res = planner.plan(NODES, None)
    cfg = _config(tmp_path, job, "c1")
    judging = cfg.online_calibration.model_copy(update={"stable_reports": 2, "replan": True})
    cfg = cfg.model_copy(update={"online_calibration": judging})
    audit = AuditLog(cfg.audit_log)
    cal = Calibrator(cfg, planner, audit, SystemClock())
    assert cal.inputs is not None
    configured = cal.inputs.calibration.for_gpu("V100-16").compute_scale
    store = await connect_etcd(servers.etcd_endpoint, security=servers.security("c1"))
    tasks = TaskSet("test-calibrator")
    try:
        lead = await campaign(store, Keys(job=job).leader, "c1", 5, timeout=10)

        async def fit(d: DesiredState, last_step: int, timings: tuple[RankTimings, ...]) -> None:
            fits = cal.fits
            cal.note(d)
            o = _observed(d, last_step, timings)
            assert cal.maybe_fit(d, o, tasks, store, lead, lambda _: None, _fenced)
            await until(lambda: cal.fits > fits, 30, f"a fit of generation {d.generation}")
            await until(lambda: not tasks.names, 60, "the fit's end")

        slow = _cluster_timings(cal, res.plan, 3.0)
        d2 = _running(res, 2)
        await fit(d2, 10, slow)
        assert cal.version == 0 and cal.last_decision is None  # one fit: not stable yet
        await fit(d2, 11, slow)
        assert cal.version == 1 and cal.calibration is not None
        kept = cal.calibration.for_gpu("V100-16").compute_scale
        assert kept == pytest.approx(3 * configured, rel=0.02), (kept, configured)
        assert cal.last_fit is not None and abs(cal.last_fit.error_after) < 0.05
        decision = cal.last_decision
        assert decision is not None and decision.calibration_version == 1, decision
        await fit(d2, 12, slow)
        assert cal.version == 1  # the measurement reached: nothing moves
    finally:
        await tasks.close()
        await store.close()
        audit.close()
    judged = [r for r in read_records([cfg.audit_log]) if r["kind"] == "replan_decision"]
    assert judged and all(r["calibration_version"] == 1 for r in judged), judged
