"""Calibrations made from fitted constants: one constant set, and the ends and corners of the
fitted ranges.

:func:`with_constant` sets constants of one GPU type in a calibration (the online fit's
results, and what a test's "true" cluster is). :func:`scale_ends` and :func:`range_corners`
give the calibrations at the ends of the fitted compute scales' ranges and at every corner of
the fitted ranges: the controller judges a replan at all of them
(:mod:`sailor.controller.online_calibration`), and the p2p fit (:mod:`fit_p2p`) solves its
range at the scales' ends.

Pure: values in, values out; no I/O, no clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from sailor.schemas import Calibration, ConstantRange, GPUPrior
from sailor.schemas.online_calibration import FittedConstant

__all__ = [
    "range_corners",
    "scale_ends",
    "with_all",
    "with_constant",
    "with_fitted_spread",
    "with_spread_restored",
]


def with_constant(cal: Calibration, gpu_type: str, **values: float) -> Calibration:
    """``cal`` with ``values`` set on ``gpu_type``'s constants (an entry made if it has none)."""
    base = cal.for_gpu(gpu_type)
    return cal.with_gpu(base.model_copy(update={"gpu_type": gpu_type, **values}))


_ONLINE_SOURCE = "online fit (the fitted ranges' evidence says which) within: "
"""How a spread the online fit narrowed names its source (once: a later fit does not nest it)."""


def with_fitted_spread(
    cal: Calibration, start: Calibration, kinds: Iterable[str], fitted: Sequence[FittedConstant]
) -> Calibration:
    """``cal`` (a fit's calibration, made from ``start``) with each kind's ``spread``, the
    ranges the uncertainty corners take (:mod:`sailor.simulator.uncertainty`), carrying the
    fitted constants' ranges (median: the fitted value) and, for every other constant, the
    range it had before the fit: the kind's own spread if ``start`` calibrates it, else
    ``start.prior``. Without this a fitted kind's entry kept the spread it had (the corners
    then priced the offline leave-one-out ranges, not what was fitted) or, a kind the
    catalog prior covered, none (every corner collapsed to one point, memory and allocator
    included, which no step timing measures). ``compute_scale`` gets a range only where the
    range before had one (else it stays a point in every corner, as docs/simulator-model.md
    says); a fitted p2p efficiency takes the fixed cost per transfer it was fitted with
    (the two move along one line, :mod:`fit_p2p`). A kind with no range before (calibrated
    without a spread, or no prior) keeps none; a kind without an entry in ``cal`` gets none
    made."""
    for g in kinds:
        if not cal.is_calibrated(g):
            continue
        before = start.for_gpu(g).spread if start.is_calibrated(g) else start.prior
        if before is None:
            continue
        mine = [c for c in fitted if c.gpu_type == g]
        # the p2p pair moves along one line: a fitted efficiency holds the fixed cost it was
        # fitted with (none, when the anchor has none), not the range the fixed cost had
        pair = any(c.name == "p2p_efficiency" and c.fitted for c in mine)
        ranges = {
            c.name: ConstantRange(
                low=c.low, median=c.value, high=c.high, evidence=f"online fit: {c.evidence}"
            )
            for c in mine
            if (c.fitted or (pair and c.name == "p2p_fixed_s"))
            and (c.name != "compute_scale" or before.compute_scale is not None)
        }
        root = before.source.removeprefix(_ONLINE_SOURCE)
        source = f"{_ONLINE_SOURCE}{root}" if ranges or root != before.source else root
        spread = GPUPrior.model_validate(
            {
                **before.model_dump(),
                **{k: r.model_dump() for k, r in ranges.items()},
                "source": source,
            }
        )
        cal = cal.with_gpu(cal.for_gpu(g).model_copy(update={"gpu_type": g, "spread": spread}))
    return cal


def with_spread_restored(
    cal: Calibration, start: Calibration, fitted: Sequence[FittedConstant]
) -> tuple[Calibration, list[str]]:
    """``cal`` (a kept fit's calibration read back) with each fitted kind's ``spread``
    rebuilt, as :func:`with_fitted_spread` from ``start`` makes it, where the record was
    kept before the fit carried its ranges into the spread: a kind the catalog prior
    covered got an entry without one (every uncertainty corner then priced one point,
    memory and allocator included, and every later fit, starting from it, kept none), a
    kind calibrated offline kept its offline spread (which overrode the fitted constants
    in every corner). Told apart by the spread: none, or one not naming the online fit
    while the kind has a fitted constant. A spread the fit made is kept as read. Also the
    kinds rebuilt (sorted)."""

    def stale(g: str) -> bool:
        if not cal.is_calibrated(g):
            return False
        spread = cal.for_gpu(g).spread
        if spread is None:
            return True
        moved = any(c.fitted for c in fitted if c.gpu_type == g)
        return moved and not spread.source.startswith(_ONLINE_SOURCE)

    kinds = sorted({c.gpu_type for c in fitted if stale(c.gpu_type)})
    out = with_fitted_spread(cal, start, kinds, fitted)
    return out, [g for g in kinds if out.for_gpu(g).spread != cal.for_gpu(g).spread]


def with_all(cal: Calibration, kinds: Iterable[str], **values: float) -> Calibration:
    for g in kinds:
        cal = with_constant(cal, g, **values)
    return cal


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
    # cost per transfer moves against the efficiency (fit_p2p_constants); either may have the range
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
