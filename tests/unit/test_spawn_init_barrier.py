"""Spawned test ranks leave ``init_process_group`` together (``tests/spawn.py``).

Seen in a fresh-clone CI: a two-rank test whose ranks each raise a local error, with no
collective, failed in gloo's ``connectFullMesh`` ("Connection closed by peer"): one rank had
built its group, finished and exited while the other was still building its own. Rank 1
here takes a second longer than rank 0 to finish building its group; rank 0 must not leave
``init_process_group`` before it has (before the barrier, it left a second earlier)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tests.spawn import spawn

_LATE_S = 0.5


def _rank(rank: int, out: str) -> None:
    if rank == 1:
        build = c10d._new_process_group_helper

        def late(*args: Any, **kwargs: Any) -> Any:
            built = build(*args, **kwargs)
            time.sleep(_LATE_S)  # still finishing its group, as a rank on a loaded host
            Path(out, "built-1").write_text(repr(time.time()))
            return built

        c10d._new_process_group_helper = late
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    Path(out, f"returned-{rank}").write_text(repr(time.time()))
    dist.destroy_process_group()


def test_no_rank_leaves_init_before_every_rank_has_built_its_group(tmp_path: Path) -> None:
    spawn(_rank, args=(str(tmp_path),), nprocs=2)
    built = float((tmp_path / "built-1").read_text())
    returned = float((tmp_path / "returned-0").read_text())
    assert returned >= built, f"rank 0 left init {built - returned:.2f} s before rank 1 built"
