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

The model's work is done once per distinct pipeline of a plan (alike pipelines share their
figures) and link curves are looked up once per pair of endpoint kinds; what is left per
stage is bookkeeping and the answer's own rows, validated in one pass.

The steps live in their own modules: the simulation's inputs and notes in :mod:`sim_inputs`,
steps 1-2 in :mod:`pipeline_kinds`, the ranks' timing of 3 (and of the collectives) in
:mod:`rank_timing`, step 4 in :mod:`grad_sync`; this module runs them and builds the answer
(critical path, memory, cost).

Pure: takes frozen values and returns one; no I/O, no clock, no globals.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sailor.schemas import (
    Calibration,
    Estimate,
    GPUCalibration,
    GPUSpec,
    MemoryBreakdown,
    ModelSpec,
    NetworkProfile,
    Pipeline,
    Plan,
    PriceTable,
    ProfileDB,
    TimeBreakdown,
)
from sailor.schemas.calibration import DEFAULT_MEMORY_OVERHEAD_BYTES
from sailor.schemas.device_kind import any_cpu_type, spec_of
from sailor.schemas.precision import Precision, supports_bf16
from sailor.simulator.communicators import stage_communicators
from sailor.simulator.grad_sync import gradient_sync, loss_allreduce_time
from sailor.simulator.memo import IdentityMemo
from sailor.simulator.memory import stage_memory
from sailor.simulator.pipeline import TimelineOp
from sailor.simulator.pipeline_kinds import PipelineKind, build_pipeline_kinds
from sailor.simulator.rank_timing import Method, OwnDevices, RankTiming, StageRef
from sailor.simulator.sim_inputs import SimInputs

__all__ = [
    "Timeline",
    "simulate",
    "simulate_with_timeline",
]


@dataclass(frozen=True)
class Timeline:
    """Per-microbatch schedule of every stage of every pipeline (from the replay)."""

    ops: tuple[TimelineOp, ...]
    pipeline_end_s: tuple[float, ...]
    iteration_time_s: float


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
    ranks: RankTiming | None = None,
) -> Estimate:
    """Simulated iteration time, peak memory per GPU and $ per iteration of ``plan``.

    ``gpu_specs`` (GPU type -> spec sheet) gives memory capacities and enables analytic
    estimates for GPU types or TP degrees without a profile. ``spot`` prices GPUs at spot
    rates, except replica groups whose own ``spot`` flag is set. ``ranks`` places and times
    the ranks (a fresh object per call; default :class:`OwnDevices`, every rank on a device of
    its own). Raises :class:`~sailor.simulator.lookup.ProfileLookupError` if a GPU type has
    neither a profile nor a spec, ``KeyError`` if it has no price.
    """
    return _run(
        plan, model, profiles, network, prices, calibration, gpu_specs, method, spot, False, ranks
    )[0]


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
    ranks: RankTiming | None = None,
) -> tuple[Estimate, Timeline]:
    """:func:`simulate` with the replay, plus every forward and backward on every stage."""
    est, tl = _run(
        plan, model, profiles, network, prices, calibration, gpu_specs, "replay", spot, True, ranks
    )
    if tl is None:
        raise RuntimeError("replay produced no timeline")
    return est, tl


