"""Peak memory of one GPU of one stage, with its breakdown.

``M = weights + gradients + optimizer + κ·(b·A·min(S-s, m) + b·a_last) + M0``
(docs/simulator-model.md, section 6):

* model state per parameter held by the GPU (parameters of the stage at its TP degree), by
  precision and optimizer, as DeepSpeed's FP16_Optimizer / fp32 training keep it (no ZeRO):
  mixed precision keeps compute-precision weights (2) and gradients (2), an fp32 master copy
  (4); Adam adds two fp32 moments (8), SGD one fp32 momentum (4). fp32 training keeps
  weights (4) and gradients (4) plus the optimizer state.
* activations: ``A`` = activation bytes per sample of the stage's layers (allocation growth
  during forward); under 1F1B stage ``s`` of ``S`` holds ``min(S-s, m)`` microbatches; the
  first backward's working set is about the forward footprint of the stage's last layer
  (``a_last``). With recomputation only each layer's input is kept, plus one layer's
  activations during its recomputation.
* ``κ``: caching-allocator factor (reserved / allocated), ``M0``: non-tensor overhead.
* During the optimizer step activations are freed, but mixed precision materialises fp32
  gradients (+4 B/param): the peak is the larger of the two phases; any excess of the step
  phase is reported as overhead (a transient buffer).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from sailor.schemas import LayerSize, MemoryBreakdown, ModelSpec

__all__ = ["stage_memory", "state_bytes_per_param"]


def state_bytes_per_param(model: ModelSpec) -> tuple[int, int, int, int]:
    """(weights incl. master copy, gradients, optimizer, step transient) bytes per parameter."""
    opt = 8 if model.optimizer == "adam" else 4
    if model.precision == "fp32":
        return 4, 4, opt, 0
    return 2 + 4, 2, opt, 4


def stage_memory(
    *,
    model: ModelSpec,
    sizes: Sequence[LayerSize],
    microbatch_size: int,
    in_flight: int,
    recompute: bool,
    alloc_factor: float,
    overhead_bytes: int,
    capacity_bytes: int,
    pipeline: int,
    stage: int,
    gpu_type: str,
) -> MemoryBreakdown:
    """Peak memory of one GPU running ``sizes`` (the stage's layers at its TP degree)."""
    if not sizes:
        raise ValueError(f"pipelines[{pipeline}].stages[{stage}]: a stage needs layers")
    if in_flight < 1:
        raise ValueError(f"in_flight={in_flight}: at least one microbatch is in flight")
    params = sum(s.params for s in sizes)
    w_b, g_b, o_b, step_b = state_bytes_per_param(model)
    weights, grads, optim = params * w_b, params * g_b, params * o_b
    b = microbatch_size
    if recompute:
        kept = sum(s.input_bytes_per_sample or s.output_bytes_per_sample for s in sizes)
        working = max(s.activation_bytes_per_sample for s in sizes)
        act_raw = b * kept * in_flight + b * working
    else:
        kept = sum(s.activation_bytes_per_sample for s in sizes)
        act_raw = b * kept * in_flight + b * sizes[-1].activation_bytes_per_sample
    acts = int(alloc_factor * act_raw)
    during_backward = weights + grads + optim + acts
    during_step = weights + grads + optim + params * step_b
    transient = max(0, during_step - during_backward)
    overhead = overhead_bytes + transient
    total = weights + grads + optim + acts + overhead
    return MemoryBreakdown(
        pipeline=pipeline,
        stage=stage,
        gpu_type=gpu_type,
        weights=weights,
        gradients=grads,
        optimizer=optim,
        activations=acts,
        overhead=overhead,
        total=total,
        capacity=capacity_bytes,
    )
