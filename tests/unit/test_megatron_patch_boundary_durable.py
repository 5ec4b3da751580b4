"""A save is awaited in short collective polls: no rank sits in one collective for a write.

Two gloo ranks; rank 0 (the committer) takes 3 s to make its save durable (its part and the
commit), rank 1 is done at once. Waiting for the save then meeting in a collective, as the
worker once did, leaves rank 1 inside one collective for the whole write: a write longer
than the process groups' timeout (GBs to an object store) would time it out. The
boundary's ``_durable`` polls every rank's ``done()`` in quick all-reduces instead.

What is measured is the longest single collective each rank sits in while it waits, which
is what a process group's timeout bounds. The groups' own timeout is long here, so a
scheduling stall of this shared machine cannot abort a rank (with a 1 s timeout one did,
under the full suite's load); the old way is run in the same processes to show the
measure tells the two apart.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from sailor.megatron_patch import boundary
from sailor.megatron_patch.boundary import Boundary, Progress, Status
from tests.spawn import spawn

WRITE_S = 3.0


class _SlowCommit:
    """A save in flight that is durable ``delay`` seconds after it starts."""

    def __init__(self, delay: float) -> None:
        self.end = time.monotonic() + delay
        self.waited = False

    def done(self) -> bool:
        return time.monotonic() >= self.end

    def wait(self) -> None:
        time.sleep(max(0.0, self.end - time.monotonic()))
        self.waited = True


def _timed(fn, longest: list[float]):  # type: ignore[no-untyped-def]
    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            longest[0] = max(longest[0], time.monotonic() - t0)

    return call


def _wait(rank: int, polled: bool) -> dict[str, object]:
    ckpt = _SlowCommit(WRITE_S if rank == 0 else 0.0)
    args = argparse.Namespace(poll_s=0.05, rank=rank, min_step_s=0.0, control=None)
    b = Boundary(args, Status(rank), Progress(None, False), ckpt, torch.device("cpu"))  # type: ignore[arg-type]
    longest = [0.0]
    dist.barrier()
    t0 = time.monotonic()
    if polled:
        b._durable()
    else:
        ckpt.wait()  # the old way: wait alone, then meet in the next collective
    _timed(dist.all_reduce, longest)(torch.ones(1))
    return {"s": time.monotonic() - t0, "waited": ckpt.waited, "longest": longest[0]}


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    longest = [0.0]
    boundary.agree_save = _timed(boundary.agree_save, longest)  # type: ignore[assignment]
    polled = _wait(rank, polled=True)
    polled["longest"] = max(float(polled["longest"]), longest[0])  # type: ignore[arg-type]
    plain = _wait(rank, polled=False)
    dist.destroy_process_group()
    Path(out, f"r{rank}.json").write_text(json.dumps({"polled": polled, "plain": plain}))


def test_a_long_save_keeps_nobody_in_one_collective(tmp_path: Path) -> None:
    spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    got = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]
    for r in got:
        assert r["polled"]["waited"] and float(r["polled"]["s"]) >= WRITE_S - 0.5, got
        # the polls: no collective lasts more than half the write (each is ~poll_s; the
        # margin is for a loaded machine's scheduling stalls)
        assert float(r["polled"]["longest"]) < WRITE_S / 2, got
    # the old way: the rank that was done at once sat in one collective for the write
    assert float(got[1]["plain"]["longest"]) >= WRITE_S - 0.5, got
