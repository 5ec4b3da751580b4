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

Pure: takes frozen values and returns one; no I/O, no clock, no globals.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from sailor.schemas import (
    Calibration,
    Estimate,
    GPUCalibration,
    GPUSpec,
    LayerSize,
    MemoryBreakdown,
    ModelSpec,
    NetworkProfile,
    Pipeline,
    Plan,
    PriceTable,
    ProfileDB,
    ReplicaGroup,
    TimeBreakdown,
)
from sailor.schemas.calibration import DEFAULT_MEMORY_OVERHEAD_BYTES
from sailor.schemas.device_kind import any_cpu_type, spec_of
from sailor.schemas.precision import (
    GRAD_ALLREDUCE_BYTES,
    Precision,
    compute_bytes,
    supports_bf16,
    wire_bytes,
)
from sailor.schemas.profile import FrameworkTime
from sailor.simulator.lookup import StageCosts, layer_sizes, layer_table
from sailor.simulator.memory import stage_memory
from sailor.simulator.network_model import AllReduce, LinkCurves, guessed_link, ring_allreduce
from sailor.simulator.pipeline import TimelineOp, closed_form_1f1b, replay_1f1b

__all__ = [
    "Method",
    "Notes",
    "OwnDevices",
    "PipelineKind",
    "PipelineRuns",
    "RankTiming",
    "Timeline",
    "simulate",
    "simulate_ranks",
    "simulate_with_timeline",
]

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


_StageKey = tuple[int, int, str, int, int, str, bool]
"""(first layer, last layer, GPU type, TP, GPUs per node, zone, recompute) of a stage."""
_PipeKey = tuple[int, tuple[_StageKey, ...], tuple[bool, ...]]
"""A pipeline's microbatch size, stages, and which consecutive stages share a node."""
_Rank = tuple[int, int]
"""(pipeline, stage) of a plan."""


@dataclass(frozen=True)
class PipelineKind:
    """The per-microbatch figures of every pipeline with one :data:`_PipeKey`."""

    row: tuple[_Stage, ...]
    fs: tuple[float, ...]
    bs: tuple[float, ...]
    delay: tuple[float, ...]
    crossings: tuple[tuple[str, str, float, float], ...]
    """(sender zone, receiver zone, forward bytes, backward bytes) of each cross-zone link,
    per microbatch."""
    stage_of_layer: tuple[int, ...]
    stages: tuple[_StageKey, ...]


class Notes:
    """The notes of one simulation, once each, in the order they arose."""

    def __init__(self) -> None:
        self.items: dict[str, None] = {}

    def add(self, *notes: str) -> None:
        for n in notes:
            if n:
                self.items[n] = None


class _Inputs:
    """One simulation's inputs and lookups: profile tables, layer sizes, link curves and
    per-GPU-type constants, each worked out on first use; the notes in the order they arose."""

    def __init__(
        self,
        model: ModelSpec,
        profiles: ProfileDB,
        network: NetworkProfile,
        cal: Calibration,
        specs: Mapping[str, GPUSpec],
        sizes_precision: Precision,
    ) -> None:
        self.model = model
        self.wire_scale = wire_bytes(model.precision) / compute_bytes(sizes_precision)
        self.profiles = profiles
        self.cal = cal
        self.specs = specs
        self.links = LinkCurves(network, specs)
        self.notes = Notes()
        self.uses_estimates = network.estimated
        self.tables: dict[tuple[str, int, int], StageCosts] = {}
        self.sizes_by_tp: dict[int, tuple[LayerSize, ...]] = {}
        self._gcal: dict[str, GPUCalibration] = {}
        self._framework: dict[str, FrameworkTime] = {}

    def gcal(self, gpu_type: str) -> GPUCalibration:
        c = self._gcal.get(gpu_type)
        if c is None:
            c = self._gcal[gpu_type] = self.cal.for_gpu(gpu_type)
        return c

    def framework(self, gpu_type: str) -> FrameworkTime:
        """The framework time measured for ``gpu_type``, else zero (imported profiles)."""
        f = self._framework.get(gpu_type)
        if f is None:
            f = self.profiles.framework_time(gpu_type) or _NO_FRAMEWORK_TIME
            self._framework[gpu_type] = f
        return f

    def wire(self, size: LayerSize) -> float:
        """Bytes per sample a stage ending with ``size``'s layer sends to the next stage (and
        gets back as its gradient): the layer's output in the wire dtype of the plan's
        precision. Profiled and imported sizes are in the model spec's precision (the
        profiler writes sizes only from a device computing in it); estimated ones in the
        plan's."""
        scale = 1.0 if size.source == "estimated" else self.wire_scale
        return size.output_bytes_per_sample * scale

    def sizes(self, tp: int) -> tuple[LayerSize, ...]:
        sz = self.sizes_by_tp.get(tp)
        if sz is None:
            sz, notes = layer_sizes(
                self.profiles, self.model, tp, self.cal.vocab_parallel, self.cal.activations
            )
            self.sizes_by_tp[tp] = sz
            self.notes.add(*notes)
            self.uses_estimates |= any(z.source == "estimated" for z in sz)
        return sz


