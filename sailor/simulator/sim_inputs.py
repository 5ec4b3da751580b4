"""One simulation's inputs and lookups, and the notes it gathers.

:class:`SimInputs` holds what a simulation reads (model, profiles, calibration, GPU specs) and
the lookups every stage of a plan shares: per-layer profile tables, layer sizes per TP degree,
link curves and per-GPU-type constants, each worked out on first use. :class:`Notes` keeps the
simulation's notes once each, in the order they arose. The parts of
:mod:`sailor.simulator.simulate` (:mod:`~sailor.simulator.pipeline_kinds`,
:mod:`~sailor.simulator.grad_sync`, the answer's rows) all read them.

Pure: one object per simulation, no I/O, no clock, no globals; it never changes its inputs.
"""

from __future__ import annotations

from collections.abc import Mapping

from sailor.schemas import (
    Calibration,
    GPUCalibration,
    GPUSpec,
    LayerSize,
    ModelSpec,
    NetworkProfile,
    ProfileDB,
)
from sailor.schemas.precision import Precision, compute_bytes, wire_bytes
from sailor.schemas.profile import FrameworkTime
from sailor.simulator.lookup import StageCosts, layer_sizes
from sailor.simulator.network_model import LinkCurves

__all__ = [
    "Notes",
    "SimInputs",
]


class Notes:
    """The notes of one simulation, once each, in the order they arose."""

    def __init__(self) -> None:
        self.items: dict[str, None] = {}

    def add(self, *notes: str) -> None:
        for n in notes:
            if n:
                self.items[n] = None


class SimInputs:
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


_NO_FRAMEWORK_TIME = FrameworkTime(gpu_type="*", source="none measured")
