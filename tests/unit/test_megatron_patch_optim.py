"""LR schedule, weight-decay groups and the once-per-element rule of the global gradient norm.

The schedule is checked against ``transformers``' own schedulers (code we do not share),
step by step, including a resume in the middle (a pure function of the step). The norm rule
is checked on heterogeneous plans: over all ranks, the elements that enter the norm are
exactly the elements of the single-process model (tied matrix once).
"""

from __future__ import annotations

import pytest
import torch

from sailor.megatron_patch.clipping import counts_in_norm
from sailor.megatron_patch.model import GPTStage, tiny_model
from sailor.megatron_patch.optim import param_groups
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.tp_layers import TPContext, tp_dim_of
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.training import NoDecay, ScheduleConfig, decays


def _hf_rates(kind: str, warmup: int, total: int, min_ratio: float, steps: int) -> list[float]:
    import transformers

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if kind == "cosine":
        sched = transformers.get_cosine_with_min_lr_schedule_with_warmup(
            opt, warmup, total, min_lr_rate=min_ratio
        )
    else:
        sched = transformers.get_linear_schedule_with_warmup(opt, warmup, total)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


@pytest.mark.parametrize(
    ("kind", "warmup", "total", "min_ratio"),
    [("cosine", 3, 10, 0.0), ("cosine", 0, 7, 0.1), ("linear", 2, 9, 0.0), ("linear", 0, 4, 0.0)],
)
def test_schedule_equals_transformers_and_resumes_anywhere(
    kind: str, warmup: int, total: int, min_ratio: float
) -> None:
    sched = ScheduleConfig(
        warmup_steps=warmup, decay=kind, total_steps=total, min_lr_ratio=min_ratio
    )  # type: ignore[arg-type]
    theirs = _hf_rates(kind, warmup, total, min_ratio, total + 1)
    mine = [sched.lr_at(s, 1.0) for s in range(total + 3)]
    assert mine[: total + 1] == pytest.approx(theirs, rel=1e-12, abs=1e-15)
    # past the end it stays at the floor (transformers' cosine would rise again)
    assert mine[total:] == pytest.approx([min_ratio] * 3, abs=1e-15)
    resumed = [sched.lr_at(s, 1.0) for s in range(5, total + 3)]  # restart at step 5
    assert resumed == mine[5:]


def test_schedule_refuses_a_decay_that_ends_before_warmup() -> None:
    with pytest.raises(ValueError, match="warmup_steps=5: must be below total_steps=5"):
        ScheduleConfig(warmup_steps=5, decay="cosine", total_steps=5)
    assert ScheduleConfig().lr_at(123, 0.1) == 0.1


def test_decay_groups_by_layer_keyed_name() -> None:
    groups: tuple[NoDecay, ...] = ("bias", "norm", "embedding")
    assert not decays("0.wte.weight", groups, tied=True)
    assert not decays("0.wpe.weight", groups, tied=True)
    assert not decays("3.ln1.weight", groups, tied=True)
    assert not decays("3.attn_q.bias", groups, tied=True)
    assert not decays("7.norm.weight", groups, tied=True)
    assert not decays("7.lm_head.weight", groups, tied=True)  # the tied embedding
    assert decays("7.lm_head.weight", groups, tied=False)
    assert decays("3.attn_q.weight", groups, tied=True)
    assert decays("0.project_in.weight", groups, tied=True)
    assert decays("3.ln1.weight", (), tied=True)
    spec = tiny_model("tiny-gpt")
    stage = GPTStage(spec, 0, spec.num_all_layers - 1, tie_in_module=True)
    pg = param_groups(stage.keyed_parameters(), 0.1, groups, spec.tie_embeddings)
    assert [g["weight_decay"] for g in pg] == [0.1, 0.0]
    n_unique = len({id(p) for p in stage.parameters()})
    assert sum(len(g["params"]) for g in pg) == n_unique  # the shared matrix once


def _stage(a: int, b: int, tp: int = 1) -> Stage:
    replica = ReplicaGroup(gpu_type="cpu", zone="z", tp=tp, gpus_per_node=4)
    return Stage(first_layer=a, last_layer=b, replica=replica)


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-llama"])
def test_every_element_enters_the_global_norm_exactly_once(model: str) -> None:
    pipelines = (
        Pipeline(stages=(_stage(0, 1), _stage(2, 3, tp=2), _stage(4, 5)), microbatch_size=1,
                 num_microbatches=2),
        Pipeline(stages=(_stage(0, 3, tp=2), _stage(4, 5, tp=2)), microbatch_size=2,
                 num_microbatches=1),
        Pipeline(stages=(_stage(0, 5),), microbatch_size=2, num_microbatches=1),
    )  # fmt: skip
    plan = Plan(model=model, global_batch_size=6, pipelines=pipelines)
    spec = tiny_model(model, 6)
    head = spec.num_all_layers - 1
    counted: dict[str, int] = {}
    naive = 0
    for rank in range(len(plan.ranks())):
        role = role_of(plan, rank)
        tp = TPContext(size=role.tp, rank=role.tp_rank, group=object() if role.tp > 1 else None)
        stage = GPTStage(spec, role.first_layer, role.last_layer, tp=tp)
        for name, p in stage.keyed_parameters():
            naive += p.numel()
            if counts_in_norm(name, tp_dim_of(p), role, spec.tie_embeddings, head):
                counted[name] = counted.get(name, 0) + p.numel()
    whole = GPTStage(spec, 0, head, tie_in_module=True)
    unique: dict[int, tuple[str, int]] = {}
    for n, p in whole.keyed_parameters():  # a tied matrix by its first name, 0.wte.weight
        unique.setdefault(id(p), (n, p.numel()))
    assert counted == dict(unique.values())
    assert naive > sum(counted.values())  # summing every rank's norm would overcount
