"""The cost model's uncertainty set: a few deterministic corners, and a plan's interval over them.

A GPU type without measurements has no known per-layer hook cost, network efficiency, fixed
sync cost, allocator factor, non-tensor memory or bytes per NCCL communicator (priced for each
one a rank holds beyond the ``communicators_covered`` the non-tensor memory already holds; the
``original`` corner has none): the catalog gives each a range with its
evidence (``Calibration.prior``); a calibrated type narrows to its fit's leave-one-out spread
(``GPUCalibration.spread``). What a deployment decides (gradient dtype on the wire, how an
activation crosses a TP boundary, the ring's links, model-state bytes) also varies. Rather
than sampling, the set is four corners, each a whole :class:`Calibration`:

* ``optimistic``: every constant at its cheap end; the cheapest deployment (DeepSpeed's
  FP16_Optimizer: 16-bit gradient all-reduce, no autocast copies; scatter + gather across TP).
* ``median``: every constant at its median; the configured deployment as it is (the
  built-in calibration prices Sailor's engine: autocast, scatter + gather across TP).
* ``pessimistic``: every constant at its costly end; the costlier choice wherever the
  deployments of the set differ: fp32 gradients on the wire, and each of the receiver's TP
  ranks taking a full copy of the activation across a TP boundary (``full_copies``: the
  engine before it sent slices, a DeepSpeed pipe engine with ``pipe_partitioned`` off; the
  measured GH200 pipelined runs read a p2p efficiency of 0.43 under it, with 0.77 ms per
  transfer, against the prior's 0.19 and 1.7 ms at this end, docs section 2).
* ``original``: the original Sailor artifact's cost model (docs ORIGINAL.md): nothing
  calibrated (efficiency 1, no hook correction, no fixed sync cost), fp32 gradients in a ring
  per GPU over a 1-GPU VM's link curve, one copy of the activation per stage boundary, 24 B
  of model state per parameter and 2 GB (3 GB with TP) of non-tensor memory.

What an estimated block keeps for its backward (``Calibration.activations``: Sailor's engine
or Megatron without flash attention) is the configured deployment's in the first three
corners, not a range: it is what that engine does, and which count is larger depends on the
model (the seq x seq term against the engine's fp32 norm inputs and per-linear casts); the
``original`` corner counts Megatron's.

Each corner is monotone in cost within its structure, so the least and largest iteration time
of a plan over the four bound what the ranges allow for that plan only up to the structures
listed; the set is what the evidence names, not every possibility.

Pure: values in, values out; :func:`corners` is memoized on the (frozen) calibration.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from functools import lru_cache

from sailor.schemas import (
    Calibration,
    ConstantRange,
    CornerFigures,
    Estimate,
    EstimateInterval,
    GPUCalibration,
    GPUPrior,
    GPUSpec,
    Interval,
    ModelSpec,
    NetworkProfile,
    Plan,
    PriceTable,
    ProfileDB,
)
from sailor.simulator.rank_timing import Method
from sailor.simulator.simulate import simulate

__all__ = [
    "CORNERS",
    "MEDIAN",
    "ORIGINAL_MEMORY_OVERHEAD_BYTES",
    "ORIGINAL_TP_OVERHEAD_BYTES",
    "corners",
    "interval_of",
    "simulate_corners",
    "simulate_interval",
]

CORNERS = ("optimistic", "median", "pessimistic", "original")
"""The corners, in the order every interval lists them."""

MEDIAN = "median"

ORIGINAL_MEMORY_OVERHEAD_BYTES = 2_000_000_000
"""The original artifact's fixed memory overhead at TP 1 (2 GB; ORIGINAL.md, Memory)."""

ORIGINAL_TP_OVERHEAD_BYTES = 1_000_000_000
"""... and 1 GB more with TP > 1 (3 GB)."""

_ORIGINAL_EXTRA_STATE = 8.0
"""The original counts 24 B per parameter (Adam 8, fp32 weights 4, grads 4, 'comm' 4, extra
copies 4); DeepSpeed's FP16_Optimizer state is 16 (2 + 2 + 4 + 8): 8 more."""


def _end(r: ConstantRange, corner: str, costly_high: bool) -> float:
    """``r``'s value in ``corner``: its median, or the cheap or costly end (the costly end is
    ``high`` when a larger value costs more)."""
    if corner == MEDIAN:
        return r.median
    cheap = corner == "optimistic"
    return r.low if cheap == costly_high else r.high


