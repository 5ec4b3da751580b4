"""Step timing that measures the device's work, not the kernel launches.

CUDA kernels run asynchronously: ``perf_counter`` around them measures how long the host
took to queue them. :func:`timestamp` synchronizes the device first (nothing on CPU, where
the work is done when the call returns). :class:`SpanTimer` times the many short spans of
one iteration without a synchronization each (CUDA events).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from sailor.comm import abort as comm_abort

__all__ = ["SpanTimer", "synchronize", "timestamp"]


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished its queued work (no-op off CUDA); abortably in an
    in-place worker (:func:`sailor.comm.abort.host_sync`)."""
    comm_abort.host_sync(device)


def timestamp(device: torch.device) -> float:
    """``perf_counter`` after the device's queued work is done."""
    synchronize(device)
    return time.perf_counter()


class SpanTimer:
    """Named spans inside one iteration (forward, backward, pipeline exchange), summed.

    Spans are too many to synchronize the device around each one (that would serialize the
    host with a GPU it is meant to run ahead of). On CUDA each span is a pair of CUDA events
    recorded on the current stream, which costs the host a few microseconds and never waits;
    their times are read in :meth:`collect`, after the caller's device synchronization ends
    the iteration's timed part (:func:`timestamp`). On CPU the work is done when a call
    returns, and a span is two ``perf_counter`` reads. Events are pooled across iterations.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._cpu: dict[str, list[float]] = {}
        self._events: list[tuple[str, Any, Any]] = []
        self._pool: list[Any] = []

    def _event(self) -> Any:
        if self._pool:
            return self._pool.pop()
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def begin(self) -> Any:
        """A mark where a span starts."""
        if not self._cuda:
            return time.perf_counter()
        ev = self._event()
        ev.record()
        return ev

    def end(self, name: str, mark: Any) -> None:
        """End the span of ``name`` begun at ``mark``."""
        if not self._cuda:
            self._cpu.setdefault(name, []).append(time.perf_counter() - mark)
            return
        ev = self._event()
        ev.record()
        self._events.append((name, mark, ev))

    def collect(self) -> dict[str, tuple[float, int]]:
        """Per name, (total seconds, spans) since the last call; on CUDA call it only after
        the device was synchronized (every recorded event has completed)."""
        out: dict[str, tuple[float, int]] = {}
        if not self._cuda:
            for name, xs in self._cpu.items():
                out[name] = (sum(xs), len(xs))
            self._cpu = {}
            return out
        for name, a, b in self._events:
            total, n = out.get(name, (0.0, 0))
            out[name] = (total + a.elapsed_time(b) / 1e3, n + 1)
            self._pool.extend((a, b))
        self._events = []
        return out
