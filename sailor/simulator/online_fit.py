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
  η = simulated all-reduce time at η = 1 / (that sync − c). A kind's η is the geometric mean
  over its groups; identified only where the all-reduces are ≥ 20 % of that sync.

Constants of kinds not in the running plan, and those the measurements do not identify, keep
their values. The fit also reports how the running plan's predicted iteration time compares
with the measured one before and after (closed form; the measured step is the median over
ranks). The optimizer step is not fitted (``compute_scale`` leaves ``update_s`` alone); its
measured-to-simulated ratio is noted.

Pure: values in, one value out; no I/O, no clock.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

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
from sailor.schemas.online_calibration import ConstantName, FittedConstant, OnlineFit, RankTimings
from sailor.simulator.simulate import simulate
from sailor.simulator.stage_ends import replay_stage_ends

__all__ = ["fit_online", "range_corners", "robust_spread", "scale_ends", "with_constant"]

_MAD_TO_SIGMA = 1.4826
"""MAD x this = the standard deviation of a normal sample."""
_MEDIAN_SE = 1.2533
"""Standard error of a median over n normal samples: this x sigma / sqrt(n)."""
_P2P_SENSITIVITY = 0.05
"""The p2p pair is identified when doubling the transfers' cost from η_p2p = 1 (at the kept
fixed cost times η0) adds at least this fraction of the measured waits."""
_SYNC_SHARE = 0.2
"""η is identified from a replica group whose all-reduces are at least this share of its sync."""
_ETA_MIN = 0.01
_FIXED_FLOOR = 1e-3
"""The least scale ``t`` over η0: the fixed cost per transfer goes down to c0 · η0 / 1000
(with η_p2p = 1), a thousandth of what it is where η_p2p reaches 1."""
_BISECT_STEPS = 14
"""Halvings of log t over its range (up to ~1e-3 .. 1e2): ~0.1 % relative precision."""
_RANGE_STEPS = 10
"""... and for the ends of its range: ~2 %."""


@dataclass(frozen=True)
class _Rank:
    rank: int
    pipeline: int
    stage: int
    gpu_type: str
    m: int
    t: RankTimings


def robust_spread(xs: Sequence[float]) -> float:
    """1.4826 x the median absolute deviation of ``xs`` (0 for fewer than two)."""
    if len(xs) < 2:
        return 0.0
    mid = statistics.median(xs)
    return _MAD_TO_SIGMA * statistics.median(abs(x - mid) for x in xs)


def with_constant(cal: Calibration, gpu_type: str, **values: float) -> Calibration:
    """``cal`` with ``values`` set on ``gpu_type``'s constants (an entry made if it has none)."""
    base = cal.for_gpu(gpu_type)
    return cal.with_gpu(base.model_copy(update={"gpu_type": gpu_type, **values}))


def _with_all(cal: Calibration, kinds: Iterable[str], **values: float) -> Calibration:
    for g in kinds:
        cal = with_constant(cal, g, **values)
    return cal


def _stage_rows(est: Estimate) -> dict[tuple[int, int], StageTime]:
    return {(s.pipeline, s.stage): s for s in est.stages}


def _ranks(plan: Plan, timings: Sequence[RankTimings]) -> tuple[list[_Rank], list[str]]:
    order = plan.ranks()
    out: list[_Rank] = []
    notes: list[str] = []
    seen: set[int] = set()
    for t in sorted(timings, key=lambda x: x.rank):
        if t.rank >= len(order) or t.rank in seen:
            notes.append(f"rank {t.rank}: not a rank of plan {plan.plan_id} (ignored)")
            continue
        seen.add(t.rank)
        pi, si, _ = order[t.rank]
        p = plan.pipelines[pi]
        out.append(_Rank(t.rank, pi, si, p.stages[si].replica.gpu_type, p.num_microbatches, t))
    return out, notes


