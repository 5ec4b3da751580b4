"""Step timing that measures the device's work, not the kernel launches.

CUDA kernels run asynchronously: ``perf_counter`` around them measures how long the host
took to queue them. :func:`timestamp` synchronizes the device first (nothing on CPU, where
the work is done when the call returns).
"""

from __future__ import annotations

import time

import torch

__all__ = ["synchronize", "timestamp"]


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished its queued work (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timestamp(device: torch.device) -> float:
    """``perf_counter`` after the device's queued work is done."""
    synchronize(device)
    return time.perf_counter()
