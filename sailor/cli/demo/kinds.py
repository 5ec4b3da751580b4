"""The demo's two node kinds and the planner's prior for them, derived from their quotas.

One machine hosts a heterogeneous cluster: every agent runs its workers under a CPU quota
(``AgentConfig.cpu_quota``, docs/runtime.md "Node kinds and CPU quotas"), odd nodes
(n1, n3, …) as ``cpu-full`` at :data:`FULL_CORES`, even ones (n2, n4, …) as ``cpu-slow`` at
:data:`SLOW_CORES` (40 % of full). With the demo's script (n1 gets a notice, n2 is lost, n4
joins) three of its four layouts mix the kinds: {full, slow, full}, {slow, full}, {full},
{full, slow}.

Why both kinds under a quota, "full" too: the machine has 2 shared cores; unthrottled
"full" workers would take what the control plane needs and what the slow ones are allowed,
so neither speed would hold. 0.5 + 0.2 + 0.5 = 1.2 cores for the three nodes of the first
layout leave the rest to the servers, the controller and the agents, and let the workers run
unpaced (a paced worker sleeps most of each step and never reaches its quota).

**The prior** (:func:`prior_calibration`) is not profiled at demo time (``sailor profile
layers --kind --cpu-quota`` takes seconds per kind, longer than a reconfiguration): each
kind's ``compute_scale`` over the catalog's nominal ``cpu`` spec is :data:`CORE_SCALE` (one
free core of this kind of machine against the nominal spec) over its quota in cores — a
kind at 0.2 cores computes 1/0.2 = 5 times slower than one core. Everything else comes from
the catalog's ``cpu`` entry. The demo plans and prices every layout with this prior: its
online calibration is off (``run.DEMO_CALIBRATION`` says why).

Pure: no I/O except :func:`write_prior`, which writes the prior as a calibration file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from sailor import catalog
from sailor.schemas.calibration import Calibration, GPUCalibration
from sailor.schemas.device_kind import CPU_DEVICE_TYPE

__all__ = [
    "CORE_SCALE",
    "DEMO_GLOBAL_BATCH",
    "FULL_CORES",
    "FULL_KIND",
    "SLOW_CORES",
    "SLOW_KIND",
    "demo_kinds",
    "prior_calibration",
    "write_prior",
]

FULL_KIND = "cpu-full"
SLOW_KIND = "cpu-slow"

FULL_CORES = 0.5
"""The ``cpu-full`` nodes' quota, cores."""

SLOW_CORES = 0.2
"""The ``cpu-slow`` nodes' quota: 40 % of :data:`FULL_CORES`."""

CORE_SCALE = 8.0
"""One free core here against the catalog's nominal ``cpu`` spec (0.2 TFLOP/s, 20 GB/s),
for the demo model: profiled unthrottled (``sailor profile layers --model-file spec.json
--kind cpu-full``, 35 s, 2 shared cores), one node's step at global batch 12 (3 microbatches
of 4) is priced 17.8 ms against 2.26 ms from the nominal spec: 7.9. Its layers are so small
that framework time, not FLOPs, dominates them, so one factor fits one microbatch size
best; the online fit corrects it."""

DEMO_GLOBAL_BATCH = 12
"""The demo's global batch. At 4 (the demo before node kinds) no slow node earns a share
(one sample at 2.5 times the time is the step); at 12 the planner puts the slow kind to work
in every membership of the demo's script: a 5 + 1 layer pipeline beside a full replica, or
replicas with 8 and 4 samples (``tests/unit/test_demo_kinds.py``)."""


def demo_kinds(nodes: Sequence[str]) -> dict[str, tuple[str, float]]:
    """Per node (``n1``, ``n2``, …, in order): its kind and quota; odd full, even slow."""
    return {
        n: (FULL_KIND, FULL_CORES) if i % 2 == 0 else (SLOW_KIND, SLOW_CORES)
        for i, n in enumerate(nodes)
    }


def prior_calibration(
    quotas: Mapping[str, float], base: Calibration | None = None, core_scale: float = CORE_SCALE
) -> Calibration:
    """``base`` (the catalog's) with one entry per kind in ``quotas`` (kind → cores): the
    ``cpu`` entry's constants, ``compute_scale = core_scale / cores``, and its source."""
    base = base or catalog.calibration()
    cpu = next((g for g in base.gpus if g.gpu_type == CPU_DEVICE_TYPE), base.default)
    own = {g.gpu_type: g for g in base.gpus if g.gpu_type not in quotas}
    for kind, cores in sorted(quotas.items()):
        if cores <= 0:
            raise ValueError(f"quota of {kind}: {cores} cores, must be > 0")
        own[kind] = GPUCalibration.model_validate(
            {
                **cpu.model_dump(),
                "gpu_type": kind,
                "compute_scale": core_scale / cores,
                "source": (
                    f"sailor demo's prior for {kind}: the catalog's cpu constants, layer "
                    f"compute {core_scale:g} x the nominal cpu spec (one core here) / "
                    f"{cores:g} cores (its quota); not profiled"
                ),
            }
        )
    return base.model_copy(update={"gpus": tuple(own[k] for k in sorted(own))})


def write_prior(path: Path, kinds: Mapping[str, tuple[str, float]]) -> Path:
    """Write :func:`prior_calibration` of the kinds' quotas to ``path`` (a calibration file
    the controller config names)."""
    quotas = dict(kinds.values())
    path.write_text(prior_calibration(quotas).model_dump_json(indent=2))
    return path
