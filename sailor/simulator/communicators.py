"""How many NCCL communicators each GPU of a plan holds, under a deployment's process groups.

Every process group a rank belongs to is an NCCL communicator with GPU buffers of its own
(channels × peers × protocol buffers, a few hundred MB each over NVLink: NVIDIA/nccl#964,
docs/simulator-model.md section 6), so a rank's non-tensor memory grows with the number of
groups it is in; the memory model prices ``count × GPUCalibration.communicator_bytes``.

* ``engine`` (Sailor's engine): counted from the layout the engine creates its groups from
  (:func:`sailor.simulator.process_groups.engine_communicators`: world, TP group, every
  gradient-sync group the rank is in), not a second description of it. A heterogeneous plan
  with many layer segments puts a rank in several sync groups.
* ``megatron_deepspeed``: the groups Megatron-DeepSpeed's training step uses on a rank of a
  plan of alike pipelines (the framework of the measured GH200 runs). Under torch's lazy
  NCCL initialisation (no ``device_id``, as those runs) a communicator is made at a group's
  first collective, so groups created but never used (the wrap-around p2p pair of
  DeepSpeed's ``PipelineParallelGrid._build_p2p_groups``) hold none.

Pure: values in, values out.
"""

from __future__ import annotations

from sailor.schemas.deployment import ProcessGroups
from sailor.schemas.plan import Plan
from sailor.simulator.process_groups import engine_communicators

__all__ = ["megatron_deepspeed_communicators", "stage_communicators"]


def megatron_deepspeed_communicators(
    stage: int, depth: int, tp: int, data_parallel: int, tie_embeddings: bool
) -> int:
    """Communicators of a rank of ``stage`` (of ``depth``) at TP ``tp`` among
    ``data_parallel`` alike pipelines under Megatron-DeepSpeed: the world group (barriers),
    its TP group (TP all-reduces), data-parallel group (gradient all-reduce), Megatron's
    model-parallel group (TP × PP: the gradient norm's and the overflow check's
    all-reduces), DeepSpeed's pipeline group (the loss broadcast), one 2-rank group per
    pipeline neighbour (the pipe engine sends by broadcast in them) and, with tied
    embeddings, the first and last stages' tied-weight group."""
    if not 0 <= stage < depth or tp < 1 or data_parallel < 1:
        raise ValueError(
            f"stage={stage}, depth={depth}, tp={tp}, data_parallel={data_parallel}: "
            "a stage of a pipeline, TP and data parallelism of at least 1"
        )
    piped = depth > 1
    ends = stage in (0, depth - 1)
    neighbours = 0 if not piped else (1 if ends else 2)
    return (
        1
        + (tp > 1)
        + (data_parallel > 1)
        + (tp * depth > 1)
        + piped
        + neighbours
        + (piped and ends and tie_embeddings)
    )


def stage_communicators(
    plan: Plan, groups: ProcessGroups, tie_embeddings: bool
) -> tuple[tuple[int, ...], ...]:
    """Per pipeline, per stage: the communicators of the stage's rank that holds the most
    (its TP ranks hold as many under both layouts)."""
    if groups == "engine":
        per_rank = engine_communicators(plan, tie_embeddings)
        out: list[tuple[int, ...]] = []
        first = 0
        for p in plan.pipelines:
            row: list[int] = []
            for s in p.stages:
                row.append(max(per_rank[first : first + s.replica.tp]))
                first += s.replica.tp
            out.append(tuple(row))
        return tuple(out)
    if groups == "megatron_deepspeed":
        dp = len(plan.pipelines)
        return tuple(
            tuple(
                megatron_deepspeed_communicators(si, p.depth, s.replica.tp, dp, tie_embeddings)
                for si, s in enumerate(p.stages)
            )
            for p in plan.pipelines
        )
    raise ValueError(f"process_groups={groups!r}: use 'engine' or 'megatron_deepspeed'")
