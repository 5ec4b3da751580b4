"""Cost tables: what the simulator's cost functions say about every layer and link.

*Estimate, then solve*: before any search, the planner asks the simulator's own lookup
(:func:`sailor.simulator.lookup.layer_table`, :func:`~sailor.simulator.lookup.layer_sizes`),
network model (:func:`~sailor.simulator.network_model.inter_curve`, ``tp_comm.tp_link``) and memory
model (:func:`sailor.simulator.memory.state_bytes_per_param`) for the per-layer time, size and
per-link transfer time of each (GPU type, TP degree, microbatch size) the pool can use, and
stores them as prefix sums. The search then prices any contiguous layer range on any stage in
O(1). The tables depend on the GPU types, zones and VM shapes of a pool, never on node
counts, so a replan after nodes join or leave reuses them (:mod:`sailor.planner.replan`).

Pure: values in, values out; the memo is owned by the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from sailor.schemas import (
    Calibration,
    Estimate,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Plan,
    PriceTable,
    ProfileDB,
    ReplicaGroup,
)
from sailor.schemas.calibration import DEFAULT_MEMORY_OVERHEAD_BYTES
from sailor.schemas.device_kind import spec_of
from sailor.schemas.precision import (
    GRAD_ALLREDUCE_BYTES,
    Precision,
    choose_precision,
    compute_bytes,
    wire_bytes,
)
from sailor.simulator.lookup import layer_sizes, layer_table
from sailor.simulator.memory import (
    communicator_memory,
    copied_params,
    held_output_bytes,
    state_bytes_per_param,
    weight_copy_bytes,
    weight_grad_bytes,
)
from sailor.simulator.network_model import inter_curve
from sailor.simulator.simulate import simulate
from sailor.simulator.tp_comm import TPLink, all_gather_s, spec_link_efficiency, tp_link

__all__ = [
    "CostTables",
    "FloatArray",
    "Inputs",
    "Kind",
    "LayerArrays",
]

FloatArray = npt.NDArray[np.float64]


def _working_sets(act: FloatArray, model: ModelSpec, vocab_parallel: bool) -> FloatArray:
    """The first backward's working set of a stage ending at each layer, per sample: the
    layer's activation bytes, twice the head's without a vocab-parallel head
    (:func:`sailor.simulator.memory.backward_working_set`)."""
    out = act.copy()
    if not vocab_parallel:
        out[model.num_all_layers - 1] *= 2
    return out


@dataclass(frozen=True)
class Inputs:
    """Everything the simulator needs besides the plan."""

    model: ModelSpec
    profiles: ProfileDB
    network: NetworkProfile
    prices: PriceTable
    gpu_specs: Mapping[str, GPUSpec]
    calibration: Calibration = field(default_factory=Calibration)
    spot: bool | None = None
    """None: each pool entry's own spot flag; True/False: every GPU at spot/on-demand rates."""
    precision: Precision | None = None
    """The job's precision, a constraint: every plan is priced and recorded in it, and GPU
    types that cannot run it are left out of the pool (:mod:`sailor.planner.job_precision`).
    None: not fixed yet (a job's first plan): each plan derives its own from its GPU types
    and the model spec's request (:func:`~sailor.schemas.precision.choose_precision`)."""

    def simulate(self, plan: Plan, calibration: Calibration | None = None) -> Estimate:
        """``plan`` simulated on these inputs (closed form), in ``calibration`` if given (a
        corner's), else in theirs; ``spot=None`` prices each replica group by its own flag,
        else on demand."""
        return simulate(
            plan,
            self.model,
            self.profiles,
            self.network,
            self.prices,
            calibration=self.calibration if calibration is None else calibration,
            gpu_specs=self.gpu_specs,
            spot=bool(self.spot),
        )


