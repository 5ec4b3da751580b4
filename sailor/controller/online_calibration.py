"""Online calibration in the controller: fit, keep, plan with, and judge a replan.

The I/O shell around two pure parts, :func:`sailor.simulator.online_fit.fit_online` (the
fit) and :func:`sailor.controller.recalibrate.decide_recalibration` (the rule). Per leader
pass, :meth:`Calibrator.note` follows the desired state (phase changes, for the downtime of
past reconfigurations; it drops a verdict that no longer applies) and hands ``decide`` the
current verdict; :meth:`Calibrator.maybe_fit` starts a fit, at most every ``interval_s``,
once every placed node reports timings of the running generation over ``min_steps`` steps
for each of its ranks and some rank reported a new step since the last fit. The fit task:

1. fits the running plan's constants (in a thread), starting from the kept calibration;
2. counts the fit stable when no compute scale moved by more than ``stable_tolerance`` (or
   its own uncertainty) since the previous fit of the generation;
3. keeps a new **version** when a fitted constant moved that much since the kept one (or,
   once per generation, the fit halves the kept calibration's miss of the running plan),
   the first version as every later one, and only when the generation's last
   ``stable_reports`` fits agree and the fit predicts the running plan no worse than the
   kept calibration (or within the tolerance); a fit that moved and is not kept is logged
   (``calibration_not_kept``) with why. A version is ``calibration/versions/<n>`` and the
   pointer ``calibration/current`` in
   one transaction guarded by the leader's epoch, a ``calibration`` audit record (version,
   constants with their ranges, prediction error before and after), and hands it to the
   planner (every later plan, membership changes included, is priced with it);
4. asks the planner for the best plan of the same nodes under it, prices both plans in the
   fitted model (and at both ends of the fitted compute scales), and applies the rule: a
   ``replan_decision`` audit record with every number; a verdict to reconfigure becomes a
   :class:`~sailor.controller.decision_types.RecalibrationAdvice`, which ``decide`` turns into a
   quiesce with cause ``recalibration: ...`` toward that plan.

A new leader reads the current version back (:meth:`Calibrator.restore`, a
``calibration_restored`` record) before it plans; a record kept before the fit carried its
ranges (a fitted kind's entry without a ``spread``, or with its offline one) gets them
rebuilt from the configured calibration, as the fit makes them (``spread_rebuilt`` names the
kinds). A fit or a judgement that fails (an input the cost model cannot price, the planner
failing) is audited (``calibration_failed``) and not retried in that generation: training
goes on, priced with the last kept calibration. A
guarded write refused means this leader was deposed: ``on_fenced`` ends the term.

Only with the ``sailor`` planner (the data-parallel stand-in prices nothing). Never imports
torch or the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from sailor.controller.audit import AuditLog
from sailor.controller.config import ControllerConfig
from sailor.controller.decision_types import Observed, RecalibrationAdvice
from sailor.controller.plan_deadlines import MeasuredIteration
from sailor.controller.planning import Planner, PlanResult
from sailor.controller.planning.in_process import CostInputs, cost_inputs_of
from sailor.controller.recalibrate import (
    RecalibrationPolicy,
    ReplanDecision,
    ReplanInputs,
    decide_recalibration,
    expected_downtime,
    mean_time_between_changes,
)
from sailor.coordination import (
    Clock,
    EtcdStore,
    FencedError,
    Keys,
    Leadership,
    TaskSet,
    TemporaryError,
)
from sailor.schemas.calibration import Calibration
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.json_text import JsonTooDeepError, load_json
from sailor.schemas.online_calibration import (
    CalibrationPointer,
    CalibrationRecord,
    OnlineFit,
    RankTimings,
)
from sailor.schemas.plan import Plan
from sailor.schemas.runtime import DesiredState, Phase
from sailor.schemas.training import TrainingConfig
from sailor.simulator import simulate
from sailor.simulator.fit_corners import range_corners, with_spread_restored
from sailor.simulator.online_fit import fit_online

__all__ = ["KEEP_VERSIONS", "Calibrator", "TraceFileError", "load_trace"]

_log = structlog.get_logger("sailor.controller")

KEEP_VERSIONS = 20
"""Calibration versions kept in etcd; writing version n deletes version n - 20."""

_MISPREDICTS = "running plan: error "
"""How a version kept for the running plan's misprediction says so (``moved``)."""

