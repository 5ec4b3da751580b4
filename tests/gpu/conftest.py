"""GPU tests: they run where CUDA is present and skip, with their reason, elsewhere.

``make gpu-test`` runs this folder alone; ``make test`` collects it too (every test skips on
a machine without CUDA). Each test asks for the GPUs it needs with ``gpus(n)``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def cuda_count() -> int:
    """Visible CUDA devices (0 without a CUDA build or driver)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _need(n: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip(f"needs {n} CUDA GPU(s): torch {torch.__version__} sees no CUDA device")
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"needs {n} CUDA GPUs, this host has {have}")


@pytest.fixture
def gpus() -> Callable[[int], None]:
    """``gpus(n)`` skips the test unless ``n`` CUDA GPUs are visible."""
    return _need
