"""Which held worker takes which rank at an in-place relayout: a pure function.

The agent hands each rank of a new layout to one of its node's held workers
(``agent/supervisor``) and the controller sizes the relayout's LOAD by the same match
(``controller/plan_deadlines.in_place_read_bytes``): both call :func:`match_held`, so the
deadline is computed for the holders the agent will pick.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["match_held"]


def match_held(
    held: Sequence[tuple[int, int]], ranks: Sequence[int], gpu_of: dict[int, int]
) -> dict[int, int]:
    """rank -> index into ``held`` of the worker that takes it. ``held``: (gpu, rank) of
    each held worker, in preference order; ``gpu_of``: each rank's local GPU (-1: none, a
    CPU kind). Passes, each over ``ranks`` in order: a worker on the rank's GPU with the
    same rank, then one on its GPU, then one with its rank, then any. Ranks left over go
    to spares or new processes."""
    free = list(range(len(held)))
    out: dict[int, int] = {}
    passes: tuple[Callable[[int, int], bool], ...] = (
        lambda i, r: gpu_of[r] >= 0 and held[i] == (gpu_of[r], r),
        lambda i, r: gpu_of[r] >= 0 and held[i][0] == gpu_of[r],
        lambda i, r: held[i][1] == r,
        lambda i, r: True,
    )
    for ok in passes:
        for r in ranks:
            if r in out:
                continue
            i = next((i for i in free if ok(i, r)), None)
            if i is not None:
                out[r] = i
                free.remove(i)
    return out