@dataclass
class PipelineRuns:
    """Each pipeline's end, each of its stages' end of last backward, and the recorded ops."""

    end_s: list[float]
    stage_end_s: list[tuple[float, ...]]
    ops: list[TimelineOp]


class RankTiming(Protocol):
    """How the placement of a plan's ranks times its pipelines and collectives.

    The simulator's own, :class:`OwnDevices`, is the GPU case: every rank owns its device. The
    CPU test scaffolding (:mod:`sailor.simulator.cpu_host`) supplies ranks sharing one host's
    cores. One object per simulation: it may keep state between calls, which come in the
    order of the iteration (pipelines, gradient all-reduces, loss all-reduce).
    """

    def run_pipelines(
        self,
        pipelines: Sequence[Pipeline],
        kinds: Sequence[PipelineKind],
        method: Method,
        timeline: bool,
        notes: Notes,
    ) -> PipelineRuns:
        """Run 1F1B on every pipeline (``kinds[i]``: the figures of ``pipelines[i]``)."""
        ...

    def end_slowdown(self, pipelines: Sequence[Pipeline]) -> float:
        """How many times slower than alone the end of iteration and the optimizer step run."""
        ...

    def grad_allreduce_s(
        self, ar: AllReduce, holders: Sequence[_Rank], node_bytes: float, *, chains: bool
    ) -> float:
        """Time of gradient all-reduce ``ar`` among the stages ``holders`` (``chains``: a
        segment's, which the next one may follow at once; the tied embedding's does not)."""
        ...

    def loss_allreduce_s(self, ar: AllReduce, ranks: int, node_bytes: float) -> float:
        """Time of the loss all-reduce ``ar`` over every rank, right after the step."""
        ...