def _check_tp(plan: Plan, model: ModelSpec) -> None:
    """Refuse a TP degree the engine cannot split the model over (``ModelSpec.tp_problem``),
    naming the first stage that has it: such a plan has no iteration time to predict."""
    bad: dict[int, str | None] = {}
    for pi, p in enumerate(plan.pipelines):
        for si, s in enumerate(p.stages):
            tp = s.replica.tp
            if tp not in bad:
                bad[tp] = model.tp_problem(tp)
            if bad[tp] is not None:
                raise ValueError(f"pipelines[{pi}].stages[{si}].replica.tp={tp}: {bad[tp]}")


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
    timeline: bool,
    ranks: RankTiming | None,
) -> tuple[Estimate, Timeline | None]:
    """The estimate, and the timeline if ``timeline`` and the method is the replay."""
    # Pipelines alike in everything the model reads (microbatch size, stages' layers, GPU
    # type, TP, node shape, zone, which neighbours share a node; and the microbatch count
    # for the schedule, the in-flight count for memory) get the same figures, so each is
    # worked out once per distinct pipeline (a 512-node plan has ~340 pipelines of 2-3
    # kinds). Sums over stages and pipelines still run one by one in plan order, so the
    # answer is bit for bit that of pricing every stage on its own
    # (tests/unit/test_simulator_golden.py).
    if plan.num_layers != model.num_all_layers:
        raise ValueError(
            f"plan.num_layers={plan.num_layers}: model {model.name} has "
            f"{model.num_all_layers} layers (embedding + blocks + head)"
        )
    if method not in ("closed_form", "replay"):
        raise ValueError(f"method={method!r}: use 'closed_form' or 'replay'")
    _check_tp(plan, model)
    cal = calibration or Calibration()
    specs = gpu_specs or {}
    spec_precision = model.precision
    model = _at_precision(model, _precision(plan, model, specs))
    inp = SimInputs(model, profiles, network, cal, specs, spec_precision)
    if plan.precision is None:
        inp.notes.add(f"plan precision not recorded: {model.precision} derived from its GPU types")
    pipelines = plan.pipelines
    ranks = OwnDevices() if ranks is None else ranks

    egress_bytes: dict[tuple[str, str], float] = {}
    kinds = build_pipeline_kinds(inp, pipelines, egress_bytes)
    runs = ranks.run_pipelines(pipelines, kinds, method, timeline, inp.notes)
    slowdown = ranks.end_slowdown(pipelines)
    ready, sync_of = gradient_sync(plan, inp, kinds, runs, slowdown, ranks, egress_bytes)
    end = {h: ready[h] + slowdown * kinds[h[0]].row[h[1]].u for h in ready}
    iteration = max(end.values()) + loss_allreduce_time(inp, pipelines, ranks)
    if iteration <= 0:
        raise ValueError("simulated iteration time is zero: the profiles hold no time")
    comms = _COMMUNICATORS.get(
        (plan,),
        (cal.process_groups, model.tie_embeddings),
        lambda: stage_communicators(plan, cal.process_groups, model.tie_embeddings),
    )
    memory, distinct = _memory(inp, pipelines, kinds, comms)
    compute_usd = _compute_usd(prices, pipelines, spot, iteration)
    egress_usd = sum(
        nbytes / 1e9 * prices.egress_per_gb(src, dst)
        for (src, dst), nbytes in sorted(egress_bytes.items())
    )
    samples = plan.global_batch_size
    # One validation of the whole answer: every StageTime and MemoryBreakdown is built and
    # checked by pydantic's core in one pass (a third of the time of one constructor call
    # per stage, which dominated large plans).
    est = Estimate.model_validate(
        {
            "iteration_time_s": iteration,
            "throughput_iter_s": 1.0 / iteration,
            "throughput_samples_s": samples / iteration,
            "time": _critical_path(pipelines, kinds, runs.end_s, end, iteration),
            "stages": _stage_times(kinds, sync_of),
            "memory": memory,
            "peak_memory_bytes": max(mb.total for mb in distinct),
            "fits_in_memory": all(mb.fits or mb.capacity == 0 for mb in distinct),
            "compute_cost_usd": compute_usd,
            "egress_cost_usd": egress_usd,
            "cost_per_iter_usd": compute_usd + egress_usd,
            "gpus_by_type_zone": _gpus_by_type_zone(kinds),
            "uses_estimates": inp.uses_estimates,
            "model": method,
            "notes": tuple(inp.notes.items),
        }
    )
    tl = (
        Timeline(ops=tuple(runs.ops), pipeline_end_s=tuple(runs.end_s), iteration_time_s=iteration)
        if method == "replay" and timeline
        else None
    )
    return est, tl