def _constants(
    gpu_type: str, prior: GPUPrior, corner: str, source: str, base: GPUCalibration
) -> GPUCalibration:
    """``base`` with every fitted constant at ``corner``'s end of ``prior`` (its measured
    ``compute_scale``, and its ``p2p_fixed_s`` and TP link efficiencies in a range written
    before those constants existed, kept unless the prior has a range for them)."""
    scale = (
        base.compute_scale
        if prior.compute_scale is None
        else _end(prior.compute_scale, corner, True)
    )
    return base.model_copy(
        update={
            "compute_scale": scale,
            "gpu_type": gpu_type,
            # a larger hook correction, efficiency, removes time: cheap end is high
            "profiler_overhead_s": _end(prior.profiler_overhead_s, corner, False),
            "network_efficiency": _end(prior.network_efficiency, corner, False),
            "p2p_efficiency": _end(prior.p2p_efficiency, corner, False),
            # the links the efficiencies' ends were read on (a range written before this
            # existed: the type's own)
            "efficiency_link_gbps": (
                base.efficiency_link_gbps
                if prior.efficiency_link_gbps is None
                else prior.efficiency_link_gbps
            ),
            "p2p_fixed_s": (
                base.p2p_fixed_s
                if prior.p2p_fixed_s is None
                else _end(prior.p2p_fixed_s, corner, True)
            ),
            "tp_link_efficiency": (
                base.tp_link_efficiency
                if prior.tp_link_efficiency is None
                else _end(prior.tp_link_efficiency, corner, False)
            ),
            "tp_link_efficiency_pcie": (
                base.tp_link_efficiency_pcie
                if prior.tp_link_efficiency_pcie is None
                else _end(prior.tp_link_efficiency_pcie, corner, False)
            ),
            "sync_fixed_s": _end(prior.sync_fixed_s, corner, True),
            "alloc_factor": _end(prior.alloc_factor, corner, True),
            "memory_overhead_bytes": int(_end(prior.memory_overhead_bytes, corner, True)),
            "communicator_bytes": (
                base.communicator_bytes
                if prior.communicator_bytes is None
                else int(_end(prior.communicator_bytes, corner, True))
            ),
            "communicators_covered": (
                base.communicators_covered
                if prior.communicators_covered is None
                else prior.communicators_covered
            ),
            "source": f"{corner} corner of {source}",
            "spread": None,
        }
    )


def _original_constants(gpu_type: str, compute_scale: float = 1.0) -> GPUCalibration:
    """The original's constants; a measured ``compute_scale`` is kept: it is how fast the
    hardware is against its profile, not a modelling choice the original made. The original
    priced no TP degree it had not profiled: an estimated one's all-reduces take the default
    ``tp_link_efficiency`` (the prior's median), not an efficiency above the evidence."""
    return GPUCalibration(
        gpu_type=gpu_type,
        compute_scale=compute_scale,
        profiler_overhead_s=0.0,
        network_efficiency=1.0,
        p2p_efficiency=1.0,
        sync_fixed_s=0.0,
        alloc_factor=1.0,
        memory_overhead_bytes=ORIGINAL_MEMORY_OVERHEAD_BYTES,
        memory_overhead_tp_bytes=ORIGINAL_TP_OVERHEAD_BYTES,
        communicator_bytes=0,
        source="the original Sailor artifact's cost model: nothing calibrated",
    )


