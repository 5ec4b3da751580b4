"""``simulate(plan, ...) -> Estimate``: iteration time, memory per GPU and $ of one plan.

The model (docs/simulator-model.md) follows what the training framework does on each rank:

1. compute per stage from per-layer profiles (:mod:`lookup`), plus the framework's measured
   time outside the layers (``ProfileDB.framework``: per microbatch on every stage, per
   sample on a stage that reads the data, per iteration on every stage);
2. pipeline transfers between consecutive stages: blocking at both ends (DeepSpeed's
   send/recv), so their time is charged to both stages; or, with
   ``Calibration.blocking_p2p=False`` (asynchronous sends), a delay on the link;
3. each pipeline runs 1F1B (:mod:`pipeline`: closed form or replay);
4. after its last backward every stage pays the fixed sync cost and the framework's
   per-iteration time, then all-reduces each of its layer segments with the other holders
   (a segment's ring starts when all its holders are ready), then the tied embedding
   gradient if the calibration says the framework reduces it separately, then runs its
   optimizer step; the iteration ends with the last step, plus a loss all-reduce over all
   ranks if the calibration says the framework runs one;
5. memory per GPU (:mod:`memory`); cost = GPU-hours by type and zone at their price (each
   replica group's own ``spot`` flag, else on-demand unless ``spot=True``) + cross-zone bytes
   at the egress price.

Pure: takes frozen values and returns one; no I/O, no clock, no globals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from sailor.schemas import (
    Calibration,
    Estimate,
    GPUSpec,
    LayerSize,
    MemoryBreakdown,
    ModelSpec,
    NetworkProfile,
    Plan,
    PriceTable,
    ProfileDB,
    StageTime,
    TimeBreakdown,
)
from sailor.schemas.calibration import DEFAULT_MEMORY_OVERHEAD_BYTES
from sailor.schemas.profile import FrameworkTime
from sailor.simulator.lookup import StageCosts, layer_sizes, layer_table
from sailor.simulator.memory import stage_memory
from sailor.simulator.network_model import AllReduce, inter_curve, intra_curve, ring_allreduce
from sailor.simulator.pipeline import TimelineOp, closed_form_1f1b, replay_1f1b

__all__ = ["Method", "Timeline", "simulate", "simulate_with_timeline"]

Method = Literal["closed_form", "replay"]
_MASK_BYTES_PER_ELEMENT = 2
_LOSS_BYTES = 8
"""The loss all-reduce of megatron_patch: one float64."""


@dataclass(frozen=True)
class Timeline:
    """Per-microbatch schedule of every stage of every pipeline (from the replay)."""

    ops: tuple[TimelineOp, ...]
    pipeline_end_s: tuple[float, ...]
    iteration_time_s: float


@dataclass(frozen=True)
class _Stage:
    f: float
    b: float
    u: float
    send_f: float
    send_b: float
    sizes: tuple[LayerSize, ...]
    fw: float = 0.0
    """Framework time per microbatch outside the layers (schedule step, data)."""


class _Notes:
    def __init__(self) -> None:
        self.items: dict[str, None] = {}

    def add(self, *notes: str) -> None:
        for n in notes:
            if n:
                self.items[n] = None


def simulate(
    plan: Plan,
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    *,
    calibration: Calibration | None = None,
    gpu_specs: Mapping[str, GPUSpec] | None = None,
    method: Method = "closed_form",
    spot: bool = False,
) -> Estimate:
    """Simulated iteration time, peak memory per GPU and $ per iteration of ``plan``.

    ``gpu_specs`` (GPU type -> spec sheet) gives memory capacities and enables analytic
    estimates for GPU types or TP degrees without a profile. ``spot`` prices GPUs at spot
    rates, except replica groups whose own ``spot`` flag is set. Raises
    :class:`~sailor.simulator.lookup.ProfileLookupError` if a GPU type has neither a profile
    nor a spec, ``KeyError`` if it has no price.
    """
    return _run(plan, model, profiles, network, prices, calibration, gpu_specs, method, spot)[0]


def simulate_with_timeline(
    plan: Plan,
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    *,
    calibration: Calibration | None = None,
    gpu_specs: Mapping[str, GPUSpec] | None = None,
    spot: bool = False,
) -> tuple[Estimate, Timeline]:
    """:func:`simulate` with the replay, plus every forward and backward on every stage."""
    est, tl = _run(plan, model, profiles, network, prices, calibration, gpu_specs, "replay", spot)
    if tl is None:
        raise RuntimeError("replay produced no timeline")
    return est, tl


def _run(
    plan: Plan,
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    calibration: Calibration | None,
    gpu_specs: Mapping[str, GPUSpec] | None,
    method: Method,
    spot: bool,
) -> tuple[Estimate, Timeline | None]:
    if plan.num_layers != model.num_all_layers:
        raise ValueError(
            f"plan.num_layers={plan.num_layers}: model {model.name} has "
            f"{model.num_all_layers} layers (embedding + blocks + head)"
        )
    if method not in ("closed_form", "replay"):
        raise ValueError(f"method={method!r}: use 'closed_form' or 'replay'")
    cal = calibration or Calibration()
    specs = gpu_specs or {}
    notes = _Notes()
    uses_estimates = network.estimated
    tables: dict[tuple[str, int, int], StageCosts] = {}
    sizes_by_tp: dict[int, tuple[LayerSize, ...]] = {}
    mask = _MASK_BYTES_PER_ELEMENT * model.seq_length**2 if cal.sends_attention_mask else 0

    # --- per-stage compute and transfers -------------------------------------------------
    stages: list[list[_Stage]] = []
    egress_bytes: dict[tuple[str, str], float] = {}
    for p in plan.pipelines:
        row: list[_Stage] = []
        for s in p.stages:
            r = s.replica
            key = (r.gpu_type, r.tp, p.microbatch_size)
            if key not in tables:
                tables[key] = layer_table(profiles, model, cal.for_gpu(r.gpu_type), specs, *key)
                notes.add(*tables[key].notes)
            if r.tp not in sizes_by_tp:
                sizes_by_tp[r.tp], n_sz = layer_sizes(profiles, model, r.tp)
                notes.add(*n_sz)
                uses_estimates |= any(z.source == "estimated" for z in sizes_by_tp[r.tp])
            costs = tables[key].layers[s.first_layer : s.last_layer + 1]
            uses_estimates |= any(c.estimated for c in costs)
            ft = _framework(profiles, r.gpu_type)
            # stages that read the data: the first (inputs) and the last (labels)
            reads = s.first_layer == 0 or s.last_layer == model.num_all_layers - 1
            row.append(
                _Stage(
                    f=sum(c.fwd_s for c in costs),
                    b=sum(c.bwd_s for c in costs),
                    u=sum(c.update_s for c in costs),
                    send_f=0.0,
                    send_b=0.0,
                    sizes=sizes_by_tp[r.tp][s.first_layer : s.last_layer + 1],
                    fw=ft.microbatch_s + (p.microbatch_size * ft.sample_s if reads else 0.0),
                )
            )
        for i in range(len(row) - 1):
            a, b = p.stages[i].replica, p.stages[i + 1].replica
            out = p.microbatch_size * row[i].sizes[-1].output_bytes_per_sample
            eff = min(
                cal.for_gpu(a.gpu_type).network_efficiency,
                cal.for_gpu(b.gpu_type).network_efficiency,
            )
            same_node = bool(a.node_id) and a.node_id == b.node_id
            if same_node:
                curve, note = intra_curve(network, a.gpu_type, a.gpus_per_node, specs)
            else:
                curve, note = inter_curve(network, a, b)
            notes.add(note)
            uses_estimates |= note.startswith("no link") or note.startswith("no intra")
            gather = 0.0
            if b.tp > 1:
                gcurve, gnote = intra_curve(network, b.gpu_type, b.tp, specs)
                notes.add(gnote)
                gather = gcurve.transfer_time(out)
            # each of the a.tp sender GPUs sends 1/tp of the output (+ the unsplit mask);
            # they send at once over the node's NICs: node-level bytes on the node curve
            node_f = a.tp * (out / a.tp + mask)
            node_b = float(out)
            t_f = curve.transfer_time(node_f) / eff + gather
            t_b = curve.transfer_time(node_b) / eff + gather
            row[i] = _replace(row[i], send_f=t_f, send_b=t_b)
            if a.zone != b.zone:
                k = (a.zone, b.zone)
                egress_bytes[k] = egress_bytes.get(k, 0.0) + p.num_microbatches * node_f
                k2 = (b.zone, a.zone)
                egress_bytes[k2] = egress_bytes.get(k2, 0.0) + p.num_microbatches * node_b
        stages.append(row)

    # --- pipelines -----------------------------------------------------------------------
    pipe_end: list[float] = []
    stage_end: list[tuple[float, ...]] = []
    ops: list[TimelineOp] = []
    for pi, (p, row) in enumerate(zip(plan.pipelines, stages, strict=True)):
        fs, bs, delay = _per_microbatch(row, cal.blocking_p2p)
        if method == "replay":
            run = replay_1f1b(fs, bs, p.num_microbatches, delay, pipeline=pi, record=True)
            pipe_end.append(run.end_s)
            stage_end.append(run.stage_end_s)
            ops.extend(run.ops)
        else:
            t = closed_form_1f1b(fs, bs, p.num_microbatches, delay)
            pipe_end.append(t)
            stage_end.append(tuple(t for _ in row))

    # --- gradient sync per layer segment, then the optimizer step ------------------------
    ready: dict[tuple[int, int], float] = {}
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            g = s.replica.gpu_type
            fixed = cal.for_gpu(g).sync_fixed_s + _framework(profiles, g).iteration_s
            ready[(pi, si)] = stage_end[pi][si] + fixed
    sync_of: dict[tuple[int, int], float] = dict.fromkeys(ready, 0.0)
    # DeepSpeed reduces the stage's gradients after the last backward; segments go in
    # reverse layer order, as gradients become available in backward
    for seg in reversed(plan.segments()):
        groups = [plan.pipelines[pi].stages[si].replica for pi, si in seg.holders]
        node_bytes = 0.0
        elements = 0.0
        for pi, si in seg.holders:
            r = plan.pipelines[pi].stages[si].replica
            n_el = sum(
                sizes_by_tp[r.tp][layer].params
                for layer in range(seg.first_layer, seg.last_layer + 1)
            )
            node_bytes = max(node_bytes, r.tp * n_el * model.param_bytes())
            elements = max(elements, float(n_el))
        eff = min(cal.for_gpu(g.gpu_type).network_efficiency for g in groups)
        ar = ring_allreduce(network, groups, node_bytes, elements, eff)
        notes.add(*ar.notes)
        start = max(ready[h] for h in seg.holders)
        for h in seg.holders:
            ready[h] = start + ar.time_s
            sync_of[h] += ar.time_s
        for src, dst, nbytes in ar.cross_zone_bytes:
            egress_bytes[(src, dst)] = egress_bytes.get((src, dst), 0.0) + nbytes
    tied = _tied_allreduce(plan, model, network, cal) if cal.tied_allreduce else None
    if tied is not None:
        holders, ar = tied
        notes.add(*ar.notes)
        start = max(ready[h] for h in holders)
        for h in holders:
            ready[h] = start + ar.time_s
            sync_of[h] += ar.time_s
        for src, dst, nbytes in ar.cross_zone_bytes:
            egress_bytes[(src, dst)] = egress_bytes.get((src, dst), 0.0) + nbytes
    end = {h: ready[h] + stages[h[0]][h[1]].u for h in ready}
    iteration = max(end.values())
    if cal.loss_allreduce:
        # one scalar over every rank, after the step; it is the iteration's barrier
        everyone = [
            s.replica for p in plan.pipelines for s in p.stages for _ in range(s.replica.tp)
        ]
        eff = min(cal.for_gpu(g.gpu_type).network_efficiency for g in everyone)
        loss_ar = ring_allreduce(network, everyone, _LOSS_BYTES, 1.0, eff)
        notes.add(*loss_ar.notes)
        iteration += loss_ar.time_s
    if iteration <= 0:
        raise ValueError("simulated iteration time is zero: the profiles hold no time")

    # --- memory --------------------------------------------------------------------------
    memory: list[MemoryBreakdown] = []
    for pi, (p, row) in enumerate(zip(plan.pipelines, stages, strict=True)):
        for si, (s, st) in enumerate(zip(p.stages, row, strict=True)):
            g = s.replica.gpu_type
            gcal = cal.for_gpu(g)
            spec = specs.get(g)
            memory.append(
                stage_memory(
                    model=model,
                    sizes=st.sizes,
                    microbatch_size=p.microbatch_size,
                    in_flight=min(p.depth - si, p.num_microbatches),
                    recompute=s.recompute,
                    alloc_factor=gcal.alloc_factor,
                    overhead_bytes=_overhead(gcal.memory_overhead_bytes, profiles, g, s.replica.tp),
                    capacity_bytes=spec.memory_bytes if spec else 0,
                    pipeline=pi,
                    stage=si,
                    gpu_type=g,
                )
            )
            if spec is None:
                notes.add(f"no GPU spec for {g}: memory capacity unknown, not checked")

    # --- cost ----------------------------------------------------------------------------
    compute_usd = 0.0
    for p in plan.pipelines:
        for s in p.stages:
            r = s.replica
            on_spot = spot if r.spot is None else r.spot
            compute_usd += r.tp * prices.gpu_hour(r.gpu_type, r.zone, on_spot) * iteration / 3600
    egress_usd = sum(
        nbytes / 1e9 * prices.egress_per_gb(src, dst)
        for (src, dst), nbytes in sorted(egress_bytes.items())
    )

    # --- breakdown of the critical path --------------------------------------------------
    crit = max(range(len(pipe_end)), key=lambda i: pipe_end[i])
    fs, bs, _ = _per_microbatch(stages[crit], cal.blocking_p2p)
    m = plan.pipelines[crit].num_microbatches
    bott = max(range(len(fs)), key=lambda i: fs[i] + bs[i])
    raw = stages[crit][bott]
    compute = m * (raw.f + raw.b + raw.fw)
    p2p = max(0.0, m * (fs[bott] + bs[bott] - raw.f - raw.b - raw.fw))
    bubble = max(0.0, pipe_end[crit] - compute - p2p)
    tail = iteration - pipe_end[crit]
    last = max(end, key=lambda h: end[h])
    update = min(stages[last[0]][last[1]].u, max(tail, 0.0))
    grad_sync = max(0.0, tail - update)

    stage_times = tuple(
        StageTime(
            pipeline=pi,
            stage=si,
            fwd_s=st.f + st.fw,
            bwd_s=st.b,
            send_s=st.send_f,
            update_s=st.u,
            grad_sync_s=sync_of[(pi, si)],
        )
        for pi, row in enumerate(stages)
        for si, st in enumerate(row)
    )
    samples = plan.global_batch_size
    est = Estimate(
        iteration_time_s=iteration,
        throughput_iter_s=1.0 / iteration,
        throughput_samples_s=samples / iteration,
        time=TimeBreakdown(
            compute_s=compute, p2p_s=p2p, bubble_s=bubble, grad_sync_s=grad_sync, update_s=update
        ),
        stages=stage_times,
        memory=tuple(memory),
        peak_memory_bytes=max(mb.total for mb in memory),
        fits_in_memory=all(mb.fits or mb.capacity == 0 for mb in memory),
        compute_cost_usd=compute_usd,
        egress_cost_usd=egress_usd,
        cost_per_iter_usd=compute_usd + egress_usd,
        gpus_by_type_zone=plan.gpus_by_type_zone(),
        uses_estimates=uses_estimates,
        model=method,
        notes=tuple(notes.items),
    )
    timeline = (
        Timeline(ops=tuple(ops), pipeline_end_s=tuple(pipe_end), iteration_time_s=iteration)
        if method == "replay"
        else None
    )
    return est, timeline


def _replace(st: _Stage, *, send_f: float, send_b: float) -> _Stage:
    return _Stage(f=st.f, b=st.b, u=st.u, send_f=send_f, send_b=send_b, sizes=st.sizes, fw=st.fw)


_NO_FRAMEWORK_TIME = FrameworkTime(gpu_type="*", source="none measured")


def _framework(profiles: ProfileDB, gpu_type: str) -> FrameworkTime:
    """The framework time measured for ``gpu_type``, else zero (imported profiles)."""
    return profiles.framework_time(gpu_type) or _NO_FRAMEWORK_TIME


def _per_microbatch(
    row: list[_Stage], blocking: bool
) -> tuple[list[float], list[float], list[float]]:
    """Per-microbatch F and B of each stage, and the delay of each link.

    Blocking transfers are charged to both ends (no link delay); asynchronous ones are a
    delay on the link (the larger of the two directions; the replay has one per link).
    """
    fs: list[float] = []
    bs: list[float] = []
    for i, st in enumerate(row):
        prev_f = row[i - 1].send_f if i and blocking else 0.0
        prev_b = row[i - 1].send_b if i and blocking else 0.0
        own_f = st.send_f if blocking else 0.0
        own_b = st.send_b if blocking else 0.0
        fs.append(st.f + st.fw + own_f + prev_f)
        bs.append(st.b + own_b + prev_b)
    delay = [] if blocking else [max(st.send_f, st.send_b) for st in row[:-1]]
    return fs, bs, delay


def _tied_allreduce(
    plan: Plan, model: ModelSpec, network: NetworkProfile, cal: Calibration
) -> tuple[list[tuple[int, int]], AllReduce] | None:
    """The tied embedding gradient's all-reduce among the stages holding the embedding or the
    head (megatron_patch's last sync group): its holders and its time; None without one.

    The ``vocab x hidden`` matrix is replicated on the TP ranks of a stage; the ring is
    modelled over the stages' nodes, as for a segment.
    """
    if not model.tie_embeddings:
        return None
    head = model.num_all_layers - 1
    holders = [
        (pi, si)
        for pi, p in enumerate(plan.pipelines)
        for si, s in enumerate(p.stages)
        if s.first_layer == 0 or s.last_layer == head
    ]
    if len(holders) < 2:
        return None  # one stage holds both copies: a local sum
    groups = [plan.pipelines[pi].stages[si].replica for pi, si in holders]
    n_el = float(model.vocab_size * model.hidden_size)
    node_bytes = max(g.tp for g in groups) * n_el * model.param_bytes()
    eff = min(cal.for_gpu(g.gpu_type).network_efficiency for g in groups)
    return holders, ring_allreduce(network, groups, node_bytes, n_el, eff)


def _overhead(explicit: int | None, profiles: ProfileDB, gpu_type: str, tp: int) -> int:
    """Non-tensor memory: calibration, else the profile's measured overhead, else 1 GiB."""
    if explicit is not None:
        return explicit
    o = profiles.overhead(gpu_type, tp)
    return o.bytes if o is not None else DEFAULT_MEMORY_OVERHEAD_BYTES