def _memory(
    inp: SimInputs,
    pipelines: Sequence[Pipeline],
    kinds: list[PipelineKind],
    comms: Sequence[Sequence[int]],
) -> tuple[list[dict[str, object]], list[MemoryBreakdown]]:
    """Every stage's memory rows (unvalidated), and the distinct validated breakdowns;
    ``comms[p][s]``: the NCCL communicators of stage ``s`` of pipeline ``p``'s ranks.

    Stages of alike pipelines at the same place share one validated breakdown; the Estimate
    validates every stage's copy (with its own indices) in one pass.
    """
    memory: list[dict[str, object]] = []
    mem_of: dict[tuple[int, int, int, bool, int], dict[str, object]] = {}
    distinct: list[MemoryBreakdown] = []
    # a plan repeats one pipeline object many times (to_plan shares them): such a pipeline
    # of one kind with the same communicators has the same rows, looked up once
    rows_of: dict[tuple[int, int, tuple[int, ...]], list[dict[str, object]]] = {}
    for pi, (p, kind) in enumerate(zip(pipelines, kinds, strict=True)):
        rkey = (id(p), id(kind), tuple(comms[pi]))
        rows = rows_of.get(rkey)
        if rows is not None:
            memory.extend({**mb, "pipeline": pi, "stage": si} for si, mb in enumerate(rows))
            continue
        rows = rows_of[rkey] = []
        for si, s in enumerate(p.stages):
            g = s.replica.gpu_type
            spec = spec_of(inp.specs, g)
            in_flight = min(p.depth - si, p.num_microbatches)
            mkey = (id(kind), si, in_flight, s.recompute, comms[pi][si])
            mb = mem_of.get(mkey)
            if mb is None:
                gcal = inp.gcal(g)
                one = stage_memory(
                    model=inp.model,
                    sizes=kind.row[si].sizes,
                    microbatch_size=p.microbatch_size,
                    in_flight=in_flight,
                    recompute=s.recompute,
                    alloc_factor=gcal.alloc_factor,
                    overhead_bytes=_overhead(gcal, inp.profiles, g, s.replica.tp),
                    capacity_bytes=spec.memory_bytes if spec else 0,
                    pipeline=pi,
                    stage=si,
                    gpu_type=g,
                    scheme=inp.cal.mixed_precision,
                    extra_state_bytes_per_param=inp.cal.extra_state_bytes_per_param,
                    vocab_parallel=inp.cal.vocab_parallel,
                    communicators=comms[pi][si],
                    communicator_bytes=gcal.communicator_bytes,
                    communicators_covered=gcal.communicators_covered,
                )
                distinct.append(one)
                mb = mem_of[mkey] = one.model_dump()
            rows.append(mb)
            memory.append({**mb, "pipeline": pi, "stage": si})
            if spec is None:
                inp.notes.add(f"no GPU spec for {g}: memory capacity unknown, not checked")
    return memory, distinct


def _compute_usd(
    prices: PriceTable, pipelines: Sequence[Pipeline], spot: bool, iteration: float
) -> float:
    """GPU-hours of one iteration at each replica group's price (its own spot flag, else
    ``spot``), summed stage by stage in plan order."""
    compute_usd = 0.0
    usd_of: dict[tuple[int, str, str, bool], float] = {}
    for p in pipelines:
        for s in p.stages:
            r = s.replica
            on_spot = spot if r.spot is None else r.spot
            ckey = (r.tp, r.gpu_type, r.zone, on_spot)
            usd = usd_of.get(ckey)
            if usd is None:
                usd = r.tp * prices.gpu_hour(r.gpu_type, r.zone, on_spot) * iteration / 3600
                usd_of[ckey] = usd
            compute_usd += usd
    return compute_usd


def _critical_path(
    pipelines: Sequence[Pipeline],
    kinds: list[PipelineKind],
    pipe_end: list[float],
    end: dict[StageRef, float],
    iteration: float,
) -> TimeBreakdown:
    """The iteration split along its critical path: the slowest pipeline's bottleneck stage
    (compute, transfers, bubble), then the tail (gradient sync, the last optimizer step)."""
    crit = max(range(len(pipe_end)), key=lambda i: pipe_end[i])
    fs, bs = kinds[crit].fs, kinds[crit].bs
    m = pipelines[crit].num_microbatches
    bott = max(range(len(fs)), key=lambda i: fs[i] + bs[i])
    raw = kinds[crit].row[bott]
    compute = m * (raw.f + raw.b + raw.fw)
    p2p = max(0.0, m * (fs[bott] + bs[bott] - raw.f - raw.b - raw.fw))
    bubble = max(0.0, pipe_end[crit] - compute - p2p)
    tail = iteration - pipe_end[crit]
    last = max(end, key=lambda h: end[h])
    update = min(kinds[last[0]].row[last[1]].u, max(tail, 0.0))
    grad_sync = max(0.0, tail - update)
    return TimeBreakdown(
        compute_s=compute, p2p_s=p2p, bubble_s=bubble, grad_sync_s=grad_sync, update_s=update
    )


