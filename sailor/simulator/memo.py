"""A bounded memo for pure functions of large frozen inputs (profile databases, models).

Hashing a :class:`~sailor.schemas.ProfileDB` by value costs more than the lookups it would
save, so such inputs are keyed by identity: an entry holds them, so their ids cannot be
reused by other objects while it is cached, and a hit also checks them with ``is``. Small
values (GPU types, TP degrees, frozen calibrations) are keyed by value. Results must be
immutable: every caller shares them. Safe across threads (the controller plans in one); two
threads missing on one key at once both compute it, and the later result is kept.

The planner and the robust planner simulate many plans of one model on one profile set; each
:func:`~sailor.simulator.simulate` call used to rebuild the same per-layer tables.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar, cast

__all__ = ["IdentityMemo"]

_T = TypeVar("_T")


class IdentityMemo:
    """Least-recently-used memo of at most ``size`` results, keyed by the identity of
    ``held`` and the value of ``key``."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"size={size}: must be positive")
        self.size = size
        self._entries: OrderedDict[tuple[Hashable, ...], tuple[tuple[object, ...], object]]
        self._entries = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(
        self, held: tuple[object, ...], key: tuple[Hashable, ...], make: Callable[[], _T]
    ) -> _T:
        """The memoized ``make()`` for (``held`` by identity, ``key`` by value)."""
        k = (*(id(o) for o in held), *key)
        with self._lock:
            hit = self._entries.get(k)
            if hit is not None and all(a is b for a, b in zip(hit[0], held, strict=True)):
                self._entries.move_to_end(k)
                self.hits += 1
                return cast(_T, hit[1])
        value = make()  # outside the lock: a miss may take milliseconds
        with self._lock:
            self.misses += 1
            self._entries[k] = (held, value)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
