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

import numpy as np

from sailor.planner.tables import CostTables, FloatArray, Kind, LayerArrays

__all__ = ["PipelineTemplate", "StageTemplate", "best_partitions"]

_TIE = 1e-9


@dataclass(frozen=True)
class StageTemplate:
    """One stage of a template."""

    first_layer: int
    last_layer: int
    kind: Kind
    time_s: float  # fwd+bwd per microbatch incl. blocking transfers at both ends
    update_s: float
    params: float  # parameters per GPU
    memory_bytes: float  # peak with S - s microbatches in flight


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
        """(mbs, stages): equal for equal templates (computed once: a replan asks per
        pipeline, ~10,000 times at 512 nodes)."""
        k = self.__dict__.get("_key")
        if k is None:
            k = (self.mbs, tuple((s.first_layer, s.last_layer, s.kind) for s in self.stages))
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
    arrs: list[LayerArrays] = []
    for kind in kinds:
        a = tables.arrays(kind.gpu_type, kind.tp, mbs)
        if a is None:
            return [], 0
        arrs.append(a)
    n = len(arrs[0].comp) - 1
    q = len(kinds)
    depth_cap = min(n, max_depth or n)
    comp = [a.stage_compute() for a in arrs]
    cap = [tables.capacity(kind.gpu_type) for kind in kinds]
    # link[x][y] = (tf+tb) after each layer from kind x to kind y
    link: dict[tuple[int, int], FloatArray] = {}
    for x in range(q):
        for y in (x, x + 1):
            if y < q:
                tf, tb = tables.link(kinds[x], kinds[y], mbs)
                link[(x, y)] = tf + tb
    none = q  # "no previous stage"
    inf = np.inf
    # V[(x, p)] = (max, sum) vectors over i, for the current k
    shape = (n + 1,)
    pruned = 0

    def stage_time(x: int, p: int, y: int | None) -> FloatArray:
        t = comp[x].copy()
        if y is not None:
            t = t + link[(x, y)][None, :]
        if p != none:
            recv = np.concatenate([[inf], link[(p, x)][:-1]])  # boundary after layer i-1
            t = t + recv[:, None]
        else:
            t[1:, :] = inf  # the first stage starts at layer 0
        return t

    combos: list[tuple[int, int]] = []
    for x in range(q):
        for p in ([none] if x == 0 else []) + [pp for pp in (x - 1, x) if pp >= 0]:
            combos.append((x, p))
    last_t = {(x, p): stage_time(x, p, None)[:, n - 1] for x, p in combos if x == q - 1}
    mid_t = {
        (x, p, y): stage_time(x, p, y)[:, : n - 1] for x, p in combos for y in (x, x + 1) if y < q
    }
    choice: list[dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]] = []
    results: list[PipelineTemplate] = []
    best_period = inf
    cidx = {c: i for i, c in enumerate(combos)}
    # every (combo, next kind y) of a stage that another follows, batched: the DP's (i, j)
    # matrices of one depth go through numpy together (per-combo calls on 26 x 25 matrices
    # were mostly call overhead). y = x comes first for each combo, as the ties expect.
    trip = [(ci, x, p, y) for ci, (x, p) in enumerate(combos) for y in (x, x + 1) if y < q]
    t_all = np.stack([mid_t[(x, p, y)] for _, x, p, y in trip])  # (T, n, n-1)
    t_x = np.array([x for _, x, _, _ in trip])
    t_y = np.array([y for _, _, _, y in trip], dtype=np.int64)
    t_prev = np.array([cidx[(y, x)] for _, x, _, y in trip])  # (y, x) is always a combo
    first = np.array([i for i, tr in enumerate(trip) if tr[3] == tr[1]])  # combo order
    second = np.array([i for i, tr in enumerate(trip) if tr[3] != tr[1]], dtype=np.int64)
    second_c = np.array([trip[i][0] for i in second], dtype=np.int64)
    t_rows, i_rows = np.arange(len(trip))[:, None], np.arange(n)[None, :]
    prev_m = prev_s = np.empty((0, n + 1))
    for k in range(1, depth_cap + 1):
        cur: dict[tuple[int, int], tuple[FloatArray, FloatArray]] = {}
        ch: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        mem_ok = [tables.stage_memory(a, k) <= c for a, c in zip(arrs, cap, strict=True)]
        blk_m = np.full((len(combos), *shape), inf)
        blk_s = np.full((len(combos), *shape), inf)
        blk_j = np.full((len(combos), *shape), -1, dtype=np.int64)
        blk_y = np.full((len(combos), *shape), -1, dtype=np.int64)
        if k == 1:
            for ci, (x, p) in enumerate(combos):
                if x != q - 1:
                    continue
                t = last_t[(x, p)]
                ok = mem_ok[x][:, n - 1]
                pruned += int(np.sum(~ok & np.isfinite(t)))
                t = np.where(ok, t, inf)
                blk_m[ci, :n], blk_s[ci, :n] = t, t
                blk_j[ci, :n] = n - 1
                blk_y[ci, :n] = x
        else:
            ok_all = np.stack([m[:, : n - 1] for m in mem_ok])[t_x]
            t = np.where(ok_all, t_all, inf)  # j < n-1: a stage follows
            mx = np.maximum(t, prev_m[t_prev][:, None, 1:n])
            sm = t + prev_s[t_prev][:, None, 1:n]
            best = mx.min(axis=2)
            tie = mx <= best[:, :, None] * (1 + _TIE)
            jsel = np.argmin(np.where(tie, sm, inf), axis=2)
            cm, cs = mx[t_rows, i_rows, jsel], sm[t_rows, i_rows, jsel]
            fin = np.isfinite(cm)
            # the first y of each combo beats the empty start wherever it is finite
            f = fin[first]
            blk_m[:, :n] = np.where(f, cm[first], inf)
            blk_s[:, :n] = np.where(f, cs[first], inf)
            blk_j[:, :n] = np.where(f, jsel[first], -1)
            blk_y[:, :n] = np.where(f, t_y[first][:, None], -1)
            if second.size:
                bm, bs = blk_m[second_c, :n], blk_s[second_c, :n]
                c2, s2 = cm[second], cs[second]
                better = ((c2 < bm * (1 - _TIE)) | ((c2 <= bm * (1 + _TIE)) & (s2 < bs))) & fin[
                    second
                ]
                blk_m[second_c, :n] = np.where(better, c2, bm)
                blk_s[second_c, :n] = np.where(better, s2, bs)
                blk_j[second_c, :n] = np.where(better, jsel[second], blk_j[second_c, :n])
                blk_y[second_c, :n] = np.where(better, t_y[second][:, None], blk_y[second_c, :n])
        for ci, c in enumerate(combos):
            cur[c], ch[c] = (blk_m[ci], blk_s[ci]), (blk_j[ci], blk_y[ci])
        prev_m, prev_s = blk_m, blk_s
        choice.append(ch)
        period, fill = cur[(0, none)][0][0], cur[(0, none)][1][0]
        if np.isfinite(period) and period < best_period * (1 - 1e-6):
            best_period = float(period)
            results.append(_backtrack(tables, arrs, kinds, choice, k, n, mbs, float(fill)))
    return results, pruned


