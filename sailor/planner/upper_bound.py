"""The pool's resources, the candidate grids and the throughput upper bound of a search.

:func:`resources_of` gives the GPUs per (type, zone, VM shape) the constraints let a plan use;
:func:`tp_candidates` and :func:`mbs_candidates` are the TP degrees and microbatch sizes the
search (and the baselines) try; :func:`per_gpu_rate`, :func:`pool_bound` and
:func:`throughput_upper_bound` give the iterations/s no plan can beat (every GPU at its best
per-sample rate, perfect scaling), which the search uses to order and prune scenarios and to
refuse a throughput floor it cannot meet. Pure: values in, values out; it never simulates.
"""

from __future__ import annotations

from collections.abc import Mapping

from sailor.planner.api import Constraints
from sailor.planner.pricing import Resource
from sailor.planner.tables import CostTables, Inputs
from sailor.schemas import (
    Calibration,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Pool,
    PriceTable,
    ProfileDB,
)
from sailor.schemas.zones import region_of

__all__ = [
    "mbs_candidates",
    "per_gpu_rate",
    "pool_bound",
    "resources_of",
    "throughput_upper_bound",
    "tp_candidates",
]


def resources_of(pool: Pool, constraints: Constraints) -> dict[Resource, int]:
    """GPUs per (type, zone, VM shape) that the constraints allow the plan to use."""
    caps: dict[Resource, int] = {}
    for e in pool.entries:
        region = region_of(e.zone)
        if constraints.allowed_zones is not None and e.zone not in constraints.allowed_zones:
            continue
        if constraints.allowed_regions is not None and region not in constraints.allowed_regions:
            continue
        if e.gpus <= 0:
            continue
        k = (e.gpu_type, e.zone, e.gpus_per_node)
        caps[k] = caps.get(k, 0) + e.gpus
    # a cap per GPU type: fill its largest zones first (whole nodes)
    by_type: dict[str, list[Resource]] = {}
    for r in caps:
        by_type.setdefault(r[0], []).append(r)
    for g, rs in by_type.items():
        cap = constraints.gpu_cap(g)
        if cap is None:
            continue
        left = cap
        for r in sorted(rs, key=lambda r: -caps[r]):
            take = min(caps[r], left // r[2] * r[2])
            caps[r] = take
            left -= take
    return {r: n for r, n in caps.items() if n > 0}


def mbs_candidates(inputs: Inputs, gpu_type: str) -> list[int]:
    """Microbatch sizes to try on ``gpu_type`` (powers of two dividing the batch; memoized)."""
    memo: dict[str, list[int]] = inputs.__dict__.setdefault("_mbs_memo", {})
    hit = memo.get(gpu_type)
    if hit is None:
        hit = memo[gpu_type] = _mbs_grid(inputs, gpu_type)
    return hit


def _mbs_grid(inputs: Inputs, gpu_type: str) -> list[int]:
    """Powers of two dividing the global batch, up to the largest profiled microbatch."""
    gbs = inputs.model.global_batch_size
    grid = inputs.profiles.grid(gpu_type)
    top = max((max(v) for v in grid.values()), default=8)
    out = []
    b = 1
    while b <= min(gbs, top):
        if gbs % b == 0:
            out.append(b)
        b *= 2
    return out or [1]


def tp_candidates(gpus_per_node: int) -> list[int]:
    """Tensor-parallel degrees to try: powers of two up to the GPUs of one node."""
    out = []
    t = 1
    while t <= gpus_per_node:
        out.append(t)
        t *= 2
    return out


# -- upper bound -----------------------------------------------------------------------------


def per_gpu_rate(tables: CostTables, gpu_type: str, gpus_per_node: int) -> float:
    """Best samples/s one GPU of the type can compute (fwd+bwd only, any TP and mbs)."""
    best = 0.0
    for tp in tp_candidates(gpus_per_node):
        for b in mbs_candidates(tables.inputs, gpu_type):
            a = tables.arrays(gpu_type, tp, b)
            if a is None or a.comp[-1] <= 0:
                continue
            best = max(best, b / (tp * float(a.comp[-1])))
    return best


def pool_bound(tables: CostTables, caps: Mapping[Resource, int]) -> float:
    """Iterations/s no plan on ``caps`` can beat: every GPU at its best rate, no overhead."""
    rate = sum(per_gpu_rate(tables, g, k) * n for (g, _z, k), n in caps.items())
    return rate / tables.inputs.model.global_batch_size


def throughput_upper_bound(
    model: ModelSpec,
    profiles: ProfileDB,
    pool: Pool,
    *,
    gpu_specs: Mapping[str, GPUSpec],
    calibration: Calibration | None = None,
    network: NetworkProfile | None = None,
    prices: PriceTable | None = None,
) -> float:
    """Iterations/s if every GPU of the pool computed at its best per-sample rate, with
    perfect scaling: no pipeline bubble, transfer, gradient sync or optimizer step."""
    inputs = Inputs(
        model=model,
        profiles=profiles,
        network=network or NetworkProfile(),
        prices=prices or PriceTable(),
        gpu_specs=gpu_specs,
        calibration=calibration or Calibration(),
    )
    return pool_bound(CostTables(inputs), resources_of(pool, Constraints()))
