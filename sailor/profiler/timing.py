"""Timing of one operation with warm-up, repetitions and the spread recorded.

Two clocks, one per device kind:

* CPU: ``time.perf_counter`` (monotonic, sub-microsecond resolution) around the call; the
  call is synchronous, so the interval is the operation.
* CUDA: a pair of CUDA events recorded on the current stream around the call, then
  ``torch.cuda.synchronize``; the interval is GPU time between the events, free of the
  Python overhead that runs ahead of the GPU. The original artifact timed layers with
  hooks that synchronised around every layer; here there are no hooks and the events
  measure what the stream did.

The central value written to the database is the **median** of the repetitions by default:
it ignores the milliseconds other jobs steal from a shared host, so it is the layer's own
cost. The **mean** is kept too (``--statistic mean``): it includes that interference at the
rate it happened, which is what a long training step on the same busy host also pays. The
spread is the standard deviation of all repetitions, so noisy figures say so.

Under a CPU quota (``sailor profile layers --cpu-quota``) neither fits a layer alone: the
median repetition ran before its period's quota was spent (the unthrottled speed), and a
layer's mean depends on how many of the run's stalls, one per 100 ms period, happened to
land in it (tiny-gpt at 0.4 cores, 1 s timed: per-layer ratios to the unthrottled times from
1.4 to 10). The **scaled** statistic gives each layer its median times the measurement's
slowdown: wall time over the measuring thread's CPU time (:class:`CpuClock`), which counts
every stall wherever it fell (the sum of means over the sum of medians,
:func:`throttle_factor`, was tried first: it counts only the stalls that fell inside a timed
interval, and gave 2.2-4.6x for an expected ~2.5x over runs of 1 s). That bets that a quota
slows every layer of a process alike, which a time share does. Where the measurement ran in
other processes (TP ranks) and no CPU time was taken, :func:`throttle_factor` stands in.

Never imports the simulator or planner; holds no global state.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "STATISTICS",
    "CpuClock",
    "RepeatSettings",
    "Stats",
    "repeat",
    "throttle_factor",
    "time_once",
]

STATISTICS = ("median", "mean", "scaled")
"""The central values a profile may record (see the module docstring)."""


@dataclass(frozen=True)
class RepeatSettings:
    """How many times an operation is run before and while it is timed."""

    warmup: int = 3
    """Untimed runs first (allocator warm-up, lazy init, optimizer state creation)."""
    min_reps: int = 5
    """At least this many timed runs."""
    max_reps: int = 50
    """At most this many timed runs."""
    min_time_s: float = 0.2
    """Keep repeating (up to ``max_reps``) until the timed runs add up to this."""

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.min_reps < 1 or self.max_reps < self.min_reps:
            raise ValueError(
                f"RepeatSettings(warmup={self.warmup}, min_reps={self.min_reps}, "
                f"max_reps={self.max_reps}): need warmup >= 0 and 1 <= min_reps <= max_reps"
            )
        if not 0 <= self.min_time_s < math.inf:  # nan fails too (it compares False)
            raise ValueError(f"min_time_s={self.min_time_s}: must be a finite number >= 0")


@dataclass(frozen=True)
class Stats:
    """Repeated timings of one operation, seconds."""

    median_s: float
    stdev_s: float
    n: int
    mean_s: float = 0.0

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        if not values:
            raise ValueError("Stats.of: no values")
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return cls(
            median_s=statistics.median(values),
            stdev_s=sd,
            n=len(values),
            mean_s=statistics.fmean(values),
        )

    def central(self, statistic: str) -> float:
        """The median or the mean (``scaled`` of one operation alone: its mean)."""
        return self.mean_s if statistic in ("mean", "scaled") else self.median_s

    def to_dict(self) -> dict[str, float]:
        return {
            "median_s": self.median_s,
            "stdev_s": self.stdev_s,
            "n": self.n,
            "mean_s": self.mean_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Stats:
        return cls(
            median_s=float(d["median_s"]),
            stdev_s=float(d["stdev_s"]),
            n=int(d["n"]),
            mean_s=float(d.get("mean_s", d["median_s"])),
        )


class CpuClock:
    """Wall time over the calling thread's CPU time across a block (``with CpuClock() as c``;
    then ``c.slowdown``): 1 on a free core, 1/cores under a CPU quota, more on a busy host."""

    def __enter__(self) -> CpuClock:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()
        self.slowdown = 1.0
        return self

    def __exit__(self, *exc: object) -> None:
        cpu = time.thread_time() - self._cpu
        wall = time.perf_counter() - self._wall
        self.slowdown = wall / cpu if cpu > 0 else 1.0


def throttle_factor(stats: Iterable[Stats]) -> float:
    """The sum of the means over the sum of the medians of ``stats`` (1 if the medians add
    up to 0): how much longer the operations took on average than undisturbed."""
    items = list(stats)
    med = sum(s.median_s for s in items)
    return sum(s.mean_s for s in items) / med if med > 0 else 1.0


def time_once(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of ``fn`` takes on ``device`` (CUDA events on GPU)."""
    if device.type == "cuda":
        import torch  # here, not at the top: the CLI's parents of probe ranks read Stats only

        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return float(start.elapsed_time(end)) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def repeat(
    fn: Callable[[], Any],
    device: torch.device,
    settings: RepeatSettings,
    before: Callable[[], Any] | None = None,
) -> Stats:
    """Warm up, then time ``fn`` repeatedly. ``before`` runs untimed before every call."""
    for _ in range(settings.warmup):
        if before is not None:
            before()
        fn()
    values: list[float] = []
    while len(values) < settings.max_reps and (
        len(values) < settings.min_reps or sum(values) < settings.min_time_s
    ):
        if before is not None:
            before()
        values.append(time_once(fn, device))
    return Stats.of(values)
