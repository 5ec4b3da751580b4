"""How the controller gets a plan for a set of nodes, and how the plan is placed on them.

``Planner`` is the small interface the executor calls on every membership change (in a
thread: planning may take a while and overlaps the checkpoint). ``DataParallelPlanner`` is a
stand-in that needs no profiles: one single-stage pipeline per GPU (tp=1), as many as divide
the global batch. The real planner (``SailorPlanner`` of :mod:`.in_process`, on
``sailor.planner``) plugs in behind the same interface. ``place`` is pure: it binds every
replica group of a plan to a concrete node with free GPUs of the right type and zone, and
returns node -> global ranks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

from sailor import catalog
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.precision import Precision, cannot_run

__all__ = ["DataParallelPlanner", "PlacementError", "PlanResult", "Planner", "place"]


class PlacementError(ValueError):
    """The plan needs GPUs the given nodes do not have. Not retryable with the same nodes."""


@dataclass(frozen=True)
class PlanResult:
    """A placed plan and why it was chosen."""

    plan: Plan
    placement: dict[str, tuple[int, ...]]
    reason: str


class Planner(Protocol):
    def plan(
        self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: Precision | None = None
    ) -> PlanResult:
        """The best plan for ``nodes``, placed on them. ``precision``: the job's, once fixed
        (``controller/job_precision.py``): the plan is made and recorded in it, on the nodes
        whose GPU type can run it; the others are left out and the reason says so."""
        ...


def _plan_id(plan: Plan) -> str:
    body = plan.model_copy(update={"plan_id": ""}).model_dump_json()
    return "p-" + hashlib.sha256(body.encode()).hexdigest()[:12]


def place(plan: Plan, nodes: tuple[NodeSpec, ...]) -> tuple[Plan, dict[str, tuple[int, ...]]]:
    """Bind each replica group to a node; returns the bound plan and node -> ranks.

    Each stage goes to the stage's own ``node_id`` if that node still has room, else to the
    first node (by id) of its GPU type, zone and ``gpus_per_node`` (the VM shape the planner
    priced it on) with ``tp`` free GPUs, else to the first of its GPU type and zone (a shape
    the plan does not name: a hand-written plan's default of 1). The planner checks its plans
    against the same rule (``sailor.planner.placement``). Nodes are bucketed by shape and by
    (GPU type, zone), each with a cursor past the full ones, so placing is linear in the
    stages for the usual shapes (it was a scan of every node per stage: 80 ms of a 200 ms
    replan at 512 nodes, benchmarks/runtime_decision_latency.py).
    """
    free = {n.node_id: n.gpus for n in sorted(nodes, key=lambda n: n.node_id)}
    spec = {n.node_id: n for n in nodes}
    buckets: dict[tuple[str, str], list[str]] = {}
    shaped: dict[tuple[str, str, int], list[str]] = {}
    for nid in free:
        buckets.setdefault((spec[nid].gpu_type, spec[nid].zone), []).append(nid)
        shaped.setdefault((spec[nid].gpu_type, spec[nid].zone, spec[nid].gpus), []).append(nid)
    cursor: dict[tuple[str, str] | tuple[str, str, int], int] = dict.fromkeys(buckets, 0)
    cursor.update(dict.fromkeys(shaped, 0))

    def first_fit(key: tuple[str, str] | tuple[str, str, int], ids: list[str], tp: int) -> str:
        lo = cursor.get(key, 0)
        while lo < len(ids) and free[ids[lo]] == 0:
            lo += 1
        if key in cursor:
            cursor[key] = lo
        return next((c for c in ids[lo:] if free[c] >= tp), "")

    ranks: dict[str, list[int]] = {}
    rank = 0
    pipelines: list[Pipeline] = []
    for pi, p in enumerate(plan.pipelines):
        stages: list[Stage] = []
        for si, s in enumerate(p.stages):
            r = s.replica
            group = (r.gpu_type, r.zone)
            hint = spec.get(r.node_id)
            nid = ""
            if (
                hint is not None
                and free[hint.node_id] >= r.tp
                and (hint.gpu_type, hint.zone) == group
            ):
                nid = hint.node_id
            if not nid:  # a node of the shape the plan was priced on, else any of the group
                shape = (r.gpu_type, r.zone, r.gpus_per_node)
                nid = first_fit(shape, shaped.get(shape, []), r.tp)
            if not nid:
                nid = first_fit(group, buckets.get(group, []), r.tp)
            if not nid:
                raise PlacementError(
                    f"pipelines[{pi}].stages[{si}]: no node with {r.tp} free {r.gpu_type} "
                    f"GPUs in {r.zone}"
                )
            first = spec[nid].gpus - free[nid]
            free[nid] -= r.tp
            # Not validated again (model_construct): the plan's own validated values, with
            # a node that has ``tp`` free GPUs, so tp <= first_gpu + tp <= gpus_per_node
            # holds by construction. Validating 1,000 stages, their replica groups and 340
            # pipelines was ~25 ms of a ~85 ms plan at 512 nodes (model_copy: 40 ms).
            bound = ReplicaGroup.model_construct(
                gpu_type=r.gpu_type,
                zone=r.zone,
                tp=r.tp,
                gpus_per_node=spec[nid].gpus,
                node_id=nid,
                first_gpu=first,
            )
            stages.append(Stage.model_construct(**{**s.__dict__, "replica": bound}))
            ranks.setdefault(nid, []).extend(range(rank, rank + r.tp))
            rank += r.tp
        pipelines.append(Pipeline.model_construct(**{**p.__dict__, "stages": tuple(stages)}))
    bound_plan = plan.model_copy(update={"pipelines": tuple(pipelines), "plan_id": ""})
    bound_plan = bound_plan.model_copy(update={"plan_id": _plan_id(bound_plan)})
    return bound_plan, {k: tuple(v) for k, v in sorted(ranks.items())}


class DataParallelPlanner:
    """Stand-in planner: data parallelism over single GPUs, batch split evenly."""

    def __init__(
        self, model: str, num_layers: int, global_batch_size: int, max_gpus: int = 0
    ) -> None:
        self.model = model
        self.num_layers = num_layers
        self.global_batch_size = global_batch_size
        self.max_gpus = max_gpus

    def plan(
        self, nodes: tuple[NodeSpec, ...], previous: Plan | None, precision: Precision | None = None
    ) -> PlanResult:
        specs = catalog.gpus()
        why = {n.gpu_type: cannot_run(n.gpu_type, specs, precision) for n in nodes if precision}
        left_out = "; ".join(
            f"left out {g}: the job runs {precision} and {r}" for g, r in sorted(why.items()) if r
        )
        usable = [n for n in nodes if not why.get(n.gpu_type)]
        gpus = [(n, g) for n in sorted(usable, key=lambda n: n.node_id) for g in range(n.gpus)]
        if self.max_gpus:
            gpus = gpus[: self.max_gpus]
        if not gpus:
            raise PlacementError("no GPU available" + (f" ({left_out})" if left_out else ""))
        dp = max(d for d in range(1, len(gpus) + 1) if self.global_batch_size % d == 0)
        pipelines = tuple(
            Pipeline(
                stages=(
                    Stage(
                        first_layer=0,
                        last_layer=self.num_layers - 1,
                        replica=ReplicaGroup(
                            gpu_type=n.gpu_type, zone=n.zone, tp=1, gpus_per_node=n.gpus
                        ),
                    ),
                ),
                microbatch_size=1,
                num_microbatches=self.global_batch_size // dp,
            )
            for n, _ in gpus[:dp]
        )
        plan = Plan(
            model=self.model,
            global_batch_size=self.global_batch_size,
            pipelines=pipelines,
            precision=precision,
        )
        if precision is None:  # recorded, as the sailor planner's: the job's from its launch
            plan = plan.with_precision(specs)
        bound, placement = place(plan, tuple(n for n, _ in gpus[:dp]))
        before = previous.num_gpus if previous else 0
        reason = f"data parallel over {dp} GPUs (was {before})"
        return PlanResult(bound, placement, reason + (f"; {left_out}" if left_out else ""))
