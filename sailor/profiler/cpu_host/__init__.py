"""CPU test scaffolding: how ranks started together on this one CPU host share its cores.

Only the CPU end-to-end check (``benchmarks/simulator_vs_cpu.py``) and ``sailor profile
layers --host-ranks N`` (off by default: 0) use it; GPU profiling never does. Two opt-in
measurements, each a module of its own:

* :mod:`sailor.profiler.cpu_host.sharing`: the slowdown of ``n`` ranks computing at once, the
  scheduler's wake-up, the gloo hand-over and the engine's all-reduces as it enters them,
  reduced to a :class:`~sailor.schemas.profile.HostSharing` (stored in ``ProfileDB.hosts``;
  the schema stays in :mod:`sailor.schemas.profile` so that every profile file loads). The
  simulator reads it only through :mod:`sailor.simulator.cpu_host`.
* :mod:`sailor.profiler.cpu_host.speed`: is this host running at its usual speed right now
  (a quick check of every core, before and after each measurement of the benchmark).

Must never be imported by the GPU profiling path; both modules import torch only in their
rank processes.
"""

__all__: list[str] = []
