"""Pipeline templates: the best uneven layer partition for each depth and stage kinds.

A template is one pipeline shape: its stages' layer ranges and kinds (GPU type, TP, zone).
For a sequence of at most two kinds (``A`` stages then ``B`` stages: a pipeline whose first
stages run on one GPU type and last on another), a dynamic program over layers finds, for
every depth ``S`` at once, the partition that minimises the bottleneck stage time (the 1F1B
period, which multiplies the number of microbatches) and, among those, the sum of stage times
(the fill and drain). A stage's time is its compute plus the blocking transfers at both of
its ends, as the simulator charges them. Stages that do not fit in memory with the
microbatches 1F1B keeps in flight at their position (``S - s``) are never formed: memory
prunes the DP, not a fixed shape.

Backward recursion, with ``k`` stages left starting at layer ``i`` on kind ``x`` after a stage
of kind ``p``: ``V[k][x][p][i] = min_j,y max(t(i..j; p→x→y), V[k-1][y][x][j+1])``; all ``i``
and ``j`` are handled at once as numpy matrices, O(L³·K²) per kind sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sailor.planner.tables import CostTables, FloatArray, Kind, LayerArrays

__all__ = [
    "PipelineTemplate",
    "StageTemplate",
    "best_partitions",
    "best_partitions_many",
    "fixed_kinds",
    "repriced",
    "with_cuts",
]

_TIE = 1e-9


class StageTemplate(NamedTuple):
    """One stage of a template.

    A named tuple, not a dataclass: a 512-GPU robust search builds ~40,000 of them and keeps
    them, and a tuple is one object for the garbage collector to walk where a dataclass
    instance is two (itself and its ``__dict__``), built at a sixth of the cost.
    """

    first_layer: int
    last_layer: int
    kind: Kind
    time_s: float  # fwd+bwd per microbatch incl. blocking transfers at both ends
    update_s: float
    params: float  # parameters per GPU
    memory_bytes: float  # peak with S - s microbatches in flight


_NeedT = tuple[tuple[tuple[str, str, int], int], ...]
_NEEDS: dict[_NeedT, _NeedT] = {}
"""Interned :meth:`PipelineTemplate.need` values (a pool has a few dozen distinct ones)."""
_NEEDS_KEPT = 4096


@dataclass(frozen=True)
class PipelineTemplate:
    """A pipeline shape with its per-microbatch figures."""

    stages: tuple[StageTemplate, ...]
    mbs: int
    period_s: float  # bottleneck stage time per microbatch
    fill_s: float  # sum of stage times (one microbatch's round trip)
    estimated: bool

    @property
    def depth(self) -> int:
        return len(self.stages)

    @property
    def gpus(self) -> int:
        g = self.__dict__.get("_gpus")
        if g is None:
            g = sum(s.kind.tp for s in self.stages)
            object.__setattr__(self, "_gpus", g)
        return int(g)

    def gpus_by_resource(self) -> dict[tuple[str, str, int], int]:
        """GPUs per (type, zone, VM shape); the caller must not mutate it."""
        out = self.__dict__.get("_res")
        if out is None:
            out = {}
            for s in self.stages:
                k = (s.kind.gpu_type, s.kind.zone, s.kind.gpus_per_node)
                out[k] = out.get(k, 0) + s.kind.tp
            object.__setattr__(self, "_res", out)
        return out

    def need(self) -> _NeedT:
        """:meth:`gpus_by_resource`'s items as a tuple, kept. Equal needs are one object
        (interned), so a caller may key on its id while the templates hold it: templates
        of one shape on other partitions or microbatch sizes are checked once."""
        hit: _NeedT | None = self.__dict__.get("_need")
        if hit is None:
            need = tuple(self.gpus_by_resource().items())
            if len(_NEEDS) > _NEEDS_KEPT:
                _NEEDS.clear()  # only sharing is lost: a caller's id is held by its template
            hit = _NEEDS.setdefault(need, need)
            object.__setattr__(self, "_need", hit)
        return hit

    def pipe_time(self, m: int) -> float:
        """1F1B closed form for ``m`` microbatches (the simulator's)."""
        return (m - 1) * self.period_s + self.fill_s

    def max_microbatches(self, t: float) -> int:
        """Most microbatches that finish within ``t`` seconds (0 if none)."""
        if t < self.fill_s:
            return 0
        return int((t - self.fill_s) / self.period_s * (1 + 1e-12)) + 1

    @property
    def key(self) -> tuple[object, ...]:
        """(mbs, each stage's last layer, each stage's kind): equal for equal templates (the
        stages tile the layers from 0, so the last layers fix the ranges). Computed once: a
        replan asks per pipeline, ~10,000 times at 512 nodes."""
        k = self.__dict__.get("_key")
        if k is None:
            st = self.stages
            k = (self.mbs, tuple(s.last_layer for s in st), tuple(s.kind for s in st))
            object.__setattr__(self, "_key", k)
        out: tuple[object, ...] = k
        return out


def best_partitions(
    tables: CostTables, kinds: tuple[Kind, ...], mbs: int, max_depth: int | None = None
) -> tuple[list[PipelineTemplate], int]:
    """Best template per depth for stages of ``kinds`` in order (each kind used at least once).

    Returns the templates (dominated depths dropped: a deeper pipeline is kept only if its
    period is shorter) and the number of (stage, depth) cells pruned by memory.
    """
    return best_partitions_many(tables, [(kinds, mbs)], max_depth)[0]


def best_partitions_many(
    tables: CostTables,
    requests: Sequence[tuple[tuple[Kind, ...], int]],
    max_depth: int | None = None,
) -> list[tuple[list[PipelineTemplate], int]]:
    """:func:`best_partitions` of every ``(kinds, mbs)`` request, in order.

    The DPs of one kind count go through numpy together: one DP's matrices are a few
    hundred cells (26 x 25 for OPT-350), so per-DP numpy calls are mostly call overhead.
    The answers are those of one DP at a time, cell for cell.
    """
    out: list[tuple[list[PipelineTemplate], int]] = [([], 0) for _ in requests]
    groups: dict[tuple[int, int], list[_Request]] = {}
    for r, (kinds, mbs) in enumerate(requests):
        arrs: list[LayerArrays] = []
        for kind in kinds:
            a = tables.arrays(kind.gpu_type, kind.tp, mbs)
            if a is None:
                break
            arrs.append(a)
        else:
            n = len(arrs[0].comp) - 1
            groups.setdefault((len(kinds), n), []).append(_Request(r, kinds, mbs, arrs))
    for (q, n), reqs in groups.items():
        for req, res in zip(reqs, _dp(tables, q, n, reqs, max_depth), strict=True):
            out[req.index] = res
    return out


@dataclass(frozen=True)
class _Request:
    index: int
    kinds: tuple[Kind, ...]
    mbs: int
    arrs: list[LayerArrays]


def _dp(
    tables: CostTables, q: int, n: int, reqs: Sequence[_Request], max_depth: int | None
) -> list[tuple[list[PipelineTemplate], int]]:
    """The backward DP of the module docstring for ``len(reqs)`` requests of ``q`` kinds and
    ``n`` layers at once (rows of every matrix: request-major, then combo or trip)."""
    inf = np.inf
    none = q  # "no previous stage"
    depth_cap = min(n, max_depth or n)
    # combos (x, p): the current kind and the one before it; trips add the next kind y
    combos: list[tuple[int, int]] = []
    for x in range(q):
        for p in ([none] if x == 0 else []) + [pp for pp in (x - 1, x) if pp >= 0]:
            combos.append((x, p))
    cidx = {c: i for i, c in enumerate(combos)}
    n_c = len(combos)
    # y = x comes first for each combo (the ties expect it); every combo has one
    trip = [(ci, x, p, y) for ci, (x, p) in enumerate(combos) for y in (x, x + 1) if y < q]
    n_t = len(trip)
    n_g = len(reqs)
    # the distinct layer arrays, for the memory masks of each depth
    uniq: dict[int, int] = {}
    ulist: list[LayerArrays] = []
    for rq in reqs:
        for a in rq.arrs:
            if id(a) not in uniq:
                uniq[id(a)] = len(ulist)
                ulist.append(a)
    # fits[u, k, i, j]: layers i..j of array u fit their GPU with k microbatches in flight
    fits = np.stack(
        [
            tables.stage_memory_upto(a, depth_cap)[: depth_cap + 1] <= tables.capacity(a.gpu_type)
            for a in ulist
        ]
    )
    t_all = np.empty((n_g * n_t, n, n - 1))
    last_t = np.full((n_g * n_c, n), inf)
    last_rows = [g * n_c + ci for g in range(n_g) for ci, (x, _) in enumerate(combos) if x == q - 1]
    for g, rq in enumerate(reqs):
        comp = [a.stage_compute() for a in rq.arrs]
        link: dict[tuple[int, int], FloatArray] = {}
        for x in range(q):
            for y in (x, x + 1):
                if y < q:
                    tf, tb = tables.link(rq.kinds[x], rq.kinds[y], rq.mbs)
                    link[(x, y)] = tf + tb

        for ti, (_, x, p, y) in enumerate(trip):
            recv = link[(p, x)] if p != none else None
            t_all[g * n_t + ti] = _stage_time(comp[x], recv, link[(x, y)])[:, : n - 1]
        for ci, (x, p) in enumerate(combos):
            if x == q - 1:
                recv = link[(p, x)] if p != none else None
                last_t[g * n_c + ci] = _stage_time(comp[x], recv, None)[:, n - 1]
    t_u = np.array([uniq[id(rq.arrs[x])] for rq in reqs for _, x, _, _ in trip], dtype=np.int64)
    t_y = np.array([y for _ in reqs for _, _, _, y in trip], dtype=np.int64)
    t_prev = np.array(
        [g * n_c + cidx[(y, x)] for g in range(n_g) for _, x, _, y in trip], dtype=np.int64
    )  # (y, x) is always a combo
    first = np.array(
        [g * n_t + ti for g in range(n_g) for ti, tr in enumerate(trip) if tr[3] == tr[1]],
        dtype=np.int64,
    )  # request, then combo order: row g * n_c + ci of the blocks below
    second = np.array(
        [g * n_t + ti for g in range(n_g) for ti, tr in enumerate(trip) if tr[3] != tr[1]],
        dtype=np.int64,
    )
    second_c = np.array(
        [g * n_c + tr[0] for g in range(n_g) for tr in trip if tr[3] != tr[1]], dtype=np.int64
    )
    l_rows = np.array(last_rows, dtype=np.int64)
    l_u = np.array([uniq[id(reqs[r // n_c].arrs[q - 1])] for r in last_rows], dtype=np.int64)
    start = cidx[(0, none)]
    pruned = np.zeros(n_g, dtype=np.int64)
    best_period = np.full(n_g, inf)
    results: list[list[PipelineTemplate]] = [[] for _ in reqs]
    choice: list[tuple[np.ndarray, np.ndarray]] = []
    prev_m = prev_s = np.empty((0, n + 1))
    for k in range(1, depth_cap + 1):
        blk_m = np.full((n_g * n_c, n + 1), inf)
        blk_s = np.full((n_g * n_c, n + 1), inf)
        blk_j = np.full((n_g * n_c, n + 1), -1, dtype=np.int64)
        blk_y = np.full((n_g * n_c, n + 1), -1, dtype=np.int64)
        if k == 1:
            ok1 = fits[l_u, 1, :, n - 1]
            t = last_t[l_rows]
            pruned += (~ok1 & np.isfinite(t)).reshape(n_g, -1).sum(axis=1)
            t = np.where(ok1, t, inf)
            blk_m[l_rows, :n], blk_s[l_rows, :n] = t, t
            blk_j[l_rows, :n] = n - 1
            blk_y[l_rows, :n] = q - 1
        else:
            # k stages from layer i need i <= n - k, and the stage i..j leaves k - 1 layers at
            # least: j <= n - k. Outside that square every cell is infinite, so the DP skips it.
            m = n - k + 1
            ok = fits[t_u, k, :m, :m]
            t = np.where(ok, t_all[:, :m, :m], inf)  # j < n-1: a stage follows
            mx = np.maximum(t, prev_m[t_prev, None, 1 : m + 1])
            sm = t + prev_s[t_prev, None, 1 : m + 1]
            best = mx.min(axis=2)
            tie = mx <= best[:, :, None] * (1 + _TIE)
            jsel = np.argmin(np.where(tie, sm, inf), axis=2)
            cm = np.take_along_axis(mx, jsel[:, :, None], axis=2)[:, :, 0]
            cs = np.take_along_axis(sm, jsel[:, :, None], axis=2)[:, :, 0]
            fin = np.isfinite(cm)
            # the first y of each combo beats the empty start wherever it is finite
            f = fin[first]
            blk_m[:, :m] = np.where(f, cm[first], inf)
            blk_s[:, :m] = np.where(f, cs[first], inf)
            blk_j[:, :m] = np.where(f, jsel[first], -1)
            blk_y[:, :m] = np.where(f, t_y[first][:, None], -1)
            if second.size:
                bm, bs = blk_m[second_c, :m], blk_s[second_c, :m]
                c2, s2 = cm[second], cs[second]
                better = ((c2 < bm * (1 - _TIE)) | ((c2 <= bm * (1 + _TIE)) & (s2 < bs))) & fin[
                    second
                ]
                blk_m[second_c, :m] = np.where(better, c2, bm)
                blk_s[second_c, :m] = np.where(better, s2, bs)
                blk_j[second_c, :m] = np.where(better, jsel[second], blk_j[second_c, :m])
                blk_y[second_c, :m] = np.where(better, t_y[second][:, None], blk_y[second_c, :m])
        prev_m, prev_s = blk_m, blk_s
        choice.append((blk_j, blk_y))
        period = blk_m[start::n_c, 0]
        better_g = np.isfinite(period) & (period < best_period * (1 - 1e-6))
        for gi in np.flatnonzero(better_g).tolist():
            best_period[gi] = period[gi]
            path = _path(choice, gi * n_c, cidx, k, none)
            rq = reqs[gi]
            placed = [(a, b, rq.kinds[x], rq.arrs[x]) for a, b, x in path]
            est = any(a.estimated for a in rq.arrs)
            results[gi].append(_assemble(tables, rq.mbs, placed, estimated=est))
        if not np.isfinite(blk_m).any():
            break  # no k-deep tail from any layer: none deeper either (each needs one)
    return [(res, int(p)) for res, p in zip(results, pruned, strict=True)]


def _stage_time(comp: FloatArray, recv: FloatArray | None, send: FloatArray | None) -> FloatArray:
    """``T[i, j]``: stage i..j's compute plus its blocking receive (the link after layer
    i - 1; None: the first stage, which starts at layer 0) and send (the link after j; None:
    the last stage)."""
    t = comp.copy()
    if send is not None:
        t = t + send[None, :]
    if recv is not None:
        t = t + np.concatenate([[np.inf], recv[:-1]])[:, None]  # boundary after layer i-1
    else:
        t[1:, :] = np.inf  # the first stage starts at layer 0
    return t


def _path(
    choice: Sequence[tuple[np.ndarray, np.ndarray]],
    row0: int,
    cidx: dict[tuple[int, int], int],
    depth: int,
    none: int,
) -> list[tuple[int, int, int]]:
    """(first layer, last layer, kind index) of each stage of the best ``depth``-deep
    partition of the request whose rows start at ``row0``."""
    ranges: list[tuple[int, int, int]] = []
    i, x, p = 0, 0, none
    for k in range(depth, 0, -1):
        bj, by = choice[k - 1]
        row = row0 + cidx[(x, p)]
        j, y = int(bj[row, i]), int(by[row, i])
        ranges.append((i, j, x))
        i, p, x = j + 1, x, y
    return ranges


def with_cuts(
    tables: CostTables, kind: Kind, mbs: int, last_layers: tuple[int, ...]
) -> PipelineTemplate | None:
    """The template of one stage kind on a given partition (None if a stage does not fit).

    Pipelines of different GPU types that share a partition share their gradient-sync
    segments: fewer, larger all-reduces than the common refinement of unrelated partitions.
    """
    arr = tables.arrays(kind.gpu_type, kind.tp, mbs)
    if arr is None:
        return None
    firsts = (0, *(b + 1 for b in last_layers[:-1]))
    placed = [(f, b, kind, arr) for f, b in zip(firsts, last_layers, strict=True)]
    cap = tables.capacity(kind.gpu_type)
    depth = len(placed)
    # stage_memory is cached per in-flight count: the check is an index lookup per stage
    if any(
        tables.stage_memory(arr, depth - s)[f, b] > cap for s, (f, b, _, _) in enumerate(placed)
    ):
        return None
    return _assemble(tables, mbs, placed, estimated=arr.estimated)


def repriced(tables: CostTables, t: PipelineTemplate) -> PipelineTemplate | None:
    """``t``'s shape (layer ranges, kinds, microbatch size) priced by ``tables`` (another
    corner's constants: :mod:`sailor.planner.robust`); None if a stage cannot be priced."""
    placed: list[tuple[int, int, Kind, LayerArrays]] = []
    for st in t.stages:
        arr = tables.arrays(st.kind.gpu_type, st.kind.tp, t.mbs)
        if arr is None:
            return None
        placed.append((st.first_layer, st.last_layer, st.kind, arr))
    return _assemble(tables, t.mbs, placed, estimated=any(p[3].estimated for p in placed))


def fixed_kinds(tables: CostTables, seq: tuple[Kind, ...], mbs: int) -> PipelineTemplate | None:
    """Best partition when stage ``s`` must run on ``seq[s]`` (None if nothing fits).

    Used where the per-depth optimum of :func:`best_partitions` needs more GPUs of one type
    than the pool has: the search then asks for each split of the depth between the types.
    Backward DP over stages, numpy over layer ranges: O(S·L²).
    """
    arrs: list[LayerArrays] = []
    for kind in seq:
        found = tables.arrays(kind.gpu_type, kind.tp, mbs)
        if found is None:
            return None
        arrs.append(found)
    n = len(arrs[0].comp) - 1
    depth = len(seq)
    if depth > n:
        return None
    inf = np.inf
    nxt_m = np.full(n + 1, inf)
    nxt_s = np.full(n + 1, inf)
    nxt_m[n] = nxt_s[n] = 0.0  # nothing left after the last stage
    choice: list[np.ndarray] = []
    for s in range(depth - 1, -1, -1):
        t = arrs[s].stage_compute()
        if s + 1 < depth:
            tf, tb = tables.link(seq[s], seq[s + 1], mbs)
            t = t + (tf + tb)[None, :]
        if s > 0:
            tf, tb = tables.link(seq[s - 1], seq[s], mbs)
            recv = np.concatenate([[inf], (tf + tb)[:-1]])
            t = t + recv[:, None]
        else:
            t = np.where(np.arange(n)[:, None] == 0, t, inf)
        ok = tables.stage_memory(arrs[s], depth - s) <= tables.capacity(seq[s].gpu_type)
        t = np.where(ok, t, inf)
        mx = np.maximum(t, nxt_m[None, 1:])
        sm = t + nxt_s[None, 1:]
        best = mx.min(axis=1)
        tie = mx <= best[:, None] * (1 + _TIE)
        jsel = np.argmin(np.where(tie, sm, inf), axis=1)
        rows = np.arange(n)
        cur_m = np.full(n + 1, inf)
        cur_s = np.full(n + 1, inf)
        cur_m[:n], cur_s[:n] = mx[rows, jsel], sm[rows, jsel]
        choice.append(jsel)
        nxt_m, nxt_s = cur_m, cur_s
    if not np.isfinite(nxt_m[0]):
        return None
    choice.reverse()
    lasts: list[int] = []
    i = 0
    for s in range(depth):
        j = int(choice[s][i])
        lasts.append(j)
        i = j + 1
    firsts = (0, *(b + 1 for b in lasts[:-1]))
    placed = [(f, b, seq[i], arrs[i]) for i, (f, b) in enumerate(zip(firsts, lasts, strict=True))]
    return _assemble(tables, mbs, placed, estimated=any(x.estimated for x in arrs))


def _assemble(
    tables: CostTables,
    mbs: int,
    placed: Sequence[tuple[int, int, Kind, LayerArrays]],
    *,
    estimated: bool,
) -> PipelineTemplate:
    """The template of stages ``(first, last, kind, arrays)`` in pipeline order.

    A stage's time is its compute plus the blocking transfers to and from its neighbours;
    its memory holds ``depth - s`` microbatches in flight (1F1B).

    The search assembles ~1,400 templates of ~10 stages per corner: per-kind lookups are
    made once per run of stages of one kind.
    """
    depth = len(placed)
    stages: list[StageTemplate] = []
    times: list[float] = []
    arr: LayerArrays | None = None
    recv: list[float] | None = None  # the link into the current stage
    for s, (a, b, kind, this) in enumerate(placed):
        if this is not arr:
            arr = this
            comp, upd, params = arr.prefix_lists()  # Python floats: the same sums, cheaper
        t = comp[b + 1] - comp[a]
        send: list[float] | None = None
        if s + 1 < depth:
            nxt = placed[s + 1][2]
            # a template has at most three distinct links: look each up once
            if recv is not None and placed[s - 1][2] is kind and nxt is kind:
                send = recv
            else:
                send = tables.link_total(kind, nxt, mbs)
            t += send[b]
        if recv is not None:
            t += recv[a - 1]
        mem = float(tables.stage_memory(arr, depth - s)[a, b])
        stages.append(
            StageTemplate(a, b, kind, t, upd[b + 1] - upd[a], params[b + 1] - params[a], mem)
        )
        times.append(t)
        recv = send
    return PipelineTemplate(
        stages=tuple(stages),
        mbs=mbs,
        period_s=max(times),
        fill_s=sum(times),  # sum(), not a running total: it is compensated from Python 3.12
        estimated=estimated,
    )
