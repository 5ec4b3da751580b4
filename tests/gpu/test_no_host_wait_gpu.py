"""Copies to a GPU that the in-place abort must be able to interrupt issue no host wait.

A pageable host-to-device copy waits in C for the stream (every NCCL kernel queued before
it): a rank whose peer died mid-collective sits there, out of reach of the abort's signal
handler. ``sailor.comm.device_copy.to_device`` stages through pinned memory; a save's TP
gate fills its flag on the device; the object collectives copy their sizes that way. Each is
run under ``torch.cuda.set_sync_debug_mode("error")`` up to its first abortable wait
(``comm.abort.host_sync``), where a synchronizing call raises. CPU counterparts:
``tests/unit/test_megatron_patch_hot_loop.py`` (the copy's calls), the checkpoint and object
collective tests (their results).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sailor.checkpoint.checkpointer import _TPGate
from sailor.comm import abort as comm_abort
from sailor.comm import api as comm
from sailor.comm import objects
from sailor.comm.device_copy import to_device


@pytest.fixture
def one_rank_nccl(gpus: Callable[[int], None], tmp_path: Path) -> Iterator[torch.device]:
    gpus(1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("nccl", init_method=store, rank=0, world_size=1)
    try:
        yield dev
    finally:
        dist.destroy_process_group()


@pytest.fixture
def strict_until_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Synchronizing calls raise until the code under test reaches its abortable wait."""
    reached: list[Any] = []
    real = comm_abort.host_sync

    def host_sync(device: torch.device) -> None:
        torch.cuda.set_sync_debug_mode("default")
        reached.append(device)
        real(device)

    monkeypatch.setattr(comm_abort, "host_sync", host_sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield reached
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_to_device_of_a_pageable_tensor_does_not_wait(gpus: Callable[[int], None]) -> None:
    gpus(1)
    dev = torch.device("cuda", 0)
    busy = torch.randn(2048, 2048, device=dev)
    host = torch.arange(1 << 20, dtype=torch.float32)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):  # queue work the copy would otherwise wait for
            busy = busy @ busy / 2048
        out = to_device(host, dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.device == dev and torch.equal(out.cpu(), host)


def test_a_save_gate_fills_its_flag_on_the_device(
    one_rank_nccl: torch.device, strict_until_host_sync: list[Any]
) -> None:
    gate = _TPGate(dist.group.WORLD, one_rank_nccl, None)
    assert gate.open()
    assert strict_until_host_sync == [one_rank_nccl]
    failed = _TPGate(dist.group.WORLD, one_rank_nccl, RuntimeError("disk full"))
    assert not failed.open()


def test_object_collectives_copy_their_sizes_without_a_wait(
    one_rank_nccl: torch.device, strict_until_host_sync: list[Any]
) -> None:
    objs: list[Any] = [{"step": 7}, "x"]
    objects.broadcast_objects(comm.current_backend(), objs, 0, dist.group.WORLD)
    assert strict_until_host_sync[:1] == [one_rank_nccl]
    assert objs == [{"step": 7}, "x"]
    torch.cuda.set_sync_debug_mode("error")  # again, for the gather's first copy
    outs: list[Any] = [None]
    objects.all_gather_objects(comm.current_backend(), outs, ("n1", 3), dist.group.WORLD)
    assert len(strict_until_host_sync) >= 3 and outs == [("n1", 3)]
