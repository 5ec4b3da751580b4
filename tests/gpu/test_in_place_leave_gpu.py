"""Leaving a held world on a real device: the queued work is waited for through a CUDA
event with a deadline (``in_place_steps._quiet_device``), not ``torch.cuda.synchronize``.

A kernel that outlives the deadline (``torch.cuda._sleep``, standing in for an NCCL op
whose peer died) is given up on within about the deadline; a drained device is seen at
once. The dead-peer case itself needs two ranks and a kill: tests/gpu/test_in_place_nccl.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from sailor.megatron_patch.in_place import Held
from sailor.megatron_patch.in_place_steps import _quiet_device


class _Trainer:
    def __init__(self) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device())


def test_the_leave_waits_for_the_device_with_a_deadline(gpus: Callable[[int], None]) -> None:
    gpus(1)
    held = Held(_Trainer(), 0, 3, 12, False, 1)  # type: ignore[arg-type]
    torch.cuda.synchronize()
    assert _quiet_device(held, timeout_s=1.0)  # nothing queued
    torch.cuda._sleep(2_000_000_000)  # type: ignore[attr-defined]  # ~1 s or more of spinning
    t = time.monotonic()
    assert not _quiet_device(held, timeout_s=0.1)
    assert time.monotonic() - t < 0.5
    torch.cuda.synchronize()
