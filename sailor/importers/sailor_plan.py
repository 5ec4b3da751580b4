"""Plans in the original artifact's format: import to a Sailor ``Plan``, export back.

The original describes a plan as a list of pipeline *templates*: each has ``num_stages``,
``layers_per_stage`` (lists of global layer indices), a data-parallel degree per stage
(``dp`` in measured plan configs, ``dp_degrees`` in planner outputs) and, per stage and
replica, ``[[[gpu, gpus_per_node, zone]], tp]``. One microbatch size (``mbs``) for the plan.

In Sailor a plan is a list of pipelines, each a single data-parallel replica. A template of
degree ``d`` becomes ``d`` pipelines with the same split; replica ``j`` of every stage goes to
pipeline ``j``. The original requires one degree for all stages of a template; a template that
violates it is rejected. The global batch is spread over the pipelines in whole microbatches
(``gbs / mbs`` of them; the first pipelines take one more when they do not divide evenly).
The format has no precision: the original trains in fp16 (Megatron-DeepSpeed), so an imported
plan records ``precision="fp16"`` unless told otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sailor.importers._read import ImportFormatError, as_int, get, load_json
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.precision import Precision

__all__ = ["export_plan", "import_plan", "plan_from_dict"]


def import_plan(
    path: str | Path,
    model: str,
    *,
    global_batch_size: int | None = None,
    precision: Precision = "fp16",
) -> Plan:
    """A ``plan_config_*.json`` (or a planner-result ``plan``) as a Sailor Plan."""
    return plan_from_dict(
        load_json(path),
        model,
        file=str(path),
        global_batch_size=global_batch_size,
        precision=precision,
    )


def plan_from_dict(
    d: Any,
    model: str,
    *,
    file: str = "<plan>",
    global_batch_size: int | None = None,
    precision: Precision = "fp16",
) -> Plan:
    mbs = as_int(get(d, "mbs", file, "mbs"), file, "mbs", min_value=1)
    gbs = global_batch_size
    if gbs is None:
        gbs = as_int(get(d, "gbs", file, "gbs"), file, "gbs", min_value=1)
    tmpl = (
        get(d, "pipeline_list", file, "pipeline_list")
        if "pipeline_list" in d
        else get(d, "pipelines", file, "pipeline_list")
    )
    if not isinstance(tmpl, list) or not tmpl:
        raise ImportFormatError(file, "pipeline_list", "expected a non-empty list")
    specs: list[list[tuple[int, int, ReplicaGroup]]] = []
    for ti, t in enumerate(tmpl):
        specs.extend(_template(t, f"pipeline_list[{ti}]", file))
    if gbs % mbs:
        raise ImportFormatError(file, "gbs", f"{gbs} is not a multiple of mbs={mbs}")
    total_mb = gbs // mbs
    n = len(specs)
    if total_mb < n:
        raise ImportFormatError(
            file, "gbs", f"{gbs} samples give {total_mb} microbatches for {n} pipelines"
        )
    pipelines: list[Pipeline] = []
    for j, stages in enumerate(specs):
        m = total_mb // n + (1 if j < total_mb % n else 0)
        pipelines.append(
            Pipeline(
                stages=tuple(Stage(first_layer=a, last_layer=b, replica=r) for a, b, r in stages),
                microbatch_size=mbs,
                num_microbatches=m,
            )
        )
    name = Path(file).stem if file != "<plan>" else "imported"
    try:
        return Plan(
            plan_id=name,
            model=model,
            global_batch_size=gbs,
            pipelines=tuple(pipelines),
            precision=precision,
        )
    except ValueError as exc:
        raise ImportFormatError(file, "pipeline_list", str(exc)) from exc


def _template(t: Any, field: str, file: str) -> list[list[tuple[int, int, ReplicaGroup]]]:
    layers = get(t, "layers_per_stage", file, f"{field}.layers_per_stage")
    key = "tmp_per_stage" if "tmp_per_stage" in t else "tmp_stages"
    reps = get(t, key, file, f"{field}.tmp_per_stage")
    dps = t.get("dp", t.get("dp_degrees"))
    if not isinstance(layers, list) or not isinstance(reps, list) or len(layers) != len(reps):
        raise ImportFormatError(file, f"{field}.layers_per_stage", "must list one entry per stage")
    if "num_stages" in t and as_int(t["num_stages"], file, f"{field}.num_stages") != len(layers):
        raise ImportFormatError(
            file, f"{field}.num_stages", f"{t['num_stages']} != {len(layers)} stages"
        )
    ranges: list[tuple[int, int]] = []
    for si, ls in enumerate(layers):
        if not isinstance(ls, list) or not ls:
            raise ImportFormatError(
                file, f"{field}.layers_per_stage[{si}]", "expected layer indices"
            )
        idx = [as_int(x, file, f"{field}.layers_per_stage[{si}]", min_value=0) for x in ls]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise ImportFormatError(
                file, f"{field}.layers_per_stage[{si}]", "layers must be contiguous"
            )
        ranges.append((idx[0], idx[-1]))
    degrees = {len(r) if isinstance(r, list) else -1 for r in reps}
    if len(degrees) != 1 or -1 in degrees:
        raise ImportFormatError(
            file,
            f"{field}.{key}",
            f"every stage needs the same number of replicas, got {sorted(degrees)}; "
            "per-stage data parallelism (stage-wise DP as in Piper) has no equivalent "
            "in pipelines of single replica groups",
        )
    d = degrees.pop()
    if dps is not None and (
        not isinstance(dps, list) or any(as_int(x, file, f"{field}.dp") != d for x in dps)
    ):
        raise ImportFormatError(
            file, f"{field}.dp", f"{dps!r} disagrees with {d} replicas per stage"
        )
    out: list[list[tuple[int, int, ReplicaGroup]]] = []
    for j in range(d):
        stages: list[tuple[int, int, ReplicaGroup]] = []
        for si, (a, b) in enumerate(ranges):
            stages.append((a, b, _replica(reps[si][j], f"{field}.{key}[{si}][{j}]", file)))
        out.append(stages)
    return out


def _replica(r: Any, field: str, file: str) -> ReplicaGroup:
    if not isinstance(r, list) or len(r) != 2 or not isinstance(r[0], list) or not r[0]:
        raise ImportFormatError(
            file, field, f"expected [[[gpu, gpus_per_node, zone]], tp], got {r!r}"
        )
    node = r[0][0]
    if not isinstance(node, list) or len(node) != 3:
        raise ImportFormatError(
            file, field + "[0][0]", f"expected [gpu, gpus_per_node, zone], got {node!r}"
        )
    gpu, gpn, zone = node
    if not isinstance(gpu, str) or not isinstance(zone, str):
        raise ImportFormatError(
            file, field + "[0][0]", f"gpu and zone must be strings, got {node!r}"
        )
    tp = as_int(r[1], file, field + "[1]", min_value=1)
    k = as_int(gpn, file, field + "[0][0][1]", min_value=1)
    try:
        return ReplicaGroup(gpu_type=gpu, zone=zone, tp=tp, gpus_per_node=k)
    except ValueError as exc:
        raise ImportFormatError(file, field, str(exc)) from exc


def export_plan(plan: Plan) -> dict[str, Any]:
    """The plan in the original's plan-config format (one microbatch size required)."""
    sizes = {p.microbatch_size for p in plan.pipelines}
    if len(sizes) != 1:
        raise ValueError(
            f"pipelines[*].microbatch_size={sorted(sizes)}: the original format has one "
            "microbatch size per plan"
        )
    groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for i, p in enumerate(plan.pipelines):
        key = tuple((s.first_layer, s.last_layer) for s in p.stages)
        groups.setdefault(key, []).append(i)
    zones = sorted({s.replica.zone for p in plan.pipelines for s in p.stages})
    templates: list[dict[str, Any]] = []
    for key, members in groups.items():
        templates.append(
            {
                "num_stages": len(key),
                "layers_per_stage": [list(range(a, b + 1)) for a, b in key],
                "tmp_per_stage": [
                    [
                        [[[r.gpu_type, r.gpus_per_node, r.zone]], r.tp]
                        for r in (plan.pipelines[j].stages[si].replica for j in members)
                    ]
                    for si in range(len(key))
                ],
                "dp": [len(members)] * len(key),
            }
        )
    return {
        "zone": zones[0],
        "pipeline_list": templates,
        "mbs": sizes.pop(),
        "gbs": plan.global_batch_size,
    }