class OwnDevices:
    """Every rank owns its device (GPUs): pipelines run on their own, collectives take the
    modelled ring's time."""

    def run_pipelines(
        self,
        pipelines: Sequence[Pipeline],
        kinds: Sequence[PipelineKind],
        method: Method,
        timeline: bool,
        notes: Notes,
    ) -> PipelineRuns:
        # alike pipelines with the same microbatch count are run once
        out = PipelineRuns([], [], [])
        runs: dict[tuple[int, int], tuple[float, tuple[float, ...], int, tuple[TimelineOp, ...]]]
        runs = {}
        for pi, (p, kind) in enumerate(zip(pipelines, kinds, strict=True)):
            rkey = (id(kind), p.num_microbatches)
            done = runs.get(rkey)
            if done is None:
                if method == "replay":
                    run = replay_1f1b(
                        kind.fs,
                        kind.bs,
                        p.num_microbatches,
                        kind.delay,
                        pipeline=pi,
                        record=timeline,
                    )
                    done = (run.end_s, run.stage_end_s, pi, run.ops)
                else:
                    t = closed_form_1f1b(kind.fs, kind.bs, p.num_microbatches, kind.delay)
                    done = (t, tuple(t for _ in kind.row), pi, ())
                runs[rkey] = done
            out.end_s.append(done[0])
            out.stage_end_s.append(done[1])
            if timeline:
                if done[2] == pi:
                    out.ops.extend(done[3])
                else:
                    out.ops.extend(dataclasses.replace(op, pipeline=pi) for op in done[3])
        return out

    def end_slowdown(self, pipelines: Sequence[Pipeline]) -> float:
        return 1.0

    def grad_allreduce_s(
        self, ar: AllReduce, holders: Sequence[_Rank], node_bytes: float, *, chains: bool
    ) -> float:
        return ar.time_s

    def loss_allreduce_s(self, ar: AllReduce, ranks: int, node_bytes: float) -> float:
        return ar.time_s


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
    return _run(
        plan,
        model,
        profiles,
        network,
        prices,
        calibration,
        gpu_specs,
        method,
        spot,
        False,
        OwnDevices(),
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
) -> tuple[Estimate, Timeline]:
    """:func:`simulate` with the replay, plus every forward and backward on every stage."""
    est, tl = _run(
        plan,
        model,
        profiles,
        network,
        prices,
        calibration,
        gpu_specs,
        "replay",
        spot,
        True,
        OwnDevices(),
    )
    if tl is None:
        raise RuntimeError("replay produced no timeline")
    return est, tl


def simulate_ranks(
    plan: Plan,
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    ranks: RankTiming,
    *,
    calibration: Calibration | None = None,
    gpu_specs: Mapping[str, GPUSpec] | None = None,
    method: Method = "closed_form",
    spot: bool = False,
    timeline: bool = False,
) -> tuple[Estimate, Timeline | None]:
    """:func:`simulate` with the ranks placed and timed by ``ranks`` (a fresh object per
    call), and the timeline if ``timeline`` and the method is the replay."""
    return _run(
        plan,
        model,
        profiles,
        network,
        prices,
        calibration,
        gpu_specs,
        method,
        spot,
        timeline,
        ranks,
    )


def _pipe_key(p: Pipeline) -> _PipeKey:
    stages = p.stages
    reps = [s.replica for s in stages]
    return (
        p.microbatch_size,
        tuple(
            (s.first_layer, s.last_layer, r.gpu_type, r.tp, r.gpus_per_node, r.zone, s.recompute)
            for s, r in zip(stages, reps, strict=True)
        ),
        tuple(bool(a.node_id) and a.node_id == b.node_id for a, b in itertools.pairwise(reps)),
    )


