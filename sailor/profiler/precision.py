"""The precision a layer is profiled in, chosen from the device that runs it.

Training computes in a 16-bit type under autocast with fp32 master weights (gradients and
AdamW state stay fp32). Which 16-bit type depends on the GPU: bf16 where the device supports
it (Ampere and newer), fp16 elsewhere — V100, T4, Titan RTX and RTX 2080 have no bf16 units
(their catalog bf16 peak is 0) and the estimator prices them at their fp16 peak, so a profile
taken in bf16 there would time an emulated path nobody trains with. On the CPU everything is
fp32, as the engine runs there.

A timing pass needs no loss scaling (overflowing fp16 gradients cost the same time), only the
dtype. The chosen precision is written into the profile (``LayerProfile.precision``).

Pure apart from the one capability query, which callers (and tests) may replace.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from sailor.megatron_patch.precision import native_bf16
from sailor.schemas.model import ModelSpec
from sailor.schemas.precision import Precision

__all__ = ["ComputePrecision", "autocast", "compute_precision", "sizes_measured"]

ComputePrecision = Precision
"""The job's precision type (``schemas.precision``), as ``LayerProfile.precision`` records it."""

_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


def compute_precision(
    spec: ModelSpec,
    device: torch.device | str,
    bf16_supported: Callable[[], bool] = native_bf16,
) -> ComputePrecision:
    """What ``spec`` computes in on ``device``: fp32 on the CPU or for an fp32 model; on a GPU,
    bf16 where the device supports it, else fp16 (whatever 16-bit type the model names)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind != "cuda" or spec.precision == "fp32":
        return "fp32"
    return "bf16" if bf16_supported() else "fp16"


def sizes_measured(spec: ModelSpec, precision: ComputePrecision) -> bool:
    """Whether a run computing in ``precision`` writes ``spec``'s layer sizes: only in the
    model's own width (a CPU run of a 16-bit model computes in fp32 and its byte counts would
    be wrong for GPUs). The sizes record ``precision`` (``LayerSize.precision``)."""
    return (precision == "fp32") == (spec.precision == "fp32")


def autocast(device: torch.device, precision: ComputePrecision) -> AbstractContextManager[Any]:
    """The autocast region a forward of ``precision`` runs in (none for fp32)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])
