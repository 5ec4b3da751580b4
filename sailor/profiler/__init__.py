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

from sailor.profiler.merge import SOURCE_RANK, load_db, merge_db, save_db

__all__ = ["SOURCE_RANK", "load_db", "merge_db", "save_db"]