def _kind(inp: _Inputs, p: Pipeline, pkey: _PipeKey, mask: float) -> PipelineKind:
    """Compute and transfers per stage of ``p``, per microbatch (independent of its count)."""
    model, cal = inp.model, inp.cal
    row: list[_Stage] = []
    for s in p.stages:
        r = s.replica
        key = (r.gpu_type, r.tp, p.microbatch_size)
        table = inp.tables.get(key)
        if table is None:
            table = layer_table(
                inp.profiles,
                model,
                inp.gcal(r.gpu_type),
                inp.specs,
                *key,
                cal.vocab_parallel,
                cal.activations,
                inp.links.network,
            )
            inp.tables[key] = table
            inp.notes.add(*table.notes)
        sizes = inp.sizes(r.tp)
        costs = table.layers[s.first_layer : s.last_layer + 1]
        inp.uses_estimates |= any(c.estimated for c in costs)
        ft = inp.framework(r.gpu_type)
        # stages that read the data: the first (inputs) and the last (labels)
        reads = s.first_layer == 0 or s.last_layer == model.num_all_layers - 1
        # with recompute, the engine runs each block's forward again in its backward
        again = (
            sum(
                c.fwd_s
                for layer, c in enumerate(costs, s.first_layer)
                if model.layer_kind(layer) == "block"
            )
            if s.recompute
            else 0.0
        )
        row.append(
            _Stage(
                f=sum(c.fwd_s for c in costs),
                b=sum(c.bwd_s for c in costs) + again,
                u=sum(c.update_s for c in costs),
                send_f=0.0,
                send_b=0.0,
                sizes=sizes[s.first_layer : s.last_layer + 1],
                fw=ft.microbatch_s + (p.microbatch_size * ft.sample_s if reads else 0.0),
            )
        )
    crossings: list[tuple[str, str, float, float]] = []
    for i in range(len(row) - 1):
        a, b = p.stages[i].replica, p.stages[i + 1].replica
        out = p.microbatch_size * inp.wire(row[i].sizes[-1])
        eff, fixed = cal.p2p_between(a.gpu_type, b.gpu_type)
        same_node = bool(a.node_id) and a.node_id == b.node_id
        if same_node:
            curve, note = inp.links.intra(a.gpu_type, a.gpus_per_node)
        else:
            curve, note = inp.links.inter(a, b)
        inp.notes.add(note)
        inp.uses_estimates |= guessed_link(note)
        gather_f = gather_b = 0.0
        if cal.p2p_across_tp == "full_copies" and (a.tp > 1 or b.tp > 1):
            # each receiver rank takes the whole activation from one sender (b.tp copies
            # forward), each sender rank the whole gradient back (a.tp copies); no gather
            node_f = b.tp * out + a.tp * mask
            node_b = float(a.tp * out)
        else:
            # one copy crosses in each direction, in 1/t slices sent at once over the node's
            # NICs (node-level bytes on the node curve; + the unsplit mask where sent); the
            # receiving TP group all-gathers it inside its node: stage s+1 (b.tp ranks)
            # forward, stage s (a.tp ranks) backward, as the engine's roles.boundary_pieces
            if b.tp > 1:
                gcurve, gnote = inp.links.intra(b.gpu_type, b.tp)
                inp.notes.add(gnote)
                gather_f = gcurve.transfer_time(out)
            if a.tp > 1:
                gcurve, gnote = inp.links.intra(a.gpu_type, a.tp)
                inp.notes.add(gnote)
                gather_b = gcurve.transfer_time(out)
            node_f = a.tp * (out / a.tp + mask)
            node_b = float(out)
        t_f = fixed + curve.transfer_time(node_f) / eff + gather_f
        t_b = fixed + curve.transfer_time(node_b) / eff + gather_b
        row[i] = _replace(row[i], send_f=t_f, send_b=t_b)
        if a.zone != b.zone:
            crossings.append((a.zone, b.zone, node_f, node_b))
    fs, bs, delay = _per_microbatch(row, cal.blocking_p2p)
    return PipelineKind(
        row=tuple(row),
        fs=tuple(fs),
        bs=tuple(bs),
        delay=tuple(delay),
        crossings=tuple(crossings),
        stage_of_layer=tuple(si for si, s in enumerate(p.stages) for _ in s.layers),
        stages=pkey[1],
    )


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
    ranks: RankTiming,
) -> tuple[Estimate, Timeline | None]:
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
    cal = calibration or Calibration()
    specs = gpu_specs or {}
    spec_precision = model.precision
    model = _at_precision(model, _precision(plan, model, specs))
    inp = _Inputs(model, profiles, network, cal, specs, spec_precision)
    if plan.precision is None:
        inp.notes.add(f"plan precision not recorded: {model.precision} derived from its GPU types")
    pipelines = plan.pipelines

    egress_bytes: dict[tuple[str, str], float] = {}
    kinds = _pipeline_kinds(inp, pipelines, egress_bytes)
    runs = ranks.run_pipelines(pipelines, kinds, method, timeline, inp.notes)
    slowdown = ranks.end_slowdown(pipelines)
    ready, sync_of = _gradient_sync(plan, inp, kinds, runs, slowdown, ranks, egress_bytes)
    end = {h: ready[h] + slowdown * kinds[h[0]].row[h[1]].u for h in ready}
    iteration = max(end.values()) + _loss_allreduce_s(inp, pipelines, ranks)
    if iteration <= 0:
        raise ValueError("simulated iteration time is zero: the profiles hold no time")
    memory, distinct = _memory(inp, pipelines, kinds)
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