@dataclass(frozen=True, order=True)
class Kind:
    """What a stage runs on: GPU type, TP degree, zone and VM shape."""

    gpu_type: str
    tp: int
    zone: str
    gpus_per_node: int

    def __hash__(self) -> int:
        # the hash a frozen dataclass computes, kept: kinds key most of the planner's tables
        # and ring memos, and the generated __hash__ rebuilt the field tuple every time
        h: int | None = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.gpu_type, self.tp, self.zone, self.gpus_per_node))
            object.__setattr__(self, "_hash", h)
        return h

    def replica(self) -> ReplicaGroup:
        """The replica group (one validated instance per kind)."""
        r = self.__dict__.get("_replica")
        if r is None:
            r = ReplicaGroup(
                gpu_type=self.gpu_type, zone=self.zone, tp=self.tp, gpus_per_node=self.gpus_per_node
            )
            object.__setattr__(self, "_replica", r)
        return r


@dataclass(frozen=True)
class LayerArrays:
    """Prefix sums over layers for one (GPU type, TP, microbatch size); index ``l`` = layers < l."""

    gpu_type: str
    tp: int
    mbs: int
    comp: FloatArray  # fwd + bwd per microbatch
    upd: FloatArray  # optimizer step
    params: FloatArray  # parameters per GPU
    act: FloatArray  # activation bytes per sample per GPU
    act_layer: FloatArray  # per layer: activation bytes per sample
    per_mb: FloatArray  # bytes per microbatch in flight (autocast weight copies)
    held_out: FloatArray  # per layer: output bytes per sample held if a stage ends there
    grad_t: FloatArray  # per layer: its backward's weight-gradient transient (bytes)
    out_layer: FloatArray  # per layer: bytes per sample sent to the next stage
    estimated: bool

    def stage_compute(self) -> FloatArray:
        """``C[i, j]`` = fwd+bwd of layers i..j per microbatch (inf where j < i); computed
        once per table (callers must not modify it)."""
        hit = self.__dict__.get("_stage_compute")
        if hit is None:
            c = self.comp[None, 1:] - self.comp[:-1, None]
            n = len(self.comp) - 1
            hit = np.where(np.triu(np.ones((n, n), dtype=bool)), c, np.inf)
            object.__setattr__(self, "_stage_compute", hit)
        out: FloatArray = hit
        return out

    def prefix_lists(self) -> tuple[list[float], list[float], list[float]]:
        """``comp``, ``upd`` and ``params`` as Python floats (same values), computed once:
        assembling a template reads a few entries per stage, where a numpy scalar costs
        more than the arithmetic."""
        hit = self.__dict__.get("_prefix_lists")
        if hit is None:
            hit = (self.comp.tolist(), self.upd.tolist(), self.params.tolist())
            object.__setattr__(self, "_prefix_lists", hit)
        out: tuple[list[float], list[float], list[float]] = hit
        return out


