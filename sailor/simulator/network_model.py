"""Network costs: pipeline point-to-point transfers and ring all-reduce over the slowest link.

Link curves come from the network profile, keyed by (zone, GPU type, GPUs per node) at both
ends. When a link is missing the fallbacks are, in order, and each is recorded in the notes:

1. inside one zone, a zone-agnostic curve (zone ``*``, e.g. a per-VM-shape fit) of both ends'
   VM shapes;
2. a curve measured between sibling zones (:func:`sibling_curve`): the same relation (one
   zone; two zones of one region; zones of the same two regions) between other zones of the
   same region(s), with both ends' VM shapes, the slowest;
3. a curve measured between the same zones by nodes of other VM shapes, the slowest;
4. a flat curve by distance: :data:`FALLBACK_SAME_ZONE_GBPS` inside a zone,
   :data:`FALLBACK_SAME_REGION_GBPS` between zones of a region, else
   :data:`FALLBACK_INTER_GBPS`.

An edge zone (an AWS local or wavelength zone, ``sailor.schemas.zones.edge_zone``) is in
its parent region for prices, but in another metro: a link between it and another zone has
no sibling (2) and is priced as between regions (4).

A VM shape (GPU type, GPUs per node) comes with its NICs: one A100-40 VM's probe peaks at 2.4
GB/s, a four-GPU one's at 6 GB/s in the same zone. So a sibling zones' curve of the same shapes
(2) comes before the same zones' curve of another shape (3). Fallbacks 2-4 are guesses
(:func:`guessed_link`: the estimate says it rests on one); 1 is a measurement of the shapes.

Intra-node transfers use the profile's intra-node curve of the GPU type, else the spec
sheet's per-GPU link bandwidth, else :data:`FALLBACK_INTRA_GBPS`.

Every bandwidth is derated by the network efficiency η of the calibration, taken on the
link at hand (``schemas.calibration.eta_on``: η was read on links of one peak bandwidth, and
the framework's shortfall is a throughput of its own in series with the link, so a slower
link loses less of its bandwidth to it). A ring all-reduce
pays the links' per-message latency at each of its ``2(n-1)`` steps, unless the network
profile holds a measured all-reduce latency for the ring's endpoint kind and scope
(``NetworkProfile.collectives``): then it pays that once, plus the steps' bandwidth time; and
when that measurement also holds the all-reduce's bus bandwidth as the backend runs it, the
bytes move at that bandwidth (``2(n-1)/n · B / bus``) instead of over the link curves. The
scope must match (:func:`ring_scope`): a probe of the GPUs of one node (NVLink, PCIe or
loopback) never prices a ring whose members are on different nodes; that ring takes an
inter-node measurement (``sailor profile network --rank 0|1``) or the inter-node links.
Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from sailor.schemas import BandwidthCurve, Endpoint, GPUSpec, NetworkProfile, ReplicaGroup
from sailor.schemas.calibration import LinkEta
from sailor.schemas.device_kind import spec_of
from sailor.schemas.network import CollectiveScope
from sailor.schemas.zones import edge_zone, region_of
from sailor.simulator.memo import IdentityMemo

__all__ = [
    "BUCKET_ELEMENTS",
    "FALLBACK_INTER_GBPS",
    "FALLBACK_INTRA_GBPS",
    "FALLBACK_SAME_REGION_GBPS",
    "FALLBACK_SAME_ZONE_GBPS",
    "AllReduce",
    "LinkCurves",
    "guessed_link",
    "inter_curve",
    "intra_curve",
    "ring_allreduce",
    "ring_order",
    "ring_scope",
    "sibling_curve",
]

FALLBACK_SAME_ZONE_GBPS = 2.4
"""Flat 2.4 GB/s inside one zone without a probe: the lowest peak the reference probes measured
between two 1-GPU VMs of one zone (A100-40, 2.4 GB/s), i.e. the smallest VM shape's NIC."""

