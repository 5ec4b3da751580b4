"""Pure plan -> engine mappings: DeepSpeed pipeline settings and Megatron-core parallel state."""

from __future__ import annotations

import pytest

from sailor.megatron_patch.deepspeed_adapter import (
    UnsupportedPlanError,
    deepspeed_config,
    deepspeed_layout,
)
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


def test_deepspeed_config_leaves_the_update_to_sailors_adamw() -> None:
    """DeepSpeed, reading the adapter's config, neither clips nor swaps the optimizer.

    Catches the adapter inheriting DeepSpeed's default global-norm clipping at 1.0
    (``GRADIENT_CLIPPING_DEFAULT``), which rescales each step's gradients before AdamW and
    drifts the parameters from Sailor's engine; and a DeepSpeed optimizer or scheduler
    section, which would replace the AdamW the adapter passes in.
    """
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    plan = _plan(_pipe([(0, 3), (4, 5)]), _pipe([(0, 3), (4, 5)]))
    cfg = deepspeed_config(deepspeed_layout(plan), plan)
    assert ds_config.get_gradient_clipping(cfg) == 0.0
    assert ds_config.get_optimizer_name(cfg) is None
    assert ds_config.get_scheduler_name(cfg) is None


def test_megatron_layout_maps_groups_and_rank_order() -> None:
    from sailor.megatron_patch.megatron_adapter import megatron_layout
    from sailor.megatron_patch.roles import role_of

    # 2 pipelines x 3 stages x TP 2; 10 global layers = embedding + 8 blocks + head.
    cuts = [(0, 3), (4, 6), (7, 9)]
    plan = _plan(_pipe(cuts, tp=2), _pipe(cuts, tp=2))
    lay = megatron_layout(plan)
    assert (lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size) == (2, 3)
    assert lay.data_parallel_size == 2 and lay.num_layers == 8
    assert lay.num_layers_in_first_pipeline_stage is None  # 3 blocks == middle's 3
    assert lay.num_layers_in_last_pipeline_stage == 2
    perm = lay.megatron_rank_of_sailor_rank
    assert sorted(perm) == list(range(12))
    # Same groups, whichever order names them.
    sailor_tp = {tuple(role_of(plan, r).tp_group) for r in range(12)}
    megatron_tp = {
        tuple(sorted(lay.sailor_rank_of_megatron_rank(m) for m in g))
        for g in lay.tensor_parallel_groups()
    }
    assert megatron_tp == sailor_tp
    for g in lay.pipeline_groups():
        roles = [role_of(plan, lay.sailor_rank_of_megatron_rank(m)) for m in g]
        assert [r.stage for r in roles] == [0, 1, 2]
        assert len({(r.pipeline, r.tp_rank) for r in roles}) == 1
    for g in lay.data_parallel_groups():
        roles = [role_of(plan, lay.sailor_rank_of_megatron_rank(m)) for m in g]
        assert len({(r.stage, r.tp_rank) for r in roles}) == 1
        assert sorted(r.pipeline for r in roles) == [0, 1]


def test_megatron_layout_rejects_heterogeneous_plans() -> None:
    from sailor.megatron_patch.megatron_adapter import UnsupportedPlanError as MErr
    from sailor.megatron_patch.megatron_adapter import initialize_megatron, megatron_layout

    with pytest.raises(MErr, match="TP degrees"):
        megatron_layout(_plan(_pipe([(0, 5)], tp=2), _pipe([(0, 5)], tp=1)))
    with pytest.raises(MErr, match="middle"):
        megatron_layout(_plan(_pipe([(0, 1), (2, 3), (4, 6), (7, 9)])))
    lay = megatron_layout(_plan(_pipe([(0, 5)])))
    assert lay.pipeline_model_parallel_size == 1 and lay.num_layers == 4
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="optional"):
            initialize_megatron(lay)