def _pipeline_kinds(
    inp: _Inputs, pipelines: Sequence[Pipeline], egress_bytes: dict[tuple[str, str], float]
) -> list[PipelineKind]:
    """Per-stage compute and transfers of each pipeline, worked out once per distinct
    pipeline; adds the pipeline transfers' cross-zone bytes to ``egress_bytes``."""
    mask = _MASK_BYTES_PER_ELEMENT * inp.model.seq_length**2 if inp.cal.sends_attention_mask else 0
    by_key: dict[_PipeKey, PipelineKind] = {}
    by_object: dict[int, PipelineKind] = {}  # the planner's plans repeat one Pipeline object
    kinds: list[PipelineKind] = []
    for p in pipelines:
        kind = by_object.get(id(p))
        if kind is None:
            key = _pipe_key(p)
            kind = by_key.get(key)
            if kind is None:
                kind = by_key[key] = _kind(inp, p, key, mask)
            by_object[id(p)] = kind
        kinds.append(kind)
        m = p.num_microbatches
        for za, zb, node_f, node_b in kind.crossings:
            egress_bytes[(za, zb)] = egress_bytes.get((za, zb), 0.0) + m * node_f
            egress_bytes[(zb, za)] = egress_bytes.get((zb, za), 0.0) + m * node_b
    return kinds


def _gradient_sync(
    plan: Plan,
    inp: _Inputs,
    kinds: list[PipelineKind],
    runs: PipelineRuns,
    slowdown: float,
    ranks: RankTiming,
    egress_bytes: dict[tuple[str, str], float],
) -> tuple[dict[_Rank, float], dict[_Rank, float]]:
    """When each stage is ready for its optimizer step, and its time in gradient all-reduces.

    After its last backward a stage pays the fixed sync cost and the framework's
    per-iteration time (``slowdown`` times), then all-reduces each layer segment with its
    other holders, then the tied embedding; adds their cross-zone bytes to ``egress_bytes``.
    """
    pipelines = plan.pipelines
    cal = inp.cal
    fixed_of: dict[str, float] = {}
    ready: dict[_Rank, float] = {}
    for pi, p in enumerate(pipelines):
        ends = runs.stage_end_s[pi]
        for si, s in enumerate(p.stages):
            g = s.replica.gpu_type
            fixed = fixed_of.get(g)
            if fixed is None:
                fixed = inp.gcal(g).sync_fixed_s + slowdown * inp.framework(g).iteration_s
                fixed_of[g] = fixed
            ready[(pi, si)] = ends[si] + fixed
    sync_of: dict[_Rank, float] = dict.fromkeys(ready, 0.0)

    def reduce(holders: list[_Rank], ar: AllReduce, node_bytes: float, chains: bool) -> None:
        inp.notes.add(*ar.notes)
        inp.uses_estimates |= any(guessed_link(n) for n in ar.notes)
        took = ranks.grad_allreduce_s(ar, holders, node_bytes, chains=chains)
        start = max(ready[h] for h in holders)
        for h in holders:
            ready[h] = start + took
            sync_of[h] += took
        for src, dst, nbytes in ar.cross_zone_bytes:
            egress_bytes[(src, dst)] = egress_bytes.get((src, dst), 0.0) + nbytes

    sizes_by_tp = inp.sizes_by_tp
    grad_bytes = _grad_bytes(inp.model, cal)
    per_gpu_of: dict[int, ReplicaGroup] = {}
    # DeepSpeed reduces the stage's gradients after the last backward; segments go in
    # reverse layer order, as gradients become available in backward
    for lo, hi, holders in reversed(_segments(plan, kinds)):
        groups = [pipelines[pi].stages[si].replica for pi, si in holders]
        node_bytes = 0.0
        elements = 0.0
        for tp in dict.fromkeys(r.tp for r in groups):  # each TP degree once, first seen first
            n_el = sum(sizes_by_tp[tp][layer].params for layer in range(lo, hi + 1))
            node_bytes = max(node_bytes, tp * n_el * grad_bytes)
            elements = max(elements, float(n_el))
        eff = min(inp.gcal(g).network_efficiency for g in dict.fromkeys(r.gpu_type for r in groups))
        if cal.ring_links == "per_gpu":
            groups, node_bytes = _per_gpu(groups, per_gpu_of), elements * grad_bytes
        ar = ring_allreduce(inp.links.network, groups, node_bytes, elements, eff, links=inp.links)
        reduce(holders, ar, node_bytes, True)
    tied = _tied_allreduce(plan, inp.model, inp) if cal.tied_allreduce else None
    if tied is not None:
        reduce(*tied, False)
    return ready, sync_of


