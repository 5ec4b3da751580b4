"""The benchmarks' own modules (``benchmarks/`` is no package), imported for tests that
judge the planner and simulator on the benchmarks' reference setups."""

from __future__ import annotations

import importlib
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

__all__ = ["BENCH", "bench_module"]

BENCH = Path(__file__).parents[1] / "benchmarks"


@cache
def bench_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported once."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
