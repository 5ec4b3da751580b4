"""The profiler: layer timing and memory on the local device, link bandwidth, estimates.

* :mod:`layers` (with :mod:`layer_bench`, :mod:`in_situ`, :mod:`layer_measurement`,
  :mod:`tp_procs`, :mod:`timing`, :mod:`memory`, :mod:`overhead`): measure the training
  framework's real layers per (TP, microbatch size) and build a
  :class:`~sailor.schemas.ProfileDB`; :mod:`memory_bound` decides first what fits the device,
  :mod:`precision` what the layers compute in;
* :mod:`collective_probe`: all-reduce latency and bus bandwidth, on one node or across two;
* :mod:`network_probe` and :mod:`curve_fit`: point-to-point bandwidth vs message size
  between two ranks, fitted to the simulator's curve and written into a NetworkProfile;
* :mod:`calibrated_estimate`: roofline estimates for GPUs not at hand, scaled by the
  efficiency measured on the GPUs that are, with a leave-one-GPU-out check;
* :mod:`merge`: measured beats imported beats estimated when databases are merged;
* :mod:`rss_probe`: a training worker that reports its peak RSS growth (end-to-end checks).

May import torch and ``megatron_patch``; never the controller, agent or coordination.
The package root imports no torch, so the pure parts load fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sailor.profiler.merge import SOURCE_RANK, load_db, merge_db, save_db

__all__ = ["SOURCE_RANK", "load_db", "merge_db", "save_db"]


def __getattr__(name: str) -> Any:
    """The root's names, from :mod:`merge` on first use: a probe's rank process
    (``python -m sailor.profiler.network_probe``) then starts without the schemas
    (~0.3 CPU-s of its start-up) that it never uses."""
    if name in __all__:
        from sailor.profiler import merge

        return getattr(merge, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