def _loss_allreduce_s(inp: _Inputs, pipelines: Sequence[Pipeline], ranks: RankTiming) -> float:
    """The loss all-reduce over every rank after the optimizer step, if the calibration says
    the framework runs one: it is the iteration's barrier."""
    if not inp.cal.loss_allreduce:
        return 0.0
    everyone = [s.replica for p in pipelines for s in p.stages for _ in range(s.replica.tp)]
    eff = min(inp.gcal(g).network_efficiency for g in dict.fromkeys(r.gpu_type for r in everyone))
    loss_ar = ring_allreduce(inp.links.network, everyone, _LOSS_BYTES, 1.0, eff, links=inp.links)
    inp.notes.add(*loss_ar.notes)
    return ranks.loss_allreduce_s(loss_ar, len(everyone), _LOSS_BYTES)


def _memory(
    inp: _Inputs, pipelines: Sequence[Pipeline], kinds: list[PipelineKind]
) -> tuple[list[dict[str, object]], list[MemoryBreakdown]]:
    """Every stage's memory rows (unvalidated), and the distinct validated breakdowns.

    Stages of alike pipelines at the same place share one validated breakdown; the Estimate
    validates every stage's copy (with its own indices) in one pass.
    """
    memory: list[dict[str, object]] = []
    mem_of: dict[tuple[int, int, int, bool], dict[str, object]] = {}
    distinct: list[MemoryBreakdown] = []
    for pi, (p, kind) in enumerate(zip(pipelines, kinds, strict=True)):
        for si, s in enumerate(p.stages):
            g = s.replica.gpu_type
            spec = spec_of(inp.specs, g)
            in_flight = min(p.depth - si, p.num_microbatches)
            mkey = (id(kind), si, in_flight, s.recompute)
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
                )
                distinct.append(one)
                mb = mem_of[mkey] = one.model_dump()
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
    end: dict[_Rank, float],
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


def _stage_times(kinds: list[PipelineKind], sync_of: dict[_Rank, float]) -> list[dict[str, object]]:
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


