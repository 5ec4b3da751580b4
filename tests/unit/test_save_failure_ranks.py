"""A save that fails on one rank is raised by every rank, through the boundary's poll, on
two real gloo ranks (``Boundary._durable`` -> ``agree_save`` -> ``raise_save_failure``).

Rank 1's save fails at once; rank 0's (the committer's) is still writing for a second. A
refusal of non-finite weights (job-wide) is raised by both ranks with the same text, rank 0
only once its own save is over (the committer deletes the refused save's files after every
writer is done). Rank 1's storage failing is its own; rank 0 raises ``PeerFailedError``.
Both ranks call the poll's collective the same number of times (NCCL needs every rank in
every collective), and neither waits in one for long. The pieces were tested with the
gather faked; this runs them together (review).
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sailor.checkpoint import NonFiniteCheckpointError
from sailor.megatron_patch import boundary
from sailor.megatron_patch.boundary import Boundary, Progress, Status
from tests.spawn import spawn

WRITE_S = 1.0
REFUSAL = "tensor 3.mlp.fc1.weight holds a non-finite value at step 40: not saved"


class _Save:
    """A save in flight: done ``delay`` s after it starts; its ``wait`` raises ``error``."""

    def __init__(self, delay: float, error: Exception | None) -> None:
        self.end, self.error = time.monotonic() + delay, error

    def done(self) -> bool:
        return time.monotonic() >= self.end

    def wait(self) -> None:
        time.sleep(max(0.0, self.end - time.monotonic()))
        if self.error is not None:
            raise self.error


def _rank(rank: int, store: str, out: str, case: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    calls = [0]
    agree = boundary.agree_save

    def counted(*a: object, **k: object) -> tuple[bool, bool]:
        calls[0] += 1
        return agree(*a, **k)  # type: ignore[arg-type]

    boundary.agree_save = counted  # type: ignore[assignment]
    error: Exception | None = None
    if rank == 1:
        error = NonFiniteCheckpointError(REFUSAL) if case == "refused" else OSError("disk full")
    save = _Save(WRITE_S if rank == 0 else 0.0, error)
    args = argparse.Namespace(poll_s=0.05, rank=rank, min_step_s=0.0, control=None)
    b = Boundary(args, Status(rank), Progress(None, False), save, torch.device("cpu"))  # type: ignore[arg-type]
    dist.barrier()
    t0 = time.monotonic()
    raised: list[str] | None = None
    try:
        b._durable()
    except Exception as exc:  # the type and text are what the test checks
        raised = [type(exc).__name__, str(exc)]
    took = time.monotonic() - t0
    dist.all_reduce(torch.ones(1))  # both ranks reach the next collective
    dist.destroy_process_group()
    Path(out, f"r{rank}.json").write_text(
        json.dumps({"raised": raised, "s": took, "calls": calls[0]})
    )


@pytest.mark.parametrize("case", ["refused", "storage"])
def test_a_failed_save_is_raised_by_every_rank(tmp_path: Path, case: str) -> None:
    spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), case), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1))
    assert r0["calls"] == r1["calls"] >= 1, (r0, r1)
    assert r0["s"] < 30 and r1["s"] < 30
    if case == "refused":
        assert r0["raised"] == r1["raised"] == ["NonFiniteCheckpointError", REFUSAL]
        assert r0["s"] >= WRITE_S - 0.2  # the committer's save was over first
    else:
        assert r1["raised"] == ["OSError", "disk full"]
        assert r0["raised"] is not None and r0["raised"][0] == "PeerFailedError"
        assert "rank(s) 1" in r0["raised"][1] and "disk full" in r0["raised"][1]
