"""The controller's planner backed by ``sailor.planner``: search once, replan on changes.

``SailorPlanner.plan(nodes, previous)`` turns the usable nodes into a planner ``Pool`` (one
entry per GPU type, zone, node shape and spot flag), runs the full search at the configured
risk level (:func:`sailor.planner.robust.robust_search`, ``robust`` by default: the plan must
fit and meet every limit in every corner of the cost model's uncertainty set) for the first
layout (or when a node shape the last search never saw appears), and the incremental
:func:`sailor.planner.robust.robust_replan` at the same risk level on later membership
changes, warm-started from the last search's cost tables and plan. The best ranked plan is
bound to concrete nodes with :func:`sailor.controller.planning.api.place` and carries its
predicted figures (the median corner's).

Inputs come from the controller config: the model (a catalog name such as ``tiny-gpt`` or
``OPT-350``, or a ModelSpec JSON/YAML file) and optional profiles, network, prices and
calibration files. Without profiles the simulator's analytic estimates from the catalog's
GPU specs are used (``cpu`` nodes get the catalog's nominal ``cpu`` spec). The search is
pure and runs in the executor's worker thread; a lock keeps two plans from interleaving.
``set_calibration`` swaps in the calibration online calibration fitted (the next plan searches
afresh with it); ``load_cost_inputs`` reads the same inputs for the controller's own fit.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sailor import catalog
from sailor.controller.config import MODEL_FILE_SUFFIXES, ControllerConfig, load_mapping
from sailor.controller.planning.api import (
    DataParallelPlanner,
    PlacementError,
    Planner,
    PlanResult,
    place,
)
from sailor.planner import Constraints, NoFeasiblePlanError, Objective
from sailor.planner.reach import PlannerReach
from sailor.planner.robust import Risk, RobustResult, robust_replan, robust_search
from sailor.schemas.calibration import Calibration
from sailor.schemas.hardware import GPUSpec, NodeSpec, Pool, PoolEntry
from sailor.schemas.model import ModelSpec
from sailor.schemas.network import NetworkProfile
from sailor.schemas.plan import Plan, PlanPrediction
from sailor.schemas.precision import Precision
from sailor.schemas.prices import PriceTable
from sailor.schemas.profile import ProfileDB

__all__ = [
    "CostInputs",
    "SailorPlanner",
    "cost_inputs_of",
    "load_cost_inputs",
    "load_model_spec",
    "planner_from_config",
    "planner_reach_of",
    "pool_of",
]

_Shape = tuple[str, str, int, bool]


def load_model_spec(name: str, global_batch_size: int | None = None) -> ModelSpec:
    """A catalog model by name or a model file, optionally with another batch size.

    A file holds a bare ``ModelSpec``, or the worker's model file ``{"spec": ModelSpec,
    "architecture": ...}`` (``megatron_patch.hf.checkpoint.model_file``, the demo's
    ``model.json``), whose spec is taken and architecture left to the workers: the
    controller plans and prices the very file the workers train."""
    path = Path(name)
    if path.suffix in MODEL_FILE_SUFFIXES and path.exists():
        data = load_mapping(path)
        if set(data) == {"spec", "architecture"} and isinstance(data["spec"], dict):
            data = data["spec"]
        spec = ModelSpec.model_validate(data)
    else:
        spec = catalog.model(name)
    if global_batch_size is not None:
        spec = spec.model_copy(update={"global_batch_size": global_batch_size})
    return spec


@dataclass(frozen=True)
class CostInputs:
    """What the cost model prices a plan with: the controller config's model and files."""

    model: ModelSpec
    profiles: ProfileDB
    network: NetworkProfile
    prices: PriceTable
    calibration: Calibration
    gpu_specs: Mapping[str, GPUSpec]


