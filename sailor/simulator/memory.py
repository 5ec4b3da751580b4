"""Peak memory of one GPU of one stage, with its breakdown.

``M = weights + gradients + optimizer + κ·(b·A·min(S-s, m) + b·a_last) + C·min(S-s, m) + T
+ n·c_comm + M0`` (docs/simulator-model.md, section 6):

* model state per parameter held by the GPU (parameters of the stage at its TP degree), by
  the plan's precision, the framework's mixed-precision scheme and the optimizer (no ZeRO):
  under autocast (megatron_patch) fp32 weights (4) and gradients (4) in every precision;
  DeepSpeed's FP16_Optimizer keeps 16-bit weights (2) and gradients (2) and an fp32 master
  copy (4); fp32 training keeps weights (4) and gradients (4). Adam adds two fp32 moments
  (8), SGD one fp32 momentum (4).
* activations: ``A`` = activation bytes per sample of the stage's layers (allocation growth
  during forward); under 1F1B stage ``s`` of ``S`` holds ``min(S-s, m)`` microbatches; the
  first backward's working set is about the forward footprint of the stage's last layer
  (``a_last``). With recomputation only each block's input is kept (the engine checkpoints
  blocks; the embedding and the head keep their activations), plus the larger of one
  layer's activations during its recomputation and the last layer's working set.
* the stage's output: Sailor's engine holds each in-flight microbatch's output (fp32
  residual stream, ``4·s·h`` per sample) until its backward, on every stage but the last
  (``held_output_bytes``); counted with the activations.
* weight copies ``C``: under autocast each forward casts the stage's weights (not the
  embedding's table, which its lookup reads in fp32) to the compute dtype and autograd
  keeps the casts until that microbatch's backward, so every microbatch in flight holds one
  copy (``params × 2`` bytes in bf16/fp16, none in fp32); it does not grow
  with the microbatch size. A profile's measured per-microbatch bytes stand in where larger.
  With recomputation the forward's casts are not kept for the backward (the recomputation
  casts again), but autocast's cache holds each cast until the microbatch's forward leaves
  its autocast context, checkpointed layers included: one microbatch's copies of the whole
  stage are in the working set (measured on CPU: 28.5 MB of forward peak against 27.3 MB of
  the stage's copies; one layer's, as counted before, was an eighth of it on an 8-block
  stage).
* ``κ``: caching-allocator factor (reserved / allocated), ``M0``: non-tensor overhead.
* ``n·c_comm``: the NCCL communicators of the GPU's rank (``n`` of them, counted from the
  plan under the deployment's process groups by :mod:`sailor.simulator.communicators`),
  each ``c_comm`` bytes of channel buffers (``GPUCalibration.communicator_bytes``).
* the weight-gradient transient: each layer's backward makes its largest weight's gradient
  and casts it to fp32 before adding it into the kept fp32 gradient; beyond the weight
  copies (the layer's own is released first) that is 4 bytes per element for a moment (the
  embedding: a dense fp32 gradient of its table); the stage's last layer's comes at the
  activations' peak (``backward_transient``); reported as overhead (a transient buffer).
* During the gradient sync and the optimizer step activations are freed, but FP16_Optimizer
  materialises fp32 gradients (+4 B/param), and under autocast the engine's flat gradient
  buffer of a sync group and its foreach AdamW's temporary take 4 B/param (one after the
  other): the peak is the larger of the two phases; any excess of the step phase is
  reported as overhead (a transient buffer).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from sailor.schemas import LayerSize, MemoryBreakdown, ModelSpec
from sailor.schemas.precision import MASTER_BYTES, compute_bytes, keeps_weight_copies

__all__ = [
    "MixedPrecision",
    "backward_transient",
    "backward_working_set",
    "communicator_memory",
    "copied_params",
    "held_output_bytes",
    "stage_memory",
    "state_bytes_per_param",
    "weight_copy_bytes",
    "weight_grad_bytes",
]

MixedPrecision = Literal["autocast", "fp16_optimizer"]
"""``Calibration.mixed_precision``: how the framework runs a 16-bit plan."""


def state_bytes_per_param(
    model: ModelSpec, scheme: MixedPrecision = "autocast"
) -> tuple[int, int, int, int]:
    """(weights incl. master copy, gradients, optimizer, step transient) bytes per parameter,
    in ``model.precision`` (the plan's precision)."""
    opt = 8 if model.optimizer == "adam" else 4
    if model.precision == "fp32" or scheme == "autocast":
        # after the backward (activations freed) the engine flattens a sync group's fp32
        # gradients into one buffer for its all-reduce, then its foreach AdamW (CUDA) makes
        # a parameter-sized temporary (torch's docs: ~sizeof(params) more peak memory):
        # 4 B/param, one at a time
        return MASTER_BYTES, MASTER_BYTES, opt, MASTER_BYTES
    half = compute_bytes(model.precision)
    return half + MASTER_BYTES, half, opt, MASTER_BYTES


def weight_copy_bytes(model: ModelSpec, params: int, scheme: MixedPrecision = "autocast") -> int:
    """Bytes of one microbatch's autocast copy of ``params`` weights (0 without autocast)."""
    if scheme != "autocast" or not keeps_weight_copies(model.precision):
        return 0
    return params * compute_bytes(model.precision)


def copied_params(model: ModelSpec, layer: int, params: int) -> int:
    """Parameters of ``layer`` (``params`` of them) that autocast casts in a forward: none of
    the embedding's. Autocast casts the inputs of matmuls, not of the embedding's lookup,
    which reads the fp32 table as it is (an OPT-style input projection, ~0.5 M parameters,
    is cast and not counted)."""
    return 0 if model.layer_kind(layer) == "embedding" else params


def held_output_bytes(model: ModelSpec, last_layer: int, scheme: MixedPrecision) -> int:
    """Bytes per sample of a stage's output that Sailor's engine holds from the microbatch's
    forward until its backward (``schedule._Stage.saved``: the backward starts from it), when
    the stage ends at ``last_layer``. The residual stream is fp32 under autocast (and in fp32
    training): ``4·s·h``; no layer counts it (the next layer that saves it is on the next
    stage). None on the last stage (its output is the loss), nor under ``fp16_optimizer``
    (Megatron frees the output's storage once it is sent and keeps its graph)."""
    if scheme != "autocast" or last_layer == model.num_all_layers - 1:
        return 0
    return MASTER_BYTES * model.seq_length * model.hidden_size


def backward_working_set(model: ModelSpec, last: LayerSize, vocab_parallel: bool) -> int:
    """Bytes per sample the first backward of a stage ending at ``last`` holds beyond what
    the stage keeps (``a_last``): about the last layer's forward footprint; twice the head's
    without a vocab-parallel head (an engine that replicates it, as Sailor's did before
    2026-11-28): beside the fp32 log-probabilities it keeps, the backward holds the logits'
    gradient and the log-softmax's, each as large."""
    act = last.activation_bytes_per_sample
    if not vocab_parallel and last.layer == model.num_all_layers - 1:
        return 2 * act
    return act


def weight_grad_bytes(
    model: ModelSpec, layer: int, tp: int, vocab_parallel: bool, scheme: MixedPrecision
) -> int:
    """Bytes one TP rank allocates for a moment in the backward of ``layer`` beyond what the
    stage is counted to hold: its largest weight's gradient cast to fp32, before it is added
    into the fp32 gradient (kept between steps, ``zero_grad(set_to_none=False)``). Under
    autocast a matmul's weight gradient comes in the compute dtype, and the weight's autocast
    copy (counted in the weight copies) is released before the cast to fp32 runs: the peak
    beyond the copies is the fp32 gradient, 4 bytes per element; in fp32 training the
    gradient is fp32 as made (4); the embedding's lookup makes a dense fp32 gradient of its
    table (4). Measured on CPU on the engine's layers (bf16): the head's backward peaks at 6.0
    B per element of its matrix (its 2-byte copy and this transient), the embedding's at 4.0.
    None under ``fp16_optimizer`` (16-bit gradients; in the fitted ``M0``)."""
    if scheme != "autocast":
        return 0
    h, v = model.hidden_size, model.vocab_size
    kind = model.layer_kind(layer)
    split = tp if vocab_parallel else 1
    if kind in ("embedding", "head"):
        largest = -(-v * h // split)
    else:
        kv = model.kv_heads * model.head_dim
        largest = -(-max(h * model.ffn_hidden_size, h * h, h * kv) // tp)
    return MASTER_BYTES * largest


def backward_transient(
    model: ModelSpec,
    sizes: Sequence[LayerSize],
    microbatch_size: int,
    vocab_parallel: bool,
    scheme: MixedPrecision,
) -> int:
    """The weight-gradient transient (:func:`weight_grad_bytes`) at a stage's peak: the last
    layer's, which runs its backward while every in-flight microbatch's activations are held;
    or, on a stage starting at the embedding, the embedding's if larger once the microbatch's
    activations of the later layers are freed (its backward comes last)."""
    tp = sizes[-1].tp
    last = weight_grad_bytes(model, sizes[-1].layer, tp, vocab_parallel, scheme)
    if len(sizes) > 1 and model.layer_kind(sizes[0].layer) == "embedding":
        first = weight_grad_bytes(model, sizes[0].layer, tp, vocab_parallel, scheme)
        freed = microbatch_size * sum(s.activation_bytes_per_sample for s in sizes[1:])
        return max(last, first - freed)
    return last


def communicator_memory(communicators: int, bytes_each: int, covered: int) -> int:
    """GPU bytes priced for a rank's ``communicators`` NCCL communicators: ``bytes_each``
    for each beyond the ``covered`` the non-tensor overhead already holds
    (``GPUCalibration.communicators_covered``). The planner's tables price their count with
    it too, so their memory bound and the simulator's figure follow one rule."""
    return max(0, communicators - covered) * bytes_each


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
    scheme: MixedPrecision = "autocast",
    extra_state_bytes_per_param: float = 0.0,
    vocab_parallel: bool = True,
    communicators: int = 0,
    communicator_bytes: int = 0,
    communicators_covered: int = 0,
) -> MemoryBreakdown:
    """Peak memory of one GPU running ``sizes`` (the stage's layers at its TP degree), whose
    rank holds ``communicators`` NCCL communicators: those beyond ``communicators_covered``
    (what ``overhead_bytes`` already holds) at ``communicator_bytes`` each."""
    if not sizes:
        raise ValueError(f"pipelines[{pipeline}].stages[{stage}]: a stage needs layers")
    if in_flight < 1:
        raise ValueError(f"in_flight={in_flight}: at least one microbatch is in flight")
    if communicators < 0 or communicator_bytes < 0 or communicators_covered < 0:
        raise ValueError(
            f"communicators={communicators}, communicator_bytes={communicator_bytes}, "
            f"communicators_covered={communicators_covered}: none can be negative"
        )
    params = sum(s.params for s in sizes)
    w_b, g_b, o_b, step_b = state_bytes_per_param(model, scheme)
    weights, grads, optim = params * w_b, params * g_b, params * o_b
    b = microbatch_size
    output = held_output_bytes(model, sizes[-1].layer, scheme)
    per_mb = [
        max(
            weight_copy_bytes(model, copied_params(model, s.layer, s.params), scheme),
            s.per_microbatch_bytes,
        )
        for s in sizes
    ]
    if recompute:
        # the engine checkpoints its blocks only: the embedding and the head keep theirs
        def held(s: LayerSize) -> int:
            if model.layer_kind(s.layer) == "block":
                return s.input_bytes_per_sample or s.output_bytes_per_sample
            return s.activation_bytes_per_sample

        kept = sum(held(s) for s in sizes)
        working = max(
            max(s.activation_bytes_per_sample for s in sizes),
            backward_working_set(model, sizes[-1], vocab_parallel),
        )
        act_raw = b * (kept + output) * in_flight + b * working
        # autocast keeps every weight it casts until the microbatch's autocast context
        # exits, checkpointed layers included: the whole stage's copies during a forward
        copies = sum(per_mb)
    else:
        kept = sum(s.activation_bytes_per_sample for s in sizes)
        ws = backward_working_set(model, sizes[-1], vocab_parallel)
        act_raw = b * (kept + output) * in_flight + b * ws
        copies = sum(per_mb) * in_flight
    acts = int(alloc_factor * act_raw)
    grad_t = backward_transient(model, sizes, b, vocab_parallel, scheme)
    during_backward = weights + grads + optim + acts + copies + grad_t
    during_step = weights + grads + optim + params * step_b
    transient = grad_t + max(0, during_step - during_backward)
    # bytes per parameter a deployment holds beyond the engine's state (Calibration)
    overhead = overhead_bytes + transient + int(extra_state_bytes_per_param * params)
    comms = communicator_memory(communicators, communicator_bytes, communicators_covered)
    total = weights + grads + optim + acts + copies + comms + overhead
    return MemoryBreakdown(
        pipeline=pipeline,
        stage=stage,
        gpu_type=gpu_type,
        weights=weights,
        gradients=grads,
        optimizer=optim,
        activations=acts,
        weight_copies=copies,
        communicators=comms,
        num_communicators=communicators,
        overhead=overhead,
        total=total,
        capacity=capacity_bytes,
    )
