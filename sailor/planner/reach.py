"""What the planner can plan with: which nodes (GPU type, zone, GPUs per node, spot) a pool
may hold before the search refuses the whole pool.

The search checks its pool once, before anything else (``search._check_inputs``): a GPU
type with neither a spec nor a profile, one without a price, one at $0/h when cost is
ranked or capped, or a node shape over ``MAX_GPUS_PER_NODE`` (a ``PoolEntry`` bound) make it
raise for the whole pool. A caller that builds pools from nodes it does not choose (the
controller, from whatever agents register) asks :meth:`PlannerReach.why_not` first and
leaves such a node out, so one node the planner cannot use never blocks the plan for the
others. Both go through this one rule, so what the controller admits is what the search
takes.

Pure: a frozen value built from the planner's inputs; no I/O, nothing read from disk.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from sailor.planner.api import Constraints, Objective
from sailor.schemas import GPUSpec, PriceTable, ProfileDB
from sailor.schemas._base import Frozen
from sailor.schemas._memo import memo
from sailor.schemas.device_kind import catalog_type
from sailor.schemas.hardware import MAX_GPUS_PER_NODE

__all__ = ["PlannerReach"]


class PlannerReach(Frozen):
    """The GPU types, prices and node shapes one planner's inputs cover."""

    known: frozenset[str] = Field(
        description="GPU types with a spec (GPU catalog) or a profile (ProfileDB)."
    )
    specs: frozenset[str] = Field(
        description="GPU types with a spec: a CPU kind (cpu-<kind>) without its own entry "
        "takes the spec of its base type (``device_kind.spec_of``)."
    )
    prices: PriceTable = Field(description="The price table the search prices GPUs with.")
    spot: bool | None = Field(
        default=None,
        description="Price every GPU at spot (True) or on-demand (False) rates; None: each "
        "node by its own flag (``Inputs.spot``).",
    )
    cost_ranked_by: str = Field(
        default="",
        description="What makes the search rank or cap by cost (\"objective='cost'\", "
        "'a cost limit'): a GPU priced at $0/h is refused then. '': it does not.",
    )
    max_gpus_per_node: int = Field(
        default=MAX_GPUS_PER_NODE, gt=0, description="GPUs per node at most (PoolEntry)."
    )

    @classmethod
    def of(
        cls,
        gpu_specs: Mapping[str, GPUSpec],
        profiles: ProfileDB,
        prices: PriceTable,
        *,
        spot: bool | None,
        objective: Objective,
        constraints: Constraints,
    ) -> PlannerReach:
        """The reach of a search over these inputs with this objective and constraints."""
        return cls(
            known=frozenset(gpu_specs) | frozenset(profiles.gpu_types()),
            specs=frozenset(gpu_specs),
            prices=prices,
            spot=spot,
            cost_ranked_by=_cost_ranked_by(objective, constraints),
        )

    def unknown_type(self, gpu_type: str) -> str:
        """Why the planner has no figure for ``gpu_type`` ('' when it has one)."""
        if gpu_type in self.known or catalog_type(gpu_type) in self.specs:
            return ""
        return (
            f"GPU type {gpu_type!r} is unknown: no profile and no spec "
            f"(known: {', '.join(sorted(self.known))})"
        )

    def why_not(self, gpu_type: str, zone: str, gpus_per_node: int, spot: bool) -> str:
        """Why a search cannot take a node of this shape ('' when it can): the text the
        search raises with (``PlannerInputError``).

        Judged once per shape and kept on this frozen value: the controller asks for every
        registered node up to three times a pass (the daemon's exclusion, ``decide``'s, an
        idle job's admission check), and its reach never changes after it starts; 512 nodes
        judged afresh against a 339-row price table took ~50-110 ms a call on its event
        loop (benchmarks/runtime_decision_latency.py, admission rows)."""
        verdicts = memo(self, "_why_not", _FIELDS)
        shape = (gpu_type, zone, gpus_per_node, spot)
        why = verdicts.get(shape)
        if why is None:
            why = verdicts[shape] = self._judge(gpu_type, zone, gpus_per_node, spot)
        return why

    def _judge(self, gpu_type: str, zone: str, gpus_per_node: int, spot: bool) -> str:
        if gpus_per_node > self.max_gpus_per_node:
            return (
                f"gpus={gpus_per_node}: over the {self.max_gpus_per_node} GPUs per node the "
                "planner takes (PoolEntry.gpus_per_node)"
            )
        unknown = self.unknown_type(gpu_type)
        if unknown:
            return f"pool {unknown}"
        priced_spot = spot if self.spot is None else self.spot
        try:
            price = self.prices.gpu_hour(gpu_type, zone, priced_spot)
        except KeyError:
            return f"pool GPU type {gpu_type!r} has no price"
        if self.cost_ranked_by and price <= 0:
            return (
                f"pool entry {gpu_type} in {zone} (spot={priced_spot}) costs $0/h: "
                f"{self.cost_ranked_by} needs a price above 0 for every GPU (for hardware "
                "you own, give its amortized $/GPU-hour; or plan for throughput without a "
                "cost limit)"
            )
        return ""


_FIELDS = tuple(PlannerReach.model_fields)
"""What a verdict depends on: every field (a copy with another one judges afresh)."""


def _cost_ranked_by(objective: Objective, constraints: Constraints) -> str:
    """What makes a search rank or cap by cost ('' nothing): samples per $ and iterations
    per $ of a free GPU are infinite, and ratios of them undefined."""
    if objective != "throughput":
        return f"objective={objective!r}"
    limits = (constraints.max_cost_per_iter_usd, constraints.max_cost_per_hour_usd)
    if any(v is not None for v in limits):
        return "a cost limit"
    return ""
