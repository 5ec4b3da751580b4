"""Measure one layer kind of the training framework at one (TP degree, microbatch size).

The layer is the real one: a :class:`~sailor.megatron_patch.model.GPTStage` holding just
that global layer (embedding = layer 0, a block = layer 1, head + loss = layer L+1), built
and initialised exactly as a worker builds it, with the worker's optimizer
(:func:`~sailor.megatron_patch.engine.make_optimizer`, AdamW, non-foreach). Inputs are what
the layer sees in a pipeline: token ids for the embedding, hidden states that require a
gradient for a block and the head (a stage's received activation does), labels for the head.

Per repetition: one forward (timed), then one backward of that forward's output with a
random output gradient (timed). Gradients accumulate across repetitions as they do across
microbatches (the engine zeroes them in place, never frees them), so no repetition pays for
allocating gradient buffers. The optimizer step is timed separately on the layer's own
parameters: the update time of *this* layer, not a share of a small model's step.

On CUDA with a non-fp32 model, forward runs under autocast with fp32 master weights, as the
engine does, in bf16 where the GPU supports it and fp16 elsewhere (:mod:`precision`). On CPU
everything is fp32, as the engine does.

With ``tp > 1`` this runs inside each TP rank (``tp_procs``), with a real process group:
the block's all-reduces are part of its time. Returns plain values; writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sailor.megatron_patch.engine import TrainConfig, make_optimizer
from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.tp_layers import TPContext
from sailor.profiler.in_situ import measure_window
from sailor.profiler.layer_measurement import KIND_LAYER, LayerMeasurement
from sailor.profiler.memory import peak_growth_bytes, saved_tensor_bytes
from sailor.profiler.precision import autocast, compute_precision
from sailor.profiler.timing import RepeatSettings, Stats, repeat, time_once
from sailor.schemas.model import LayerKind, ModelSpec
from sailor.schemas.precision import wire_bytes

__all__ = ["kind_layer", "measure_kinds", "measure_layer"]


def kind_layer(spec: ModelSpec, kind: LayerKind) -> int:
    """The global layer index measured for ``kind`` (blocks: the first block)."""
    return {"embedding": 0, "block": 1, "head": spec.num_all_layers - 1}[kind]


def _inputs(
    spec: ModelSpec, kind: LayerKind, mbs: int, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    s, h, v = spec.seq_length, spec.hidden_size, spec.vocab_size
    if kind == "embedding":
        return torch.randint(0, v, (mbs, s), generator=gen).to(device), None
    x = torch.randn(mbs, s, h, generator=gen).to(device).requires_grad_()
    labels = torch.randint(0, v, (mbs, s), generator=gen).to(device) if kind == "head" else None
    return x, labels


def measure_layer(
    spec: ModelSpec,
    kind: LayerKind,
    mbs: int,
    device: torch.device,
    settings: RepeatSettings,
    tp: TPContext | None = None,
    measure_memory: bool = True,
    seed: int = 0,
) -> LayerMeasurement:
    """Time and size one layer kind of ``spec`` at microbatch size ``mbs`` on ``device``."""
    if mbs < 1:
        raise ValueError(f"mbs={mbs}: must be >= 1")
    ctx = tp or TPContext()
    layer = kind_layer(spec, kind)
    with torch.device(device):  # drawn on the device (``init_rng``), not on the host
        stage = GPTStage(spec, layer, layer, tp=ctx, seed=seed)
    params = list(stage.parameters())
    gen = torch.Generator().manual_seed(seed * 7919 + mbs)
    x, labels = _inputs(spec, kind, mbs, device, gen)
    precision = compute_precision(spec, device)

    def forward() -> torch.Tensor:
        with autocast(device, precision):
            out: torch.Tensor = stage(x, labels)
        return out

    with torch.no_grad():
        probe = forward()
    grad_out = torch.randn(probe.shape, generator=gen).to(device, probe.dtype)
    # what crosses a stage boundary is the engine's wire dtype (the compute dtype), not the
    # dtype autocast leaves a block's output in (fp32: the residual stream)
    wire = wire_bytes(precision)
    output_bytes = 0 if kind == "head" else probe.numel() * wire
    input_bytes = x.numel() * (x.element_size() if kind == "embedding" else wire)

    def backward(out: torch.Tensor) -> None:
        torch.autograd.backward(out, None if kind == "head" else grad_out)
        if x.grad is not None:
            x.grad = None  # the previous stage consumes it; do not accumulate input grads

    fwd_t, bwd_t = _fwd_bwd_times(forward, backward, device, settings)

    saved = saved_tensor_bytes(forward, params)
    peak = 0
    if measure_memory:

        def step() -> None:
            backward(forward())

        peak = peak_growth_bytes(step, device)

    opt = make_optimizer(params, TrainConfig(), foreach=device.type == "cuda")  # the engine's
    update = repeat(opt.step, device, settings)
    return LayerMeasurement(
        kind=kind,
        tp=ctx.size,
        mbs=mbs,
        fwd=Stats.of(fwd_t),
        bwd=Stats.of(bwd_t),
        update=update,
        params=sum(p.numel() for p in params),
        saved_bytes=saved,
        output_bytes=output_bytes,
        input_bytes=input_bytes,
        peak_growth_bytes=peak,
    )


def _fwd_bwd_times(
    forward: Callable[[], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    device: torch.device,
    settings: RepeatSettings,
) -> tuple[list[float], list[float]]:
    for _ in range(settings.warmup):
        backward(forward())
    fwd: list[float] = []
    bwd: list[float] = []
    while len(fwd) < settings.max_reps and (
        len(fwd) < settings.min_reps or sum(fwd) + sum(bwd) < settings.min_time_s
    ):
        box: list[torch.Tensor] = []
        fwd.append(time_once(lambda b=box: b.append(forward()), device))  # type: ignore[misc]
        bwd.append(time_once(lambda o=box[0]: backward(o), device))  # type: ignore[misc]
    return fwd, bwd


_PEAK_ONLY = RepeatSettings(warmup=1, min_reps=1, max_reps=1, min_time_s=0.0)


def measure_kinds(
    spec: ModelSpec,
    mbs: int,
    device: torch.device,
    settings: RepeatSettings,
    tp: TPContext | None = None,
    in_situ: bool = True,
    measure_memory: bool = True,
    blocks: int | None = None,
) -> list[LayerMeasurement]:
    """Every layer at ``mbs``: in place (:mod:`in_situ`, one entry per global layer, peak
    growth from each kind alone) or one entry per kind measured alone.

    ``blocks``: the window :func:`~sailor.profiler.memory_bound.plan_window` chose for the
    device (the embedding, that many blocks and the head in place; 0: each kind alone); None:
    the whole model."""
    if not in_situ or blocks == 0:
        return [
            measure_layer(spec, k, mbs, device, settings, tp, measure_memory) for k in KIND_LAYER
        ]
    out = measure_window(
        spec, spec.num_layers if blocks is None else blocks, mbs, device, settings, tp
    )
    if measure_memory:
        peaks = {
            k: measure_layer(spec, k, mbs, device, _PEAK_ONLY, tp).peak_growth_bytes
            for k in KIND_LAYER
        }
        out = [m.with_peak(peaks[m.kind]) for m in out]
    return out
