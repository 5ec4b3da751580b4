"""Phase deadlines derived from what the plan moves (``controller/plan_deadlines.py``).

A 7B model on two 8-GPU nodes needs minutes of CHECKPOINT and LOAD; bad settings are
refused by name.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sailor import catalog
from sailor.controller.plan_deadlines import (
    CHECKPOINT_BYTES_PER_PARAM,
    DeadlineModel,
    checkpoint_layer_bytes,
    derived_deadlines,
    phase_need,
    read_bytes_per_node,
    write_bytes_per_node,
)
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Pipeline, Plan, PlanPrediction, ReplicaGroup, Stage
from sailor.schemas.runtime import Phase

NOW = 1000.0

LLAMA_7B = ModelSpec(
    name="llama-2-7b",
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    ffn_hidden_size=11008,
    seq_length=4096,
    vocab_size=32000,
    activation="swiglu",
    norm="rmsnorm",
    position_embedding="rope",
    tie_embeddings=False,
    global_batch_size=512,
    precision="bf16",
)


def _plan(
    model: ModelSpec,
    stages: int,
    tp: int,
    nodes: tuple[str, ...],
    iteration_s: float | None = None,
    gpu: str = "A100-80",
) -> tuple[Plan, dict[str, tuple[int, ...]]]:
    """One pipeline of ``stages`` even stages at TP ``tp``, stage i on ``nodes[i]``."""
    n = model.num_all_layers
    cuts = [round(i * n / stages) for i in range(stages + 1)]
    st = tuple(
        Stage(
            first_layer=cuts[i],
            last_layer=cuts[i + 1] - 1,
            replica=ReplicaGroup(gpu_type=gpu, zone="z", tp=tp, gpus_per_node=max(tp, 1)),
        )
        for i in range(stages)
    )
    pred = (
        PlanPrediction(
            iteration_time_s=iteration_s,
            throughput_iter_s=1 / iteration_s,
            peak_memory_bytes=0,
            cost_per_iter_usd=0,
        )
        if iteration_s
        else None
    )
    plan = Plan(
        plan_id=f"{model.name}-{stages}x{tp}",
        model=model.name,
        global_batch_size=8,
        pipelines=(Pipeline(stages=st, microbatch_size=1, num_microbatches=8),),
        predicted=pred,
    )
    placement = {nodes[i]: tuple(range(i * tp, (i + 1) * tp)) for i in range(stages)}
    return plan, placement


def test_a_checkpoint_holds_twelve_bytes_per_parameter() -> None:
    """The fp32 master weight and both AdamW moments, as ``sailor.checkpoint`` stores them
    (not a 16-bit copy: autocast keeps none), the vocabulary padded as the engine pads it."""
    assert CHECKPOINT_BYTES_PER_PARAM == 12
    m = catalog.model("OPT-350")  # vocab 50272 = 785.5 x 64: padded to 50304
    assert checkpoint_layer_bytes(m, 1) == m.layer_params(1) * 12
    pad = (50304 - 50272) * m.hidden_size
    assert checkpoint_layer_bytes(m, 0) == (m.layer_params(0) + pad) * 12


def test_a_7b_model_on_two_8_gpu_nodes_gets_minutes_of_checkpoint_and_load() -> None:
    plan, placement = _plan(LLAMA_7B, 2, 8, ("n1", "n2"), iteration_s=8.0)
    writes = write_bytes_per_node(plan, placement, LLAMA_7B)
    total = sum(checkpoint_layer_bytes(LLAMA_7B, x) for x in range(LLAMA_7B.num_all_layers))
    assert sum(writes.values()) == total  # every layer written once
    assert 80e9 < total < 82e9  # 6.74 B parameters x 12 B
    reads = read_bytes_per_node(plan, placement, LLAMA_7B)
    assert reads["n2"] == pytest.approx(writes["n2"], rel=1e-3)  # its own stage, whole
    need = derived_deadlines(plan, placement, LLAMA_7B)
    ck, load = need[Phase.CHECKPOINT], need[Phase.LOAD]
    # n2 (blocks 17-32, the head) writes 40.4 GB; at 125 MiB/s x2 + 10 s: ~10.5 minutes
    assert ck.node == "n2" and ck.bytes == writes["n2"]
    assert ck.seconds == pytest.approx(10 + 2 * writes["n2"] / (125 * 2**20))
    assert 9 * 60 < ck.seconds < 12 * 60
    assert 9 * 60 < load.seconds < 12 * 60 and load.node == "n2"
    assert ck.why() == "node n2 writes 40.4 GB at 125 MiB/s x2 + 10 s start-up"
    assert need[Phase.VERIFY].seconds == pytest.approx(20 + 2 * 2 * 8.0)
    assert need[Phase.QUIESCE].seconds == pytest.approx(2 * 2 * 8.0)  # stop_ahead_steps 1, +1
    # a faster disk (a local NVMe at 2 GB/s) shortens it in proportion
    fast = derived_deadlines(plan, placement, LLAMA_7B, DeadlineModel(write_mib_s=2000))
    assert fast[Phase.CHECKPOINT].seconds == pytest.approx(10 + (ck.seconds - 10) / 16)
    # a launch that loads no checkpoint reads nothing
    fresh = phase_need(
        Phase.LOAD, plan, placement, LLAMA_7B, DeadlineModel(), loads_checkpoint=False
    )
    assert fresh is not None and fresh.bytes == 0 and fresh.seconds == 20


def test_the_busiest_node_sets_it_and_tp_ranks_read_their_slices() -> None:
    """Four stages on two nodes: a node holding two stages reads both; a stage at TP 2
    reads each split tensor once in all (two halves) and a replicated one (the learned
    position table, the final norm) once per TP rank; the simulator's per-rank count leaves
    out the padded vocabulary rows (at most 63) and splits a block's norms."""
    m = catalog.model("GPT-Neo-2.7")
    plan, _ = _plan(m, 4, 2, ("a", "b", "c", "d"))
    placement = {"x": (0, 1, 2, 3), "y": (4, 5, 6, 7)}
    reads = read_bytes_per_node(plan, placement, m)
    per_stage = [
        sum(checkpoint_layer_bytes(m, x) for x in s.layers) for s in plan.pipelines[0].stages
    ]
    pos = m.seq_length * m.hidden_size  # read by both TP ranks of stage 0
    pad = (50304 - m.vocab_size) * m.hidden_size  # the simulator's count leaves it out
    assert reads["x"] == per_stage[0] + per_stage[1] + 12 * (pos - pad)
    norm = 2 * m.hidden_size  # the head's final layernorm, read by both TP ranks of stage 3
    assert reads["y"] == per_stage[2] + per_stage[3] + 12 * (norm - pad)
    need = phase_need(Phase.LOAD, plan, placement, m, DeadlineModel())
    assert need is not None and need.node == max(reads, key=lambda n: reads[n])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("write_mib_s", 0),
        ("read_mib_s", -100),
        ("safety", 0.5),
        ("verify_steps", 0),
        ("load_startup_s", -1),
        ("write_mib_s", float("nan")),
    ],
)
def test_bad_settings_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValidationError) as exc:
        DeadlineModel(**{field: value})
    text = str(exc.value)
    assert field in text and f"input_value={value}" in text


def test_another_models_plan_is_refused() -> None:
    plan, placement = _plan(LLAMA_7B, 2, 8, ("n1", "n2"))
    tiny = catalog.model("tiny-gpt")
    with pytest.raises(ValueError, match="has 34 layers, model 'tiny-gpt' 6"):
        phase_need(Phase.CHECKPOINT, plan, placement, tiny, DeadlineModel())
