"""Which device types are host CPUs, and which catalog entry a device type takes its spec from.

A node's ``gpu_type`` names what its ranks compute on. On GPU nodes that is the GPU type
(``A100-40``, ``H100-80``); on CPU nodes it is ``cpu`` or a **CPU kind** ``cpu-<kind>``
(``cpu-full``, ``cpu-slow``): CPU nodes of different speed, e.g. agents on one machine whose
workers run under different CPU quotas (``sailor.agent.cpu_quota``). The planner treats kinds
as it treats GPU types: each has its own profile, and a pool may mix them.

Every CPU kind is a CPU for everything that depends on the device rather than its speed:
the backend (gloo), the precision (fp32), the node check (no GPU probes). Spec-sheet figures,
prices and simulator constants of a kind come from the catalog's ``cpu`` entry unless a
table has an entry of that exact name (:func:`catalog_type`, :func:`spec_of`). Profiles do
not fall back: a kind's speed is what its own profile says.

Pure: no I/O, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import lru_cache

from sailor.schemas.hardware import GPUSpec

__all__ = [
    "CPU_DEVICE_TYPE",
    "any_cpu_type",
    "catalog_type",
    "is_cpu_type",
    "spec_of",
]

CPU_DEVICE_TYPE = "cpu"
"""The catalog's "GPU type" of a CPU rank (``sailor/catalog/gpus.json``), and the base type
of every CPU kind."""

_CPU_KIND = re.compile(r"cpu-[A-Za-z0-9][A-Za-z0-9_.-]*")
"""``cpu-<kind>``: a kind name starts with a letter or digit (``cpu-`` alone is no kind)."""


def is_cpu_type(gpu_type: str) -> bool:
    """Whether ``gpu_type`` is a host CPU: ``cpu`` or a CPU kind ``cpu-<kind>``."""
    return gpu_type == CPU_DEVICE_TYPE or _CPU_KIND.fullmatch(gpu_type) is not None


def any_cpu_type(gpu_types: Iterable[str]) -> bool:
    """Whether any of ``gpu_types`` is a host CPU."""
    return any(is_cpu_type(g) for g in gpu_types)


def catalog_type(gpu_type: str) -> str:
    """The catalog entry ``gpu_type`` falls back to when a table has none of its own: ``cpu``
    for a CPU kind, else ``gpu_type`` itself (GPU types never fall back)."""
    return CPU_DEVICE_TYPE if is_cpu_type(gpu_type) else gpu_type


def spec_of(specs: Mapping[str, GPUSpec], gpu_type: str) -> GPUSpec | None:
    """The spec of ``gpu_type`` in ``specs``: its own entry, else (a CPU kind) the ``cpu``
    entry under the kind's name, else None.

    The fallback spec says where it came from in its ``source``, so a figure derived from it
    (a memory capacity, an analytic estimate) can be traced to the ``cpu`` entry.
    """
    own = specs.get(gpu_type)
    if own is not None:
        return own
    base = catalog_type(gpu_type)
    if base == gpu_type:
        return None
    spec = specs.get(base)
    return None if spec is None else _renamed(spec, gpu_type)


@lru_cache(maxsize=256)
def _renamed(spec: GPUSpec, name: str) -> GPUSpec:
    """``spec`` under ``name`` (memoized: the planner asks for a capacity many times)."""
    return spec.model_copy(
        update={
            "name": name,
            "source": f"the {spec.name!r} entry (none for {name!r}): {spec.source}",
        }
    )
