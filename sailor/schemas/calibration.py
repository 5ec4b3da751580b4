"""Calibration constants of the simulator: one value per GPU type, each with its measurement.

The simulator models the training framework from first principles (profiles, link curves,
parameter counts). A few effects cannot be derived from a per-layer profile or a link probe;
each is one constant per GPU type (a GPU type's nodes form one cluster, so network constants
are per GPU type too). Every constant records the measurement it came from. GPU types
without a calibration use :attr:`Calibration.default`, whose values are physically motivated
and documented below; they are not fitted to any measured plan.

See ``docs/simulator-model.md`` for how each constant enters the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator, model_validator

from sailor.schemas._base import Frozen, field_error
from sailor.schemas.deployment import Deployment, DeploymentStructure
from sailor.schemas.device_kind import catalog_type

__all__ = [
    "DEFAULT_MEMORY_OVERHEAD_BYTES",
    "PCIE_LINK_EFFICIENCY",
    "SPEC_LINK_EFFICIENCY",
    "Calibration",
    "ConstantRange",
    "GPUCalibration",
    "GPUPrior",
    "LinkEta",
    "eta_on",
    "pcie_link",
]

DEFAULT_MEMORY_OVERHEAD_BYTES = 1 << 30
"""1 GiB of non-tensor memory per training process when nothing was measured: the CUDA
context with its loaded kernel modules (~0.3-0.5 GiB on Ampere/Hopper with lazy loading),
cuBLAS/cuDNN workspaces and NCCL communicator buffers (a few MiB per channel and peer)."""


SPEC_LINK_EFFICIENCY = 0.27
"""Fraction of the spec sheet's per-GPU intra-node bandwidth (NVLink, or any link but PCIe)
an estimated TP all-reduce reaches, when the network profile has no intra-node curve of the
GPU type: the median of the catalog prior's ``tp_link_efficiency`` (its evidence there)."""

PCIE_LINK_EFFICIENCY = 0.16
"""The same over a PCIe link (``pcie_link``): the median of the catalog prior's
``tp_link_efficiency_pcie``."""


def pcie_link(link: str) -> bool:
    """Whether a spec sheet's ``intra_node_link`` (``'PCIe4 x16'``, ``'PCI-e 3'``, ``'PCI
    Express 5'``; not ``'NVLink3'``, ``'shared memory'``) is PCIe."""
    return link.strip().lower().startswith("pci")


def eta_on(eta: float, ref_gbps: float | None, link_gbps: float) -> float:
    """An efficiency ``eta`` read on links of peak ``ref_gbps``, on a link of peak
    ``link_gbps``.

    The framework's shortfall against the probe is a throughput of its own, in series with
    the link (buffer copies, bucket flattening, kernel and host-side work per byte, waits that
    do not scale with the wire): a transfer takes ``bytes/B + bytes/R`` with
    ``R = ref·η/(1−η)``, so on a link of peak ``B`` the efficiency is ``R/(R+B) =
    1/(1 + (1/η − 1)·B/ref)``. On the link it was read on it is ``eta``; a slower link loses
    less of its bandwidth to the framework (a 1 Gb/s link ~0.5 %, where 0.2 was read at
    92 GB/s), a faster one more. ``ref_gbps`` None (or ``eta`` 1): ``eta`` on every link."""
    if ref_gbps is None or link_gbps == ref_gbps or eta >= 1.0:
        return eta  # as read (bit for bit on the links it was read on)
    if not link_gbps > 0 or math.isinf(link_gbps):
        return eta
    return 1.0 / (1.0 + (1.0 / eta - 1.0) * link_gbps / ref_gbps)


@dataclass(frozen=True)
class LinkEta:
    """The efficiency of a transfer or ring step among GPU types: each type's (η, the peak
    it was read at), the least of theirs on the link at hand (:func:`eta_on`). Hashable:
    the planner's memo keys hold it."""

    etas: tuple[tuple[float, float | None], ...]

    @classmethod
    def as_read(cls, eta: float) -> LinkEta:
        """``eta`` on every link, with no reference link to transport it from: a value meant
        as it is (the original artifact's η = 1, a test's fixed efficiency), not one read on
        links of some peak."""
        return cls(((eta, None),))

    def on(self, link_gbps: float) -> float:
        """The efficiency on a link of peak ``link_gbps`` GB/s."""
        return min(eta_on(e, ref, link_gbps) for e, ref in self.etas)