def _backtrack(
    tables: CostTables,
    arrs: list[LayerArrays],
    kinds: tuple[Kind, ...],
    choice: list[dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]],
    depth: int,
    n: int,
    mbs: int,
    fill: float,
) -> PipelineTemplate:
    q = len(kinds)
    none = q
    ranges: list[tuple[int, int, int]] = []
    i, x, p = 0, 0, none
    for k in range(depth, 0, -1):
        bj, by = choice[k - 1][(x, p)]
        j, y = int(bj[i]), int(by[i])
        ranges.append((i, j, x))
        i, p, x = j + 1, x, y
    placed = [(a, b, kinds[x], arrs[x]) for a, b, x in ranges]
    return _assemble(tables, mbs, placed, estimated=any(a.estimated for a in arrs))


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
    """
    depth = len(placed)
    stages: list[StageTemplate] = []
    for s, (a, b, kind, arr) in enumerate(placed):
        mem = float(tables.stage_memory(arr, depth - s)[a, b])
        t = float(arr.comp[b + 1] - arr.comp[a])
        if s + 1 < depth:
            tf, tb = tables.link(kind, placed[s + 1][2], mbs)
            t += float(tf[b] + tb[b])
        if s > 0:
            tf, tb = tables.link(placed[s - 1][2], kind, mbs)
            t += float(tf[a - 1] + tb[a - 1])
        stages.append(
            StageTemplate(
                first_layer=a,
                last_layer=b,
                kind=kind,
                time_s=t,
                update_s=float(arr.upd[b + 1] - arr.upd[a]),
                params=float(arr.params[b + 1] - arr.params[a]),
                memory_bytes=mem,
            )
        )
    times = [st.time_s for st in stages]
    return PipelineTemplate(
        stages=tuple(stages),
        mbs=mbs,
        period_s=max(times),
        fill_s=sum(times),
        estimated=estimated,
    )
