"""Binding a rank to CPU cores: which cores each local rank gets, and the binding itself.

Ranks that share a host compete for its cores. Left to the scheduler, a rank woken by a
message is often placed on the core of the rank that woke it (wake-affine), so two ranks that
compute at once can share one core while another idles until the load balancer moves one.
Bound ranks stay where they are put: ``launch_local(pin_cores=True)`` gives local rank ``r``
core ``cores[r % len(cores)]`` (round robin over the cores this process may use), and the
profiler's host-sharing probe places its ranks by the same rule, so the profile describes the
runs it predicts. It is opt-in and round robin on GPU hosts too: nothing here binds a rank to
its GPU's NUMA node (no pinning by default).

``parse_cores`` and ``round_robin`` are pure; ``bind`` is the one system call.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["available_cores", "bind", "format_cores", "parse_cores", "round_robin"]


def parse_cores(text: str, field: str = "--cpu-cores") -> frozenset[int]:
    """Cores from a list like ``"0,2-3"``; a clear error naming ``field`` otherwise."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"{field}={text!r}: {part!r} is not a core or a range a-b") from None
        if a < 0 or b < a:
            raise ValueError(f"{field}={text!r}: {part!r} is not a valid core range")
        cores.update(range(a, b + 1))
    return frozenset(cores)


def format_cores(cores: frozenset[int] | set[int]) -> str:
    """The inverse of :func:`parse_cores` (a comma-separated list)."""
    return ",".join(str(c) for c in sorted(cores))


def round_robin(world: int, cores: Sequence[int]) -> list[frozenset[int]]:
    """One core per rank, ``cores[r % len(cores)]`` for rank ``r``."""
    if not cores:
        raise ValueError("cores: no core to place ranks on")
    return [frozenset({cores[r % len(cores)]}) for r in range(world)]


def available_cores() -> list[int]:
    """The cores this process may run on, in order."""
    return sorted(os.sched_getaffinity(0))


def bind(cores: frozenset[int]) -> None:
    """Bind the calling thread, and every thread it starts afterwards, to ``cores``."""
    allowed = set(available_cores())
    if not cores <= allowed:
        raise ValueError(
            f"--cpu-cores={format_cores(cores)}: not all of them are available "
            f"(this process may use {format_cores(allowed)})"
        )
    os.sched_setaffinity(0, cores)