_T975 = (
    (1, 12.71),
    (2, 4.30),
    (3, 3.18),
    (4, 2.78),
    (5, 2.57),
    (6, 2.45),
    (8, 2.31),
    (10, 2.23),
    (15, 2.13),
    (20, 2.09),
    (30, 2.04),
)
"""Student's t 97.5 % quantiles by degrees of freedom (two-sided 95 %)."""


def _t975(dof: int) -> float:
    """The t quantile of the largest tabled ``dof`` not above it (conservative); 1.96 above 30."""
    if dof > 30:
        return 1.96
    t = _T975[0][1]
    for d, q in _T975:
        if dof >= d:
            t = q
    return t


def _interval(
    value: float, between: float, n: int, within_rel: Sequence[float], steps: int
) -> tuple[float, float, float]:
    """(standard error, low, high) of a median ``value`` of ``n`` ranks: the spread between
    ranks over √n and the ranks' own step-to-step spread over √(all steps); the range is a
    95 % interval with Student's t for the fewer degrees of freedom of the two (a spread
    taken from three steps is itself uncertain)."""
    se_between = between / math.sqrt(n) if n > 1 else 0.0
    rms = math.sqrt(statistics.fmean(w * w for w in within_rel)) if within_rel else 0.0
    se_within = _MEDIAN_SE * abs(value) * rms / math.sqrt(max(steps, 1))
    se = math.hypot(se_between, se_within)
    dofs = [d for d, e in ((n - 1, se_between), (steps - n, se_within)) if e > 0]
    k = _t975(max(1, min(dofs))) if dofs else 2.0
    return se, value - k * se, value + k * se


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
    ranks, notes = _ranks(plan, timings)
    if not ranks:
        raise ValueError(f"no timing of a rank of plan {plan.plan_id}")
    kinds = sorted({s.replica.gpu_type for p in plan.pipelines for s in p.stages})

    def sim(cal: Calibration) -> Estimate:
        return simulate(plan, model, profiles, network, prices, calibration=cal, gpu_specs=specs)

    constants: list[FittedConstant] = []
    cal = _fit_compute(ranks, kinds, cal0, sim, constants, notes)
    cal = _fit_p2p(
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
    cal = _fit_sync(
        plan, ranks, kinds, cal, sim, constants, notes, _tied_holders(plan, model), frame
    )
    before = sim(cal0)
    after = sim(cal)
    notes.extend(_optimizer_notes(ranks, _stage_rows(after)))
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


def _kept(g: str, name: ConstantName, value: float, why: str, samples: int = 0) -> FittedConstant:
    return FittedConstant(
        gpu_type=g,
        name=name,
        value=value,
        low=value,
        high=value,
        previous=value,
        samples=samples,
        fitted=False,
        evidence=why[:1000],
    )


def _fit_compute(
    ranks: list[_Rank],
    kinds: list[str],
    cal0: Calibration,
    sim: Callable[[Calibration], Estimate],
    out: list[FittedConstant],
    notes: list[str],
) -> Calibration:
    one = _stage_rows(sim(_with_all(cal0, kinds, compute_scale=1.0)))
    two = _stage_rows(sim(_with_all(cal0, kinds, compute_scale=2.0)))
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
            out.append(_kept(g, "compute_scale", prev, "no rank of this kind reported compute"))
            continue
        scales = [x for x, _, _ in xs]
        value = statistics.median(scales)
        se, low, high = _interval(
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


def _pred_waits(
    plan: Plan,
    cal: Calibration,
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    specs: Mapping[str, GPUSpec],
) -> dict[tuple[int, int], float]:
    """Per (pipeline, stage) of a multi-stage pipeline: the replay's time of the stage
    outside its own compute during the pipeline phase (transfers, fill, drain, waits)."""
    est, end = replay_stage_ends(plan, model, profiles, network, prices, cal, specs)
    rows = _stage_rows(est)
    out: dict[tuple[int, int], float] = {}
    for pi, p in enumerate(plan.pipelines):
        if p.depth < 2:
            continue
        for si in range(p.depth):
            st = rows[(pi, si)]
            busy = p.num_microbatches * (st.fwd_s + st.bwd_s)
            out[(pi, si)] = max(0.0, end[(pi, si)] - busy)
    return out


def _fit_p2p(
    plan: Plan,
    ranks: list[_Rank],
    kinds: list[str],
    cal: Calibration,
    anchor: Calibration,
    out: list[FittedConstant],
    notes: list[str],
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    specs: Mapping[str, GPUSpec],
) -> Calibration:
    piped = [r for r in ranks if plan.pipelines[r.pipeline].depth > 1]
    involved = sorted({r.gpu_type for r in piped})
    for g in kinds:
        if g not in involved:
            gc = cal.for_gpu(g)
            why = "no multi-stage pipeline on this kind"
            out.append(_kept(g, "p2p_efficiency", gc.p2p_eta, why))
            out.append(_kept(g, "p2p_fixed_s", gc.p2p_fixed_s, why))
    if not piped:
        return cal
    # the line's pair: what the anchor charges a boundary between these kinds
    eta0, c0 = anchor.p2p_between(*involved)
    measured = sum(r.t.p2p_s for r in piped)
    # the waits are mostly fill, drain and imbalance, which the compute scales set: the
    # range takes in the compute scales' range too (each end solved on its own)
    bases = [cal, *scale_ends(cal, out)]
    memo: dict[tuple[int, float], float] = {}

    def pair(t: float) -> tuple[float, float]:
        """(η_p2p, c_p2p) at scale ``t`` of the transfers' cost (module docstring)."""
        return min(1.0, eta0 / t), c0 * t

    def predicted(t: float, base: int = 0) -> float:
        key = (base, t)
        if key not in memo:
            eta, fixed = pair(t)
            waits = _pred_waits(
                plan,
                _with_all(bases[base], involved, p2p_efficiency=eta, p2p_fixed_s=fixed),
                model,
                profiles,
                network,
                prices,
                specs,
            )
            memo[key] = sum(waits[(r.pipeline, r.stage)] for r in piped)
        return memo[key]

    at_one, at_half = predicted(eta0), predicted(2 * eta0)
    if measured <= 0 or at_half - at_one < _P2P_SENSITIVITY * measured:
        why = (
            f"transfers do not move the waits: predicted {at_one:.3g} s at η_p2p=1 (with "
            f"{c0 * eta0 * 1e3:.3g} ms per transfer), {at_half:.3g} s at twice that transfer "
            f"cost, measured {measured:.3g} s"
        )
        for g in involved:
            gc = cal.for_gpu(g)
            out.append(_kept(g, "p2p_efficiency", gc.p2p_eta, why, len(piped)))
            out.append(_kept(g, "p2p_fixed_s", gc.p2p_fixed_s, why, len(piped)))
        return cal

    t_lo = eta0 * (_FIXED_FLOOR if c0 > 0 else 1.0)
    t_hi = eta0 / _ETA_MIN

    def solve(target: float, base: int = 0, steps: int = _BISECT_STEPS) -> float:
        if predicted(t_lo, base) >= target:
            return t_lo
        if predicted(t_hi, base) <= target:
            return t_hi
        lo, hi = math.log(t_lo), math.log(t_hi)
        for _ in range(steps):
            mid = (lo + hi) / 2
            if predicted(math.exp(mid), base) < target:
                lo = mid
            else:
                hi = mid
        return math.exp((lo + hi) / 2)

    t = solve(measured)
    steps = sum(r.t.steps for r in piped)
    rms = math.sqrt(statistics.fmean(r.t.p2p_spread**2 for r in piped))
    rel = _t975(max(1, steps - len(piped))) * _MEDIAN_SE * rms / math.sqrt(max(steps, 1))
    ends = [
        solve(measured * k, b, _RANGE_STEPS)
        for b in range(len(bases))
        for k in ((1 + rel, 1 - rel) if rel > 0 else (1.0,))
        if b or rel > 0
    ]
    t_min, t_max = min([t, *ends]), max([t, *ends])
    (eta, fixed), (eta_hi, fixed_lo), (eta_lo, fixed_hi) = pair(t), pair(t_min), pair(t_max)
    evidence = (
        f"1F1B replay matches the measured pipeline waits ({measured:.3g} s over "
        f"{len(piped)} rank(s)) at η_p2p={eta:.3g} and {fixed * 1e3:.3g} ms per transfer "
        f"(scale {t:.3g} of the anchor pair's transfer cost; one microbatch size cannot tell "
        "the two apart: both move along one line); range over the waits' and the compute "
        "scales' ranges"
    )
    for g in involved:
        gc = cal.for_gpu(g)
        both: tuple[tuple[ConstantName, float, float, float, float], ...] = (
            ("p2p_efficiency", eta, eta_lo, eta_hi, gc.p2p_eta),
            ("p2p_fixed_s", fixed, fixed_lo, fixed_hi, gc.p2p_fixed_s),
        )
        for name, value, low, high, prev in both:
            out.append(
                FittedConstant(
                    gpu_type=g,
                    name=name,
                    value=value,
                    low=low,
                    high=high,
                    previous=prev,
                    samples=len(piped),
                    fitted=name == "p2p_efficiency" or c0 > 0,
                    evidence=evidence,
                )
            )
    return _with_all(cal, involved, p2p_efficiency=eta, p2p_fixed_s=fixed)


def scale_ends(cal: Calibration, fitted: Sequence[FittedConstant]) -> list[Calibration]:
    """``cal`` with every fitted compute scale at the low end of its range, then the high."""
    out: list[Calibration] = []
    for end in ("low", "high"):
        c = cal
        for k in fitted:
            if k.name == "compute_scale" and k.fitted and k.high > k.low:
                c = with_constant(c, k.gpu_type, compute_scale=k.low if end == "low" else k.high)
        if c != cal:
            out.append(c)
    return out


_CORNER_DIMS = 6
"""At most this many ranges are spanned by :func:`range_corners` (2^6 = 64 corners, two
simulations each per judgement); beyond, the widest ones (relative to their value)."""


def range_corners(cal: Calibration, fitted: Sequence[FittedConstant]) -> list[Calibration]:
    """``cal`` at every corner of the fitted ranges: each fitted compute scale (per kind) and
    the pipeline efficiency at the low or the high end of its range, in every combination.

    Both ends of all scales at once (:func:`scale_ends`) miss the corners that matter for a
    heterogeneous plan: one kind faster than fitted while another is slower moves work
    between them, and a plan that shifts work to the first wins at both uniform ends yet
    loses there. A plan is bet on only if it wins at all of them. ``cal`` itself is not
    among them; a constant without a range (low == high) adds none.
    """
    dims: list[tuple[float, list[tuple[str, str, float, float]]]] = []
    for k in fitted:
        if k.name == "compute_scale" and k.fitted and k.high > k.low:
            dims.append((_width(k), [(k.gpu_type, "compute_scale", k.low, k.high)]))
    # one scale for every kind in multi-stage pipelines: one dimension, along which the fixed
    # cost per transfer moves against the efficiency (_fit_p2p); either may have the range
    # (the efficiency's is empty once it reaches 1, where the fixed cost alone moves)
    p2p = [k for k in fitted if k.name in ("p2p_efficiency", "p2p_fixed_s") and k.fitted]
    if any(k.high > k.low for k in p2p):
        targets: list[tuple[str, str, float, float]] = [
            (k.gpu_type, k.name, k.low, k.high)
            if k.name == "p2p_efficiency"
            else (k.gpu_type, k.name, k.high, k.low)  # dear end first, with the low efficiency
            for k in p2p
        ]
        dims.append((max(_width(k) for k in p2p), targets))
    dims = sorted(dims, key=lambda d: -d[0])[:_CORNER_DIMS]
    if not dims:
        return []
    out: list[Calibration] = []
    for ends in itertools.product((0, 1), repeat=len(dims)):
        c = cal
        for (_, targets), end in zip(dims, ends, strict=True):
            for g, name, at0, at1 in targets:
                c = with_constant(c, g, **{name: at1 if end else at0})
        out.append(c)
    return out


def _width(k: FittedConstant) -> float:
    return (k.high - k.low) / max(abs(k.value), 1e-12)


def _groups(plan: Plan) -> dict[tuple[int, int], int]:
    """(pipeline, stage) -> id of its replica group: stages that share a layer segment."""
    parent: dict[tuple[int, int], tuple[int, int]] = {}

    def find(x: tuple[int, int]) -> tuple[int, int]:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for seg in plan.segments():
        holders = list(seg.holders)
        for h in holders[1:]:
            parent[find(h)] = find(holders[0])
    for pi, p in enumerate(plan.pipelines):
        for si in range(p.depth):
            find((pi, si))
    roots = sorted({find(x) for x in parent})
    ids = {r: i for i, r in enumerate(roots)}
    return {x: ids[find(x)] for x in list(parent)}


def _tied_holders(plan: Plan, model: ModelSpec) -> frozenset[tuple[int, int]]:
    """(pipeline, stage) of the stages in the engine's tied-embedding group when it spans
    stages: the embedding's and the head's copies are all-reduced together after the
    segments (``megatron_patch.sync_groups``), so a holder's measured sync includes waiting
    for the other copy's stage to finish its backward (in 1F1B the head's stage ends first
    and waits out the pipeline's drain). That wait is not a fixed cost of the sync."""
    if not model.tie_embeddings:
        return frozenset()
    head = plan.num_layers - 1
    holders = frozenset(
        (pi, si)
        for pi, p in enumerate(plan.pipelines)
        for si, st in enumerate(p.stages)
        if st.first_layer == 0 or st.last_layer == head
    )
    return holders if len(holders) > 1 else frozenset()


def _fit_sync(
    plan: Plan,
    ranks: list[_Rank],
    kinds: list[str],
    cal: Calibration,
    sim: Callable[[Calibration], Estimate],
    out: list[FittedConstant],
    notes: list[str],
    tied: frozenset[tuple[int, int]] = frozenset(),
    iteration_s: Mapping[str, float] | None = None,
) -> Calibration:
    iteration_s = iteration_s or {}
    rows1 = _stage_rows(sim(_with_all(cal, kinds, network_efficiency=1.0)))
    lone = [
        r
        for r in ranks
        if rows1[(r.pipeline, r.stage)].grad_sync_s <= 0 and (r.pipeline, r.stage) not in tied
    ]
    # the tied copies' all-reduce is a collective of its own: its last arriver (least sync)
    # waited for no one, so its sync is the fixed cost (the tied all-reduce inside it, as
    # the calibration's tied_allreduce=False says); the others' syncs hold their waits. Only
    # where no holder also all-reduces a segment (else the order of arrival is unknown).
    holders = [r for r in ranks if (r.pipeline, r.stage) in tied]
    if holders and all(rows1[(r.pipeline, r.stage)].grad_sync_s <= 0 for r in holders):
        arrived = min(holders, key=lambda r: r.t.sync_s)
        lone.append(arrived)
        if len(holders) > 1:
            notes.append(
                f"tied embedding: rank {arrived.rank} arrived last at its all-reduce (sync "
                f"{arrived.t.sync_s:.3g} s); the {len(holders) - 1} other holder(s) waited for it "
                "(not read as sync_fixed_s)"
            )
    elif holders:
        notes.append(
            f"{len(holders)} rank(s) hold a tied embedding copy and all-reduce segments: their "
            "syncs are not read as sync_fixed_s"
        )
    fixed: dict[str, float] = {}
    for g in kinds:
        prev = cal.for_gpu(g).sync_fixed_s
        xs = [r for r in lone if r.gpu_type == g]
        if not xs:
            out.append(_kept(g, "sync_fixed_s", prev, "every rank of this kind all-reduces"))
            fixed[g] = prev
            continue
        fixed[g] = statistics.median(r.t.sync_s for r in xs)  # the sync's own: for η below
        # the iteration's fixed time beyond the framework time the profile holds: the sync
        # outside the all-reduces and the rest of the step outside the pipeline, the sync and
        # the optimizer (zeroing the gradients; the engine's loss all-reduce, which the
        # simulator adds only with loss_allreduce). The simulator adds c where the sync
        # starts: for the iteration's length, where in it the time is spent does not matter.
        frame = iteration_s.get(g, 0.0)
        # the optimizer step is not fitted: what it takes beyond its profiled time is a
        # fixed cost of the iteration too (a CPU's, not a network's)
        vals = [
            max(
                0.0,
                r.t.sync_s
                + r.t.rest_s
                + r.t.optim_s
                - rows1[(r.pipeline, r.stage)].update_s
                - frame,
            )
            for r in xs
        ]
        value = statistics.median(vals)
        _, low, high = _interval(
            value,
            robust_spread(vals),
            len(xs),
            [r.t.sync_spread for r in xs],
            sum(r.t.steps for r in xs),
        )
        out.append(
            FittedConstant(
                gpu_type=g,
                name="sync_fixed_s",
                value=value,
                low=max(0.0, low),
                high=high,
                previous=prev,
                samples=len(xs),
                fitted=True,
                evidence=(
                    f"median over {len(xs)} rank(s) without a gradient all-reduce of their sync "
                    f"and the step's rest outside pipeline, sync and optimizer, less the "
                    f"profiled framework time per iteration ({frame:.3g} s)"
                ),
            )
        )
        cal = with_constant(cal, g, sync_fixed_s=value)
    group_of = _groups(plan)
    last: dict[int, _Rank] = {}
    for r in ranks:
        if rows1[(r.pipeline, r.stage)].grad_sync_s <= 0:
            continue
        gid = group_of[(r.pipeline, r.stage)]
        if gid not in last or r.t.sync_s < last[gid].t.sync_s:
            last[gid] = r
    etas: dict[str, list[float]] = {g: [] for g in kinds}
    members: dict[int, set[str]] = {}
    for x, gid in group_of.items():
        members.setdefault(gid, set()).add(plan.pipelines[x[0]].stages[x[1]].replica.gpu_type)
    skipped = 0
    for gid, r in sorted(last.items()):
        ar1 = rows1[(r.pipeline, r.stage)].grad_sync_s
        comm = r.t.sync_s - fixed[r.gpu_type]
        if comm <= 0 or comm < _SYNC_SHARE * r.t.sync_s:
            skipped += 1
            continue
        eta = min(1.0, max(_ETA_MIN, ar1 / comm))
        for g in members[gid]:
            etas[g].append(eta)
    if skipped:
        notes.append(f"{skipped} replica group(s) whose all-reduces were < 20% of their sync")
    for g in kinds:
        prev = cal.for_gpu(g).network_efficiency
        found = etas[g]
        if not found:
            out.append(
                _kept(g, "network_efficiency", prev, "no replica group's all-reduce identified")
            )
            continue
        value = min(1.0, math.exp(statistics.fmean(math.log(x) for x in found)))
        out.append(
            FittedConstant(
                gpu_type=g,
                name="network_efficiency",
                value=value,
                low=min(min(found), value),
                high=max(max(found), value),
                previous=prev,
                samples=len(found),
                fitted=True,
                evidence=(
                    f"geometric mean over {len(found)} replica group(s): simulated all-reduce at "
                    "η=1 over the last arriver's sync less the fixed cost"
                ),
            )
        )
        cal = with_constant(cal, g, network_efficiency=value)
    return cal


def _optimizer_notes(ranks: list[_Rank], rows: dict[tuple[int, int], StageTime]) -> list[str]:
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