def _legacy_tp_link(data: Any, field: str) -> Any:
    """A calibration or prior written before the PCIe field existed: its one TP link value
    held for every link, PCIe too (what it meant when written)."""
    if isinstance(data, dict) and "tp_link_efficiency" in data and field not in data:
        return {**data, field: data["tp_link_efficiency"]}
    return data


class ConstantRange(Frozen):
    """What is known about one constant: a low, a median and a high value, and why.

    ``low <= median <= high`` in the constant's own units. Which end is pessimistic depends on
    the constant (a low network efficiency and a high allocator factor both cost more); the
    corners of :mod:`sailor.simulator.uncertainty` pick the end that costs more.
    """

    low: float = Field(description="Lowest value the evidence supports.")
    median: float = Field(description="Central value used by the median corner.")
    high: float = Field(description="Highest value the evidence supports.")
    evidence: str = Field(default="", description="The measurements, figures or physics behind it.")

    @model_validator(mode="after")
    def _ordered(self) -> ConstantRange:
        if not self.low <= self.median <= self.high:
            raise field_error(
                "low/median/high", (self.low, self.median, self.high), "must be ordered"
            )
        return self


class GPUPrior(Frozen):
    """Ranges of every constant calibration fits, for a GPU type without measurements (the
    catalog's prior) or around a calibrated type's fit (its leave-one-out spread)."""

    profiler_overhead_s: ConstantRange = Field(description="Profiler hook cost per layer, s.")
    network_efficiency: ConstantRange = Field(
        description="Fraction of the probed link bandwidth the gradient all-reduces reach."
    )
    p2p_efficiency: ConstantRange = Field(
        description="Fraction of the probed link bandwidth pipeline transfers reach."
    )
    efficiency_link_gbps: float | None = Field(
        default=None,
        gt=0,
        description="Peak bandwidth (GB/s) of the node links the network_efficiency and "
        "p2p_efficiency ranges were read on (GPUCalibration.efficiency_link_gbps); None: "
        "each end applies on every link as it is.",
    )
    p2p_fixed_s: ConstantRange | None = Field(
        default=None,
        description="Fixed cost of one pipeline transfer besides its bytes, s; None (a range "
        "written before this constant existed): the type's point value in every corner.",
    )
    tp_link_efficiency: ConstantRange | None = Field(
        default=None,
        description="Fraction of the spec sheet's intra-node link bandwidth an estimated TP "
        "all-reduce reaches (NVLink, any link but PCIe); None (a range written before this "
        "constant existed): the type's point value in every corner.",
    )
    tp_link_efficiency_pcie: ConstantRange | None = Field(
        default=None,
        description="The same over a PCIe link; None (a range written before it existed): "
        "the type's point value in every corner.",
    )
    sync_fixed_s: ConstantRange = Field(description="Fixed sync cost per iteration, s.")
    alloc_factor: ConstantRange = Field(
        description="Caching-allocator factor (reserved/allocated)."
    )
    memory_overhead_bytes: ConstantRange = Field(description="Non-tensor memory per GPU, bytes.")
    communicator_bytes: ConstantRange | None = Field(
        default=None,
        description="GPU memory of one NCCL communicator a rank holds, bytes; None (a range "
        "written before this constant existed): the type's point value in every corner.",
    )
    communicators_covered: int | None = Field(
        default=None,
        ge=0,
        description="How many NCCL communicators per rank the memory_overhead_bytes range "
        "holds (only those beyond are priced at communicator_bytes); None: the type's "
        "point value.",
    )
    compute_scale: ConstantRange | None = Field(
        default=None,
        description="Measured layer compute over profiled (online calibration); None: the "
        "type's point value in every corner.",
    )
    source: str = Field(default="", description="Where the ranges come from.")

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        return _legacy_tp_link(data, "tp_link_efficiency_pcie")

    @model_validator(mode="after")
    def _bounds(self) -> GPUPrior:
        for name in (
            "network_efficiency",
            "p2p_efficiency",
            "tp_link_efficiency",
            "tp_link_efficiency_pcie",
        ):
            r: ConstantRange | None = getattr(self, name)
            if r is not None and (r.low <= 0 or r.high > 1):
                raise field_error(name, (r.low, r.high), "an efficiency lies in (0, 1]")
        if self.alloc_factor.low < 1:
            raise field_error("alloc_factor.low", self.alloc_factor.low, "must be >= 1")
        for name in (
            "profiler_overhead_s",
            "p2p_fixed_s",
            "sync_fixed_s",
            "memory_overhead_bytes",
            "communicator_bytes",
        ):
            r = getattr(self, name)
            if r is not None and r.low < 0:
                raise field_error(f"{name}.low", r.low, "must be >= 0")
        if self.compute_scale is not None and self.compute_scale.low <= 0:
            raise field_error("compute_scale.low", self.compute_scale.low, "must be > 0")
        return self