def _stage_times(
    kinds: list[PipelineKind], sync_of: dict[StageRef, float]
) -> list[dict[str, object]]:
    """Every stage's time rows (unvalidated), in plan order."""
    return [
        {
            "pipeline": pi,
            "stage": si,
            "fwd_s": st.f + st.fw,
            "bwd_s": st.b,
            "send_s": st.send_f,
            "update_s": st.u,
            "grad_sync_s": sync_of[(pi, si)],
        }
        for pi, kind in enumerate(kinds)
        for si, st in enumerate(kind.row)
    ]


def _gpus_by_type_zone(kinds: list[PipelineKind]) -> dict[str, int]:
    """``plan.gpus_by_type_zone()``, counted once per distinct pipeline."""
    count: dict[int, int] = {}
    of: dict[int, PipelineKind] = {}
    for k in kinds:
        count[id(k)] = count.get(id(k), 0) + 1
        of[id(k)] = k
    out: dict[str, int] = {}
    for i, k in of.items():
        for _, _, gpu_type, tp, _, zone, _ in k.stages:
            key = f"{gpu_type}@{zone}"
            out[key] = out.get(key, 0) + tp * count[i]
    return dict(sorted(out.items()))


def _precision(plan: Plan, model: ModelSpec, specs: Mapping[str, GPUSpec]) -> Precision:
    """The plan's precision (derived from its GPU types if not recorded); bf16 on a GPU type
    without bf16 units, and 16 bits with CPU ranks (the engine computes in fp32 on a CPU), are
    refused."""
    prec = plan.resolved_precision(specs, model.precision)
    if prec != "fp32" and any_cpu_type(plan.gpu_types):
        raise ValueError(
            f"plan.precision={prec!r}: CPU ranks compute in fp32; record fp32, or leave "
            "precision unset to derive it"
        )
    if prec == "bf16":
        without = [g for g in plan.gpu_types if (sp := spec_of(specs, g)) and not supports_bf16(sp)]
        if without:
            raise ValueError(
                f"plan.precision='bf16': {', '.join(without)} has no bf16 units (catalog bf16 "
                "peak 0); record fp16, or leave precision unset to derive it"
            )
    return prec


def _at_precision(model: ModelSpec, precision: Precision) -> ModelSpec:
    """``model`` computing in ``precision``: the plan's choice is what runs and is priced
    (compute peak of analytic estimates, estimated layer sizes, model state). One copy per
    (model, precision), kept: the layer tables are memoized on the model's identity, so a
    fresh copy per call rebuilt them in every simulation of a plan whose precision is not the
    spec's (a search simulates thousands)."""
    if model.precision == precision:
        return model
    return _AT_PRECISION.get(
        (model,),
        ("precision", precision),
        lambda: model.model_copy(update={"precision": precision}),
    )


_AT_PRECISION = IdentityMemo(64)


_COMMUNICATORS = IdentityMemo(16)
"""Each stage's NCCL communicators by the plan's identity and the deployment's process
groups: they depend on the plan's layout only, not on the calibration's figures, and a
robust planner simulates one plan in every corner (four calls; at 512 GPUs counting them
was ~30% of a simulation)."""


def _overhead(gcal: GPUCalibration, profiles: ProfileDB, gpu_type: str, tp: int) -> int:
    """Non-tensor memory: calibration, else the profile's measured overhead, else 1 GiB;
    plus the calibration's extra for a GPU in a TP group."""
    extra = gcal.memory_overhead_tp_bytes if tp > 1 else 0
    if gcal.memory_overhead_bytes is not None:
        return gcal.memory_overhead_bytes + extra
    o = profiles.overhead(gpu_type, tp)
    return (o.bytes if o is not None else DEFAULT_MEMORY_OVERHEAD_BYTES) + extra
