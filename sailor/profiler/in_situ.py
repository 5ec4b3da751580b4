"""Measure every layer of a model in place: the whole model runs, each layer is timed.

Timing a layer alone (:mod:`layer_bench`) keeps its weights and activations in cache from one
repetition to the next, and measures one block for all. Here every global layer is timed
where it runs in training, after the layer before it and with the whole model's working set:

* **Forward**: one :class:`~sailor.megatron_patch.model.GPTStage` holding every layer, run
  layer by layer exactly as ``GPTStage.forward`` does, with a timestamp between layers (the
  monotonic clock on CPU; a CUDA event on GPU, recorded without synchronising, so no
  per-layer stall is added — the original artifact's hooks synchronised).
* **Backward**: one ``backward`` of the loss; a gradient hook on each layer's input records
  when that gradient is complete, which closes the layer's backward (the embedding's closes
  with the call). Timestamps only, no synchronisation.
* **Update**: one AdamW (the engine's) per layer over the same model, stepped one after the
  other, each timed: the step of *that* layer with the cache state of a full step.
* **Saved for backward**: saved-tensor hooks attribute each saved tensor to the layer running.

Every global layer is measured, blocks included (no copying of one block to the others),
when the whole model fits the device. When it does not (:mod:`memory_bound` decides before
anything is built), :func:`measure_window` measures a GPT of the first ``k`` blocks between
the same embedding and head, and the blocks outside it take a measured block's figures.
Peak memory growth stays with :mod:`layer_bench` (it needs a layer alone). Works inside TP
ranks too (the stage is built with the rank's :class:`TPContext`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sailor.megatron_patch.engine import TrainConfig, make_optimizer
from sailor.megatron_patch.model import GPTStage
from sailor.megatron_patch.tp_layers import TPContext
from sailor.profiler.layer_measurement import LayerMeasurement
from sailor.profiler.memory_bound import window_layers, window_spec
from sailor.profiler.precision import autocast, compute_precision
from sailor.profiler.timing import RepeatSettings, Stats, time_once
from sailor.schemas.model import ModelSpec
from sailor.schemas.precision import wire_bytes

__all__ = ["measure_model", "measure_window"]


class _Clock:
    """Timestamps on the host clock (CPU) or as CUDA events read after one synchronise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list[Any] = []

    def mark(self) -> int:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self, a: int, b: int) -> float:
        if self.cuda:
            return float(self.marks[a].elapsed_time(self.marks[b])) / 1e3
        return float(self.marks[b] - self.marks[a])

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def measure_model(
    spec: ModelSpec,
    mbs: int,
    device: torch.device,
    settings: RepeatSettings,
    tp: TPContext | None = None,
    seed: int = 0,
) -> list[LayerMeasurement]:
    """Fwd, bwd and update time and saved bytes of every global layer, measured in place.

    ``peak_growth_bytes`` is 0 here (see :mod:`layer_bench`). The repetition count is fixed
    when ``settings.min_reps == settings.max_reps`` (TP ranks must agree on it).
    """
    ctx = tp or TPContext()
    n = spec.num_all_layers
    with torch.device(device):  # drawn on the device (``init_rng``), not on the host
        stage = GPTStage(spec, 0, n - 1, tp=ctx, seed=seed)
    mods = list(stage.layers.values())
    gen = torch.Generator().manual_seed(seed * 7919 + mbs)
    tokens = torch.randint(0, spec.vocab_size, (mbs, spec.seq_length), generator=gen).to(device)
    labels = torch.randint(0, spec.vocab_size, (mbs, spec.seq_length), generator=gen).to(device)
    precision = compute_precision(spec, device)
    wire = wire_bytes(precision)

    current = [0]
    saved: list[dict[int, int]] = [{} for _ in range(n)]
    skip = {p.untyped_storage().data_ptr() for p in stage.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in skip and ptr != 0:
            d = saved[current[0]]
            d[ptr] = max(d.get(ptr, 0), st.nbytes())
        return t

    def one(record: bool) -> tuple[list[float], list[float]]:
        clock = _Clock(device)
        fwd_marks = [clock.mark()]
        inputs: list[torch.Tensor] = []
        x: torch.Tensor = tokens
        with autocast(device, precision):
            for i, mod in enumerate(mods):
                current[0] = i
                if i > 0:
                    inputs.append(x)
                x = mod(x, labels) if i == n - 1 else mod(x)
                fwd_marks.append(clock.mark())
        bwd_marks: dict[int, int] = {}
        for i, h in enumerate(inputs, start=1):
            h.register_hook(_stamp(bwd_marks, i, clock))  # type: ignore[no-untyped-call]
        start = clock.mark()
        x.backward()  # type: ignore[no-untyped-call]
        end = clock.mark()
        clock.sync()
        if not record:
            return [], []
        fwd = [clock.seconds(fwd_marks[i], fwd_marks[i + 1]) for i in range(n)]
        # layer i's backward ends when the gradient of its input (layer i's hook) is done
        ends = [bwd_marks.get(i, end) for i in range(1, n)] + [start]
        bwd = [clock.seconds(ends[0], end)]  # embedding: after block 1's input grad
        bwd += [clock.seconds(ends[i], ends[i - 1]) for i in range(1, n)]
        return fwd, bwd

    for _ in range(settings.warmup):
        one(record=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        one(record=False)
    fwd_t: list[list[float]] = [[] for _ in range(n)]
    bwd_t: list[list[float]] = [[] for _ in range(n)]
    total = 0.0
    while len(fwd_t[0]) < settings.max_reps and (
        len(fwd_t[0]) < settings.min_reps or total < settings.min_time_s
    ):
        f, b = one(record=True)
        for i in range(n):
            fwd_t[i].append(f[i])
            bwd_t[i].append(b[i])
        total += sum(f) + sum(b)
    opts = [
        make_optimizer(m.parameters(), TrainConfig(), foreach=device.type == "cuda") for m in mods
    ]
    upd = _updates(opts, device, settings)
    out: list[LayerMeasurement] = []
    for i, mod in enumerate(mods):
        out.append(
            LayerMeasurement(
                kind=spec.layer_kind(i),
                tp=ctx.size,
                mbs=mbs,
                fwd=Stats.of(fwd_t[i]),
                bwd=Stats.of(bwd_t[i]),
                update=upd[i],
                params=sum(p.numel() for p in mod.parameters()),
                saved_bytes=sum(saved[i].values()),
                # the engine's wire dtype (the compute dtype) crosses stage boundaries
                output_bytes=0 if i == n - 1 else mbs * spec.seq_length * spec.hidden_size * wire,
                input_bytes=tokens.numel() * tokens.element_size()
                if i == 0
                else mbs * spec.seq_length * spec.hidden_size * wire,
                peak_growth_bytes=0,
                layer=i,
            )
        )
    return out


def measure_window(
    spec: ModelSpec,
    blocks: int,
    mbs: int,
    device: torch.device,
    settings: RepeatSettings,
    tp: TPContext | None = None,
    seed: int = 0,
) -> list[LayerMeasurement]:
    """:func:`measure_model` of the window of ``blocks`` blocks (:mod:`memory_bound`), in global
    layer indices: the embedding, blocks ``1..blocks-1``, the window's last block as the block
    before the head, the head; plus one per-kind block entry (``layer=-1``, an interior block
    of the window) for the blocks outside it. The whole model when ``blocks`` covers it."""
    if blocks >= spec.num_layers:
        return measure_model(spec, mbs, device, settings, tp, seed)
    ms = measure_model(window_spec(spec, blocks), mbs, device, settings, tp, seed)
    where = window_layers(spec, blocks)
    out = [dataclasses.replace(m, layer=where[i]) for i, m in enumerate(ms)]
    # an interior block: preceded by a block (or the embedding when blocks < 3), followed by one
    representative = ms[(blocks + 1) // 2]
    return [*out, dataclasses.replace(representative, layer=-1)]


def _stamp(marks: dict[int, int], i: int, clock: _Clock) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        marks[i] = clock.mark()

    return hook


def _updates(
    opts: Sequence[torch.optim.Optimizer], device: torch.device, settings: RepeatSettings
) -> list[Stats]:
    for _ in range(settings.warmup):
        for o in opts:
            o.step()
    times: list[list[float]] = [[] for _ in opts]
    while len(times[0]) < settings.max_reps and (
        len(times[0]) < settings.min_reps or sum(map(sum, times)) < settings.min_time_s
    ):
        for i, o in enumerate(opts):
            times[i].append(time_once(o.step, device))
    return [Stats.of(t) for t in times]