class GPUCalibration(Frozen):
    """Constants for one GPU type (``gpu_type='*'`` for the default)."""

    gpu_type: str = Field(description="GPU type these constants belong to; '*' = default.")
    compute_scale: float = Field(
        default=1.0,
        gt=0,
        description=(
            "Measured over profiled forward and backward time of a layer on this GPU type: "
            "every profiled (or estimated) layer's fwd_s and bwd_s is multiplied by it, after "
            "the profiler-hook correction; nothing else (optimizer update, framework time, "
            "transfers) is. Fitted online from the running job's step reports "
            "(sailor.simulator.online_fit). Default 1.0: the profile is the truth."
        ),
    )
    profiler_overhead_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "CPU-side cost per layer (forward + backward) of the profiler's timing hooks, s. "
            "Removed from a layer's profiled time only while the layer is latency-bound. "
            "Default 0: the profile is taken at face value (an upper bound of training time)."
        ),
    )
    network_efficiency: float = Field(
        default=1.0,
        gt=0,
        le=1.0,
        description=(
            "Fraction of the probed link bandwidth the training framework's collectives and "
            "pipeline transfers reach. Default 1.0: the probe is taken as the truth."
        ),
    )
    p2p_efficiency: float | None = Field(
        default=None,
        gt=0,
        le=1.0,
        description=(
            "Fraction of the probed link bandwidth pipeline transfers reach. None: the same "
            "as network_efficiency (what a calibration from gradient reduce times gives)."
        ),
    )
    efficiency_link_gbps: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Peak bandwidth (GB/s) of the node links network_efficiency and p2p_efficiency "
            "were read on. On a link of peak B the simulator uses 1/(1 + (1/η − 1)·B/this): "
            "the framework's shortfall is a throughput of its own in series with the link "
            "(docs/simulator-model.md section 3), so a slower link keeps more of its "
            "bandwidth. None: each efficiency applies on every link as it is."
        ),
    )
    p2p_fixed_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Fixed cost of one pipeline transfer (each direction, each microbatch, each stage "
            "boundary) besides its bytes over the link: the pipeline engine's own work around "
            "a send (dispatch, buffer handling, the communicator's latency), s. Default 0."
        ),
    )
    tp_link_efficiency: float = Field(
        default=SPEC_LINK_EFFICIENCY,
        gt=0,
        le=1.0,
        description=(
            "Fraction of the spec sheet's per-GPU intra-node bandwidth the TP all-reduces of "
            "an estimated layer reach (a TP degree nobody profiled; a measured intra-node "
            "curve is taken as it is), over NVLink or any link but PCIe. Default "
            "SPEC_LINK_EFFICIENCY (0.27)."
        ),
    )
    tp_link_efficiency_pcie: float = Field(
        default=PCIE_LINK_EFFICIENCY,
        gt=0,
        le=1.0,
        description=(
            "The same over a PCIe link (the spec sheet's intra_node_link). Default "
            "PCIE_LINK_EFFICIENCY (0.16)."
        ),
    )
    sync_fixed_s: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Fixed cost per iteration between the last backward and the optimizer step "
            "(gradient flatten/unflatten, barrier, loss-scale overflow check), s. Default 0."
        ),
    )
    alloc_factor: float = Field(
        default=1.0,
        ge=1.0,
        description=(
            "Caching-allocator factor: reserved / allocated activation memory (what "
            "nvidia-smi reports over what tensors hold). Default 1.0: no fragmentation."
        ),
    )
    memory_overhead_bytes: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Non-tensor memory per GPU (context, NCCL buffers, allocator slack), bytes. "
            "None: take ProfileDB.overheads for the GPU type, else 1 GiB "
            "(DEFAULT_MEMORY_OVERHEAD_BYTES)."
        ),
    )
    communicator_bytes: int = Field(
        default=0,
        ge=0,
        description=(
            "GPU memory of one NCCL communicator (its channels' buffers and work queues), "
            "bytes, counted once per communicator a rank holds under the deployment's "
            "process groups (DeploymentStructure.process_groups) beyond the "
            "communicators_covered that memory_overhead_bytes holds. Default 0: not counted "
            "apart (a calibration written before it, whose M0 holds its runs' communicators)."
        ),
    )
    communicators_covered: int = Field(
        default=0,
        ge=0,
        description=(
            "How many NCCL communicators per rank memory_overhead_bytes already holds: the "
            "most the runs it was measured on held (counted under their deployment's process "
            "groups). Only the communicators a rank holds beyond it are priced at "
            "communicator_bytes each. Default 0: every one."
        ),
    )
    memory_overhead_tp_bytes: int = Field(
        default=0,
        ge=0,
        description=(
            "Extra non-tensor memory of a GPU in a TP group (TP > 1), bytes. 0 in the engine's "
            "model; the original artifact's memory model adds 1 GB (2 GB at TP 1, 3 GB above)."
        ),
    )
    source: str = Field(
        default="default: physically motivated, not fitted (docs/simulator-model.md)",
        description="Measurements these constants were derived from.",
    )
    spread: GPUPrior | None = Field(
        default=None,
        description=(
            "The constants' leave-one-out spread (each constant refitted without each measured "
            "run): the range the uncertainty corners use for this calibrated GPU type. None: "
            "the point values only."
        ),
    )
    fitted_under: Deployment | None = Field(
        default=None,
        description=(
            "The deployment the measured runs behind these constants ran on (part of their "
            "provenance): what a replay of those runs and the accuracy tests simulate with "
            "(Calibration.as_fitted). Not what a plan is priced with: that is the "
            "Calibration's own structure. None: not fitted to measured runs."
        ),
    )

    @property
    def p2p_eta(self) -> float:
        """Efficiency of pipeline transfers (network_efficiency unless set apart), on the
        links it was read on (:attr:`efficiency_link_gbps`)."""
        return self.network_efficiency if self.p2p_efficiency is None else self.p2p_efficiency

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        return _legacy_tp_link(data, "tp_link_efficiency_pcie")

    def tp_link_efficiency_of(self, link: str) -> float:
        """The TP link efficiency over a spec sheet's ``intra_node_link`` of this kind."""
        return self.tp_link_efficiency_pcie if pcie_link(link) else self.tp_link_efficiency


