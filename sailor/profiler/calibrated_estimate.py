"""Calibrated analytic profiles for GPU types that are not at hand.

The simulator's roofline (:mod:`sailor.simulator.estimate_profile`) derates every GPU's
peak FLOP/s and HBM bandwidth by one constant, ``ROOFLINE_EFFICIENCY = 0.5``. Small layers
reach far less than that, and how much less depends on the layer kind and on how much work
one GPU does per call far more than on the GPU. So the efficiency is *measured*:

1. For each measured GPU type with a spec sheet, each (layer kind, TP, mbs) it was
   profiled at, and each of forward, backward and update: efficiency
   ``e = roofline time at 100 % of peak / measured compute time``, with the layers of a kind
   summed (the measured times are read through the simulator's own lookup, so its
   corrections of known profile defects apply: an embedding backward below its forward, one
   ``update_s`` for every layer). At TP > 1 the measured time less the layer's TP
   all-reduces over that GPU's node link.
2. A GPU's efficiencies of a kind form a curve over the **work one GPU does per call**,
   ``w = mbs / TP`` (a TP group splits each matmul's columns or rows ``TP`` ways: TP 4 at
   mbs 8 does per GPU the FLOPs of TP 1 at mbs 2), drawn from its TP-1 points when it has any:
   they hold no all-reduce, so no link's estimate (a PCIe node's eight-way all-reduce runs far
   below its spec sheet) leaks into the compute. A GPU measured at TP > 1 only gives its
   points with their all-reduces taken out.
3. The target's efficiency at ``(kind, TP, mbs)`` is the **geometric mean** over the GPU types
   of their curves at ``w`` (log-linear between points; only GPUs whose points span ``w`` when
   any does, else every GPU at its nearest end), and its time ``roofline at 100 % / e``.
   ``affine=True`` instead fits ``t = latency + scale · roofline`` over the GPUs per
   measured (kind, TP, mbs) key (a key no GPU has: the nearest mbs in log2 at the same kind
   and TP, then the nearest TP, then ``ROOFLINE_EFFICIENCY``); on the reference profiles it
   is worse in leave-one-GPU-out. Every entry is written with ``source="estimated"``.

:func:`leave_one_gpu_out` says how good this is: each measured GPU is estimated from the
others only and compared with its measurement, next to the uncalibrated roofline.

Pure: values in, values out (the GPU specs are arguments).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sailor.schemas import (
    GPUCalibration,
    GPUSpec,
    LayerProfile,
    ModelSpec,
    NetworkProfile,
    ProfileDB,
)
from sailor.schemas.model import LayerKind
from sailor.schemas.profile import COMPUTE_ONLY_META
from sailor.simulator.estimate_profile import ROOFLINE_EFFICIENCY, estimate_layer_timing
from sailor.simulator.lookup import layer_table, measured_whole_ends
from sailor.simulator.tp_comm import compute_part, model_comm_s, tp_link

__all__ = [
    "Efficiency",
    "KindCost",
    "LooRow",
    "WorkCurves",
    "calibrated_efficiencies",
    "estimate_gpu",
    "gpu_efficiencies",
    "leave_one_gpu_out",
    "measured_grid",
]

Key = tuple[LayerKind, int, int]
"""(layer kind, TP degree, microbatch size)."""

_NO_CORRECTION = GPUCalibration(gpu_type="*")


@dataclass(frozen=True)
class Efficiency:
    """Fraction of the spec-sheet roofline reached by forward, backward and update."""

    fwd: float
    bwd: float
    update: float


@dataclass(frozen=True)
class KindCost:
    """Calibrated cost of one layer of a kind: ``latency + scale × roofline`` per component.

    ``scale`` is ``1 / efficiency``; ``latency`` (s, per layer) is the GPU-independent floor
    (kernel launches, framework overhead) that small layers sit on.
    """

    latency: tuple[float, float, float]
    scale: tuple[float, float, float]

    def time(self, roof: tuple[float, float, float]) -> tuple[float, float, float]:
        lf, lb, lu = self.latency
        sf, sb, su = self.scale
        return (lf + sf * roof[0], lb + sb * roof[1], lu + su * roof[2])


def _roofline(
    model: ModelSpec, gpu: GPUSpec, tp: int, mbs: int, layer: int
) -> tuple[float, float, float]:
    """Roofline (fwd, bwd, update) at 100 % of peak (the simulator's estimate × its derating)."""
    t = estimate_layer_timing(model, gpu, tp, mbs, layer)
    e = ROOFLINE_EFFICIENCY
    return (t.fwd_s * e, t.bwd_s * e, t.update_s * e)


def _tp_comm(
    model: ModelSpec,
    spec: GPUSpec,
    tp: int,
    mbs: int,
    network: NetworkProfile | None,
    vocab_parallel: bool,
) -> list[tuple[float, float]]:
    """Forward and backward seconds of every layer's TP all-reduces at ``tp`` on a node of
    ``spec``: its intra-node curve in ``network``, else its spec sheet's link at the prior's
    median efficiency (the simulator's own pricing, ``tp_comm``; none at TP 1).
    ``vocab_parallel``: the embedding and head were split (else they have none)."""
    if tp <= 1:
        return [(0.0, 0.0)] * model.num_all_layers
    return model_comm_s(
        model, tp, mbs, tp_link(network, {spec.name: spec}, spec.name, tp), vocab_parallel
    )


def measured_grid(db: ProfileDB, gpu: str) -> list[tuple[int, int]]:
    out = []
    for tp, sizes in db.grid(gpu).items():
        for b in sizes:
            t = db.timing(gpu, tp, b, 0)
            if t is not None and t.source != "estimated":
                out.append((tp, b))
    return out


def _kind_sums(
    db: ProfileDB, model: ModelSpec, spec: GPUSpec, network: NetworkProfile | None = None
) -> dict[Key, tuple[list[float], list[float]]]:
    """Per key: (roofline f, b, u summed over the kind's layers; measured compute f, b, u
    summed: at TP > 1 the measured time less the TP all-reduces estimated over this GPU
    type's node link, which its efficiency must not carry to another GPU's link)."""
    out: dict[Key, tuple[list[float], list[float]]] = {}
    specs = {spec.name: spec}
    for tp, mbs in measured_grid(db, spec.name):
        costs = layer_table(db, model, _NO_CORRECTION, specs, spec.name, tp, mbs).layers
        # an older Sailor profile timed the embedding and head whole: no all-reduce in them
        split = not measured_whole_ends(db, spec.name, tp, mbs, model.num_all_layers)
        comms = _tp_comm(model, spec, tp, mbs, network, split)
        for layer, (c, (cf, cb)) in enumerate(zip(costs, comms, strict=True)):
            roof, meas = out.setdefault((model.layer_kind(layer), tp, mbs), ([0.0] * 3, [0.0] * 3))
            for i, v in enumerate(_roofline(model, spec, tp, mbs, layer)):
                roof[i] += v
            # the all-reduces out as the lookup's rule 3 takes them out (its derated roofline)
            est = estimate_layer_timing(model, spec, tp, mbs, layer)
            compute = (
                compute_part(c.fwd_s, cf, est.fwd_s),
                compute_part(c.bwd_s, cb, est.bwd_s),
                c.update_s,
            )
            for i, v in enumerate(compute):
                meas[i] += v
    return out


def gpu_efficiencies(
    db: ProfileDB, model: ModelSpec, spec: GPUSpec, network: NetworkProfile | None = None
) -> dict[Key, Efficiency]:
    """Measured efficiency (roofline / measured compute) of every (kind, TP, mbs) of one GPU
    type."""
    out: dict[Key, Efficiency] = {}
    for k, (roof, meas) in _kind_sums(db, model, spec, network).items():
        if min(meas) > 0:
            out[k] = Efficiency(*(r / m for r, m in zip(roof, meas, strict=True)))
    return out


def _gmean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def _fit(pairs: list[tuple[float, float]], affine: bool) -> tuple[float, float]:
    """(latency, scale) of ``t = latency + scale·roofline`` over GPUs' (roofline, t) pairs.

    Least squares when ``affine`` and the GPUs differ; a negative latency or a non-positive
    scale (fewer GPUs than the noise allows) falls back to the pure scale, the geometric
    mean of ``t / roofline``.
    """
    pairs = [(r, t) for r, t in pairs if r > 0 and t > 0]
    if not pairs:
        return 0.0, 1.0 / ROOFLINE_EFFICIENCY
    pure = (0.0, _gmean([t / r for r, t in pairs]))
    if not affine or len({r for r, _ in pairs}) < 2:
        return pure
    xs = [r for r, _ in pairs]
    ys = [t for _, t in pairs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    k = sum((x - mx) * (y - my) for x, y in pairs) / sxx
    lat = my - k * mx
    if lat < 0 or k <= 0:
        return pure
    return lat, k


def calibrated_efficiencies(
    db: ProfileDB,
    model: ModelSpec,
    specs: Mapping[str, GPUSpec],
    exclude: Iterable[str] = (),
    affine: bool = False,
    network: NetworkProfile | None = None,
) -> WorkCurves | dict[Key, KindCost]:
    """The calibrated cost model of the compute over the measured GPU types (with a spec,
    not in ``exclude``), their TP all-reduces taken out over their node links (``network``'s
    intra-node curves, else spec sheets): each GPU's efficiency curves over the work per GPU
    (:class:`WorkCurves`), or with ``affine`` a fit per measured (kind, TP, mbs) key whose
    latency is per layer of the kind."""
    skip = set(exclude)
    used = [g for g in db.gpu_types() if g not in skip and g in specs]
    if not affine:
        return WorkCurves.of({g: gpu_efficiencies(db, model, specs[g], network) for g in used})
    per_key: dict[Key, list[tuple[list[float], list[float]]]] = {}
    for g in used:
        for k, v in _kind_sums(db, model, specs[g], network).items():
            per_key.setdefault(k, []).append(v)
    counts: dict[LayerKind, int] = {}
    for layer in range(model.num_all_layers):
        kind = model.layer_kind(layer)
        counts[kind] = counts.get(kind, 0) + 1
    out: dict[Key, KindCost] = {}
    for k, vs in per_key.items():
        fits = [_fit([(roof[i], meas[i]) for roof, meas in vs], affine) for i in range(3)]
        n = counts[k[0]]
        out[k] = KindCost(
            latency=(fits[0][0] / n, fits[1][0] / n, fits[2][0] / n),
            scale=(fits[0][1], fits[1][1], fits[2][1]),
        )
    return out


_Point = tuple[float, float, float]
"""(log work per GPU, log efficiency of forward, of backward)."""


@dataclass(frozen=True)
class WorkCurves:
    """Per GPU type and layer kind, its measured forward and backward efficiencies as a
    curve over the work one GPU does per call, ``log(mbs / TP)``, and its update's over the
    parameters one GPU holds, ``log(1 / TP)`` (the geometric mean over the microbatch sizes
    measured: the update does not depend on them); each sorted. The target's cost is their
    geometric mean at its work (the module docstring, steps 2 and 3)."""

    compute: Mapping[str, Mapping[LayerKind, tuple[_Point, ...]]] = field(default_factory=dict)
    update: Mapping[str, Mapping[LayerKind, tuple[tuple[float, float], ...]]] = field(
        default_factory=dict
    )

    @classmethod
    def of(cls, effs: Mapping[str, Mapping[Key, Efficiency]]) -> WorkCurves:
        """The curves of each GPU's measured efficiencies: for the compute, its TP-1 points
        of a kind when it has any (no all-reduce in them), else all of them; for the update,
        all of them (no all-reduce in any)."""
        compute: dict[str, dict[LayerKind, tuple[_Point, ...]]] = {}
        update: dict[str, dict[LayerKind, tuple[tuple[float, float], ...]]] = {}
        for g, eff in effs.items():
            kinds: dict[LayerKind, list[tuple[int, _Point]]] = {}
            upd: dict[LayerKind, dict[int, list[float]]] = {}
            for (kind, tp, mbs), e in eff.items():
                point = (math.log(mbs / tp), math.log(e.fwd), math.log(e.bwd))
                kinds.setdefault(kind, []).append((tp, point))
                upd.setdefault(kind, {}).setdefault(tp, []).append(math.log(e.update))
            compute[g] = {
                kind: _merged(p for tp, p in pts if tp == 1 or all(t > 1 for t, _ in pts))
                for kind, pts in kinds.items()
            }
            update[g] = {
                kind: tuple(sorted((-math.log(tp), statistics.fmean(v)) for tp, v in by.items()))
                for kind, by in upd.items()
            }
        return cls(compute, update)

    def cost(self, kind: LayerKind, tp: int, mbs: int) -> KindCost:
        """The calibrated cost of one layer of ``kind`` at (``tp``, ``mbs``)."""
        compute = [c[kind] for c in self.compute.values() if c.get(kind)]
        fwd, bwd = _gmean_at(compute, mbs / tp, 2)
        (upd,) = _gmean_at([c[kind] for c in self.update.values() if c.get(kind)], 1 / tp, 1)
        return KindCost(latency=(0.0, 0.0, 0.0), scale=(1 / fwd, 1 / bwd, 1 / upd))


def _merged(points: Iterable[_Point]) -> tuple[_Point, ...]:
    """``points`` sorted by work, those of one work (TP 2 at mbs 4 and TP 4 at mbs 8, of a GPU
    measured at TP > 1 only) merged into their mean: a curve is a function of the work."""
    by: dict[float, list[_Point]] = {}
    for p in points:
        by.setdefault(round(p[0], 9), []).append(p)
    return tuple(
        (ps[0][0], statistics.fmean(p[1] for p in ps), statistics.fmean(p[2] for p in ps))
        for _, ps in sorted(by.items())
    )


def _gmean_at(
    curves: Sequence[tuple[tuple[float, ...], ...]], work: float, n: int
) -> tuple[float, ...]:
    """The geometric mean of ``curves``' efficiencies at ``work``: of those whose points
    span it when any does, else of every curve at its nearest end; ``ROOFLINE_EFFICIENCY``
    without curves."""
    if not curves:
        return (ROOFLINE_EFFICIENCY,) * n
    w = math.log(work)
    spanning = [c for c in curves if c[0][0] - _W_TOL <= w <= c[-1][0] + _W_TOL]
    logs = [_at(c, w) for c in spanning or curves]
    return tuple(math.exp(statistics.fmean(x[i] for x in logs)) for i in range(n))


_W_TOL = 1e-9


def _at(curve: tuple[tuple[float, ...], ...], w: float) -> tuple[float, ...]:
    """The log efficiencies of ``curve`` at log work ``w``: linear between its points, its
    nearest end's outside them."""
    if w <= curve[0][0]:
        return curve[0][1:]
    for a, b in itertools.pairwise(curve):
        if w <= b[0]:
            f = (w - a[0]) / (b[0] - a[0])
            return tuple(x + f * (y - x) for x, y in zip(a[1:], b[1:], strict=True))
    return curve[-1][1:]


_DEFAULT = KindCost(latency=(0.0, 0.0, 0.0), scale=(1 / ROOFLINE_EFFICIENCY,) * 3)


def _lookup(
    table: WorkCurves | Mapping[Key, KindCost], kind: LayerKind, tp: int, mbs: int
) -> KindCost:
    if isinstance(table, WorkCurves):
        return table.cost(kind, tp, mbs)
    if (kind, tp, mbs) in table:
        return table[(kind, tp, mbs)]
    cands = [k for k in table if k[0] == kind]
    if not cands:
        return _DEFAULT
    best = min(
        cands, key=lambda k: (k[1] != tp, abs(math.log2(k[1] / tp)), abs(math.log2(k[2] / mbs)))
    )
    return table[best]


def estimate_gpu(
    model: ModelSpec,
    spec: GPUSpec,
    table: WorkCurves | Mapping[Key, KindCost],
    grid: Iterable[tuple[int, int]],
) -> ProfileDB:
    """Estimated timings of every layer of ``model`` on ``spec`` at each (TP, mbs) of
    ``grid``: the calibrated compute alone. Stamped :data:`COMPUTE_ONLY_META`: the simulator
    adds the TP all-reduces at TP > 1 over the plan's link (the network profile's intra-node
    curve of the type, else its spec sheet at the calibration's link efficiency), so they
    follow the uncertainty set and a later probe, and no calibrated ``compute_scale``
    multiplies them."""
    out: list[LayerProfile] = []
    for tp, mbs in sorted(set(grid)):
        for layer in range(model.num_all_layers):
            kind = model.layer_kind(layer)
            f, b, u = _lookup(table, kind, tp, mbs).time(_roofline(model, spec, tp, mbs, layer))
            out.append(
                LayerProfile(
                    gpu_type=spec.name,
                    tp=tp,
                    microbatch_size=mbs,
                    layer=layer,
                    kind=kind,
                    fwd_s=f,
                    bwd_s=b,
                    update_s=u,
                    source="estimated",
                    # the rooflines above are in the model's precision: a plan in another
                    # is scaled from it (simulator.lookup), as from a measured profile
                    precision=model.precision,
                )
            )
    meta = {
        f"{spec.name}.{COMPUTE_ONLY_META}": "the TP all-reduces are not in these times: "
        "the simulator adds them over the plan's link"
    }
    return ProfileDB(model=model.name, timings=tuple(out), meta=meta)


@dataclass(frozen=True)
class LooRow:
    """One measured (GPU, TP, mbs): calibrated and plain-roofline estimates vs measurement."""

    gpu_type: str
    tp: int
    mbs: int
    measured_s: float
    """Sum over all layers of forward + backward, s."""
    calibrated_s: float
    roofline_s: float
    measured_update_s: float
    calibrated_update_s: float
    roofline_update_s: float

    @property
    def err(self) -> float:
        return (self.calibrated_s - self.measured_s) / self.measured_s

    @property
    def roofline_err(self) -> float:
        return (self.roofline_s - self.measured_s) / self.measured_s

    @property
    def update_err(self) -> float:
        return (self.calibrated_update_s - self.measured_update_s) / self.measured_update_s

    @property
    def roofline_update_err(self) -> float:
        return (self.roofline_update_s - self.measured_update_s) / self.measured_update_s


def leave_one_gpu_out(
    db: ProfileDB,
    model: ModelSpec,
    specs: Mapping[str, GPUSpec],
    affine: bool = False,
    network: NetworkProfile | None = None,
) -> list[LooRow]:
    """Estimate each measured GPU type from the others; one row per (GPU, TP, mbs) whose
    measured times are positive. ``network``: intra-node curves for the TP all-reduces (the
    left-out GPU's own curve prices its estimate, as a user's probe of it would)."""
    rows: list[LooRow] = []
    measured = [g for g in db.gpu_types() if g in specs and measured_grid(db, g)]
    for g in measured:
        if len(measured) < 2:
            break
        table = calibrated_efficiencies(
            db, model, specs, exclude=[g], affine=affine, network=network
        )
        grid = measured_grid(db, g)
        est = estimate_gpu(model, specs[g], table, grid)
        for tp, mbs in grid:
            meas = layer_table(db, model, _NO_CORRECTION, {g: specs[g]}, g, tp, mbs).layers
            # read as the simulator reads them: the compute plus the TP all-reduces
            cal = layer_table(
                est, model, _NO_CORRECTION, {g: specs[g]}, g, tp, mbs, network=network
            ).layers
            roof = [
                estimate_layer_timing(model, specs[g], tp, mbs, i)
                for i in range(model.num_all_layers)
            ]
            row = LooRow(
                gpu_type=g,
                tp=tp,
                mbs=mbs,
                measured_s=sum(c.fwd_s + c.bwd_s for c in meas),
                calibrated_s=sum(c.fwd_s + c.bwd_s for c in cal),
                roofline_s=sum(r.fwd_s + r.bwd_s for r in roof),
                measured_update_s=sum(c.update_s for c in meas),
                calibrated_update_s=sum(c.update_s for c in cal),
                roofline_update_s=sum(r.update_s for r in roof),
            )
            if row.measured_s > 0 and row.measured_update_s > 0:
                rows.append(row)
    return rows