@lru_cache(maxsize=32)
def corners(cal: Calibration) -> tuple[tuple[str, Calibration], ...]:
    """The four corners of ``cal`` as (name, calibration), in :data:`CORNERS` order.

    Calibrated GPU types take their ``spread`` (else their point values in every corner but
    ``original``); the rest take ``cal.prior`` (else ``cal.default`` in every corner).
    """
    out: list[tuple[str, Calibration]] = []
    for corner in CORNERS:
        if corner == "original":
            c = cal.model_copy(
                update={
                    "gpus": tuple(
                        _original_constants(g.gpu_type, g.compute_scale) for g in cal.gpus
                    ),
                    "default": _original_constants("*", cal.default.compute_scale),
                    "mixed_precision": "fp16_optimizer",
                    "grad_allreduce_bytes": 4,
                    "ring_links": "per_gpu",
                    "p2p_across_tp": "scatter_gather",
                    "sends_attention_mask": False,
                    "extra_state_bytes_per_param": _ORIGINAL_EXTRA_STATE,
                    "blocking_p2p": True,
                    "tied_allreduce": False,
                    "loss_allreduce": False,
                    "vocab_parallel": True,
                    "activations": "megatron",
                }
            )
            out.append((corner, c))
            continue
        gpus = tuple(
            _constants(g.gpu_type, g.spread, corner, "its leave-one-out spread", g)
            if g.spread is not None
            else g
            for g in cal.gpus
        )
        default = (
            _constants("*", cal.prior, corner, "the catalog prior", cal.default)
            if cal.prior is not None
            else cal.default
        )
        update: dict[str, object] = {"gpus": gpus, "default": default}
        if corner == "optimistic":
            update.update(
                mixed_precision="fp16_optimizer",
                grad_allreduce_bytes=None,
                p2p_across_tp="scatter_gather",
                sends_attention_mask=False,
                extra_state_bytes_per_param=0.0,
                vocab_parallel=True,
            )
        elif corner == "pessimistic":
            # the costlier choice where deployments differ: full copies across a TP boundary
            # (at the prior's low p2p efficiency it charges the measured GH200 pipelined
            # runs more than they took, docs/simulator-model.md section 2), and
            # fp32 gradients on the wire for an autocast engine (an fp16_optimizer one keeps
            # its 16-bit all-reduce: that is what it does, not a range). The embedding and
            # head stay as the deployment holds them (both deployments of the catalog split
            # them by vocabulary: no range either)
            update.update(p2p_across_tp="full_copies")
            if cal.mixed_precision == "autocast":
                update.update(grad_allreduce_bytes=4)
        out.append((corner, cal.model_copy(update=update)))
    return tuple(out)


def interval_of(figures: Mapping[str, Estimate]) -> EstimateInterval:
    """The interval of one plan from its estimate in each corner (``figures`` in set order;
    the median corner's value is the median, else the median over the corners)."""
    rows = tuple(
        CornerFigures(
            corner=name,
            iteration_time_s=e.iteration_time_s,
            throughput_iter_s=e.throughput_iter_s,
            cost_per_iter_usd=e.cost_per_iter_usd,
            peak_memory_bytes=e.peak_memory_bytes,
            fits_in_memory=e.fits_in_memory,
        )
        for name, e in figures.items()
    )

    def span(attr: str) -> Interval:
        xs = [float(getattr(r, attr)) for r in rows]
        mid = figures.get(MEDIAN)
        return Interval(
            low=min(xs),
            median=float(getattr(mid, attr)) if mid is not None else statistics.median(xs),
            high=max(xs),
        )

    return EstimateInterval(
        corners=rows,
        iteration_time_s=span("iteration_time_s"),
        throughput_iter_s=span("throughput_iter_s"),
        cost_per_iter_usd=span("cost_per_iter_usd"),
        peak_memory_bytes=span("peak_memory_bytes"),
        fits_in_memory=all(r.fits_in_memory for r in rows),
    )


def simulate_interval(
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
) -> tuple[Estimate, EstimateInterval]:
    """:func:`simulate` in every corner of ``calibration``: the median corner's estimate
    (with its breakdowns) and the interval. Four simulations."""
    est = simulate_corners(
        plan,
        model,
        profiles,
        network,
        prices,
        calibration=calibration,
        gpu_specs=gpu_specs,
        method=method,
        spot=spot,
    )
    return est[MEDIAN], interval_of(est)


def simulate_corners(
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
    known: Mapping[str, Estimate] | None = None,
) -> dict[str, Estimate]:
    """:func:`simulate` in every corner of ``calibration``, by corner name (in
    :data:`CORNERS`' order); a corner's estimate in ``known`` is taken as it is."""
    out: dict[str, Estimate] = {}
    for name, cal in corners(Calibration() if calibration is None else calibration):
        hit = (known or {}).get(name)
        out[name] = hit or simulate(
            plan,
            model,
            profiles,
            network,
            prices,
            calibration=cal,
            gpu_specs=gpu_specs,
            method=method,
            spot=spot,
        )
    return out