def load_cost_inputs(
    model: str,
    global_batch_size: int | None = None,
    *,
    profiles: Sequence[Path] = (),
    network: Path | None = None,
    prices: Path | None = None,
    calibration: Path | None = None,
) -> CostInputs:
    """The model, profiles, network, prices and calibration the config names (defaults: no
    profile, the default network, the catalog's prices, calibration and GPU specs)."""
    spec = load_model_spec(model, global_batch_size)
    db = ProfileDB(model=spec.name)
    for p in profiles:
        part = ProfileDB.model_validate(load_mapping(p))
        if part.model != spec.name:
            raise ValueError(f"{p}: profiles of model={part.model!r}, planning {spec.name!r}")
        db = db.merged(part)
    return CostInputs(
        model=spec,
        profiles=db,
        network=NetworkProfile.model_validate(load_mapping(network))
        if network
        else NetworkProfile(),
        prices=PriceTable.model_validate(load_mapping(prices)) if prices else catalog.prices(),
        calibration=(
            Calibration.model_validate(load_mapping(calibration))
            if calibration
            else catalog.calibration()
        ),
        gpu_specs=catalog.gpus(),
    )


def cost_inputs_of(config: ControllerConfig) -> CostInputs:
    """:func:`load_cost_inputs` of a controller config."""
    return load_cost_inputs(
        config.model,
        config.global_batch_size,
        profiles=config.profiles,
        network=config.network,
        prices=config.prices,
        calibration=config.calibration,
    )


def _shape(n: NodeSpec) -> _Shape:
    return (n.gpu_type, n.zone, n.gpus, n.spot)


def pool_of(nodes: Sequence[NodeSpec]) -> Pool:
    """The planner's pool for a set of nodes: counts per (GPU type, zone, shape, spot)."""
    counts: dict[_Shape, int] = {}
    for n in nodes:
        counts[_shape(n)] = counts.get(_shape(n), 0) + 1
    return Pool(
        entries=tuple(
            PoolEntry(gpu_type=g, zone=z, nodes=k, gpus_per_node=per, spot=spot)
            for (g, z, per, spot), k in sorted(counts.items())
        )
    )


