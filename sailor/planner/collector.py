"""The cyclic garbage collector, paused while the planner runs.

A 512-GPU robust search keeps ~10^5 new objects (templates, their stages, allocations,
estimates) and makes no reference cycles: every collection during it frees nothing
(measured, ``gc.callbacks``), yet the collector's passes over the growing heap were 12-30% of
the search's CPU time. Reference counting still frees everything the search drops; cycles
made meanwhile (none measured) wait for the next collection after it.

The controller's planner process already collects only between calls
(:mod:`sailor.controller.planning.process`); this gives every other caller the same: ``sailor
plan``, the in-thread planner, benchmarks and library users.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["collector_paused"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


_lock = threading.Lock()
_running = 0  # calls inside, on every thread
_resume = False  # whether the first of them found the collector on


def collector_paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` with the collector disabled while it runs, and left as it was found once the
    last such call on any thread has returned: two searches on two threads (the
    controller's in-thread planner beside ``sailor plan`` in a library) share one pause,
    and the first to finish does not resume the collector under the other; a call made
    while something else paused it does not resume it."""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        global _running, _resume
        with _lock:
            if _running == 0:
                _resume = gc.isenabled()
                gc.disable()
            _running += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _running -= 1
                if _running == 0 and _resume:
                    gc.enable()

    return run
