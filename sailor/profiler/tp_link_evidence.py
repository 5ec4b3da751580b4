"""What fraction of its spec-sheet link a GPU type's measured TP all-reduces reached.

The evidence behind the catalog prior's ``tp_link_efficiency`` (NVLink and the rest) and
``tp_link_efficiency_pcie``: the efficiency that prices a TP degree from a TP-1 profile at the
same work per GPU (the compute scaled by the roofline, the all-reduces added over the spec
sheet's link: the simulator's rule 5, and what ``sailor profile estimate``'s work-keyed
efficiencies assume) at the time a profile measured at that TP degree. The simulator's rule 3
scales another TP degree at the same microbatch instead: read that way, the remainder also
holds the compute efficiency lost at the smaller work per GPU, and the figures are lower
(A100-40 TP 4 at mbs 1: 0.04); they are not link evidence.

For a GPU type measured at TP ``t``, microbatch ``b``, and at TP 1, microbatch ``b/t`` (the
same work per GPU): the blocks' compute at ``(t, b)`` is the TP-1 time scaled by the
roofline's ratio of the two (which counts what a TP group does not split: norms, residuals);
what the measurement holds beyond it is the all-reduces; the efficiency is what
:func:`~sailor.simulator.tp_comm.model_comm_s` prices them at, over the spec sheet's link at
efficiency 1, divided by that remainder. A TP degree faster than its TP-1 compute (a
remainder at or below zero) gives no figure.

Pure: values in, values out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sailor.profiler.calibrated_estimate import measured_grid
from sailor.schemas import GPUCalibration, GPUSpec, ModelSpec, ProfileDB
from sailor.simulator.estimate_profile import estimate_layer_timing
from sailor.simulator.lookup import layer_table
from sailor.simulator.tp_comm import model_comm_s, tp_link

__all__ = ["ImpliedEfficiency", "implied_tp_link_efficiency"]

_AS_MEASURED = GPUCalibration(gpu_type="*")


@dataclass(frozen=True)
class ImpliedEfficiency:
    """One measured (GPU type, TP, mbs) against its TP-1 profile at ``mbs / tp``."""

    gpu_type: str
    link: str
    tp: int
    mbs: int
    measured_s: float
    """The blocks' forward + backward at (tp, mbs), s."""
    compute_s: float
    """The TP-1 blocks' time at ``mbs / tp``, scaled by the roofline's ratio, s."""
    spec_comm_s: float
    """The blocks' all-reduces over the spec sheet's link at efficiency 1, s."""

    @property
    def efficiency(self) -> float | None:
        """``spec_comm_s / (measured_s - compute_s)``; None when nothing is left over."""
        left = self.measured_s - self.compute_s
        return self.spec_comm_s / left if left > 0 else None


def _blocks_s(db: ProfileDB, model: ModelSpec, spec: GPUSpec, tp: int, mbs: int) -> float:
    costs = layer_table(db, model, _AS_MEASURED, {spec.name: spec}, spec.name, tp, mbs).layers
    return sum(c.fwd_s + c.bwd_s for i, c in enumerate(costs) if model.layer_kind(i) == "block")


def _roof_blocks_s(model: ModelSpec, spec: GPUSpec, tp: int, mbs: int) -> float:
    out = 0.0
    for i in range(model.num_all_layers):
        if model.layer_kind(i) == "block":
            t = estimate_layer_timing(model, spec, tp, mbs, i)
            out += t.fwd_s + t.bwd_s
    return out


def implied_tp_link_efficiency(
    db: ProfileDB, model: ModelSpec, specs: Mapping[str, GPUSpec]
) -> list[ImpliedEfficiency]:
    """One row per measured (GPU type with a spec sheet, TP > 1, mbs) whose TP-1 profile has
    microbatch ``mbs / tp`` (measured or imported entries only); in the database's order of
    types, then by (TP, mbs)."""
    rows: list[ImpliedEfficiency] = []
    for g in db.gpu_types():
        spec = specs.get(g)
        if spec is None:
            continue
        grid = set(measured_grid(db, g))
        for tp, mbs in sorted(grid):
            if tp <= 1 or mbs % tp or (1, mbs // tp) not in grid:
                continue
            base = mbs // tp
            compute = _blocks_s(db, model, spec, 1, base) * (
                _roof_blocks_s(model, spec, tp, mbs) / _roof_blocks_s(model, spec, 1, base)
            )
            link = tp_link(None, {g: spec}, g, tp, 1.0)
            comm = sum(
                f + b
                for i, (f, b) in enumerate(model_comm_s(model, tp, mbs, link, True))
                if model.layer_kind(i) == "block"
            )
            rows.append(
                ImpliedEfficiency(
                    gpu_type=g,
                    link=spec.intra_node_link,
                    tp=tp,
                    mbs=mbs,
                    measured_s=_blocks_s(db, model, spec, tp, mbs),
                    compute_s=compute,
                    spec_comm_s=comm,
                )
            )
    return rows
