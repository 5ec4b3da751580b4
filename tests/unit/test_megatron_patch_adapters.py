"""Pure plan -> engine mappings: DeepSpeed pipeline settings and Megatron-core parallel state."""

from __future__ import annotations

import pytest

from sailor.megatron_patch.deepspeed_adapter import UnsupportedPlanError, deepspeed_layout
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage


def _pipe(cuts: list[tuple[int, int]], tp: int = 1, mbs: int = 2, m: int = 2) -> Pipeline:
    rg = ReplicaGroup(gpu_type="A100", zone="z", tp=tp, gpus_per_node=4)
    return Pipeline(
        stages=tuple(Stage(first_layer=a, last_layer=b, replica=rg) for a, b in cuts),
        microbatch_size=mbs,
        num_microbatches=m,
    )


def _plan(*pipes: Pipeline) -> Plan:
    return Plan(model="m", global_batch_size=sum(p.samples for p in pipes), pipelines=pipes)


def test_deepspeed_layout_of_a_uniform_plan_keeps_the_uneven_partition() -> None:
    lay = deepspeed_layout(_plan(_pipe([(0, 3), (4, 5)]), _pipe([(0, 3), (4, 5)])))
    assert lay.parts == (0, 4, 6)
    assert (lay.num_stages, lay.data_parallel) == (2, 2)
    assert (lay.micro_batch_size, lay.gradient_accumulation_steps) == (2, 2)
    assert lay.activation_checkpoint_interval == 0


@pytest.mark.parametrize(
    ("plan", "why"),
    [
        (_plan(_pipe([(0, 3), (4, 5)]), _pipe([(0, 2), (3, 5)])), "partition"),
        (_plan(_pipe([(0, 5)]), _pipe([(0, 5)], mbs=1)), "microbatch"),
        (_plan(_pipe([(0, 5)], tp=2)), "tp=2"),
    ],
)
def test_deepspeed_layout_rejects_what_it_cannot_run(plan: Plan, why: str) -> None:
    with pytest.raises(UnsupportedPlanError, match=why):
        deepspeed_layout(plan)
