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
    held: Sequence[tuple[int, int]],
    ranks: Sequence[int],
    gpu_of: dict[int, int],
    kept: Callable[[int, int], int] | None = None,
) -> dict[int, int]:
    """rank -> index into ``held`` of the worker that takes it. ``held``: (gpu, rank) of
    each held worker, in preference order; ``gpu_of``: each rank's local GPU (-1: none, a
    CPU kind); ``kept(i, r)``: the layers worker ``i`` keeps if it takes rank ``r``
    (``relayout.kept_layers``: those it holds at the same TP degree and TP rank).

    Passes: a worker on the rank's GPU with the same rank, then one on its GPU (its CUDA
    context and shards live there), each over ``ranks`` in order; then, of the pairs left,
    those that keep the most layers first (a layer kept is one not sent over the network
    or read), ties in preference order and rank order; then any, over ``ranks`` in order.
    Without ``kept``: a worker with the same rank number instead, which says nothing of
    its layers once the layout changed (the old and the new plan number their ranks each
    their own way). Ranks left over go to spares or new processes."""
    free = list(range(len(held)))
    out: dict[int, int] = {}

    def by_rank(ok: Callable[[int, int], bool]) -> None:
        for r in ranks:
            if r in out:
                continue
            i = next((i for i in free if ok(i, r)), None)
            if i is not None:
                out[r] = i
                free.remove(i)

    by_rank(lambda i, r: gpu_of[r] >= 0 and held[i] == (gpu_of[r], r))
    by_rank(lambda i, r: gpu_of[r] >= 0 and held[i][0] == gpu_of[r])
    if kept is None:
        by_rank(lambda i, r: held[i][1] == r)
    else:
        order = {r: k for k, r in enumerate(ranks)}
        pairs = sorted(
            (-n, i, order[r], r)
            for r in ranks
            if r not in out
            for i in free
            if (n := kept(i, r)) > 0
        )
        for _, i, _, r in pairs:
            if r not in out and i in free:
                out[r] = i
                free.remove(i)
    by_rank(lambda i, r: True)
    return out
