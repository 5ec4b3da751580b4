"""The online fit of the pipeline transfers' constants, ``p2p_efficiency`` and ``p2p_fixed_s``.

One value each for the GPU types (kinds) in multi-stage pipelines: the 1F1B replay (with the
fitted compute scales) predicts each rank's time outside its own compute during the pipeline
phase, and the transfers' cost is scaled along one line through the anchor's pair until the
predicted sum over ranks equals the measured sum of ``p2p_s`` (bisection); the range is
solved at both ends of the waits' spread and of the compute scales' ranges. The method, and
when the pair counts as identified, is in :mod:`sailor.simulator.online_fit`'s docstring.

Pure: values in, one value out; no I/O, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from sailor.schemas import (
    Calibration,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Plan,
    PriceTable,
    ProfileDB,
)
from sailor.schemas.online_calibration import ConstantName, FittedConstant
from sailor.simulator.fit_corners import scale_ends, with_all
from sailor.simulator.fit_evidence import (
    ETA_MIN,
    MEDIAN_SE,
    RankEvidence,
    kept_constant,
    stage_rows,
    t975,
)
from sailor.simulator.stage_ends import replay_stage_ends

__all__: list[str] = [
    "fit_p2p_constants",
]

_P2P_SENSITIVITY = 0.05
"""The p2p pair is identified when doubling the transfers' cost from η_p2p = 1 (at the kept
fixed cost times η0) adds at least this fraction of the measured waits."""


_FIXED_FLOOR = 1e-3
"""The least scale ``t`` over η0: the fixed cost per transfer goes down to c0 · η0 / 1000
(with η_p2p = 1), a thousandth of what it is where η_p2p reaches 1."""


_BISECT_STEPS = 14
"""Halvings of log t over its range (up to ~1e-3 .. 1e2): ~0.1 % relative precision."""


_RANGE_STEPS = 10
"""... and for the ends of its range: ~2 %."""


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
    rows = stage_rows(est)
    out: dict[tuple[int, int], float] = {}
    for pi, p in enumerate(plan.pipelines):
        if p.depth < 2:
            continue
        for si in range(p.depth):
            st = rows[(pi, si)]
            busy = p.num_microbatches * (st.fwd_s + st.bwd_s)
            out[(pi, si)] = max(0.0, end[(pi, si)] - busy)
    return out


def fit_p2p_constants(
    plan: Plan,
    ranks: list[RankEvidence],
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
            out.append(kept_constant(g, "p2p_efficiency", gc.p2p_eta, why))
            out.append(kept_constant(g, "p2p_fixed_s", gc.p2p_fixed_s, why))
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
                with_all(bases[base], involved, p2p_efficiency=eta, p2p_fixed_s=fixed),
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
            out.append(kept_constant(g, "p2p_efficiency", gc.p2p_eta, why, len(piped)))
            out.append(kept_constant(g, "p2p_fixed_s", gc.p2p_fixed_s, why, len(piped)))
        return cal

    t_lo = eta0 * (_FIXED_FLOOR if c0 > 0 else 1.0)
    t_hi = eta0 / ETA_MIN

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
    rel = t975(max(1, steps - len(piped))) * MEDIAN_SE * rms / math.sqrt(max(steps, 1))
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
    return with_all(cal, involved, p2p_efficiency=eta, p2p_fixed_s=fixed)