PLAN_TIMEOUT_S = 60.0
"""The best plan under a new calibration must come within this (like a replan)."""


def _measured(fit: OnlineFit, source: str) -> MeasuredIteration | None:
    """A fit's measured iteration, for the deadlines (None for a fit of an unnamed plan)."""
    if not fit.plan_id:
        return None
    return MeasuredIteration(
        plan_id=fit.plan_id, iteration_s=fit.measured_step_s, source=source[:200]
    )


class TraceFileError(ValueError):
    """A membership trace file that cannot give a mean time between changes (names the
    file, the row, the field and the value)."""


def load_trace(path: Path) -> float:
    """Mean time between changes of a ``[{"Time": s, "GPUs": n}, ...]`` trace file: ``Time``
    a finite number of seconds, ``GPUs`` a whole count from 0 (``TraceFileError`` names the
    first row that is not). Read at the controller's start: a NaN time made the horizon NaN,
    and every replan judgement of the job then failed; a missing key stopped the controller
    with a bare ``KeyError: 'Time'``; a count of 4.7 was read as 4."""
    try:
        rows = load_json(path.read_text(), str(path))
    except JsonTooDeepError as exc:  # a bare RecursionError stopped the controller's start
        raise TraceFileError(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise TraceFileError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(rows, list):
        raise TraceFileError(
            f'{path}: a trace is a list of {{"Time": s, "GPUs": n}}, got {type(rows).__name__}'
        )
    points: list[tuple[float, int]] = []
    for i, r in enumerate(rows):
        t, n = (r.get("Time"), r.get("GPUs")) if isinstance(r, dict) else (None, None)
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            raise TraceFileError(f"{path}: [{i}].Time={t!r}: a finite number of seconds")
        if isinstance(n, bool) or not isinstance(n, int | float) or n < 0 or n != int(n):
            raise TraceFileError(f"{path}: [{i}].GPUs={n!r}: a whole count from 0")
        points.append((float(t), int(n)))
    try:
        return mean_time_between_changes(points)
    except ValueError as exc:
        raise TraceFileError(f"{path}: {exc}") from exc


class Calibrator:
    """Online calibration of one controller process (state kept across its terms)."""

    def __init__(
        self,
        config: ControllerConfig,
        planner: Planner,
        audit: AuditLog,
        clock: Clock,
        training: TrainingConfig | None = None,
    ) -> None:
        s = config.online_calibration
        self.settings = s
        self.policy = RecalibrationPolicy(
            margin=s.margin, min_improvement=s.min_improvement, stable_reports=s.stable_reports
        )
        self.planner = planner
        self.audit = audit
        self.clock = clock
        self.training = training
        self.keys = Keys(job=config.job)
        self.enabled = (
            s.enabled
            and config.planner == "sailor"
            and getattr(planner, "set_calibration", None) is not None
        )
        # read at start, like the training config: a broken file stops the controller early
        self.inputs: CostInputs | None = cost_inputs_of(config) if self.enabled else None
        self.time_to_change_s = (
            load_trace(s.membership_trace)
            if s.membership_trace is not None
            else s.time_between_changes_s
        )
        self.version = 0
        self.calibration: Calibration | None = self.inputs.calibration if self.inputs else None
        self.last_fit: OnlineFit | None = None
        self.last_decision: ReplanDecision | None = None
        self.advice: RecalibrationAdvice | None = None
        self.measured: MeasuredIteration | None = None
        """The latest fit's measured iteration (or the kept record's, read back by a new
        leader): what QUIESCE and VERIFY of that plan are sized by (``DecideConfig``)."""
        self.fits = 0
        self._generation = -1  # generation of the fits counted in _stable
        self._stable = 0
        self._last_fit_at = -math.inf
        self._last_fit_step = -1
        self._decided = -1  # generation a recalibration replan was decided in
        self._failed = -1  # generation whose fit or judgement failed (not retried)
        self._refit = -1  # generation whose misprediction was kept (once per generation)
        self._phases: list[tuple[str, float]] = []
        self._phase: tuple[int, Phase] | None = None
        self._task: asyncio.Task[Any] | None = None

    # --- every pass -----------------------------------------------------------------------

    def note(self, desired: DesiredState) -> RecalibrationAdvice | None:
        """Follow the desired state; the verdict ``decide`` should see this pass (if any)."""
        key = (desired.generation, desired.phase)
        if key != self._phase:
            self._phase = key
            self._phases.append((desired.phase.value, self.clock.now()))
            del self._phases[:-64]
        adv = self.advice
        if adv is not None and (
            desired.phase is not Phase.RUNNING or desired.generation != adv.generation
        ):
            self.advice = adv = None
        return adv

    def maybe_fit(
        self,
        desired: DesiredState,
        observed: Observed,
        tasks: TaskSet,
        store: EtcdStore,
        lead: Leadership,
        wake: Callable[[bool], None],
        on_fenced: Callable[[FencedError], None],
    ) -> bool:
        """Start a fit if one is due (module docstring); True if one started."""
        if not self.enabled or self.inputs is None or desired.plan is None:
            return False
        if desired.phase is not Phase.RUNNING or desired.generation == self._failed:
            return False
        if self._task is not None and not self._task.done():
            return False
        if self.clock.now() - self._last_fit_at < self.settings.interval_s:
            return False
        timings = self._timings(desired, observed)
        if timings is None:
            return False
        newest = min(t.last_step for t in timings)
        if desired.generation == self._generation and newest <= self._last_fit_step:
            return False
        self._last_fit_at = self.clock.now()
        nodes = tuple(observed.nodes[n] for n in observed.usable)
        self._task = tasks.spawn(
            f"calibrate-g{desired.generation}",
            self._fit_and_judge(desired, timings, newest, nodes, store, lead, wake, on_fenced),
        )
        return True

    def _timings(self, d: DesiredState, o: Observed) -> list[RankTimings] | None:
        """Every placed rank's timings of generation ``d.generation``, or None if some rank
        has none yet (or over fewer than ``min_steps`` steps)."""
        out: list[RankTimings] = []
        for node, ranks in d.placement.items():
            st = o.status.get(node)
            if st is None or st.generation != d.generation or st.state != "running":
                return None
            by_rank = {t.rank: t for t in st.timings}
            for r in ranks:
                t = by_rank.get(r)
                if t is None or t.steps < self.settings.min_steps:
                    return None
                out.append(t)
        return out or None

    # --- the fit task ---------------------------------------------------------------------

    async def _fit_and_judge(
        self,
        d: DesiredState,
        timings: list[RankTimings],
        newest: int,
        nodes: tuple[NodeSpec, ...],
        store: EtcdStore,
        lead: Leadership,
        wake: Callable[[bool], None],
        on_fenced: Callable[[FencedError], None],
    ) -> None:
        try:
            await self._fit_and_judge_once(d, timings, newest, nodes, store, lead, wake)
        except FencedError as exc:
            on_fenced(exc)
        except TemporaryError as exc:  # etcd unavailable: the next interval tries again
            _log.warning("calibration_retry", error=str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # not the controller's end: training goes on, priced as before
            self._failed = d.generation
            with contextlib.suppress(OSError, ValueError):
                self.audit.write(
                    "calibration_failed",
                    self.clock.now(),
                    epoch=lead.epoch,
                    generation=d.generation,
                    error=repr(exc)[:500],
                )
            _log.warning("calibration_failed", error=repr(exc)[:300])

    async def _fit_and_judge_once(
        self,
        d: DesiredState,
        timings: list[RankTimings],
        newest: int,
        nodes: tuple[NodeSpec, ...],
        store: EtcdStore,
        lead: Leadership,
        wake: Callable[[bool], None],
    ) -> None:
        inp, plan, base = self.inputs, d.plan, self.calibration
        if inp is None or plan is None or base is None:
            return
        fit = await asyncio.to_thread(
            fit_online,
            plan,
            timings,
            inp.model,
            inp.profiles,
            inp.network,
            inp.prices,
            calibration=base,
            gpu_specs=inp.gpu_specs,
            anchor=inp.calibration,
        )
        self.fits += 1
        self.measured = _measured(fit, f"fit of generation {d.generation}")
        if d.generation != self._generation:
            self._generation, self._stable, self.last_fit = d.generation, 0, None
        prev = self.last_fit
        self._stable = self._stable + 1 if prev is None or self._agrees(prev, fit) else 1
        self.last_fit = fit
        self._last_fit_step = newest
        moved, refused = self._to_keep(fit, base, d.generation)
        if moved:
            if moved[0].startswith(_MISPREDICTS):
                self._refit = d.generation
            await self._keep(fit, d, store, lead, moved)
        elif refused:
            _log.warning("calibration_not_kept", generation=d.generation, reason=refused)
        if not self.settings.replan or d.generation <= self._decided or not self._runs(d):
            return
        if self.version == 0:
            # none kept (the configured constants priced the running plan as measured, or
            # the fits are not stable yet): nothing to replan for
            return
        decision, best = await self._judge(d, plan, fit, nodes, newest)
        if not self._runs(d):  # the layout changed while the planner searched: moot
            return
        self.last_decision = decision
        self.audit.write(
            "replan_decision", self.clock.now(), epoch=lead.epoch, **decision.model_dump()
        )
        await self.audit.durable()
        if decision.reconfigure and best is not None:
            self._decided = d.generation
            self.advice = RecalibrationAdvice(
                generation=d.generation,
                plan=best.plan,
                placement=best.placement,
                membership=tuple(n.node_id for n in nodes),
                cause=(
                    f"recalibration: calibration v{decision.calibration_version} prices "
                    f"{decision.running_plan} at {decision.running_s:.4g} s, "
                    f"{decision.best_plan} at {decision.best_s:.4g} s; {decision.reason}"
                ),
            )
            wake(True)

    def _runs(self, d: DesiredState) -> bool:
        """The generation the fit is of still runs (as of the loop's last pass)."""
        return self._phase == (d.generation, Phase.RUNNING)

    def _agrees(self, prev: OnlineFit, fit: OnlineFit) -> bool:
        """No compute scale moved by more than the tolerance (or its uncertainty)."""
        tol = self.settings.stable_tolerance
        for c in fit.constants:
            if c.name != "compute_scale" or not c.fitted:
                continue
            p = prev.constant(c.gpu_type, c.name)
            if p is None or not p.fitted:
                return False
            allowed = max(tol, c.relative_uncertainty) * abs(p.value)
            if abs(c.value - p.value) > allowed:
                return False
        return True

    def _to_keep(self, fit: OnlineFit, kept: Calibration, generation: int) -> tuple[list[str], str]:
        """Whether ``fit`` becomes the next version: (why: the constants that moved from
        ``kept`` or the running plan's misprediction it halves; [] keeps nothing), and why a
        fit that moved is not kept ('' otherwise). Every version, the first included (it
        was kept whatever it was), needs the generation's fits stable (``stable_reports``
        in a row agreeing: one fit of early or disturbed steps priced every membership
        replan after it) and a prediction of the running plan no worse than the kept
        calibration's, or within the tolerance (:meth:`_worse`)."""
        if self._stable < self.policy.stable_reports:
            return [], ""
        moved = self._moved(fit, kept)
        if not moved and self._refit != generation:
            moved = self._mispredicts(fit)
        if not moved:
            return [], ""
        worse = self._worse(fit)
        return ([], worse) if worse else (moved, "")

    def _worse(self, fit: OnlineFit) -> str:
        """Why ``fit`` predicts the running plan worse than the calibration it started from
        (the kept one), beyond the tolerance; '' when it does not. Constants fitted each
        from the measurement that isolates it can still add up to a worse iteration time
        (a pipeline wait or sync the cost model attributes otherwise): such a fit is no
        better calibration for the planner than the kept one."""
        before, after = fit.error_before, fit.error_after
        tol = self.settings.stable_tolerance
        if abs(after) <= max(abs(before), tol):
            return ""
        return (
            f"the fit predicts the running plan worse than the kept calibration: error "
            f"{before:+.1%} -> {after:+.1%} (tolerance {tol:.0%})"
        )

    def _mispredicts(self, fit: OnlineFit) -> list[str]:
        """The running plan's prediction, when the kept calibration misses its measured step
        by more than the tolerance and the fit halves the miss (once per generation, when
        its fits are stable: the caller). Without it, constants whose ranges are wide (two
        ranks of a kind, steps of a few milliseconds on shared cores) never count as moved,
        stay as first fitted on the previous layout, and a new layout is priced from what
        the old one showed. ``fit.error_before`` is the kept calibration's error (the fit
        starts from it)."""
        before, after = fit.error_before, fit.error_after
        if abs(before) > self.settings.stable_tolerance and abs(after) <= abs(before) / 2:
            return [f"{_MISPREDICTS}{before:+.1%} -> {after:+.1%}"]
        return []

    def _moved(self, fit: OnlineFit, kept: Calibration) -> list[str]:
        """Fitted constants that moved from the kept calibration by more than the tolerance
        (or their own uncertainty)."""
        out = []
        tol = self.settings.stable_tolerance
        for c in fit.constants:
            if not c.fitted:
                continue
            g = kept.for_gpu(c.gpu_type)
            old = g.p2p_eta if c.name == "p2p_efficiency" else float(getattr(g, c.name))
            floor = {"sync_fixed_s": 1e-3, "p2p_fixed_s": 1e-4}.get(c.name, 0.0)
            scale = max(abs(old), floor)
            if abs(c.value - old) > max(tol, c.relative_uncertainty) * scale:
                out.append(f"{c.gpu_type}.{c.name}")
        return out

    async def _keep(
        self,
        fit: OnlineFit,
        d: DesiredState,
        store: EtcdStore,
        lead: Leadership,
        moved: Sequence[str],
    ) -> None:
        version = self.version + 1
        now = self.clock.now()
        rec = CalibrationRecord(
            version=version, epoch=lead.epoch, generation=d.generation, time=now, fit=fit
        )
        ptr = CalibrationPointer(version=version, epoch=lead.epoch)
        old = version - KEEP_VERSIONS
        await store.put_all_guarded(
            [
                (self.keys.calibration_version(version), rec.model_dump_json().encode()),
                (self.keys.calibration, ptr.model_dump_json().encode()),
            ],
            self.keys.leader,
            lead.epoch,
            delete=[self.keys.calibration_version(old)] if old >= 1 else [],
        )
        self.version, self.calibration = version, fit.calibration
        self.audit.write(
            "calibration",
            now,
            epoch=lead.epoch,
            version=version,
            generation=d.generation,
            plan_id=fit.plan_id,
            ranks=fit.ranks,
            steps=fit.steps,
            measured_step_s=fit.measured_step_s,
            predicted_before_s=fit.predicted_before_s,
            predicted_after_s=fit.predicted_after_s,
            error_before=round(fit.error_before, 6),
            error_after=round(fit.error_after, 6),
            moved=list(moved),
            constants=[c.model_dump() for c in fit.constants],
            notes=list(fit.notes),
        )
        await self.audit.durable()
        self._hand_to_planner(fit.calibration)

    def _hand_to_planner(self, cal: Calibration) -> None:
        setter = getattr(self.planner, "set_calibration", None)
        if setter is not None:
            setter(cal)

    async def _judge(
        self,
        d: DesiredState,
        plan: Plan,
        fit: OnlineFit,
        nodes: tuple[NodeSpec, ...],
        step: int,
    ) -> tuple[ReplanDecision, PlanResult | None]:
        best = await self._best_plan(nodes, plan)
        cal = self.calibration
        assert_inp = self.inputs
        if cal is None or assert_inp is None:
            raise RuntimeError("calibration lost during a fit")
        # the point estimate, then every corner of the fitted ranges: the best plan must win
        # at all of them (a mixed corner, one kind faster and another slower than fitted,
        # is where a plan that moves work between kinds loses)
        corners = [cal, *range_corners(cal, fit.constants)]
        times = await asyncio.to_thread(
            lambda: [(self._price(plan, c), self._price(best.plan, c)) for c in corners]
        )
        running_s, best_s = times[0]
        worst = min(1.0 - b / r for r, b in times)
        downtime, source = expected_downtime(self._phases, self.settings.default_downtime_s)
        total = self.training.schedule.total_steps if self.training is not None else None
        inputs = ReplanInputs(
            generation=d.generation,
            calibration_version=max(self.version, 1),
            running_plan=plan.plan_id,
            best_plan=best.plan.plan_id,
            same_layout=best.plan.pipelines == plan.pipelines,
            running_s=running_s,
            best_s=best_s,
            measured_s=fit.measured_step_s,
            worst_improvement=worst,
            corners=len(corners) - 1,
            downtime_s=downtime,
            downtime_source=source,
            time_to_change_s=self.time_to_change_s,
            remaining_steps=max(0, total - step) if total is not None else None,
            stable_reports=self._stable,
            decided_generation=self._decided,
        )
        return decide_recalibration(inputs, self.policy), best

    def _price(self, plan: Plan, cal: Calibration) -> float:
        inp = self.inputs
        if inp is None:
            raise RuntimeError("no cost inputs")
        est = simulate(
            plan,
            inp.model,
            inp.profiles,
            inp.network,
            inp.prices,
            calibration=cal,
            gpu_specs=inp.gpu_specs,
        )
        return est.iteration_time_s

    async def _best_plan(self, nodes: tuple[NodeSpec, ...], running: Plan) -> PlanResult:
        aplan = getattr(self.planner, "aplan", None)
        if aplan is not None:
            work = aplan(nodes, running, running.precision)  # the job's (launch records it)
        else:
            work = asyncio.to_thread(self.planner.plan, nodes, running, running.precision)
        result: PlanResult = await asyncio.wait_for(work, PLAN_TIMEOUT_S)
        return result

    # --- takeover -------------------------------------------------------------------------

    async def restore(self, store: EtcdStore, lead: Leadership) -> None:
        """Read the current calibration version back from etcd (a new leader, or this one
        again); plan with it. An unreadable record is audited and the kept one stays."""
        if not self.enabled:
            return
        ptr_kv = await store.get(self.keys.calibration)
        if ptr_kv is None:
            return
        try:
            ptr = CalibrationPointer.model_validate_json(ptr_kv.value)
            kv = await store.get(self.keys.calibration_version(ptr.version))
            if kv is None:
                raise ValueError(f"version {ptr.version} named by the pointer is missing")
            rec = CalibrationRecord.model_validate_json(kv.value)
        except (ValidationError, ValueError) as exc:
            self.audit.write(
                "calibration_failed",
                self.clock.now(),
                epoch=lead.epoch,
                generation=-1,
                error=f"unreadable calibration in etcd: {str(exc).splitlines()[0][:300]}",
            )
            return
        # a record kept before the fit carried its spread: rebuilt from the configured
        # calibration, as the fit makes it (else every uncertainty corner is one point)
        base = self.inputs.calibration if self.inputs is not None else Calibration()
        cal, rebuilt = with_spread_restored(rec.fit.calibration, base, rec.fit.constants)
        if rec.version >= self.version:
            self.version, self.calibration = rec.version, cal
            if self.measured is None:
                self.measured = _measured(rec.fit, f"calibration v{rec.version}")
            self._hand_to_planner(cal)
        self.audit.write(
            "calibration_restored",
            self.clock.now(),
            sync=True,
            epoch=lead.epoch,
            version=rec.version,
            written_by_epoch=rec.epoch,
            generation=rec.generation,
            spread_rebuilt=rebuilt,
        )

    def summary(self) -> Mapping[str, object]:
        """What ``sailor status`` and tests may show about it."""
        return {
            "enabled": self.enabled,
            "version": self.version,
            "fits": self.fits,
            "stable_reports": self._stable,
            "decided_generation": self._decided,
        }
