"""The templates a pool offers the search, and the search state that caches them.

:func:`template_set` gives a pool's pipeline templates: per zone, every stage kind (GPU type,
TP) alone and every ordered pair of kinds (:mod:`templates` runs the DPs), every kind on the
best partitions of each depth (shared sync segments), the splits of a depth between two
kinds that fit the pool, pipelines that span two zones, dominated templates dropped; cached
per pool shape on :class:`SearchState`, which a replan reuses. :func:`shortlist` is the
smaller set a replan allocates over. :func:`fits`, :func:`rate` and :func:`cuts_of` are the
template predicates the scenarios share.

Pure: values in, values out, apart from the caches on the :class:`SearchState` passed in. It
never allocates pipelines nor simulates (:mod:`scenarios` and :mod:`judge` do).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

from sailor.planner.pricing import GpuPricing, Resource
from sailor.planner.tables import CostTables, Kind
from sailor.planner.templates import (
    PipelineTemplate,
    best_partitions_many,
    fixed_kinds,
    with_cuts,
)
from sailor.planner.upper_bound import mbs_candidates, tp_candidates

__all__ = [
    "SMALL_POOL_GPUS",
    "SearchState",
    "cuts_of",
    "fits",
    "rate",
    "shortlist",
    "template_set",
]


@dataclass
class SearchState:
    """What a replan reuses: the cost tables and every template computed so far."""

    tables: CostTables
    templates: dict[tuple[object, ...], list[PipelineTemplate]] = field(default_factory=dict)
    pruned_memory: int = 0
    shortlist: dict[int, PipelineTemplate] = field(default_factory=dict)
    """Templates used by any allocation of the last search: where a replan looks first."""
    pricing: GpuPricing | None = None
    """Prices of the pool being searched (each entry's spot flag); set per search."""
    template_sets: dict[tuple[object, ...], list[PipelineTemplate]] = field(default_factory=dict)
    """Templates (dominated ones dropped) per pool shape: see :func:`template_set`."""
    left_out: tuple[str, ...] = ()
    """GPU types of the pool being searched left out for the job's precision, one line
    each with the reason (:func:`sailor.planner.job_precision.runnable_pool`); set per
    search."""


SMALL_POOL_GPUS = 16
"""Pools up to this size pack every pipeline spanning GPU types first once (each GPU matters);
larger pools only the best few."""


def template_set(
    state: SearchState, caps: Mapping[Resource, int]
) -> tuple[list[PipelineTemplate], int]:
    """The pool's templates, dominated ones dropped, and the number of DPs run for them.

    Cached per pool shape: a template needs at most ``layers x GPUs per node`` GPUs of a
    resource, and no rule that picks templates looks further (see :func:`_saturated`), so
    pools that differ only above that count share one list (a replan after nodes join or
    leave a large pool finds it ready).
    """
    n = state.tables.inputs.model.num_all_layers
    key = tuple(sorted((r, min(c, _saturated(r, n))) for r, c in caps.items()))
    hit = state.template_sets.get(key)
    if hit is not None:
        return hit, 0
    tstats = {"computed": 0}
    out = _prune_dominated(_templates(state, dict(key), tstats))
    state.template_sets[key] = out
    return out, tstats["computed"]


def _saturated(r: Resource, n_layers: int) -> int:
    """GPUs of ``r`` above which the template rules see no difference: every template fits
    (at most ``n_layers`` stages of at most a node each), every split of a depth between two
    kinds fits, and neither the small-pool rules (:data:`SMALL_POOL_GPUS`, :data:`_SPLIT_ALL`)
    apply."""
    return max(r[2] * n_layers, SMALL_POOL_GPUS + 1, r[2] * (_SPLIT_ALL + 1))


def shortlist(
    templates: Sequence[PipelineTemplate], used: Mapping[int, PipelineTemplate]
) -> list[PipelineTemplate]:
    keys = {t.key for t in used.values()}
    groups: dict[tuple[object, ...], list[PipelineTemplate]] = {}
    for t in templates:
        groups.setdefault((t.mbs, tuple(sorted(t.gpus_by_resource()))), []).append(t)
    out = [t for t in templates if t.key in keys]
    for g in groups.values():
        g.sort(key=lambda t: -rate(t))
        out.extend(t for t in g[:_SHORTLIST_PER_GROUP] if t.key not in keys)
    return out


_SHORTLIST_PER_GROUP = 4
"""Templates per (microbatch size, resource set) a replan adds to the last search's."""


def _templates(
    state: SearchState, caps: Mapping[Resource, int], stats: dict[str, int]
) -> list[PipelineTemplate]:
    tables = state.tables
    inputs = tables.inputs
    by_zone: dict[str, list[Resource]] = {}
    for r in caps:
        by_zone.setdefault(r[1], []).append(r)
    out: list[PipelineTemplate] = []

    def prefetch(keys: Sequence[tuple[tuple[Kind, ...], int]]) -> None:
        """Run the DPs of ``keys`` not yet computed together (:func:`best_partitions_many`)."""
        todo = list(dict.fromkeys(k for k in keys if k not in state.templates))
        for key, (hit, pruned) in zip(todo, best_partitions_many(tables, todo), strict=True):
            state.templates[key] = hit
            state.pruned_memory += pruned
            stats["computed"] += 1

    def get(kinds: tuple[Kind, ...], b: int) -> list[PipelineTemplate]:
        key = (kinds, b)
        if key not in state.templates:
            prefetch([key])
        return state.templates[key]

    zones: list[tuple[str, list[Resource], dict[Resource, list[Kind]], dict[str, list[int]]]] = []
    for zone, rs in sorted(by_zone.items()):
        kinds_by_r = {
            r: [Kind(r[0], tp, zone, r[2]) for tp in tp_candidates(r[2])] for r in sorted(rs)
        }
        mbs_by_type = {r[0]: mbs_candidates(inputs, r[0]) for r in rs}
        zones.append((zone, rs, kinds_by_r, mbs_by_type))
    # every zone's DPs of one kind and of two, each set in one batch (the loops below ask
    # for exactly these)
    prefetch(
        [
            ((k,), b)
            for _, rs, kinds_by_r, mbs_by_type in zones
            for r, ks in kinds_by_r.items()
            for k in ks
            for b in mbs_by_type[r[0]]
        ]
    )
    prefetch(
        [
            ((k1, k2), b)
            for _, rs, kinds_by_r, mbs_by_type in zones
            for ra, rb in combinations(sorted(rs), 2)
            for r1, r2 in ((ra, rb), (rb, ra))
            for k1 in kinds_by_r[r1]
            for k2 in kinds_by_r[r2]
            for b in sorted(set(mbs_by_type[r1[0]]) & set(mbs_by_type[r2[0]]))
        ]
    )
    singles_of: dict[Resource, list[PipelineTemplate]] = {}
    for _zone, rs, kinds_by_r, mbs_by_type in zones:
        singles: list[PipelineTemplate] = []
        for r, ks in kinds_by_r.items():
            for k in ks:
                for b in mbs_by_type[r[0]]:
                    fit = [t for t in get((k,), b) if fits(t, caps)]
                    singles.extend(fit)
                    singles_of.setdefault(r, []).extend(fit)
        out.extend(singles)
        if len(rs) > 1:
            out.extend(_aligned(state, singles, kinds_by_r, mbs_by_type, caps))
        for ra, rb in combinations(sorted(rs), 2):
            for r1, r2 in ((ra, rb), (rb, ra)):
                common = sorted(set(mbs_by_type[r1[0]]) & set(mbs_by_type[r2[0]]))
                for k1 in kinds_by_r[r1]:
                    for k2 in kinds_by_r[r2]:
                        for b in common:
                            found = get((k1, k2), b)
                            out.extend(t for t in found if fits(t, caps))
                            out.extend(_split_to_fit(state, found, k1, k2, b, caps))
    if len(by_zone) > 1:
        out.extend(_cross_zone(state, caps, singles_of, get, prefetch))
    return out


_CROSS_ZONE_KINDS = 1
"""Per resource that hosts whole pipelines in its own zone, the (TP, microbatch size) of its
best few single-zone templates (by samples per GPU-second) are the stage kinds it offers to
pipelines that span zones. A resource that hosts no whole pipeline offers every TP degree and
microbatch size: spanning zones is then the only way to use it."""


def _cross_zone(
    state: SearchState,
    caps: Mapping[Resource, int],
    singles_of: Mapping[Resource, list[PipelineTemplate]],
    get: Callable[[tuple[Kind, ...], int], list[PipelineTemplate]],
    prefetch: Callable[[Sequence[tuple[tuple[Kind, ...], int]]], None],
) -> list[PipelineTemplate]:
    """Pipelines whose first stages run in one zone and the rest in another.

    They pay off when a zone's GPUs cannot hold a whole pipeline (a model that needs more
    stages than one zone has nodes of its type) or a zone has leftover GPUs that can join a
    pipeline as stages; the hop between the two zones runs over the cross-zone link curve
    (:meth:`CostTables.link`) and its bytes pay egress both ways (:func:`p2p_egress`).
    Pools up to :data:`SMALL_POOL_GPUS` pair every kind; larger ones only the best kinds of
    each resource, which keeps the DPs to a few per ordered pair of resources.
    """
    inputs = state.tables.inputs
    small = sum(caps.values()) <= SMALL_POOL_GPUS
    offer: dict[Resource, list[tuple[int, int]]] = {}
    for r in sorted(caps):
        ts = sorted(singles_of.get(r, []), key=lambda t: -rate(t))
        every = [(tp, b) for tp in tp_candidates(r[2]) for b in mbs_candidates(inputs, r[0])]
        if small or not ts:
            offer[r] = every
            continue
        best: list[tuple[int, int]] = []
        for t in ts:
            tb = (t.stages[0].kind.tp, t.mbs)
            if tb not in best:
                best.append(tb)
            if len(best) >= _CROSS_ZONE_KINDS:
                break
        offer[r] = best
    todo: dict[tuple[Kind, Kind, int], None] = {}
    for r1 in sorted(caps):
        for r2 in sorted(caps):
            if r1[1] == r2[1]:
                continue
            both = set(mbs_candidates(inputs, r1[0])) & set(mbs_candidates(inputs, r2[0]))
            for tp1, b1 in offer[r1]:
                for tp2, b2 in offer[r2]:
                    k1, k2 = Kind(r1[0], tp1, r1[1], r1[2]), Kind(r2[0], tp2, r2[1], r2[2])
                    for b in sorted({b1, b2} & both):
                        todo.setdefault((k1, k2, b))
    prefetch([((k1, k2), b) for k1, k2, b in todo])  # one batch of DPs
    out: list[PipelineTemplate] = []
    for k1, k2, b in todo:
        found = get((k1, k2), b)
        out.extend(t for t in found if fits(t, caps))
        out.extend(_split_to_fit(state, found, k1, k2, b, caps))
    return out


_SPLIT_ALL = 8
"""When the pool holds at most this many stages of two kinds, every split of every depth
between them is evaluated (small pools: each GPU matters)."""


def _split_to_fit(
    state: SearchState,
    found: Sequence[PipelineTemplate],
    k1: Kind,
    k2: Kind,
    b: int,
    caps: Mapping[Resource, int],
) -> list[PipelineTemplate]:
    """Where a depth's optimum needs more GPUs of a type than the pool has, the best
    partition for every split of that depth between the two types that does fit."""
    r1 = (k1.gpu_type, k1.zone, k1.gpus_per_node)
    r2 = (k2.gpu_type, k2.zone, k2.gpus_per_node)
    max1, max2 = caps.get(r1, 0) // k1.tp, caps.get(r2, 0) // k2.tp
    out: list[PipelineTemplate] = []
    n = state.tables.inputs.model.num_all_layers
    unfit = {t.depth for t in found if not fits(t, caps)}
    small = max1 + max2 <= _SPLIT_ALL
    for depth in range(2, min(n, max1 + max2) + 1):
        if not small and depth not in unfit:
            continue
        lo, hi = max(1, depth - max2), min(max1, depth - 1)
        # small pools: every split; otherwise the two extremes that fit (as many stages of
        # either type as the pool holds), which bound the rest
        splits = range(lo, hi + 1) if small else sorted({lo, hi} if lo <= hi else set())
        for a in splits:
            seq = (k1,) * a + (k2,) * (depth - a)
            key = ("split", seq, b)
            hit = state.templates.get(key)
            if hit is None:
                one = fixed_kinds(state.tables, seq, b)
                hit = [one] if one is not None else []
                state.templates[key] = hit
            out.extend(t for t in hit if fits(t, caps))
    return out


_LEADERS_PER_DEPTH = 2
"""Partitions per depth that every other stage kind of the zone is also evaluated on."""


def cuts_of(t: PipelineTemplate) -> tuple[int, ...]:
    return tuple(s.last_layer for s in t.stages)


def rate(t: PipelineTemplate) -> float:
    """Samples per GPU-second in steady state."""
    return t.mbs / (t.period_s * t.gpus)


def _aligned(
    state: SearchState,
    singles: Sequence[PipelineTemplate],
    kinds_by_r: Mapping[Resource, list[Kind]],
    mbs_by_type: Mapping[str, list[int]],
    caps: Mapping[Resource, int],
) -> list[PipelineTemplate]:
    """Templates of every kind on the best partitions of each depth (shared sync segments)."""
    by_depth: dict[int, list[PipelineTemplate]] = {}
    for t in singles:
        if t.depth > 1:
            by_depth.setdefault(t.depth, []).append(t)
    out: list[PipelineTemplate] = []
    for ts in by_depth.values():
        ts.sort(key=lambda t: -rate(t))
        leaders: list[tuple[int, ...]] = []
        for t in ts:
            c = cuts_of(t)
            if c not in leaders:
                leaders.append(c)
            if len(leaders) >= _LEADERS_PER_DEPTH:
                break
        for cuts in leaders:
            for r, ks in kinds_by_r.items():
                for k in ks:
                    for b in mbs_by_type[r[0]]:
                        key = ("cuts", k, b, cuts)
                        hit = state.templates.get(key)
                        if hit is None:
                            one = with_cuts(state.tables, k, b, cuts)
                            hit = [one] if one is not None else []
                            state.templates[key] = hit
                        out.extend(t for t in hit if fits(t, caps))
    return out


def fits(t: PipelineTemplate, caps: Mapping[Resource, int]) -> bool:
    # a loop, not all() over a generator: a replan asks for every template of each corner
    for r, n in t.gpus_by_resource().items():  # noqa: SIM110
        if caps.get(r, 0) < n:
            return False
    return True


def _prune_dominated(ts: Sequence[PipelineTemplate]) -> list[PipelineTemplate]:
    """Drop a template if another with the same microbatch size uses no more GPUs of any
    resource and is no slower in period and fill."""
    groups: dict[tuple[object, ...], list[PipelineTemplate]] = {}
    for t in ts:
        sig = (t.mbs, tuple(sorted(t.gpus_by_resource())))
        groups.setdefault(sig, []).append(t)
    out: list[PipelineTemplate] = []
    for g in groups.values():
        g.sort(key=lambda t: (t.gpus, t.period_s, t.fill_s))
        kept: list[PipelineTemplate] = []
        for t in g:
            use = t.gpus_by_resource()
            if any(
                k.period_s <= t.period_s
                and k.fill_s <= t.fill_s
                and all(n <= use[r] for r, n in k.gpus_by_resource().items())
                for k in kept
            ):
                continue
            kept.append(t)
        out.extend(kept)
    return out
