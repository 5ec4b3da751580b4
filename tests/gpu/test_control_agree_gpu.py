"""The control request's agreement on a GPU issues no synchronizing copy: the engine starts
it after the iteration's gradient and step all-reduces (``Trainer._agree``), where a pageable
host-to-device copy would wait, in C, for every peer's collectives, and the in-place abort
(SIGUSR1, ``comm.abort``) could not reach the host. CPU counterpart of the call order:
``tests/unit/test_dry_run_matches_real.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from sailor.megatron_patch.clock import synchronize
from sailor.megatron_patch.control import ControlRequest, read_agreed, start_agree


def test_start_agree_copies_to_the_device_without_a_sync(
    gpus: Callable[[int], None], tmp_path: Path
) -> None:
    gpus(1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        local = ControlRequest(stop_at_step=7, save_step=5, save_dir="/x", prune_below=2)
        torch.cuda.set_sync_debug_mode("error")
        try:
            # world_size 2: the collective is issued on this one-rank group as the engine
            # issues it on a larger one (``world_size`` is the dry run's override)
            pending = start_agree(local, dev, world_size=2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert pending is not None and pending.device == dev
        synchronize(dev)
        got = read_agreed(local, pending)
        assert (got.stop_at_step, got.save_step, got.prune_below) == (7, 5, 2)
        assert not got.save_optional
    finally:
        dist.destroy_process_group()
