"""Fit the simulator's bandwidth curve to probe points and record it in a NetworkProfile.

The curve form is fixed by :class:`~sailor.schemas.network.BandwidthCurve`:
``GB/s = c0·L² + c1·L + c2`` with ``L = log2(bytes / 1e6)``. The coefficients are the
ordinary least-squares solution in ``L`` over the measured points (each point weighs the
same: sizes are spaced evenly in ``L``, so no part of the range dominates). The measured
range becomes the curve's clamp (``min_bytes``, ``max_bytes``) and its largest measured
bandwidth the upper clamp (``max_gbps``), so the fit is never extrapolated. A quadratic that
falls below half the least measured bandwidth somewhere in the measured range is refitted as
a line, and a line that does as the mean: a loaded host's noisy points (one 16 KiB message at
2.4 ms among 0.2-0.5 ms ones) had the quadratic dip below zero between 128 KiB and 1 MiB,
where the evaluation floors it at 1 MB/s, and transfers measured at 0.5-2 ms were priced at
0.13-1 s.

Optionally (:func:`split_latency`) a fixed per-message latency is taken out first: the
median over the :data:`LATENCY_SIZES` smallest messages of their one-way time minus their
bytes at the peak bandwidth (one size alone was not enough: on a shared host a single size
can land in a quiet moment, 0.25 ms against 1.9-2.0 ms for the next three sizes in one of our
probes, and the pipelines' many small messages then looked 8x cheaper). The curve is then
fitted to ``bytes / (time − latency)`` and the latency goes into ``BandwidthCurve.latency_s``
(``transfer_time = latency + bytes / GB/s``). Without it, the quadratic in ``L`` has to bend
a latency-bound region (bandwidth ∝ bytes, i.e. exponential in ``L``) and misses the small
sizes by a factor of 2-4 on a loaded host; with it, the remaining curve is flat enough.

Also reported: the fit's relative error of the transfer time at each point, so a poor fit
is visible rather than silently used.

Pure: numbers in, schemas out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from sailor.schemas import BandwidthCurve, Endpoint, Link, NetworkProfile
from sailor.schemas.network import quadratic_least

__all__ = [
    "LATENCY_SIZES",
    "fit_curve",
    "fit_link",
    "fit_residuals",
    "split_latency",
    "with_link",
]

LATENCY_SIZES = 3
"""How many of the smallest message sizes the latency is taken from (their median)."""


def fit_curve(points: Sequence[tuple[int, float]], latency_s: float = 0.0) -> BandwidthCurve:
    """Least-squares curve through ``(message bytes, GB/s)`` points (at least 3 sizes)."""
    sizes = sorted({b for b, _ in points})
    if len(sizes) < 3:
        raise ValueError(f"points: need at least 3 distinct message sizes, got {len(sizes)}")
    for b, g in points:
        if b <= 0 or not math.isfinite(g) or g <= 0:
            raise ValueError(f"point ({b}, {g}): bytes and GB/s must be positive and finite")
    lg = np.array([math.log2(b / 1e6) for b, _ in points])
    y = np.array([g for _, g in points])
    c0 = c1 = 0.0
    c2 = float(y.mean())
    # a quadratic (or a line) that falls below half the least measured bandwidth somewhere
    # in the measured range is the fit's artifact, not the link (module docstring): the next
    # lower degree instead, down to the mean
    for degree in (2, 1):
        a = np.stack([lg**k for k in range(degree, -1, -1)], axis=1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        full = (0.0,) * (2 - degree) + tuple(float(x) for x in coef)
        cs = (full[0], full[1], full[2])
        if quadratic_least(cs, float(lg.min()), float(lg.max())) >= _DIP * float(y.min()):
            c0, c1, c2 = cs
            break
    return BandwidthCurve(
        coeffs=(c0, c1, c2),
        max_gbps=float(y.max()),
        min_bytes=sizes[0],
        max_bytes=sizes[-1],
        latency_s=latency_s,
    )


_DIP = 0.5
"""How far below the least measured bandwidth a fitted curve may go within the measured range
(between two points a quadratic through them may pass a little below both)."""


def split_latency(points: Sequence[tuple[int, float]]) -> tuple[float, list[tuple[int, float]]]:
    """From ``(bytes, one-way seconds)``: the per-message latency and ``(bytes, GB/s)``
    points of the remaining (bandwidth-bound) time."""
    if not points:
        raise ValueError("points: empty")
    peak = max(b / t for b, t in points if t > 0)
    small = sorted(points)[:LATENCY_SIZES]
    latency = max(0.0, statistics.median(t - b / peak for b, t in small))
    out = []
    for b, t in points:
        rest = t - latency
        # a point faster than the latency (noise) is taken at the peak bandwidth
        out.append((b, b / rest / 1e9 if rest > b / peak else peak / 1e9))
    return latency, out


def fit_link(points: Sequence[tuple[int, float]], latency: bool = True) -> BandwidthCurve:
    """Curve from ``(bytes, one-way seconds)`` probe points, with or without a latency term."""
    if latency:
        lat, gbps = split_latency(points)
        return fit_curve(gbps, latency_s=lat)
    return fit_curve([(b, b / t / 1e9) for b, t in points])


def fit_residuals(curve: BandwidthCurve, points: Sequence[tuple[int, float]]) -> list[float]:
    """Relative error of the transfer time ``(fit − measured) / measured`` at each
    ``(bytes, one-way seconds)`` point."""
    return [(curve.transfer_time(b) - t) / t for b, t in points]


def with_link(
    net: NetworkProfile | None,
    src: Endpoint,
    dst: Endpoint,
    curve: BandwidthCurve,
    intra: bool = False,
    source: str = "",
) -> NetworkProfile:
    """``net`` with the link ``src -> dst`` set to ``curve`` (replacing a link of that pair).

    ``intra=True`` records an intra-node curve (``src`` must equal ``dst``). An inter-node
    link replaces entries of either direction of the pair: the probe measures a round trip,
    which is symmetric.
    """
    net = net or NetworkProfile()
    if intra:
        if src != dst:
            raise ValueError(f"intra-node curve needs src == dst, got {src} and {dst}")
        keep = tuple(ln for ln in net.intra_node if ln.src != src)
        links, intra_links = net.links, (*keep, Link(src=src, dst=dst, curve=curve))
    else:
        keep = tuple(ln for ln in net.links if {ln.src, ln.dst} != {src, dst})
        links, intra_links = (*keep, Link(src=src, dst=dst, curve=curve)), net.intra_node
    return NetworkProfile(
        links=links, intra_node=intra_links, estimated=net.estimated, source=source or net.source
    )