class Calibration(DeploymentStructure):
    """All calibration constants the simulator uses, per GPU type, with a default, and the
    deployment structure it prices (:class:`DeploymentStructure`: the deployment being
    planned or simulated, by default Sailor's engine; a fit's own deployment is its
    ``GPUCalibration.fitted_under``)."""

    gpus: tuple[GPUCalibration, ...] = Field(
        default=(), description="Calibrated GPU types (at most one entry per type)."
    )
    default: GPUCalibration = Field(
        default_factory=lambda: GPUCalibration(gpu_type="*"),
        description="Constants for GPU types without an entry.",
    )
    prior: GPUPrior | None = Field(
        default=None,
        description=(
            "Ranges of every fitted constant for GPU types without a calibration, with their "
            "evidence (the catalog's). The uncertainty corners take their constants from it; "
            "None: only the point default is known."
        ),
    )

    @field_validator("gpus")
    @classmethod
    def _unique(cls, v: tuple[GPUCalibration, ...]) -> tuple[GPUCalibration, ...]:
        seen: set[str] = set()
        for c in v:
            if c.gpu_type in seen or c.gpu_type == "*":
                raise field_error("gpus", c.gpu_type, "duplicate or wildcard GPU type")
            seen.add(c.gpu_type)
        return v

    def for_gpu(self, gpu_type: str) -> GPUCalibration:
        """Constants of ``gpu_type``; a CPU kind without its own takes the ``cpu`` entry's
        (``schemas.device_kind``); else the default."""
        for name in dict.fromkeys((gpu_type, catalog_type(gpu_type))):
            for c in self.gpus:
                if c.gpu_type == name:
                    return c
        return self.default

    def p2p_between(self, *gpu_types: str) -> tuple[float, float]:
        """(p2p efficiency, fixed cost per transfer) of a pipeline boundary between stages of
        ``gpu_types``: the least efficiency (as read, on its own links) and the largest
        fixed cost of theirs."""
        cals = [self.for_gpu(g) for g in gpu_types]
        return min(c.p2p_eta for c in cals), max(c.p2p_fixed_s for c in cals)

    def p2p_link(self, *gpu_types: str) -> tuple[LinkEta, float]:
        """(p2p efficiency by link, fixed cost per transfer) of a pipeline boundary between
        stages of ``gpu_types``: :meth:`p2p_between` with the efficiencies taken on the link
        at hand (:class:`LinkEta`)."""
        cals = [self.for_gpu(g) for g in dict.fromkeys(gpu_types)]
        etas = LinkEta(tuple((c.p2p_eta, c.efficiency_link_gbps) for c in cals))
        return etas, max(c.p2p_fixed_s for c in cals)

    def network_link_eta(self, *gpu_types: str) -> LinkEta:
        """The collectives' efficiency of a ring among nodes of ``gpu_types``, by link."""
        cals = [self.for_gpu(g) for g in dict.fromkeys(gpu_types)]
        return LinkEta(tuple((c.network_efficiency, c.efficiency_link_gbps) for c in cals))

    def is_calibrated(self, gpu_type: str) -> bool:
        """Whether ``gpu_type`` has constants of its own (or, a CPU kind, the ``cpu`` entry)."""
        names = {gpu_type, catalog_type(gpu_type)}
        return any(c.gpu_type in names for c in self.gpus)

    def with_deployment(self, deployment: DeploymentStructure) -> Calibration:
        """A copy that prices ``deployment``'s structure (the constants unchanged)."""
        return self.model_copy(update=deployment.structure())

    def fitted_structure(self, gpu_type: str) -> Deployment:
        """The deployment ``gpu_type``'s constants were fitted under; a clear error when the
        type has no fit that records one."""
        own = self.for_gpu(gpu_type)
        if not self.is_calibrated(gpu_type) or own.fitted_under is None:
            fitted = [c.gpu_type for c in self.gpus if c.fitted_under is not None]
            raise ValueError(
                f"gpu_type={gpu_type!r}: no fit with a recorded deployment "
                f"(fitted_under) in this calibration (fitted types: {fitted or 'none'})"
            )
        return own.fitted_under

    def as_fitted(self, gpu_type: str) -> Calibration:
        """This calibration pricing the structure ``gpu_type``'s fit was made under: what a
        replay of its measured runs simulates with."""
        return self.with_deployment(self.fitted_structure(gpu_type))

    def with_gpu(self, cal: GPUCalibration) -> Calibration:
        """A copy with ``cal`` replacing any entry of its GPU type."""
        rest = tuple(c for c in self.gpus if c.gpu_type != cal.gpu_type)
        return self.model_copy(update={"gpus": (*rest, cal)})
