"""GPU prices of one pool: each GPU at its own entry's rate (spot or on-demand).

A pool may hold spot and on-demand nodes of one GPU type in one zone (separate
:class:`~sailor.schemas.PoolEntry` values). They compute alike, so the search treats them as one
resource (GPU type, zone, VM shape) and this module prices the GPUs a plan uses of it, cheapest
first: a plan that needs ``n`` of ``N`` GPUs rents the ``n`` cheapest. :func:`GpuPricing.flags`
then marks each replica group of a plan spot or on-demand so that the simulator, which prices
a replica group by its ``spot`` flag, charges the same.

Pure: built from the pool and the price table; never mutates them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sailor.schemas import Pool, PriceTable

__all__ = ["GpuPricing", "Resource"]

Resource = tuple[str, str, int]
"""(GPU type, zone, GPUs per node)."""


@dataclass(frozen=True)
class GpuPricing:
    """Per resource: (spot flag, GPUs, $ per GPU-second) of each entry, cheapest first."""

    tiers: Mapping[Resource, tuple[tuple[bool, int, float], ...]]

    @classmethod
    def of(cls, pool: Pool, prices: PriceTable, spot: bool | None) -> GpuPricing:
        """``spot=None`` prices each entry by its own flag; True/False overrides every entry."""
        acc: dict[Resource, dict[bool, int]] = {}
        for e in pool.entries:
            if e.gpus <= 0:
                continue
            flag = e.spot if spot is None else spot
            by_flag = acc.setdefault((e.gpu_type, e.zone, e.gpus_per_node), {})
            by_flag[flag] = by_flag.get(flag, 0) + e.gpus
        tiers: dict[Resource, tuple[tuple[bool, int, float], ...]] = {}
        for r, by_flag in acc.items():
            rows = [(f, n, prices.gpu_hour(r[0], r[1], f) / 3600.0) for f, n in by_flag.items()]
            rows.sort(key=lambda x: (x[2], not x[0]))  # cheapest first; spot first on a tie
            tiers[r] = tuple(rows)
        return cls(tiers)

    def cheapest_per_s(self, r: Resource) -> float:
        """$ per second of the resource's cheapest GPU (0 if the pool has none)."""
        t = self.tiers.get(r)
        return t[0][2] if t else 0.0

    def per_s(self, use: Mapping[Resource, int]) -> float:
        """$ per second of renting ``use`` GPUs per resource, cheapest first."""
        total = 0.0
        for r, n in use.items():
            left = n
            rows = self.tiers.get(r, ())
            for _flag, avail, price in rows:
                take = min(left, avail)
                total += take * price
                left -= take
                if left <= 0:
                    break
            if left > 0 and rows:  # more than the pool holds: at the dearest rate
                total += left * rows[-1][2]
        return total

    def flags(self, r: Resource, tps: Sequence[int]) -> list[bool]:
        """Spot flag of each replica group of ``tps`` GPUs on ``r``, cheapest GPUs first.

        Larger groups are placed first: entries hold whole nodes and every TP degree is a
        power of two dividing the node, so the GPUs left in a tier always hold whole groups
        of the next (smaller or equal) degree, and the flags match :meth:`per_s` exactly.
        """
        rows = list(self.tiers.get(r, ()))
        out = [False] * len(tps)
        tier, left = 0, rows[0][1] if rows else 0
        for i in sorted(range(len(tps)), key=lambda i: -tps[i]):
            while tier + 1 < len(rows) and left < tps[i]:
                tier += 1
                left = rows[tier][1]
            out[i] = rows[tier][0] if rows else False
            left -= tps[i]
        return out
