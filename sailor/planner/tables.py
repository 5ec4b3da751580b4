"""Cost tables: what the simulator's cost functions say about every layer and link.

*Estimate, then solve*: before any search, the planner asks the simulator's own lookup
(:func:`sailor.simulator.lookup.layer_table`, :func:`~sailor.simulator.lookup.layer_sizes`),
network model (:func:`~sailor.simulator.network_model.inter_curve`, ``intra_curve``) and memory
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
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    PriceTable,
    ProfileDB,
    ReplicaGroup,
)
from sailor.schemas.calibration import DEFAULT_MEMORY_OVERHEAD_BYTES
from sailor.simulator.lookup import layer_sizes, layer_table
from sailor.simulator.memory import state_bytes_per_param
from sailor.simulator.network_model import inter_curve, intra_curve

__all__ = ["CostTables", "Inputs", "Kind", "LayerArrays"]

FloatArray = npt.NDArray[np.float64]


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


@dataclass(frozen=True, order=True)
class Kind:
    """What a stage runs on: GPU type, TP degree, zone and VM shape."""

    gpu_type: str
    tp: int
    zone: str
    gpus_per_node: int

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
    out_layer: FloatArray  # per layer: output bytes per sample
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


class CostTables:
    """Memo of layer arrays, link times and memory constants for one set of inputs.

    Filled lazily; reused by :func:`sailor.planner.replan.replan` for a changed pool.
    """

    def __init__(self, inputs: Inputs) -> None:
        self.inputs = inputs
        self._arrays: dict[tuple[str, int, int], LayerArrays] = {}
        self._links: dict[tuple[Kind, Kind, int], tuple[FloatArray, FloatArray]] = {}
        self._failed: dict[tuple[str, int, int], str] = {}
        self._mem: dict[tuple[str, int, int, int], FloatArray] = {}
        self.notes: list[str] = []
        m = inputs.model
        w, g, o, step = state_bytes_per_param(m)
        self.state_bytes = float(w + g + o)
        self.step_bytes = float(step)
        self.mask_bytes = (
            float(2 * m.seq_length**2) if inputs.calibration.sends_attention_mask else 0.0
        )
        self.hits = 0
        self.misses = 0

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
        try:
            costs = layer_table(
                inp.profiles,
                inp.model,
                inp.calibration.for_gpu(gpu_type),
                inp.gpu_specs,
                gpu_type,
                tp,
                mbs,
            )
            sizes, _ = layer_sizes(inp.profiles, inp.model, tp)
        except (KeyError, ValueError) as exc:
            self._failed[key] = str(exc)
            return None
        comp = np.array([c.fwd_s + c.bwd_s for c in costs.layers])
        upd = np.array([c.update_s for c in costs.layers])
        params = np.array([float(s.params) for s in sizes])
        act = np.array([float(s.activation_bytes_per_sample) for s in sizes])
        out = np.array([float(s.output_bytes_per_sample) for s in sizes])
        z = np.zeros(1)
        arr = LayerArrays(
            gpu_type=gpu_type,
            tp=tp,
            mbs=mbs,
            comp=np.concatenate([z, np.cumsum(comp)]),
            upd=np.concatenate([z, np.cumsum(upd)]),
            params=np.concatenate([z, np.cumsum(params)]),
            act=np.concatenate([z, np.cumsum(act)]),
            act_layer=act,
            out_layer=out,
            estimated=costs.estimated or any(s.source == "estimated" for s in sizes),
        )
        self._arrays[key] = arr
        return arr

    def failure(self, gpu_type: str, tp: int, mbs: int) -> str | None:
        return self._failed.get((gpu_type, tp, mbs))

    # -- memory --------------------------------------------------------------------------
    def capacity(self, gpu_type: str) -> float:
        spec = self.inputs.gpu_specs.get(gpu_type)
        return float(spec.memory_bytes) if spec is not None else float("inf")

    def overhead(self, gpu_type: str, tp: int) -> float:
        """Non-tensor memory, as the simulator takes it."""
        c = self.inputs.calibration.for_gpu(gpu_type)
        if c.memory_overhead_bytes is not None:
            return float(c.memory_overhead_bytes)
        o = self.inputs.profiles.overhead(gpu_type, tp)
        return float(o.bytes) if o is not None else float(DEFAULT_MEMORY_OVERHEAD_BYTES)

    def stage_memory(self, a: LayerArrays, in_flight: int) -> FloatArray:
        """``M[i, j]``: peak bytes of a stage of layers i..j holding ``in_flight`` microbatches.

        The same formula as :func:`sailor.simulator.memory.stage_memory` (no recomputation),
        vectorized over every layer range; a test checks the two agree.
        """
        key = (a.gpu_type, a.tp, a.mbs, in_flight)
        hit = self._mem.get(key)
        if hit is not None:
            return hit
        kappa = self.inputs.calibration.for_gpu(a.gpu_type).alloc_factor
        params = a.params[None, 1:] - a.params[:-1, None]
        acts_kept = a.act[None, 1:] - a.act[:-1, None]
        acts = np.floor(kappa * (a.mbs * acts_kept * in_flight + a.mbs * a.act_layer[None, :]))
        state = params * self.state_bytes
        total = np.maximum(state + acts, state + params * self.step_bytes)
        out: FloatArray = total + self.overhead(a.gpu_type, a.tp)
        self._mem[key] = out
        return out

    # -- links ---------------------------------------------------------------------------
    def link(self, a: Kind, b: Kind, mbs: int) -> tuple[FloatArray, FloatArray]:
        """Blocking forward and backward transfer time after each layer, from ``a`` to ``b``.

        Mirrors the simulator: the sender node ships the output plus one attention mask per
        TP rank over the inter-node curve, derated by the network efficiency; a receiver
        with TP > 1 all-gathers the output inside its node.
        """
        key = (a, b, mbs)
        hit = self._links.get(key)
        if hit is not None:
            return hit
        arr = self.arrays(b.gpu_type, b.tp, mbs) or self.arrays(a.gpu_type, a.tp, mbs)
        if arr is None:
            raise KeyError(f"no layer table for {a} or {b}")
        inp = self.inputs
        ra, rb = a.replica(), b.replica()
        curve, note = inter_curve(inp.network, ra, rb)
        if note:
            self.notes.append(note)
        eff = min(
            inp.calibration.for_gpu(a.gpu_type).network_efficiency,
            inp.calibration.for_gpu(b.gpu_type).network_efficiency,
        )
        gcurve = intra_curve(inp.network, b.gpu_type, b.tp, inp.gpu_specs)[0] if b.tp > 1 else None
        tf = np.empty(len(arr.out_layer))
        tb = np.empty(len(arr.out_layer))
        for j, per_sample in enumerate(arr.out_layer):
            out = mbs * float(per_sample)
            gather = gcurve.transfer_time(out) if gcurve is not None else 0.0
            tf[j] = curve.transfer_time(out + a.tp * self.mask_bytes) / eff + gather
            tb[j] = curve.transfer_time(out) / eff + gather
        self._links[key] = (tf, tb)
        return tf, tb

    def price_per_s(self, gpu_type: str, zone: str) -> float:
        """On-demand unless ``spot=True`` (the search prices a pool through ``GpuPricing``)."""
        return self.inputs.prices.gpu_hour(gpu_type, zone, bool(self.inputs.spot)) / 3600.0
