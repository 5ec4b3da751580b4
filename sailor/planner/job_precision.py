"""The job's precision as a constraint of the search: which GPU types of a pool may run it.

A job computes in one precision for its whole life (docs/training.md, "One precision per
job"): once it is fixed (``Inputs.precision``), every plan is priced in it (the tables'
``model_on``, the simulator through ``Plan.precision``) and a GPU type that cannot run it
(:func:`sailor.schemas.precision.cannot_run`: bf16 on a type without bf16 units, 16 bits
on a CPU kind) is left out of the pool before any search, with the reason, which the
search's result and every plan's explanation carry. Leaving it out is the only choice the
planner makes: it never changes the job's precision to admit a type (that would change a
running job's numerics).

Pure: values in, values out.
"""

from __future__ import annotations

from collections.abc import Mapping

from sailor.schemas import GPUSpec, Pool
from sailor.schemas.precision import Precision, cannot_run

__all__ = ["runnable_pool"]


def runnable_pool(
    pool: Pool, precision: Precision | None, specs: Mapping[str, GPUSpec]
) -> tuple[Pool, tuple[str, ...]]:
    """``pool`` without the entries whose GPU type cannot run ``precision``, and one line per
    type left out saying why (none when ``precision`` is None: not fixed yet)."""
    if precision is None:
        return pool, ()
    why: dict[str, str] = {}
    kept = []
    for e in pool.entries:
        reason = why.get(e.gpu_type)
        if reason is None:
            reason = why[e.gpu_type] = cannot_run(e.gpu_type, specs, precision)
        if not reason:
            kept.append(e)
    if len(kept) == len(pool.entries):
        return pool, ()
    notes = tuple(
        f"left out {g} ({pool.gpus_by_type()[g]} GPUs): the job runs {precision} and {r}"
        for g, r in sorted(why.items())
        if r
    )
    return Pool(entries=tuple(kept)), notes
