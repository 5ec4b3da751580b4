"""One training precision per job: which one, and what it costs in bytes.

A job computes in one precision on every rank. The plan records it (``Plan.precision``), the
engine (``sailor.megatron_patch``) runs it, and the simulator prices it with the byte counts
below. What the engine does with each precision:

* ``bf16``: torch autocast to bfloat16 over fp32 weights, fp32 gradients and fp32 AdamW
  state; no loss scaling (bf16 has fp32's exponent range).
* ``fp16``: the same with float16, plus dynamic loss scaling (fp16 overflows where bf16 does
  not). Chosen where some GPU of the plan has no bf16 units (V100, T4, Turing cards).
* ``fp32``: no autocast. CPU ranks always run it (the engine computes in fp32 on CPU).

Under autocast each forward casts the stage's weights to the compute dtype, and autograd
keeps those casts until the microbatch's backward: every microbatch in flight holds its own
compute-dtype copy of the stage's weights (:func:`keeps_weight_copies`).

Must never import torch or read a file: the simulator and planner use it, and the engine
must keep its constants true.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from sailor.schemas.device_kind import any_cpu_type, spec_of
from sailor.schemas.hardware import GPUSpec

__all__ = [
    "GRAD_ALLREDUCE_BYTES",
    "MASTER_BYTES",
    "Precision",
    "cannot_run",
    "choose_precision",
    "compute_bytes",
    "keeps_weight_copies",
    "loss_scaling",
    "supports_bf16",
    "wire_bytes",
]

Precision = Literal["fp32", "bf16", "fp16"]

MASTER_BYTES = 4
"""Bytes per element of the weights, gradients and optimizer state the engine keeps: fp32
whatever the compute precision (autocast casts on the fly)."""

GRAD_ALLREDUCE_BYTES = MASTER_BYTES
"""Bytes per gradient element in the engine's gradient all-reduce: the engine reduces the
fp32 gradients as they are (``megatron_patch/grad_sync.py``), in every precision."""


def compute_bytes(precision: Precision) -> int:
    """Bytes per element of tensors computed in ``precision`` (activations, weight casts)."""
    return 4 if precision == "fp32" else 2


def wire_bytes(precision: Precision) -> int:
    """Bytes per element of an activation or its gradient sent between pipeline stages: the
    compute dtype (what the layers produce under autocast)."""
    return compute_bytes(precision)


def keeps_weight_copies(precision: Precision) -> bool:
    """Whether each in-flight microbatch holds a compute-dtype copy of the stage's weights
    (autocast saves the casts for backward); never in fp32."""
    return precision != "fp32"


def loss_scaling(precision: Precision) -> bool:
    """Whether the engine runs dynamic loss scaling (fp16 only)."""
    return precision == "fp16"


def supports_bf16(spec: GPUSpec) -> bool:
    """Whether the catalog gives the GPU type a bf16 peak (it has bf16 units)."""
    return spec.peak_tflops_bf16 > 0


def choose_precision(
    gpu_types: Iterable[str],
    specs: Mapping[str, GPUSpec],
    requested: Precision = "bf16",
) -> Precision:
    """The precision of a job on ``gpu_types``.

    ``requested="fp32"`` (a model spec asking for full precision) is kept. Otherwise: fp32
    when any rank is a CPU, ``cpu`` or a CPU kind (the engine computes in fp32 there, and a
    job has one precision);
    bf16 when every GPU type's spec has a bf16 peak; else fp16. A GPU type without a spec
    cannot be shown to have bf16 units, so it counts as one without (fp16 costs the same
    bytes; only its loss scaling differs).
    """
    types = list(dict.fromkeys(gpu_types))
    if not types:
        raise ValueError("gpu_types=[]: a job needs at least one device type")
    if requested == "fp32" or any_cpu_type(types):
        return "fp32"
    if all((s := spec_of(specs, g)) is not None and supports_bf16(s) for g in types):
        return "bf16"
    return "fp16"


def cannot_run(gpu_type: str, specs: Mapping[str, GPUSpec], precision: Precision) -> str:
    """Why a rank on ``gpu_type`` cannot compute in ``precision`` ('' if it can): the
    planner leaves such a type out of a job fixed at ``precision``, and the worker refuses
    a plan that places one.

    fp32 runs everywhere. A CPU or CPU kind computes in fp32 only (the engine's rule). bf16
    needs bf16 units: a spec with a bf16 peak (a type without a spec cannot be shown to
    have them, as in :func:`choose_precision`). fp16 runs on every GPU.
    """
    if precision == "fp32":
        return ""
    if any_cpu_type((gpu_type,)):
        return f"{gpu_type} is a CPU kind: it computes in fp32 only"
    if precision == "bf16":
        spec = spec_of(specs, gpu_type)
        if spec is None:
            return f"{gpu_type} has no spec in the catalog: bf16 units not known"
        if not supports_bf16(spec):
            return f"{gpu_type} has no bf16 units (catalog peak_tflops_bf16 = 0)"
    return ""