FALLBACK_SAME_REGION_GBPS = 2.4
"""Flat 2.4 GB/s between zones of one region without a probe: the reference probes between
us-central1 zones (1-GPU A100-40 VMs) peak at 2.5-2.6 GB/s, as high as inside one zone."""

FALLBACK_INTER_GBPS = 0.5
"""Flat 0.5 GB/s (4 Gbit/s) for an unknown inter-node link: below the slowest link the
reference probes measured (us-central1 ↔ us-west1, 0.6-1.1 GB/s at its peak), so a missing
link never makes a plan look faster than a measured one."""

FALLBACK_INTRA_GBPS = 10.0
"""Flat 10 GB/s inside a node without a curve or spec: a PCIe 3.0 x16 link (~12 GB/s)."""

BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` (5e8, counted in elements, not bytes): gradients
are all-reduced in buckets of this many elements, one after the other."""


def _flat(gbps: float) -> BandwidthCurve:
    return BandwidthCurve(coeffs=(0.0, 0.0, gbps), max_gbps=gbps)


def guessed_link(note: str) -> bool:
    """``note`` (of :func:`inter_curve`, :func:`intra_curve` or a ring) says the link is a
    guess: flat by distance, a spec sheet, a sibling zones' curve or another VM shape's, not
    a measured curve of this link."""
    return note.startswith(("no link", "no intra"))


def inter_curve(
    network: NetworkProfile, a: ReplicaGroup, b: ReplicaGroup
) -> tuple[BandwidthCurve, str]:
    """Curve between the nodes of two replica groups, and a note if a fallback was used
    (the module docstring's order; :func:`guessed_link` tells a guess from a measurement)."""
    src = Endpoint(zone=a.zone, gpu_type=a.gpu_type, gpus_per_node=a.gpus_per_node)
    dst = Endpoint(zone=b.zone, gpu_type=b.gpu_type, gpus_per_node=b.gpus_per_node)
    exact = network.curves().get((src, dst))
    if exact is not None:
        return exact, ""
    link = f"{a.gpu_type}x{a.gpus_per_node}@{a.zone} -> {b.gpu_type}x{b.gpus_per_node}@{b.zone}"
    anywhere = network.inter(src, dst)
    if anywhere is not None:
        return anywhere, f"link {link} not profiled: the zone-agnostic curve of these VM shapes"
    sibling = sibling_curve(network, src, dst)
    if sibling is not None:
        curve, where = sibling
        return curve, (
            f"no link {link} in the network profile: slowest curve of these VM shapes "
            f"measured {where}"
        )
    other = _other_shapes(network, src, dst)
    if other is not None:
        curve, shapes = other
        return curve, (
            f"no link {link} in the network profile: slowest curve of other VM shapes "
            f"between these zones ({shapes})"
        )
    if a.zone == b.zone:
        gbps = FALLBACK_SAME_ZONE_GBPS
    elif region_of(a.zone) == region_of(b.zone) and not _edge(a.zone, b.zone):
        gbps = FALLBACK_SAME_REGION_GBPS
    else:
        gbps = FALLBACK_INTER_GBPS
    return _flat(gbps), (
        f"no link {a.zone} -> {b.zone} in the network profile: conservative flat {gbps} GB/s"
    )


def _other_shapes(
    network: NetworkProfile, src: Endpoint, dst: Endpoint
) -> tuple[BandwidthCurve, str] | None:
    """The slowest curve measured between the zones of ``src`` and ``dst`` (either way round)
    by nodes of other VM shapes, and that link's shapes. A node's NICs go with its shape, so
    this is a guess: the slowest, so that it is rarely an optimistic one."""
    best: tuple[BandwidthCurve, str] | None = None
    for (x, y), c in network.curves().items():
        if (x.zone, y.zone) == (src.zone, dst.zone) and (
            best is None or c.max_gbps < best[0].max_gbps
        ):
            best = c, f"{x.gpu_type}x{x.gpus_per_node} -> {y.gpu_type}x{y.gpus_per_node}"
    return best


def _edge(*zones: str) -> bool:
    """Whether one of ``zones`` is an edge zone (an AWS local or wavelength zone): in its
    parent region for prices, but another metro, not on the region's fabric."""
    return any(edge_zone(z) for z in zones)


def _shape(e: Endpoint) -> tuple[str, int]:
    return e.gpu_type, e.gpus_per_node


def sibling_curve(
    network: NetworkProfile, src: Endpoint, dst: Endpoint
) -> tuple[BandwidthCurve, str] | None:
    """A curve measured between other zones of the regions of ``src`` and ``dst``, standing
    in for their unprofiled link: inside one zone, a link measured inside another zone of
    the region; between two zones of one region, one measured between two other zones of it;
    between regions, one measured between zones of the same two regions. Zones of a region
    share its network fabric, so a sibling's curve is a better guess than a flat one by
    distance; still a guess (its note says so). Only links whose ends have the VM shapes
    (GPU type, GPUs per node) of ``src`` and ``dst`` (either way round) stand in: a node's
    NICs go with its shape, and another shape's link can be several times faster or slower
    (then the flat guess). The slowest of them; None: no such link. Memoized on the
    network profile's identity (a search asks for the same pairs in every simulation)."""
    return _SIBLINGS.get((network,), ("sibling", src, dst), lambda: _sibling(network, src, dst))


_SIBLINGS = IdentityMemo(4096)


def _sibling(
    network: NetworkProfile, src: Endpoint, dst: Endpoint
) -> tuple[BandwidthCurve, str] | None:
    if src.zone != dst.zone and _edge(src.zone, dst.zone):
        return None  # an edge zone's link leaves the region's fabric: no zones are alike
    ra, rb = region_of(src.zone), region_of(dst.zone)
    if src.zone == dst.zone:
        where = f"inside another zone of {ra}"
    elif ra == rb:
        where = f"between two other zones of {ra}"
    else:
        where = f"between other zones of {ra} and {rb}"
    shapes = {(_shape(src), _shape(dst)), (_shape(dst), _shape(src))}
    pair = {(src.zone, dst.zone), (dst.zone, src.zone)}
    best: BandwidthCurve | None = None
    for ln in network.links:
        if (_shape(ln.src), _shape(ln.dst)) not in shapes or "*" in (ln.src.zone, ln.dst.zone):
            continue
        if ln.src.zone != ln.dst.zone and _edge(ln.src.zone, ln.dst.zone):
            continue
        if (ln.src.zone, ln.dst.zone) in pair:
            continue  # the pair itself: its links are exact, or another shape's (a guess)
        x, y = region_of(ln.src.zone), region_of(ln.dst.zone)
        if src.zone == dst.zone:
            related = ln.src.zone == ln.dst.zone and x == ra
        elif ra == rb:
            related = ln.src.zone != ln.dst.zone and x == ra == y
        else:
            related = {x, y} == {ra, rb}
        if related and (best is None or best.max_gbps > ln.curve.max_gbps):
            best = ln.curve
    return None if best is None else (best, where)


def intra_curve(
    network: NetworkProfile,
    gpu_type: str,
    gpus: int,
    specs: Mapping[str, GPUSpec],
    spec_group: int | None = None,
) -> tuple[BandwidthCurve, str]:
    """Curve between ``gpus`` GPUs of one node of ``gpu_type``. Without a measured curve,
    the spec sheet's link among ``spec_group`` GPUs (default ``gpus``): on a mesh node a
    group of n GPUs reaches n - 1 pair links (``GPUSpec.link_gbps_among``); a transfer
    between two GPUs, such as a stage boundary's, one."""
    curve = network.intra(gpu_type, gpus)
    if curve is not None:
        return curve, ""
    spec = spec_of(specs, gpu_type)
    if spec is not None:
        group = gpus if spec_group is None else spec_group
        gbps = spec.link_gbps_among(group)
        pair = spec.intra_node_pair_link_gbps
        links = min(group - 1, round(gbps / pair)) if pair else 0
        mesh = "" if links < 1 else f" ({links} of its pair links at {pair:g} GB/s)"
        return _flat(gbps), (
            f"no intra-node curve for {gpu_type}: spec-sheet {spec.intra_node_link} "
            f"{gbps:g} GB/s{mesh}"
        )
    return _flat(FALLBACK_INTRA_GBPS), (
        f"no intra-node curve or spec for {gpu_type}: flat {FALLBACK_INTRA_GBPS} GB/s"
    )


class LinkCurves:
    """The curve lookups of one simulation, each worked out once.

    :func:`inter_curve` depends only on the (zone, GPU type, GPUs per node) of both ends and
    :func:`intra_curve` on (GPU type, GPUs): a plan of hundreds of pipelines asks for the same
    few pairs thousands of times (every stage boundary, every step of every ring), and each
    answer builds its endpoints and, without a measured link, a fallback curve. Holds only
    what ``network`` and ``specs`` give; meant to live for one simulation.
    """

    def __init__(self, network: NetworkProfile, specs: Mapping[str, GPUSpec]) -> None:
        self.network = network
        self.specs = specs
        self._inter: dict[tuple[str, str, int, str, str, int], tuple[BandwidthCurve, str]] = {}
        self._intra: dict[tuple[str, int, int | None], tuple[BandwidthCurve, str]] = {}

    def inter(self, a: ReplicaGroup, b: ReplicaGroup) -> tuple[BandwidthCurve, str]:
        """:func:`inter_curve` of ``a`` and ``b``."""
        key = (a.zone, a.gpu_type, a.gpus_per_node, b.zone, b.gpu_type, b.gpus_per_node)
        hit = self._inter.get(key)
        if hit is None:
            hit = self._inter[key] = inter_curve(self.network, a, b)
        return hit

    def intra(
        self, gpu_type: str, gpus: int, spec_group: int | None = None
    ) -> tuple[BandwidthCurve, str]:
        """:func:`intra_curve` of ``gpus`` GPUs of ``gpu_type``."""
        key = (gpu_type, gpus, spec_group)
        hit = self._intra.get(key)
        if hit is None:
            hit = self._intra[key] = intra_curve(
                self.network, gpu_type, gpus, self.specs, spec_group
            )
        return hit


@dataclass(frozen=True)
class AllReduce:
    """A ring all-reduce: its time, and the bytes each zone pair carries."""

    time_s: float
    cross_zone_bytes: tuple[tuple[str, str, float], ...]
    notes: tuple[str, ...]
    latency_s: float = 0.0
    """The part of ``time_s`` that is per-message latency (the rest moves bytes)."""


def ring_scope(groups: Sequence[ReplicaGroup]) -> CollectiveScope:
    """Whether a ring among ``groups`` stays inside one node: every group placed on the same
    node (``node_id``, set at launch), as a pipeline's stages are judged for a point-to-point
    transfer. Unplaced groups are taken to be on nodes of their own (the ring model prices
    each hop over the node-to-node curve)."""
    first = groups[0].node_id if groups else ""
    if first and all(g.node_id == first for g in groups):
        return "intra_node"
    return "inter_node"


class _NodeKind(Protocol):
    @property
    def zone(self) -> str: ...
    @property
    def gpu_type(self) -> str: ...
    @property
    def gpus_per_node(self) -> int: ...


def ring_order(node: _NodeKind) -> tuple[str, str, int]:
    """Where a node stands in a gradient ring (the sort key of :func:`ring_allreduce`'s
    ring, and of the planner's closed form of it): by zone, then GPU type and node shape,
    so that the ring crosses each zone boundary and each change of node kind once, whatever
    the order of a plan's data-parallel replicas."""
    return (node.zone, node.gpu_type, node.gpus_per_node)


def ring_allreduce(
    network: NetworkProfile,
    groups: Sequence[ReplicaGroup],
    node_bytes: float,
    elements_per_gpu: float,
    efficiency: LinkEta,
    *,
    links: LinkCurves | None = None,
) -> AllReduce:
    """Ring all-reduce of ``node_bytes`` per node among the nodes of ``groups``.

    Each TP rank of a node runs its own ring; the rings of a node run at once and share its
    NICs, so one step moves ``node_bytes / n`` per node over the node-level curve. A step
    lasts as long as the slowest link of the ring; a ring has ``2(n-1)`` steps. The ring
    visits the zones in order and, in a zone, the nodes by GPU type and node shape, so it
    crosses each zone boundary and each change of node kind once, whatever the order of
    ``groups`` (a plan's data-parallel replicas are not ordered). Gradients go in
    buckets of :data:`BUCKET_ELEMENTS` elements, one after the other. Each distinct pair of
    neighbours is priced once (``links`` shares the lookups across rings); each note is
    listed once, in ring order. ``efficiency`` is taken on each step's link
    (:meth:`LinkEta.on`); a value meant as it is on every link is ``LinkEta.as_read``.
    """
    n = len(groups)
    if n <= 1 or node_bytes <= 0:
        return AllReduce(0.0, (), ())
    links = links if links is not None else LinkCurves(network, {})
    ring = sorted(groups, key=ring_order)
    buckets = max(1, math.ceil(elements_per_gpu / BUCKET_ELEMENTS))
    chunk = node_bytes / buckets / n
    kinds = [(g.zone, g.gpu_type, g.gpus_per_node) for g in ring]
    measured = None
    bus_gbps = None
    scope = ring_scope(groups)
    if len(set(kinds)) == 1:
        zone, gpu_type, gpus = kinds[0]
        ep = Endpoint(zone=zone, gpu_type=gpu_type, gpus_per_node=gpus)
        measured = network.collective_latency(ep, n, scope)
        if measured is not None:
            bus_gbps = network.collective_bus_gbps(ep, n, scope)
    # neighbour pairs by kind, first occurrence first (the order of the notes)
    pairs: dict[tuple[tuple[str, str, int], tuple[str, str, int]], int] = {}
    for i, pair in enumerate(zip(kinds, kinds[1:] + kinds[:1], strict=True)):
        pairs.setdefault(pair, i)
    notes: list[str] = []
    step = 0.0
    step_latency = 0.0  # the per-message latency inside the slowest step
    for i in pairs.values():
        curve, note = links.inter(ring[i], ring[(i + 1) % n])
        if note and note not in notes:
            notes.append(note)
        latency = 0.0
        if bus_gbps is not None:
            per_step = chunk / (bus_gbps * 1e9)  # the backend's measured bandwidth
        else:
            per_step = curve.transfer_time(chunk)
            if measured is not None:
                per_step -= curve.latency_s  # paid once per all-reduce below, as measured
            else:
                latency = min(curve.latency_s, per_step)
        eff = efficiency.on(curve.max_gbps)
        if per_step / eff > step:
            step, step_latency = per_step / eff, latency / eff
    crossed = 2.0 * (n - 1) * chunk * buckets
    crossings = tuple(
        (za, zb, crossed)
        for (za, _, _), (zb, _, _) in zip(kinds, kinds[1:] + kinds[:1], strict=True)
        if za != zb
    )
    fixed = 0.0 if measured is None else measured * buckets
    return AllReduce(
        time_s=2.0 * (n - 1) * step * buckets + fixed,
        cross_zone_bytes=crossings,
        notes=tuple(notes),
        latency_s=2.0 * (n - 1) * step_latency * buckets + fixed,
    )