class CostTables:
    """Memo of layer arrays, link times and memory constants for one set of inputs.

    Filled lazily; reused by :func:`sailor.planner.replan.replan` for a changed pool.
    """

    def __init__(self, inputs: Inputs) -> None:
        self.inputs = inputs
        self._arrays: dict[tuple[str, int, int], LayerArrays] = {}
        self._links: dict[tuple[Kind, Kind, int], tuple[FloatArray, FloatArray]] = {}
        self._link_totals: dict[tuple[Kind, Kind, int], list[float]] = {}
        self._failed: dict[tuple[str, int, int], str] = {}
        self._mem: dict[tuple[str, int, int], FloatArray] = {}
        self._models: dict[str, ModelSpec] = {}
        self.notes: list[str] = []
        m = inputs.model
        self.mask_bytes = (
            float(2 * m.seq_length**2) if inputs.calibration.sends_attention_mask else 0.0
        )
        # bytes per gradient element in the gradient all-reduces, as the simulator prices them
        cal = inputs.calibration
        self.grad_bytes = (
            cal.grad_allreduce_bytes
            if cal.grad_allreduce_bytes is not None
            else GRAD_ALLREDUCE_BYTES
            if cal.mixed_precision == "autocast"
            else m.param_bytes()
        )
        self.hits = 0
        self.misses = 0

    # -- precision ---------------------------------------------------------------------
    def model_on(self, gpu_type: str) -> ModelSpec:
        """The model at the precision a job on ``gpu_type`` alone runs in: the job's
        (``inputs.precision``) once it is fixed.

        The tables are per GPU type and outlive a pool, so before the job's precision is
        fixed they price each type at its own precision; a plan mixing types runs one
        precision for all (Plan.precision). bf16 and fp16 cost the same bytes and, on
        catalog GPUs with both, the same peak; only fp32 differs, and the plans the search
        returns are re-simulated at their own precision.
        """
        m = self._models.get(gpu_type)
        if m is None:
            base = self.inputs.model
            prec = self.inputs.precision or choose_precision(
                (gpu_type,), self.inputs.gpu_specs, base.precision
            )
            m = base if prec == base.precision else base.model_copy(update={"precision": prec})
            self._models[gpu_type] = m
        return m

    def state_bytes(self, gpu_type: str) -> tuple[float, float, float]:
        """(model state, step transient, autocast copy) bytes per parameter on ``gpu_type``."""
        m = self.model_on(gpu_type)
        scheme = self.inputs.calibration.mixed_precision
        w, g, o, step = state_bytes_per_param(m, scheme)
        return float(w + g + o), float(step), float(weight_copy_bytes(m, 1, scheme))

    def wire_scale(self, gpu_type: str) -> float:
        """Wire bytes per byte of a profiled output size on ``gpu_type`` (as the simulator:
        profiled sizes are in the model spec's precision, the wire in the plan's)."""
        m = self.model_on(gpu_type)
        return wire_bytes(m.precision) / compute_bytes(self.inputs.model.precision)

    # -- layers ------------------------------------------------------------------------
    def arrays(self, gpu_type: str, tp: int, mbs: int) -> LayerArrays | None:
        """Layer arrays, or None when the simulator cannot price this configuration."""
        key = (gpu_type, tp, mbs)
        hit = self._arrays.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        if key in self._failed:
            return None
        self.misses += 1
        inp = self.inputs
        why = inp.model.tp_problem(tp)
        if why is not None:  # priced or not, the engine cannot build the stage
            self._failed[key] = why
            return None
        try:
            model = self.model_on(gpu_type)
            costs = layer_table(
                inp.profiles,
                model,
                inp.calibration.for_gpu(gpu_type),
                inp.gpu_specs,
                gpu_type,
                tp,
                mbs,
                inp.calibration.vocab_parallel,
                inp.calibration.activations,
                inp.network,
                inp.calibration.mixed_precision,
            )
            cal = inp.calibration
            sizes, _ = layer_sizes(inp.profiles, model, tp, cal.vocab_parallel, cal.activations)
        except (KeyError, ValueError) as exc:
            self._failed[key] = str(exc)
            return None
        comp = np.array([c.fwd_s + c.bwd_s for c in costs.layers])
        upd = np.array([c.update_s for c in costs.layers])
        params = np.array([float(s.params) for s in sizes])
        act = np.array([float(s.activation_bytes_per_sample) for s in sizes])
        copy_per_param = self.state_bytes(gpu_type)[2]
        per_mb = np.array(
            [
                max(
                    copy_per_param * copied_params(model, s.layer, s.params),
                    float(s.per_microbatch_bytes),
                )
                for s in sizes
            ]
        )
        scale = self.wire_scale(gpu_type)
        out = np.array(
            [
                float(s.output_bytes_per_sample) * (1.0 if s.source == "estimated" else scale)
                for s in sizes
            ]
        )
        z = np.zeros(1)
        arr = LayerArrays(
            gpu_type=gpu_type,
            tp=tp,
            mbs=mbs,
            comp=np.concatenate([z, np.cumsum(comp)]),
            upd=np.concatenate([z, np.cumsum(upd)]),
            params=np.concatenate([z, np.cumsum(params)]),
            act=np.concatenate([z, np.cumsum(act)]),
            act_layer=_working_sets(act, model, inp.calibration.vocab_parallel),
            held_out=np.array(
                [
                    float(held_output_bytes(model, layer, inp.calibration.mixed_precision))
                    for layer in range(model.num_all_layers)
                ]
            ),
            per_mb=np.concatenate([z, np.cumsum(per_mb)]),
            grad_t=np.array(
                [
                    float(
                        weight_grad_bytes(model, layer, tp, cal.vocab_parallel, cal.mixed_precision)
                    )
                    for layer in range(model.num_all_layers)
                ]
            ),
            out_layer=out,
            estimated=costs.estimated or any(s.source == "estimated" for s in sizes),
        )
        self._arrays[key] = arr
        return arr

    def failure(self, gpu_type: str, tp: int, mbs: int) -> str | None:
        return self._failed.get((gpu_type, tp, mbs))

    # -- memory --------------------------------------------------------------------------
    def capacity(self, gpu_type: str) -> float:
        spec = spec_of(self.inputs.gpu_specs, gpu_type)
        return float(spec.memory_bytes) if spec is not None else float("inf")

    def overhead(self, gpu_type: str, tp: int) -> float:
        """Non-tensor memory, as the simulator takes it, with the NCCL communicators every
        rank holds whatever the plan (the world group's, and its TP group's at TP > 1): the
        gradient-sync groups depend on the whole plan, so the simulator, which re-prices the
        plans the search returns, counts them (``simulator.communicators``)."""
        c = self.inputs.calibration.for_gpu(gpu_type)
        extra = float(c.memory_overhead_tp_bytes) if tp > 1 else 0.0
        extra += communicator_memory(1 + (tp > 1), c.communicator_bytes, c.communicators_covered)
        if c.memory_overhead_bytes is not None:
            return float(c.memory_overhead_bytes) + extra
        o = self.inputs.profiles.overhead(gpu_type, tp)
        base = float(o.bytes) if o is not None else float(DEFAULT_MEMORY_OVERHEAD_BYTES)
        return base + extra

    def stage_memory(self, a: LayerArrays, in_flight: int) -> FloatArray:
        """``M[i, j]``: peak bytes of a stage of layers i..j holding ``in_flight`` microbatches.

        The same formula as :func:`sailor.simulator.memory.stage_memory` (no recomputation),
        vectorized over every layer range; a test checks the two agree.
        """
        out: FloatArray = self.stage_memory_upto(a, in_flight)[in_flight]
        return out

    def stage_memory_upto(self, a: LayerArrays, in_flight: int) -> FloatArray:
        """:meth:`stage_memory` for every in-flight count from 0 to at least ``in_flight``
        (first axis), computed at once: the template DP asks for every count up to the
        depth of each of its layer arrays."""
        key = (a.gpu_type, a.tp, a.mbs)
        hit = self._mem.get(key)
        if hit is not None and in_flight < len(hit):
            return hit
        n = len(a.comp) - 1
        flights = np.arange(max(in_flight, n) + 1, dtype=np.float64)[:, None, None]
        kappa = self.inputs.calibration.for_gpu(a.gpu_type).alloc_factor
        params = a.params[None, 1:] - a.params[:-1, None]
        acts_kept = a.act[None, 1:] - a.act[:-1, None]
        # the engine holds a stage's output until its backward (none after the last layer)
        held = a.held_out[None, :]
        acts = np.floor(
            kappa * (a.mbs * (acts_kept + held) * flights + a.mbs * a.act_layer[None, :])
        )
        copies = (a.per_mb[None, 1:] - a.per_mb[:-1, None]) * flights
        # the weight-gradient transient of a stage's last layer; on a stage from the embedding,
        # the embedding's once the later layers' activations of its microbatch are freed
        # (memory.backward_transient)
        grad_t = np.repeat(a.grad_t[None, :], len(a.grad_t), axis=0)
        freed = a.mbs * (a.act[1:] - a.act[1])
        grad_t[0, 1:] = np.maximum(a.grad_t[1:], a.grad_t[0] - freed[1:])
        state_b, step_b, _ = self.state_bytes(a.gpu_type)
        state = params * state_b
        total = np.maximum(state + acts + copies + grad_t, state + params * step_b)
        extra = self.inputs.calibration.extra_state_bytes_per_param
        if extra:
            total = total + np.floor(extra * params)
        out: FloatArray = total + self.overhead(a.gpu_type, a.tp)
        self._mem[key] = out
        return out

    # -- links ---------------------------------------------------------------------------
    def link(self, a: Kind, b: Kind, mbs: int) -> tuple[FloatArray, FloatArray]:
        """Blocking forward and backward transfer time after each layer, from ``a`` to ``b``.

        Mirrors the simulator: the sender node ships its output (its size at the sender's TP
        degree) plus one attention mask per TP rank over the inter-node curve, derated by the
        p2p efficiency, plus the fixed cost per transfer; a receiver with TP > 1 all-gathers
        the output inside its node.
        """
        key = (a, b, mbs)
        hit = self._links.get(key)
        if hit is not None:
            return hit
        # the sender's output at its own TP degree, as the simulator sends it: a size
        # estimated at the receiver's TP may differ from the sender's profiled one (the
        # receiver's was read until 2026-11-28, 0.08-1.8 % off on 4-GPU nodes)
        arr = self.arrays(a.gpu_type, a.tp, mbs)
        if arr is None:
            raise KeyError(f"no layer table for the sender {a}")
        inp = self.inputs
        ra, rb = a.replica(), b.replica()
        curve, note = inter_curve(inp.network, ra, rb)
        if note:
            self.notes.append(note)
        etas, fixed = inp.calibration.p2p_link(a.gpu_type, b.gpu_type)
        eff = etas.on(curve.max_gbps)
        copies = self.p2p_copies(a, b)
        # one copy crossing: the receiving TP group all-gathers it (stage b forward, a back)
        cal = inp.calibration

        def gather_link(k: Kind) -> TPLink | None:
            if k.tp <= 1 or copies is not None:
                return None
            eff = spec_link_efficiency(inp.gpu_specs, k.gpu_type, cal.for_gpu(k.gpu_type))
            return tp_link(inp.network, inp.gpu_specs, k.gpu_type, k.tp, eff)

        glink_f, glink_b = gather_link(b), gather_link(a)
        tf = np.empty(len(arr.out_layer))
        tb = np.empty(len(arr.out_layer))
        of_size: dict[float, tuple[float, float]] = {}  # most layers send the same bytes
        for j, per_sample in enumerate(arr.out_layer.tolist()):
            hit_j = of_size.get(per_sample)
            if hit_j is None:
                out = mbs * per_sample
                gather_f = all_gather_s(glink_f, out, b.tp) if glink_f is not None else 0.0
                gather_b = all_gather_s(glink_b, out, a.tp) if glink_b is not None else 0.0
                fwd, bwd = (out, out) if copies is None else (copies[0] * out, copies[1] * out)
                hit_j = of_size[per_sample] = (
                    fixed + curve.transfer_time(fwd + a.tp * self.mask_bytes) / eff + gather_f,
                    fixed + curve.transfer_time(bwd) / eff + gather_b,
                )
            tf[j], tb[j] = hit_j
        self._links[key] = (tf, tb)
        return tf, tb

    def link_total(self, a: Kind, b: Kind, mbs: int) -> list[float]:
        """Forward plus backward blocking transfer time after each layer, from ``a`` to
        ``b`` (:meth:`link`, summed), as Python floats; computed once per link."""
        key = (a, b, mbs)
        hit = self._link_totals.get(key)
        if hit is None:
            tf, tb = self.link(a, b, mbs)
            hit = self._link_totals[key] = (tf + tb).tolist()
        return hit

    def p2p_copies(self, a: Kind, b: Kind) -> tuple[int, int] | None:
        """Copies of the activation (forward) and of its gradient (backward) that cross the
        link from ``a`` to ``b`` under ``Calibration.p2p_across_tp='full_copies'``; None when
        one copy crosses and a TP receiver all-gathers it (as the simulator)."""
        if self.inputs.calibration.p2p_across_tp == "full_copies" and (a.tp > 1 or b.tp > 1):
            return b.tp, a.tp
        return None

    def price_per_s(self, gpu_type: str, zone: str) -> float:
        """On-demand unless ``spot=True`` (the search prices a pool through ``GpuPricing``)."""
        return self.inputs.prices.gpu_hour(gpu_type, zone, bool(self.inputs.spot)) / 3600.0