class SailorPlanner:
    """``Planner`` of the controller on top of ``sailor.planner`` (search, then replan)."""

    def __init__(
        self,
        model: ModelSpec,
        *,
        profiles: ProfileDB | None = None,
        network: NetworkProfile | None = None,
        prices: PriceTable | None = None,
        calibration: Calibration | None = None,
        objective: Objective = "throughput",
        constraints: Constraints | None = None,
        spot: bool = True,
        risk: Risk = "robust",
    ) -> None:
        self.model = model
        self.profiles = profiles or ProfileDB(model=model.name)
        self.network = network or NetworkProfile()
        self.prices = prices or catalog.prices()
        self.calibration = calibration or catalog.calibration()
        self.objective: Objective = objective
        self.constraints = constraints or Constraints()
        self.spot = spot
        self.risk: Risk = risk
        self._last: RobustResult | None = None
        self._shapes: frozenset[_Shape] = frozenset()
        self._precision: Precision | None = None  # the job precision ``_last`` was made in
        self._lock = threading.Lock()

    @classmethod
    def from_files(
        cls,
        model: str,
        global_batch_size: int | None = None,
        *,
        profiles: Sequence[Path] = (),
        network: Path | None = None,
        prices: Path | None = None,
        calibration: Path | None = None,
        objective: Objective = "throughput",
        risk: Risk = "robust",
    ) -> SailorPlanner:
        """Build from the controller config's model name and optional input files."""
        c = load_cost_inputs(
            model,
            global_batch_size,
            profiles=profiles,
            network=network,
            prices=prices,
            calibration=calibration,
        )
        return cls(
            c.model,
            profiles=c.profiles,
            network=c.network,
            prices=c.prices,
            calibration=c.calibration,
            objective=objective,
            risk=risk,
        )

    def reach(self) -> PlannerReach:
        """What this planner can use: a pool with a node outside it is refused as a whole
        (``planner.reach``), so the controller admits no such node (``DecideConfig``)."""
        return PlannerReach.of(
            catalog.gpus(),
            self.profiles,
            self.prices,
            spot=self.spot,
            objective=self.objective,
            constraints=self.constraints,
        )

    def set_calibration(self, calibration: Calibration) -> None:
        """Plan with ``calibration`` from the next call on (online calibration). The last
        search's cost tables were priced with the old one, so the next call searches afresh."""
        with self._lock:
            if calibration == self.calibration:
                return
            self.calibration = calibration
            self._last = None
            self._shapes = frozenset()
            self._precision = None

    def _search(
        self, pool: Pool, shapes: frozenset[_Shape], precision: Precision | None
    ) -> tuple[RobustResult, str]:
        # a replan warm-starts from tables priced in the last search's precision: once the
        # job's is fixed (or changed), the next search starts afresh in it
        if (
            self._last is not None
            and self._last.plans
            and shapes <= self._shapes
            and precision == self._precision
        ):
            return robust_replan(self._last, pool), "replan"
        res = robust_search(
            self.model,
            self.profiles,
            pool,
            self.network,
            self.prices,
            self.objective,
            self.constraints,
            gpu_specs=catalog.gpus(),
            calibration=self.calibration,
            risk=self.risk,
            spot=self.spot,
            top_k=3,
            precision=precision,
        )
        return res, "search"

    def plan(
        self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: Precision | None = None
    ) -> PlanResult:
        """The best plan for ``nodes``, placed on them; raises if none is feasible.
        ``precision``: the job's, once fixed (``Planner.plan``). A node this planner cannot
        use (``reach``) is left out, and the plan's reason says so: the controller admits
        none, but keeps the nodes of a running layout whatever its reach
        (``controller/plannable.py``), so a controller restarted with other prices may ask
        for one, and the search would refuse the whole pool for it."""
        if not nodes:
            raise PlacementError("no node to plan for")
        reach = self.reach()
        refused = [f"{n.node_id}: {why}" for n in nodes if (why := reach.why_not(*_shape(n)))]
        if refused:
            nodes = tuple(n for n in nodes if not reach.why_not(*_shape(n)))
            if not nodes:
                raise NoFeasiblePlanError(
                    "the planner can use none of the nodes: " + "; ".join(refused)
                )
        pool = pool_of(nodes)
        shapes = frozenset(_shape(n) for n in nodes)
        with self._lock:
            res, how = self._search(pool, shapes, precision)
            if not res.plans:
                reason = res.reason or "no feasible plan"
                left = [w for w in res.left_out if w not in reason]
                raise NoFeasiblePlanError("; ".join([reason, *left]))
            if precision != self._precision:
                self._shapes = frozenset()
            self._last = res
            self._precision = precision
            self._shapes = self._shapes | shapes
        best = res.plans[0]
        est = best.estimate
        predicted = PlanPrediction(
            iteration_time_s=est.iteration_time_s,
            throughput_iter_s=est.throughput_iter_s,
            peak_memory_bytes=est.peak_memory_bytes,
            cost_per_iter_usd=est.cost_per_iter_usd,
        )
        bound, placement = place(best.plan.model_copy(update={"predicted": predicted}), nodes)
        shape = "+".join(f"{len(p.stages)}st" for p in bound.pipelines)
        before = previous.num_gpus if previous else 0
        reason = (
            f"sailor planner ({how}): {bound.num_gpus} GPUs, pipelines {shape}, "
            f"{est.throughput_iter_s:.3g} it/s predicted (was {before} GPUs); risk {res.risk}: "
            f"{best.interval.throughput_iter_s.low:.3g} it/s in its worst corner"
        )
        if bound.precision is not None:
            reason += f"; precision {bound.precision}"
            if precision is not None:
                reason += " (the job's)"
        if res.left_out:
            reason += "; " + "; ".join(res.left_out)
        if refused:
            reason += "; left out, the planner cannot use them: " + "; ".join(refused)
        return PlanResult(bound, placement, reason)


def planner_reach_of(config: ControllerConfig) -> PlannerReach | None:
    """What the planner ``config.planner`` names can use, read from the config's files as
    :func:`planner_from_config` builds it (its ``reach``); None for the stand-in planner,
    which takes any node."""
    if config.planner == "data_parallel":
        return None
    c = cost_inputs_of(config)
    return PlannerReach.of(
        c.gpu_specs,
        c.profiles,
        c.prices,
        spot=True,  # SailorPlanner's default, which from_files keeps
        objective=config.objective,
        constraints=Constraints(),
    )


def planner_from_config(config: ControllerConfig) -> Planner:
    """The planner ``config.planner`` names, built from the config's model and files."""
    if config.planner == "data_parallel":
        return DataParallelPlanner(
            config.model, config.num_layers, config.global_batch_size, config.max_gpus
        )
    return SailorPlanner.from_files(
        config.model,
        config.global_batch_size,
        profiles=config.profiles,
        network=config.network,
        prices=config.prices,
        calibration=config.calibration,
        objective=config.objective,
        risk=config.risk,
    )
