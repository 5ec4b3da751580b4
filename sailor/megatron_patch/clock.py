"""Step timing that measures the device's work, not the kernel launches.

CUDA kernels run asynchronously: ``perf_counter`` around them measures how long the host
took to queue them. :func:`timestamp` synchronizes the device first (nothing on CPU, where
the work is done when the call returns). :class:`SpanTimer` times the many short spans of
one iteration, and :class:`StepClock` its phases, without a synchronization each (CUDA
events, read after the iteration's one host wait: the step agreement's read).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from sailor.comm import abort as comm_abort

__all__ = ["SpanTimer", "StepClock", "synchronize", "timestamp"]


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


class StepClock:
    """The phases of one iteration (compute, sync, optimizer) timed without a device wait
    of their own.

    A mark is a CUDA event recorded on the current stream (a ``perf_counter`` read on CPU,
    where the work is done when a call returns); :meth:`seconds` between two marks is read
    once both have run, i.e. after a host wait that came after the later one (the engine's
    step agreement). The optimizer step runs after that wait, so on CUDA its time is known
    only at the next iteration's wait: :meth:`optimizer` returns the last optimizer step
    known done (the previous iteration's; 0.0 before any), and keeps this one's marks open
    until :meth:`settle` (called after the next wait) reads them. On CPU it is this step's.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._open: tuple[Any, Any] | None = None
        self.last_optimizer_s = 0.0
        """The last optimizer step whose marks were read."""

    def mark(self) -> Any:
        """A mark at this point of the device's queue (no wait)."""
        if not self._cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        ev.record()
        return ev

    def seconds(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b`` (on CUDA: both run, after a host wait)."""
        if not self._cuda:
            return float(b - a)
        return float(a.elapsed_time(b)) / 1e3

    def settle(self) -> None:
        """After a host wait: read the optimizer step left open, now done."""
        if self._open is not None:
            self.last_optimizer_s = self.seconds(*self._open)
            self._open = None

    def optimizer(self, a: Any, b: Any) -> float:
        """The optimizer step between marks ``a`` and ``b``: its own seconds on CPU; on CUDA
        the last one known done (this one is read at the next :meth:`settle`)."""
        if not self._cuda:
            self.last_optimizer_s = self.seconds(a, b)
        else:
            self._open = (a, b)
        return self.last_optimizer_s
