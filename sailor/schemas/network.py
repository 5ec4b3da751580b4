"""Network: bandwidth between endpoints as a function of message size.

An endpoint is (zone, GPU type, GPUs per node): the same zone pair can differ by VM shape
(NIC bandwidth scales with the VM). The curve form is the one the profiler fits:
``GB/s = c0·L² + c1·L + c2`` with ``L = log2(bytes / 1e6)``, evaluated with ``L`` clamped to the
measured message-size range and the result clamped to ``(0, max_gbps]`` so that a fit is never
extrapolated into negative or unbounded bandwidth.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any, Literal, Self

from pydantic import Field, model_validator

from sailor.schemas._base import Frozen, field_error

__all__ = [
    "BandwidthCurve",
    "CollectiveLatency",
    "CollectiveScope",
    "Endpoint",
    "Link",
    "NetworkProfile",
    "quadratic_least",
]

CollectiveScope = Literal["intra_node", "inter_node"]
"""Where the ranks of a measured collective were: all on one node, or one per node."""

_MIN_GBPS = 1e-3
"""Floor of any evaluated bandwidth (1 MB/s): a fit that dips to zero must not divide by zero."""


class BandwidthCurve(Frozen):
    """Bandwidth in GB/s as a quadratic in log2 of the message size in MB."""

    coeffs: tuple[float, float, float] = Field(description="(c0, c1, c2) of c0·L²+c1·L+c2.")
    max_gbps: float = Field(gt=0, description="Largest bandwidth measured, GB/s (upper clamp).")
    min_bytes: int = Field(default=1 << 16, gt=0, description="Smallest message size measured.")
    max_bytes: int = Field(default=1 << 30, gt=0, description="Largest message size measured.")
    latency_s: float = Field(default=0.0, ge=0, description="Fixed per-message latency, s.")

    @model_validator(mode="after")
    def _range(self) -> BandwidthCurve:
        if self.min_bytes > self.max_bytes:
            raise field_error("min_bytes", self.min_bytes, f"exceeds max_bytes={self.max_bytes}")
        if not all(math.isfinite(c) for c in self.coeffs):
            raise field_error("coeffs", self.coeffs, "must be finite")
        return self

    def nonpositive_ranges(self) -> list[tuple[int, int]]:
        """The message sizes (bytes, from..to) within the measured range where the quadratic
        is <= 0 GB/s (where :meth:`gbps` floors it at 1 MB/s); empty for a sound curve."""
        lo, hi = math.log2(self.min_bytes / 1e6), math.log2(self.max_bytes / 1e6)
        if quadratic_least(self.coeffs, lo, hi) > 0:
            return []
        c0, c1, c2 = self.coeffs
        cuts = [lo, hi]
        if c0 == 0 and c1 != 0:
            cuts.append(-c2 / c1)
        elif c0 != 0 and c1 * c1 - 4 * c0 * c2 >= 0:
            r = math.sqrt(c1 * c1 - 4 * c0 * c2)
            cuts += [(-c1 - r) / (2 * c0), (-c1 + r) / (2 * c0)]
        xs = sorted({x for x in cuts if lo <= x <= hi})
        out: list[tuple[float, float]] = []
        for a, b in itertools.pairwise(xs):
            m = (a + b) / 2
            if c0 * m * m + c1 * m + c2 > 0:
                continue
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        if not out:  # the least is 0 at one point only (a root the curve touches)
            x = min(xs, key=lambda x: c0 * x * x + c1 * x + c2)
            out.append((x, x))
        return [(round(2**a * 1e6), round(2**b * 1e6)) for a, b in out]

    def gbps(self, nbytes: float) -> float:
        """Bandwidth for a message of ``nbytes``, clamped to the measured range."""
        b = min(max(float(nbytes), float(self.min_bytes)), float(self.max_bytes))
        lg = math.log2(b / 1e6)
        c0, c1, c2 = self.coeffs
        bw = c0 * lg * lg + c1 * lg + c2
        return min(max(bw, _MIN_GBPS), self.max_gbps)

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` as one message."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / (self.gbps(nbytes) * 1e9)


def quadratic_least(coeffs: tuple[float, float, float], lo: float, hi: float) -> float:
    """The least of ``c0·L² + c1·L + c2`` over ``lo <= L <= hi``."""
    c0, c1, c2 = coeffs
    at = [lo, hi]
    if c0 > 0 and lo < -c1 / (2 * c0) < hi:
        at.append(-c1 / (2 * c0))
    return min(c0 * x * x + c1 * x + c2 for x in at)


class Endpoint(Frozen):
    """One side of a link."""

    zone: str = Field(description="Zone name.")
    gpu_type: str = Field(description="GPU type of the node.")
    gpus_per_node: int = Field(gt=0, description="GPUs per node (VM shape).")


class Link(Frozen):
    """Measured bandwidth from ``src`` to ``dst`` (symmetric unless both directions are given)."""

    src: Endpoint = Field(description="Sending endpoint.")
    dst: Endpoint = Field(description="Receiving endpoint.")
    curve: BandwidthCurve = Field(description="Bandwidth as a function of message size.")


class CollectiveLatency(Frozen):
    """Time of an all-reduce of a tiny tensor among ``ranks`` ranks of one endpoint kind.

    The fixed cost of a collective with the backend in use, measured directly: the
    point-to-point latency of a ping-pong probe does not carry over (on a loaded 2-core
    host, 1.7-2 ms one way against ~0.3-1.5 ms for a whole 2-4 rank all-reduce of one
    scalar: ranks that meet at a collective are awake, a ping-pong receiver is asleep).
    """

    endpoint: Endpoint = Field(description="Endpoint kind of every rank (one zone, GPU type).")
    ranks: int = Field(ge=2, description="Ranks in the all-reduce.")
    latency_s: float = Field(ge=0, description="Time of one all-reduce of a tiny tensor, s.")
    bus_gbps: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Bus bandwidth of the all-reduce as the backend runs it, measured at larger "
            "sizes (up to max_bytes): an all-reduce of B bytes among n ranks takes "
            "latency_s + 2(n-1)/n * B / bus_gbps. None: not measured (the ring is priced "
            "from the link curves)."
        ),
    )
    max_bytes: int = Field(default=0, ge=0, description="Largest size measured, bytes.")
    source: str = Field(default="", description="Measurement it came from.")
    scope: CollectiveScope = Field(
        default="intra_node",
        description=(
            "Where the ranks were: 'intra_node' (GPUs or processes of one node, over its "
            "own links or loopback; what every probe before this field measured) or "
            "'inter_node' (one rank per node, over the network between nodes). The "
            "simulator prices a ring with the measurement of its own scope only."
        ),
    )


class NetworkProfile(Frozen):
    """All links the simulator may need, plus intra-node curves per (GPU type, GPUs per node)."""

    links: tuple[Link, ...] = Field(default=(), description="Inter-node links.")
    intra_node: tuple[Link, ...] = Field(
        default=(), description="Intra-node curves (src == dst endpoint)."
    )
    estimated: bool = Field(
        default=False, description="True if any curve is an estimate, not a measurement."
    )
    source: str = Field(default="", description="Where this profile came from.")
    collectives: tuple[CollectiveLatency, ...] = Field(
        default=(),
        description=(
            "Measured all-reduce latencies (tiny tensor) per endpoint kind and rank count. "
            "Empty: a ring all-reduce pays the links' per-message latency at every step."
        ),
    )

    def collective_latency(
        self, endpoint: Endpoint, ranks: int, scope: CollectiveScope = "intra_node"
    ) -> float | None:
        """All-reduce latency among ``ranks`` ranks of ``endpoint`` measured in ``scope``, or
        None if not measured.

        A rank count not measured is scaled from the nearest measured one by the number of
        ring steps, ``2(n-1)``.
        """
        mine = [c for c in self.collectives if c.endpoint == endpoint and c.scope == scope]
        if not mine or ranks < 2:
            return None
        near = min(mine, key=lambda c: (abs(c.ranks - ranks), -c.ranks))
        return near.latency_s * (ranks - 1) / (near.ranks - 1)

    def collective_bus_gbps(
        self, endpoint: Endpoint, ranks: int, scope: CollectiveScope = "intra_node"
    ) -> float | None:
        """Measured all-reduce bus bandwidth among ``ranks`` ranks of ``endpoint`` in
        ``scope`` (that of the nearest measured rank count: a ring's bus bandwidth hardly
        depends on it), or None if none was measured."""
        mine = [
            c
            for c in self.collectives
            if c.endpoint == endpoint and c.bus_gbps and c.scope == scope
        ]
        if not mine or ranks < 2:
            return None
        return min(mine, key=lambda c: (abs(c.ranks - ranks), -c.ranks)).bus_gbps

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy without the lookup caches of this instance (they index the old data)."""
        copy = super().model_copy(update=update, deep=deep)
        for key in ("_idx",):
            copy.__dict__.pop(key, None)
        return copy

    def _index(self) -> dict[tuple[Endpoint, Endpoint], BandwidthCurve]:
        cache = self.__dict__.get("_idx")
        if cache is None:
            cache = {}
            for ln in self.links:
                cache[(ln.src, ln.dst)] = ln.curve
                cache.setdefault((ln.dst, ln.src), ln.curve)
            self.__dict__["_idx"] = cache
        return cache

    def curves(self) -> Mapping[tuple[Endpoint, Endpoint], BandwidthCurve]:
        """Every measured inter-node curve by (source, destination) endpoint, each link
        either way round (a link's own direction wins). Built once; do not modify."""
        return self._index()

    def inter(self, src: Endpoint, dst: Endpoint) -> BandwidthCurve | None:
        """Curve measured between two endpoints on different nodes (either way round), or,
        inside one zone, a zone-agnostic curve (zone ``*``, e.g. a per-VM-shape fit) of their
        VM shapes; None if neither is known. The simulator's fallbacks for an unknown link
        (other zones, other VM shapes, distance) are ``sailor.simulator.network_model``'s."""
        idx = self._index()
        curve = idx.get((src, dst))
        if curve is None and src.zone == dst.zone:
            anywhere = (src.model_copy(update={"zone": "*"}), dst.model_copy(update={"zone": "*"}))
            curve = idx.get(anywhere)
        return curve

    def intra(self, gpu_type: str, gpus_per_node: int) -> BandwidthCurve | None:
        """Curve between GPUs of one node."""
        for ln in self.intra_node:
            if ln.src.gpu_type == gpu_type and ln.src.gpus_per_node == gpus_per_node:
                return ln.curve
        for ln in self.intra_node:
            if ln.src.gpu_type == gpu_type:
                return ln.curve
        return None
