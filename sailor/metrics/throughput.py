"""Per-step training metrics: tokens/s, MFU per GPU type, loss, lr.

MFU of GPU type ``g`` = (model FLOPs the plan gives type ``g`` per iteration / step time)
/ (peak FLOP/s of ``g`` at the run's precision x devices of type ``g``). On a one-type plan
that is the usual ``flops_per_token x tokens/s / (peak x GPUs)``; on a heterogeneous plan
each type is charged only with the layers and samples its stages run, so a slow type shows
as a low MFU instead of dragging every type's figure. Peaks come from the catalog
(``GPUSpec.peak_tflops``: spec-sheet dense peaks). A CPU (``cpu`` or a CPU kind) has no
meaningful peak (the catalog's ``cpu`` figure is a nominal placeholder), so its MFU is
``None``, as is that of a type the catalog does not know.

Pure: no I/O, no clock, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

from sailor.metrics.flops import flops_per_iteration_by_gpu_type, gpus_by_type
from sailor.schemas.device_kind import is_cpu_type, spec_of
from sailor.schemas.hardware import GPUSpec
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan
from sailor.schemas.precision import Precision

__all__ = ["mfu_by_gpu_type", "step_metrics"]


def mfu_by_gpu_type(
    plan: Plan,
    spec: ModelSpec,
    step_s: float,
    precision: Precision,
    specs: Mapping[str, GPUSpec],
) -> dict[str, float | None]:
    """Model FLOPs utilisation of each GPU type of ``plan`` for an iteration of ``step_s``."""
    if step_s <= 0:
        raise ValueError(f"step_s={step_s}: must be > 0")
    flops = flops_per_iteration_by_gpu_type(plan, spec)
    gpus = gpus_by_type(plan)
    out: dict[str, float | None] = {}
    for g, f in flops.items():
        gs = spec_of(specs, g)
        peak = gs.peak_tflops(precision) * 1e12 if gs is not None else 0.0
        if is_cpu_type(g) or peak <= 0:
            out[g] = None
            continue
        out[g] = f / step_s / (peak * gpus[g])
    return out


def step_metrics(
    plan: Plan,
    spec: ModelSpec,
    *,
    step: int,
    step_s: float,
    loss: float,
    lr: float,
    precision: Precision,
    specs: Mapping[str, GPUSpec],
) -> dict[str, float | int | None]:
    """The metrics of one iteration, flat: ``step``, ``loss``, ``lr``, ``step_s``,
    ``samples_per_s``, ``tokens_per_s``, and ``mfu/<gpu type>`` per type of the plan."""
    tokens = plan.global_batch_size * spec.seq_length
    out: dict[str, float | int | None] = {
        "step": step,
        "loss": loss,
        "lr": lr,
        "step_s": step_s,
        "samples_per_s": plan.global_batch_size / step_s,
        "tokens_per_s": tokens / step_s,
    }
    for g, m in mfu_by_gpu_type(plan, spec, step_s, precision, specs).items():
        out[f"mfu/{g}"] = m
    return out
