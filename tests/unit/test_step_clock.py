"""The iteration clock on CPU: marks are host clock reads, and the optimizer step is its own
(the work is done when a call returns). The CUDA path: ``tests/gpu/test_step_clock_gpu.py``."""

from __future__ import annotations

import time

import torch

from sailor.megatron_patch.clock import StepClock


def test_cpu_marks_read_the_host_clock_and_the_optimizer_is_this_steps() -> None:
    clock = StepClock(torch.device("cpu"))
    a = clock.mark()
    time.sleep(0.01)
    b = clock.mark()
    assert clock.seconds(a, b) >= 0.01
    assert clock.optimizer(a, b) == clock.seconds(a, b) == clock.last_optimizer_s
    clock.settle()  # nothing left open on CPU
    assert clock.last_optimizer_s == clock.seconds(a, b)