def _segments(
    plan: Plan, kinds: list[PipelineKind]
) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """``plan.segments()`` as (first layer, last layer, holders), from the distinct pipelines.

    The common refinement of the partitions: every stage starts a segment, and a segment
    lies inside one stage of each pipeline.
    """
    cuts: set[int] = set()
    for kind in {id(k): k for k in kinds}.values():
        cuts.update(
            i
            for i, si in enumerate(kind.stage_of_layer)
            if i == 0 or si != kind.stage_of_layer[i - 1]
        )
    bounds = [*sorted(cuts), plan.num_layers]
    return [
        (a, b - 1, [(pi, kind.stage_of_layer[a]) for pi, kind in enumerate(kinds)])
        for a, b in itertools.pairwise(bounds)
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


def _replace(st: _Stage, *, send_f: float, send_b: float) -> _Stage:
    return _Stage(f=st.f, b=st.b, u=st.u, send_f=send_f, send_b=send_b, sizes=st.sizes, fw=st.fw)


_NO_FRAMEWORK_TIME = FrameworkTime(gpu_type="*", source="none measured")


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
    plan: Plan, model: ModelSpec, inp: _Inputs
) -> tuple[list[tuple[int, int]], AllReduce, float] | None:
    """The tied embedding gradient's all-reduce among the stages holding the embedding or the
    head (megatron_patch's last sync group): its holders, its time and the bytes per node;
    None without one.

    With ``vocab_parallel`` the ``vocab x hidden`` matrix is split over a stage's TP ranks and
    reduced in ``T`` chunk groups (``T`` the largest TP degree among the holders), one
    ``V·h/T`` chunk per rank each, as a segment's TP-sharded parameters are: a node moves the
    whole matrix once, and a GPU of a TP-``t`` holder ``V·h/t``. Without it the matrix is
    replicated on the TP ranks of a stage, each reducing it whole. The ring is modelled over
    the stages' nodes, as for a segment.
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
    if inp.cal.vocab_parallel:
        node_bytes = n_el * _grad_bytes(model, inp.cal)
        # a TP-t holder's GPU takes part in T/t chunk groups in turn: V·h/t elements, the
        # most on the smallest TP degree (what a per-GPU ring moves)
        n_el /= min(g.tp for g in groups)
    else:
        node_bytes = max(g.tp for g in groups) * n_el * _grad_bytes(model, inp.cal)
    eff = min(inp.gcal(g).network_efficiency for g in dict.fromkeys(r.gpu_type for r in groups))
    if inp.cal.ring_links == "per_gpu":
        groups, node_bytes = _per_gpu(groups, {}), n_el * _grad_bytes(model, inp.cal)
    return (
        holders,
        ring_allreduce(inp.links.network, groups, node_bytes, n_el, eff, links=inp.links),
        node_bytes,
    )


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
    (compute peak of analytic estimates, estimated layer sizes, model state)."""
    if model.precision == precision:
        return model
    return model.model_copy(update={"precision": precision})


def _grad_bytes(model: ModelSpec, cal: Calibration) -> int:
    """Bytes per gradient element in the gradient all-reduces: the engine reduces its fp32
    gradients (autocast); DeepSpeed's FP16_Optimizer reduces the 16-bit ones."""
    if cal.grad_allreduce_bytes is not None:
        return cal.grad_allreduce_bytes
    if cal.mixed_precision == "autocast":
        return GRAD_ALLREDUCE_BYTES
    return model.param_bytes()


def _overhead(gcal: GPUCalibration, profiles: ProfileDB, gpu_type: str, tp: int) -> int:
    """Non-tensor memory: calibration, else the profile's measured overhead, else 1 GiB;
    plus the calibration's extra for a GPU in a TP group."""
    extra = gcal.memory_overhead_tp_bytes if tp > 1 else 0
    if gcal.memory_overhead_bytes is not None:
        return gcal.memory_overhead_bytes + extra
    o = profiles.overhead(gpu_type, tp)
    return (o.bytes if o is not None else DEFAULT_MEMORY_OVERHEAD_BYTES) + extra


def _per_gpu(groups: list[ReplicaGroup], memo: dict[int, ReplicaGroup]) -> list[ReplicaGroup]:
    """``groups`` as 1-GPU VMs of their type and zone (``Calibration.ring_links='per_gpu'``,
    the original artifact's ring: each rank's ring over a 1-GPU VM's link curve)."""
    out = []
    for r in groups:
        one = memo.get(id(r))
        if one is None:
            one = memo[id(r)] = r.model_copy(update={"gpus_per_node": 1, "tp": 1})
        out.append(one)
    return out
