"""The iteration clock on a GPU: marks are CUDA events that never wait; the optimizer step's
time is read at the next host wait. CPU counterpart: ``tests/unit/test_engine_host_waits.py``
(one host wait per iteration in a real run) and ``tests/unit/test_step_clock.py``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sailor.megatron_patch.clock import StepClock, synchronize


def test_marks_time_device_work_and_the_optimizer_is_read_after_the_next_wait(
    gpus: Callable[[int], None],
) -> None:
    gpus(1)
    dev = torch.device("cuda", 0)
    clock = StepClock(dev)
    x = torch.randn(2048, 2048, device=dev)
    m0 = clock.mark()
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    m1 = clock.mark()
    opt_a = clock.mark()
    for _ in range(20):
        x = x @ x
    opt_b = clock.mark()
    assert clock.optimizer(opt_a, opt_b) == 0.0  # not known yet: no wait
    synchronize(dev)
    assert clock.seconds(m0, m1) > 0
    clock.settle()
    assert clock.last_optimizer_s > 0
