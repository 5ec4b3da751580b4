"""Fit the running cluster's cost-model constants from its workers' step timings.

The constants of :class:`~sailor.schemas.calibration.GPUCalibration` are unknown for a user's
cluster until the job runs. Its workers report, per rank, the medians of their last steps
(:class:`~sailor.schemas.online_calibration.RankTimings`: forward and backward compute of one
microbatch, pipeline waits, gradient sync, optimizer step, the step). From those and the
running plan this module fits, per GPU type (kind) in the plan, each constant from the
measurement that isolates it (as :mod:`calibrate` does for offline runs, never from a fit of
iteration times):

* ``compute_scale`` (k): per rank, measured (fwd + bwd) per microbatch, less the framework
  time the simulator adds outside the layers, over the profiled layer compute of that rank's
  stage (the stage's fwd + bwd at scale 2 minus at scale 1: exactly what the scale multiplies).
  Per kind the median over its ranks; its standard error combines the spread between ranks
  (1.4826 × MAD / √n) and each rank's step-to-step spread (over √steps); the range is a 95 %
  interval (Student's t for the fewer degrees of freedom).
* ``p2p_efficiency`` (η_p2p) and ``p2p_fixed_s`` (c_p2p), one value each for the kinds in
  multi-stage pipelines: the 1F1B replay (with the fitted k) predicts each rank's time
  outside its own compute during the pipeline phase (transfers, fill and drain, waiting for
  a slower neighbour); the transfers' cost is scaled until the predicted sum over ranks
  equals the measured sum of ``p2p_s`` (bisection: the prediction grows with the scale).
  A running layout has one microbatch size, so its transfers cannot tell the fixed cost from
  the bandwidth (as in :mod:`calibrate`): the scale ``t`` moves both along one line through
  the anchor's pair ``(η0, c0)`` (the configured calibration's, so that every fit of a job
  stays on one line and a fixed cost fitted away can come back; without an anchor, the
  kept calibration's): ``η_p2p = η0 / t`` and ``c_p2p = c0 · t`` while ``η0 / t ≤ 1``;
  below that ``η_p2p = 1`` and ``c_p2p = c0 · t`` alone shrinks (to a thousandth of
  ``c0 · η0``). ``t = 1`` is the anchor's pair, and every transfer's time is a continuous,
  increasing function of ``t``. With ``c0 = 0`` the efficiency alone moves.
  Identified only when the transfers move the prediction (doubling their cost from
  ``η_p2p = 1``, at ``t = η0``, adds ≥ 5 % of the measured waits); else kept. The waits are
  mostly fill, drain and imbalance, which the compute scales set, so the range is solved
  at both ends of the compute scales' ranges as well as of the waits' own spread.
* ``sync_fixed_s`` (c): per kind, the median over its ranks without a gradient all-reduce
  (a stage no other pipeline holds) of their ``sync_s`` and the rest of their step outside
  the pipeline, the sync and the optimizer (``rest_s``: zeroing gradients, the engine's loss
  all-reduce), less the framework time per iteration the profile holds (which the simulator
  adds beside c). Of the stages holding a copy of a tied
  embedding (the engine all-reduces the copies in a group of their own after the segments)
  only the last to arrive counts: the others' syncs hold their wait for it, in 1F1B the
  pipeline's drain, which is no fixed cost.
* ``network_efficiency`` (η): per group of stages that all-reduce together, the rank with the
  least ``sync_s`` arrived last, so its sync is c + its all-reduces (no waiting for others);
  η is the efficiency at which the simulated all-reduces take (that sync − c): simulated at
  η = 1 over (that sync − c) where η applies on every link as read and no all-reduce of the
  plan's kinds was measured (one simulation, at η = 1); on links other than those the kind's
  efficiencies were read on (``GPUCalibration.efficiency_link_gbps``), or with a measured
  all-reduce latency (paid once, not derated), solved from the all-reduces simulated at
  η = 1 and 1/2 (time is affine in 1/η − 1 there), so that the fitted η is in the frame the
  simulator takes it in. c the median sync of the kind's
  lone ranks; a kind without any subtracts its kept ``sync_fixed_s`` from the same sum that
  constant is fitted from (the sync, ``rest_s`` and the optimizer step beyond its profile,
  less the framework time), not from the sync alone. A kind's η is the geometric mean
  over its groups; identified only where the all-reduces are ≥ 20 % of that sync. Its
  range spans the groups' η and each group's 95 % interval from its last arriver's
  step-to-step spread of the sync (one group gives a range too).

Constants of kinds not in the running plan, and those the measurements do not identify, keep
their values. Each fitted kind's entry carries the ranges the uncertainty corners take
(``GPUCalibration.spread``; :func:`~sailor.simulator.fit_corners.with_fitted_spread`): the
fitted constants' ranges, and for the rest (memory, allocator, hook cost: no step timing
measures them) the ranges they had before, the kind's own spread or the catalog prior. The
fit also reports how the running plan's predicted iteration time compares with the measured
one before and after (closed form; the measured step is the median over ranks). The
optimizer step is not fitted (``compute_scale`` leaves ``update_s`` alone); its
measured-to-simulated ratio is noted.

This module holds the entry point and the compute scale's fit; the p2p pair's fit is in
:mod:`fit_p2p`, the sync's constants' in :mod:`fit_sync`, what they share (the ranks'
timings, intervals, kept constants) in :mod:`fit_evidence`, and the calibrations made from
the fitted constants (:func:`~sailor.simulator.fit_corners.with_constant`, the ranges' ends
and corners) in :mod:`fit_corners`.

Pure: values in, one value out; no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

from sailor.schemas import (
    Calibration,
    Estimate,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Plan,
    PriceTable,
    ProfileDB,
    StageTime,
)
from sailor.schemas.online_calibration import FittedConstant, OnlineFit, RankTimings
from sailor.simulator.fit_corners import with_all, with_constant, with_fitted_spread
from sailor.simulator.fit_evidence import (
    RankEvidence,
    evidence_ranks,
    kept_constant,
    median_interval,
    robust_spread,
    stage_rows,
)
from sailor.simulator.fit_p2p import fit_p2p_constants
from sailor.simulator.fit_sync import fit_sync_constants, tied_holders
from sailor.simulator.simulate import simulate

__all__ = ["fit_online"]


def fit_online(
    plan: Plan,
    timings: Sequence[RankTimings],
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    *,
    calibration: Calibration | None = None,
    gpu_specs: Mapping[str, GPUSpec] | None = None,
    anchor: Calibration | None = None,
) -> OnlineFit:
    """The constants of the running cluster (see the module docstring).

    ``timings``: one entry per rank that reported (any subset of the plan's ranks, at least
    one). ``anchor``: the calibration whose p2p pair sets the line the transfers' cost is
    scaled along (the configured one, so that successive fits stay on one line); None: the
    kept ``calibration``. Raises ``ValueError`` when no timing belongs to the plan.
    """
    cal0 = calibration or Calibration()
    specs = gpu_specs or {}
    ranks, notes = evidence_ranks(plan, timings)
    if not ranks:
        raise ValueError(f"no timing of a rank of plan {plan.plan_id}")
    kinds = sorted({s.replica.gpu_type for p in plan.pipelines for s in p.stages})

    def sim(cal: Calibration) -> Estimate:
        return simulate(plan, model, profiles, network, prices, calibration=cal, gpu_specs=specs)

    constants: list[FittedConstant] = []
    cal = _fit_compute(ranks, kinds, cal0, sim, constants, notes)
    cal = fit_p2p_constants(
        plan,
        ranks,
        kinds,
        cal,
        anchor or cal0,
        constants,
        notes,
        model,
        profiles,
        network,
        prices,
        specs,
    )
    frame = {g: f.iteration_s for g in kinds if (f := profiles.framework_time(g)) is not None}
    cal = fit_sync_constants(
        plan,
        ranks,
        kinds,
        cal,
        sim,
        constants,
        notes,
        tied_holders(plan, model),
        frame,
        network=network,
    )
    cal = with_fitted_spread(cal, cal0, kinds, constants)
    before = sim(cal0)
    after = sim(cal)
    notes.extend(_optimizer_notes(ranks, stage_rows(after)))
    measured = statistics.median(r.t.step_s for r in ranks)
    return OnlineFit(
        calibration=cal,
        constants=tuple(constants),
        plan_id=plan.plan_id,
        ranks=len(ranks),
        steps=min(r.t.steps for r in ranks),
        measured_step_s=measured,
        predicted_before_s=before.iteration_time_s,
        predicted_after_s=after.iteration_time_s,
        notes=tuple(notes),
    )


def _fit_compute(
    ranks: list[RankEvidence],
    kinds: list[str],
    cal0: Calibration,
    sim: Callable[[Calibration], Estimate],
    out: list[FittedConstant],
    notes: list[str],
) -> Calibration:
    one = stage_rows(sim(with_all(cal0, kinds, compute_scale=1.0)))
    two = stage_rows(sim(with_all(cal0, kinds, compute_scale=2.0)))
    by_kind: dict[str, list[tuple[float, float, int]]] = {g: [] for g in kinds}
    for r in ranks:
        a, b = one[(r.pipeline, r.stage)], two[(r.pipeline, r.stage)]
        layers = (b.fwd_s + b.bwd_s) - (a.fwd_s + a.bwd_s)
        outside = (a.fwd_s + a.bwd_s) - layers  # framework time the scale does not touch
        # the whole pipeline compute per microbatch: the timed passes and the code between
        # them (data, loss, the schedule's own), as the simulator's stage time holds both
        between = r.t.between_s / r.m if r.m else 0.0
        measured = r.t.fwd_s + r.t.bwd_s + between - outside
        if layers <= 0 or measured <= 0:
            notes.append(
                f"rank {r.rank}: no layer compute to compare ({measured:.3g} s measured, "
                f"{layers:.3g} s profiled)"
            )
            continue
        by_kind[r.gpu_type].append((measured / layers, r.t.compute_spread, r.t.steps))
    cal = cal0
    for g in kinds:
        prev = cal0.for_gpu(g).compute_scale
        xs = by_kind[g]
        if not xs:
            out.append(
                kept_constant(g, "compute_scale", prev, "no rank of this kind reported compute")
            )
            continue
        scales = [x for x, _, _ in xs]
        value = statistics.median(scales)
        se, low, high = median_interval(
            value, robust_spread(scales), len(xs), [w for _, w, _ in xs], sum(s for *_, s in xs)
        )
        low = max(low, value * 1e-3)
        cal = with_constant(cal, g, compute_scale=value)
        out.append(
            FittedConstant(
                gpu_type=g,
                name="compute_scale",
                value=value,
                low=low,
                high=high,
                previous=prev,
                samples=len(xs),
                fitted=True,
                evidence=(
                    f"median of {len(xs)} rank(s) measured/profiled layer compute per "
                    f"microbatch: {min(scales):.3g}..{max(scales):.3g}; se {se:.2g}"
                ),
            )
        )
    return cal


def _optimizer_notes(
    ranks: list[RankEvidence], rows: dict[tuple[int, int], StageTime]
) -> list[str]:
    """Measured over simulated optimizer step per kind (not fitted: noted)."""
    ratios: dict[str, list[float]] = {}
    for r in ranks:
        u = rows[(r.pipeline, r.stage)].update_s
        if u > 0 and r.t.optim_s > 0:
            ratios.setdefault(r.gpu_type, []).append(r.t.optim_s / u)
    return [
        f"{g}: optimizer step measured {statistics.median(x):.3g}x simulated (not fitted)"
        for g, x in sorted(ratios.items())
    ]
