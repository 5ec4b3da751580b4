"""Phase deadlines derived from what the plan moves (``controller/plan_deadlines.py``), and
their way through ``decide`` (the executor's audit record of them:
tests/integration/test_controller_executor.py, which builds its plan with ``even_plan``).

A 7B model on two 8-GPU nodes gets minutes of CHECKPOINT and LOAD deadline (it got the CPU
demo's 60 s and 120 s before); the demo's tiny model keeps every configured deadline; bad
settings are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from sailor import catalog
from sailor.controller.config import ControllerConfig
from sailor.controller.decide import decide
from sailor.controller.decision_types import (
    DecideConfig,
    Observed,
    SetDesired,
    move_to,
    phase_deadline,
)
from sailor.controller.launch import launch_next
from sailor.controller.phases import PhaseDeadlines
from sailor.controller.plan_deadlines import (
    CHECKPOINT_BYTES_PER_PARAM,
    DeadlineModel,
    MeasuredIteration,
    _held_ranks,
    checkpoint_layer_bytes,
    derived_deadlines,
    in_place_read_bytes,
    phase_need,
    read_bytes_per_node,
    write_bytes_per_node,
)
from sailor.megatron_patch.held_match import match_held
from sailor.megatron_patch.relayout import RankSchedule, Schedule, Transfer, schedule
from sailor.megatron_patch.roles import replica_ranks, role_of
from sailor.schemas.device_kind import is_cpu_type
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Pipeline, Plan, PlanPrediction, ReplicaGroup, Stage
from sailor.schemas.runtime import AgentState, AgentStatus, DesiredState, NoticeRecord, Phase

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


def even_plan(
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
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"), iteration_s=8.0)
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
    assert need[Phase.QUIESCE].why() == "2 iterations of 8 s (predicted) x2"
    assert need[Phase.VERIFY].why() == "2 iterations of 8 s (predicted) x2 + 20 s start-up"
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
    position table, the final norm) once per TP rank; the padded vocabulary rows (at most
    63), which the simulator's per-rank count leaves out, are read as the checkpoint holds
    them (review: the reads left them out, the writes not)."""
    m = catalog.model("GPT-Neo-2.7")
    plan, _ = even_plan(m, 4, 2, ("a", "b", "c", "d"))
    placement = {"x": (0, 1, 2, 3), "y": (4, 5, 6, 7)}
    reads = read_bytes_per_node(plan, placement, m)
    per_stage = [
        sum(checkpoint_layer_bytes(m, x) for x in s.layers) for s in plan.pipelines[0].stages
    ]
    pos = m.seq_length * m.hidden_size  # read by both TP ranks of stage 0
    assert m.vocab_size < 50304  # padded: the rows counted in both
    assert reads["x"] == per_stage[0] + per_stage[1] + 12 * pos
    norm = 2 * m.hidden_size  # the head's final layernorm, read by both TP ranks of stage 3
    assert reads["y"] == per_stage[2] + per_stage[3] + 12 * norm
    need = phase_need(Phase.LOAD, plan, placement, m, DeadlineModel())
    assert need is not None and need.node == max(reads, key=lambda n: reads[n])


def _demo_plan() -> tuple[Plan, dict[str, tuple[int, ...]], ModelSpec]:
    m = catalog.model("tiny-gpt")
    plan, placement = even_plan(m, 2, 1, ("cpu-a", "cpu-b"), iteration_s=1.0, gpu="cpu")
    return plan, placement, m


@pytest.mark.parametrize(
    "deadlines",
    [
        PhaseDeadlines(),  # the defaults: make demo's controller config
        PhaseDeadlines(quiesce=20, checkpoint=20, launch=15, load=60, verify=60),  # demo
        PhaseDeadlines(quiesce=15, checkpoint=15, launch=10, load=30, verify=30),  # integration
    ],
)
def test_the_demo_model_keeps_every_configured_deadline(deadlines: PhaseDeadlines) -> None:
    """The tiny model (a step of 1 s, generously: well under one on the demo) needs less
    than every configured deadline the demo and the tests run with, so theirs are the ones
    that fire, when they fired before."""
    plan, placement, m = _demo_plan()
    cfg = DecideConfig(checkpoint_dir="/ck", deadlines=deadlines, model=m, stop_ahead_steps=2)
    d = DesiredState(epoch=1, plan=plan, placement=placement, load_step=5)
    for phase in Phase:
        got = phase_deadline(d, phase, cfg)
        assert got.seconds == deadlines.of(phase), phase
        assert not got.derived
    why = phase_deadline(d, Phase.CHECKPOINT, cfg).why()
    assert why.startswith(f"configured deadlines.checkpoint {deadlines.checkpoint:g} s (plan ")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("write_mib_s", 0),
        ("write_mib_s", 0.01),
        ("read_mib_s", -100),
        ("read_mib_s", 0.5),
        ("max_s", 0),
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
    raw = {"deadlines": {"derive": {field: value}}}
    with pytest.raises(ValidationError) as exc:
        ControllerConfig.model_validate(raw)
    assert f"deadlines.derive.{field}" in str(exc.value)


def test_a_derived_deadline_is_capped_and_the_why_says_so() -> None:
    """A wild predicted iteration time (or a throughput of 1 MiB/s) gave deadlines of days
    (review: 0.01 MiB/s gave ~93 days of CHECKPOINT for a 7B plan, and the LOAD and VERIFY
    stretch doubled them): the need stops at ``max_s`` (3 h), and the record says so."""
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"), iteration_s=3600.0)
    slow = DeadlineModel(write_mib_s=1, read_mib_s=1)
    need = derived_deadlines(plan, placement, LLAMA_7B, slow)
    for phase in (Phase.CHECKPOINT, Phase.LOAD, Phase.VERIFY, Phase.QUIESCE):
        assert need[phase].seconds == 3 * 3600, phase
    ck = need[Phase.CHECKPOINT]
    assert ck.uncapped_s == pytest.approx(10 + 2 * ck.bytes / 2**20)
    assert ck.why().endswith(f"= {ck.uncapped_s:.0f} s, capped by deadlines.derive.max_s")
    assert need[Phase.VERIFY].why() == (
        "2 iterations of 3.6e+03 s (predicted) x2 + 20 s start-up = 14420 s, capped by "
        "deadlines.derive.max_s"
    )
    cfg = large_cfg(deadlines=PhaseDeadlines(derive=slow.model_copy(update={"max_s": 900})))
    d = DesiredState(epoch=1, plan=plan, placement=placement, load_step=5)
    got = phase_deadline(d, Phase.LOAD, cfg)
    assert got.seconds == 900 and got.derived
    assert "capped by deadlines.derive.max_s = 900 s (above deadlines.load 120 s)" in got.why()
    # within the cap: the formula's own figure, nothing said
    assert derived_deadlines(plan, placement, LLAMA_7B)[Phase.LOAD].uncapped_s == 0


def test_another_models_plan_is_refused_by_the_function_and_not_derived_by_decide() -> None:
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"))
    tiny = catalog.model("tiny-gpt")
    with pytest.raises(ValueError, match="has 34 layers, model 'tiny-gpt' 6"):
        phase_need(Phase.CHECKPOINT, plan, placement, tiny, DeadlineModel())
    cfg = DecideConfig(checkpoint_dir="/ck", model=tiny)
    got = phase_deadline(DesiredState(epoch=1, plan=plan, placement=placement), Phase.LOAD, cfg)
    assert got.seconds == 120 and "not derived: plan 'llama-2-7b-2x8' has 34 layers" in got.why()


def test_derivation_can_be_turned_off() -> None:
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"))
    off = PhaseDeadlines(derive=DeadlineModel(enabled=False))
    cfg = DecideConfig(checkpoint_dir="/ck", model=LLAMA_7B, deadlines=off)
    d = DesiredState(epoch=1, plan=plan, placement=placement)
    got = phase_deadline(d, Phase.CHECKPOINT, cfg)
    assert got.seconds == 60
    assert got.why() == (
        "configured deadlines.checkpoint 60 s (not derived: deadlines.derive.enabled is false)"
    )


def _st(node: str, gen: int, step: int, state: AgentState = "running") -> AgentStatus:
    return AgentStatus(node_id=node, generation=gen, state=state, step=step)


def large_cfg(**kw: Any) -> DecideConfig:
    """The decide settings of a controller whose model is the 7B (its deadlines derived)."""
    return DecideConfig(checkpoint_dir="/ck", model=LLAMA_7B, **kw)


def _ns(*ids: str) -> dict[str, NodeSpec]:
    return {n: NodeSpec(node_id=n, gpu_type="A100-80", gpus=8, zone="z", address="h") for n in ids}


def test_decide_gives_a_large_plans_checkpoint_the_derived_deadline() -> None:
    """QUIESCE -> CHECKPOINT of a 7B plan: ~10 minutes from now, not the configured 60 s
    (which aborted every reconfiguration of such a job: CHECKPOINT does not stretch)."""
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"), iteration_s=8.0)
    cfg = large_cfg()
    d = DesiredState(
        epoch=3,
        generation=1,
        phase=Phase.QUIESCE,
        phase_since=NOW - 5,
        phase_deadline=NOW + 60,
        plan=plan,
        placement=placement,
        membership=("n1", "n2"),
        stop_step=12,
    )
    o = Observed(now=NOW, nodes=_ns("n1", "n2"), status={n: _st(n, 1, 12) for n in placement})
    moved = [a for a in decide(d, o, cfg) if isinstance(a, SetDesired)]
    assert [a.state.phase for a in moved] == [Phase.CHECKPOINT]
    state = moved[0].state
    want = derived_deadlines(plan, placement, LLAMA_7B)[Phase.CHECKPOINT].seconds
    assert state.phase_deadline == pytest.approx(NOW + want)
    assert 9 * 60 < want < 12 * 60
    # the same through the configured path: without the model, the floor
    bare = [
        a for a in decide(d, o, DecideConfig(checkpoint_dir="/ck")) if isinstance(a, SetDesired)
    ]
    assert bare[0].state.phase_deadline == NOW + 60


def test_decide_derives_load_and_verify_of_the_plan_launched_and_the_stretch_stacks() -> None:
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"), iteration_s=30.0)
    cfg = large_cfg()
    d = DesiredState(
        epoch=3,
        generation=2,
        phase=Phase.LAUNCH,
        phase_since=NOW - 5,
        phase_deadline=NOW + 20,
        plan=plan,
        placement=placement,
        membership=("n1", "n2"),
        load_step=12,
        deadline_stretch={"load": 2},
    )
    acked = frozenset(f"e3-g2-launch-{n}" for n in placement)
    o = Observed(
        now=NOW,
        nodes=_ns("n1", "n2"),
        status={n: _st(n, 2, 12, "idle") for n in placement},
        acked=acked,
    )
    (a,) = decide(d, o, cfg)
    assert isinstance(a, SetDesired) and a.state.phase is Phase.LOAD
    need = derived_deadlines(plan, placement, LLAMA_7B)
    assert a.state.phase_deadline == pytest.approx(NOW + 2 * need[Phase.LOAD].seconds)
    why = phase_deadline(a.state, Phase.LOAD, cfg).why()
    assert why.startswith("derived from plan llama-2-7b-2x8: node n2 reads 40.4 GB")
    assert why.endswith(f"stretched x2: {2 * need[Phase.LOAD].seconds:.0f} s")
    # its workers up after 600 s: within the derived deadline, so the stretch goes
    later = Observed(
        now=NOW + 600,
        nodes=o.nodes,
        status={n: _st(n, 2, 12) for n in placement},
        acked=acked,
    )
    (v,) = decide(a.state, later, cfg)
    assert v.state.phase is Phase.VERIFY and v.state.deadline_stretch == {}  # type: ignore[union-attr]
    verify = need[Phase.VERIFY].seconds  # 20 s + 2 x 2 x 30 s, above the 120 s floor
    assert verify == pytest.approx(140)
    assert v.state.phase_deadline == pytest.approx(NOW + 740)  # type: ignore[union-attr]


def test_an_in_place_load_is_not_sized_as_a_checkpoint_read() -> None:
    """An in-place launch takes its state from the live ranks: sized as a full read (a 7B
    plan: ~637 s), a hung one waited over ten minutes before falling back to the restart
    path. It gets the floor; the restart path's LOAD is sized in full."""
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"), iteration_s=8.0)
    cfg = large_cfg(in_place=True)
    d = DesiredState(
        epoch=3,
        generation=2,
        phase=Phase.LAUNCH,
        phase_since=NOW - 5,
        phase_deadline=NOW + 20,
        plan=plan,
        placement=placement,
        membership=("n1", "n2"),
        load_step=12,
        path="in_place",
    )
    o = Observed(
        now=NOW,
        nodes=_ns("n1", "n2"),
        status={n: _st(n, 2, 12, "idle") for n in placement},
        acked=frozenset(f"e3-g2-launch-{n}" for n in placement),
    )
    (a,) = decide(d, o, cfg)
    assert isinstance(a, SetDesired) and a.state.phase is Phase.LOAD
    assert a.state.phase_deadline == NOW + 120
    why = phase_deadline(a.state, Phase.LOAD, cfg).why()
    assert why == (
        "configured deadlines.load 120 s (plan llama-2-7b-2x8 needs 20 s start-up (in place: "
        "reads no checkpoint) = 20 s)"
    )
    restart = d.model_copy(update={"path": "restart"})
    (r,) = decide(restart, o, cfg)
    full = derived_deadlines(plan, placement, LLAMA_7B)[Phase.LOAD].seconds
    assert full > 600 and r.state.phase_deadline == pytest.approx(NOW + full)  # type: ignore[union-attr]


def test_a_quiesce_of_slow_steps_is_derived_and_a_notice_still_cuts_it() -> None:
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"), iteration_s=20.0)
    cfg = large_cfg(stop_ahead_steps=1, notice_margin_s=5)
    d = DesiredState(
        epoch=3,
        generation=1,
        phase=Phase.RUNNING,
        plan=plan,
        placement=placement,
        membership=("n1", "n2"),
    )
    status = {n: _st(n, 1, 10) for n in placement}
    joined = Observed(now=NOW, nodes=_ns("n1", "n2", "n3"), status=status)
    q = next(a for a in decide(d, joined, cfg) if isinstance(a, SetDesired))
    assert q.state.phase is Phase.QUIESCE
    assert q.state.phase_deadline == pytest.approx(NOW + 2 * 2 * 20.0)  # 80 s, not 30 s
    notice = NoticeRecord(node_id="n2", deadline=NOW + 40)
    noticed = Observed(now=NOW, nodes=_ns("n1", "n2"), status=status, notices={"n2": notice})
    q = next(a for a in decide(d, noticed, cfg) if isinstance(a, SetDesired))
    assert q.state.phase_deadline == NOW + 35


def test_a_stalled_load_stretches_the_derived_deadline() -> None:
    """Past the derived LOAD deadline with every worker still starting: nobody is charged,
    and the next deadline doubles what the plan needs, not the configured floor."""
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"))
    cfg = large_cfg()
    base = derived_deadlines(plan, placement, LLAMA_7B)[Phase.LOAD].seconds
    d = DesiredState(
        epoch=3,
        generation=2,
        phase=Phase.LOAD,
        phase_since=NOW - base - 1,
        phase_deadline=NOW - 1,
        plan=plan,
        placement=placement,
        membership=("n1", "n2"),
        load_step=12,
    )
    o = Observed(
        now=NOW, nodes=_ns("n1", "n2"), status={n: _st(n, 2, 12, "idle") for n in placement}
    )
    moved = [a for a in decide(d, o, cfg) if isinstance(a, SetDesired)]
    assert moved[0].state.phase is Phase.TEARDOWN
    assert moved[0].state.deadline_stretch == {"load": 2}
    assert (
        f"the next load deadline is {2 * base:.0f} s (load as derived from the plan "
        f"{base:.0f} s x2" in moved[0].reason
    )


T = 1_764_000_000.0
"""A Unix time of today: the base is a difference of two such times."""


def _stretched_load(plan: Plan, placement: dict[str, tuple[int, ...]], base: float) -> DesiredState:
    """A LOAD begun by a leader that derived it (``base`` s) and stretched it x2, at T."""
    return DesiredState(
        epoch=4,
        generation=3,
        phase=Phase.LOAD,
        phase_since=T - 2 * base - 1,
        phase_deadline=T - 1,
        plan=plan,
        placement=placement,
        membership=("n1", "n2"),
        load_step=12,
        deadline_stretch={"load": 2},
        phase_epoch=3,
    )


def test_a_standby_without_the_model_stretches_and_fits_what_the_phase_got() -> None:
    """The deadline of a LOAD survives a leader change, and so must its stretch's base: a
    standby whose model did not load (the floors alone) took the floor, 120 s, as the
    base of a phase the previous leader had derived (637 s), and fitted another factor
    (review). The base is what the phase got over its factor."""
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"))
    base = derived_deadlines(plan, placement, LLAMA_7B)[Phase.LOAD].seconds
    d = _stretched_load(plan, placement, base)
    standby = DecideConfig(checkpoint_dir="/ck")  # no model: the floors
    idle = {n: _st(n, 3, 12, "idle") for n in placement}
    for cfg in (large_cfg(), standby):  # the leader that derived it, and the standby
        (a,) = [x for x in decide(d, Observed(T, _ns("n1", "n2"), idle), cfg) if _set(x)]
        assert a.state.deadline_stretch == {"load": 4}  # type: ignore[union-attr]
        reason = a.reason  # type: ignore[union-attr]
        assert f"the next load deadline is {4 * base:.0f} s (load as derived" in reason
        assert f"{base:.0f} s x4" in reason, cfg.model
    # through at 1.1 x the base: the factor fits 2 under either leader
    up = {n: _st(n, 3, 12) for n in placement}
    d = d.model_copy(update={"phase_deadline": T + 600, "phase_since": T - 2 * base + 600})
    later = Observed(d.phase_since + 1.1 * base, _ns("n1", "n2"), up)
    for cfg in (large_cfg(), standby):
        (v,) = [x for x in decide(d, later, cfg) if _set(x)]
        assert v.state.phase is Phase.VERIFY  # type: ignore[union-attr]
        assert v.state.deadline_stretch == {"load": 2}, cfg.model  # type: ignore[union-attr]


def test_the_jobs_charge_names_a_derived_deadline_as_derived() -> None:
    """At the stretch's cap the job is charged: the text said ``deadlines.load x8`` of a
    length the plan's need set (its seconds were right), and told the operator to raise a
    floor that was not the deadline (review)."""
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"))
    base = derived_deadlines(plan, placement, LLAMA_7B)[Phase.LOAD].seconds
    d = _stretched_load(plan, placement, base).model_copy(
        update={"deadline_stretch": {"load": 8}, "phase_since": T - 8 * base - 1}
    )
    idle = {n: _st(n, 3, 12, "idle") for n in placement}
    (a,) = [x for x in decide(d, Observed(T, _ns("n1", "n2"), idle), large_cfg()) if _set(x)]
    reason = a.reason  # type: ignore[union-attr]
    assert a.state.job_health.cause.startswith("DeadlineMissed")  # type: ignore[union-attr]
    assert f"by the load deadline ({8 * base:.0f} s, load as derived from the plan x8)" in reason
    assert "deadlines.load x8" not in reason
    assert "set deadlines.derive.read_mib_s to what the storage gives" in reason
    # a configured one keeps its setting's name
    floor = d.model_copy(update={"phase_since": T - 8 * 120 - 1})
    cfg = DecideConfig(checkpoint_dir="/ck")
    (b,) = [x for x in decide(floor, Observed(T, _ns("n1", "n2"), idle), cfg) if _set(x)]
    assert "(960 s, deadlines.load x8)" in b.reason  # type: ignore[union-attr]
    assert "raise deadlines.load if the phase" in b.reason  # type: ignore[union-attr]


def _set(a: object) -> bool:
    return isinstance(a, SetDesired)


def test_the_controller_reads_the_model_that_sizes_its_deadlines(tmp_path: Path) -> None:
    """The config's model (a catalog name or a file) is read at start; off or unknown: none
    (the stand-in planner's model name need not be a known model), and the floors hold."""
    from sailor.controller.daemon import Controller, _model_for_deadlines

    assert _model_for_deadlines(ControllerConfig()) == catalog.model("tiny-gpt").model_copy(
        update={"global_batch_size": 8}
    )
    spec = tmp_path / "m.json"
    spec.write_text(LLAMA_7B.model_dump_json())
    got = _model_for_deadlines(ControllerConfig(model=str(spec)))
    assert got is not None and got.name == "llama-2-7b"
    off = PhaseDeadlines(derive=DeadlineModel(enabled=False))
    assert _model_for_deadlines(ControllerConfig(deadlines=off)) is None
    unknown = ControllerConfig(model="no-such-model", planner="data_parallel")
    assert _model_for_deadlines(unknown) is None
    # a model file that is no YAML: logged, the floors (review: yaml.YAMLError is no
    # ValueError, and it stopped the controller's construction)
    broken = tmp_path / "m.yaml"
    broken.write_text("name: [unclosed\n")
    bad = ControllerConfig(
        model=str(broken), planner="data_parallel", audit_log=str(tmp_path / "audit.jsonl")
    )
    with capture_logs() as logs:
        assert Controller(bad).decide_cfg.model is None
    assert [x["event"] for x in logs] == ["deadlines_not_derived"]


def test_quiesce_and_verify_are_sized_by_the_measured_iteration_of_the_same_plan() -> None:
    """The plan predicts 8 s a step; the running cluster measured 30 s (online
    calibration's fit): QUIESCE and VERIFY of that plan wait for 30 s steps, and the why
    says which; another plan keeps its own prediction (a prediction 4x too fast aborted a
    healthy quiesce)."""
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"), iteration_s=8.0)
    seen = MeasuredIteration(plan_id=plan.plan_id, iteration_s=30.0, source="calibration v3")
    need = derived_deadlines(plan, placement, LLAMA_7B, measured=seen)
    assert need[Phase.QUIESCE].seconds == pytest.approx(2 * 2 * 30.0)
    assert need[Phase.VERIFY].seconds == pytest.approx(20 + 2 * 2 * 30.0)
    assert need[Phase.QUIESCE].why() == "2 iterations of 30 s (measured, calibration v3) x2"
    other = seen.model_copy(update={"plan_id": "another"})
    pred = derived_deadlines(plan, placement, LLAMA_7B, measured=other)[Phase.VERIFY]
    assert pred.seconds == pytest.approx(20 + 2 * 2 * 8.0)
    assert pred.why() == "2 iterations of 8 s (predicted) x2 + 20 s start-up"
    # through decide's deadline: the config carries what the daemon read of the fit
    cfg = large_cfg(measured=seen)
    d = DesiredState(epoch=1, plan=plan, placement=placement, load_step=5)
    got = phase_deadline(d, Phase.QUIESCE, cfg)
    assert got.seconds == pytest.approx(120.0) and got.derived
    assert "30 s (measured, calibration v3)" in got.why()
    with pytest.raises(ValidationError, match="iteration_s"):
        MeasuredIteration(plan_id="p", iteration_s=0)


def test_an_in_place_load_that_reads_layers_is_sized_by_them() -> None:
    """n2 is gone; n1 keeps its ranks and takes four more blocks, n3 joins with the rest:
    no surviving replica holds n2's layers, so n1 reads those four blocks and n3 the
    rest from the checkpoint (sized as reading nothing, a slow disk aborted the in-place
    launch at the floor, and every one after it fell back to the restart path)."""
    old, old_place = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"), iteration_s=8.0)
    cut = 21
    new = old.model_copy(
        update={
            "plan_id": "llama-2-7b-new",
            "pipelines": (
                old.pipelines[0].model_copy(
                    update={
                        "stages": (
                            old.pipelines[0].stages[0].model_copy(update={"last_layer": cut - 1}),
                            old.pipelines[0].stages[1].model_copy(update={"first_layer": cut}),
                        )
                    }
                ),
            ),
        }
    )
    new_place = {"n1": old_place["n1"], "n3": old_place["n2"]}
    reads = in_place_read_bytes(old, old_place, new, new_place, LLAMA_7B)
    block = sum(checkpoint_layer_bytes(LLAMA_7B, x) for x in range(17, 21))
    assert reads["n1"] == pytest.approx(block, rel=1e-3)
    full = read_bytes_per_node(new, new_place, LLAMA_7B)
    assert reads["n3"] == full["n3"]  # a new node holds nothing: reads its whole stage
    # the same layout again, every node kept: nothing to read
    assert not any(in_place_read_bytes(old, old_place, old, old_place, LLAMA_7B).values())
    # through the launch: the previous layout is known at LAUNCH, its LOAD is sized by it
    cfg = large_cfg(in_place=True)
    down = DesiredState(
        epoch=3,
        generation=2,
        phase=Phase.TEARDOWN,
        plan=old,
        placement=old_place,
        membership=("n1", "n2"),
        load_step=12,
    )
    up = move_to(
        down,
        Phase.LAUNCH,
        NOW,
        cfg,
        generation=3,
        plan=new,
        placement=new_place,
        path="in_place",
    )
    assert up.in_place_reads == {n: b for n, b in reads.items() if b}
    load = move_to(up, Phase.LOAD, NOW + 5, cfg)
    dl = phase_deadline(load, Phase.LOAD, cfg)
    assert dl.derived and dl.need is not None and dl.need.node == "n3"
    assert load.phase_deadline == pytest.approx(NOW + 5 + 20 + 2 * full["n3"] / (125 * 2**20))
    assert "node n3 reads 30.7 GB (in place: the layers no surviving replica holds)" in dl.why()
    # the restart path's launch sizes a full read, and records no in-place reads
    again = move_to(down, Phase.LAUNCH, NOW, cfg, generation=3, plan=new, placement=new_place)
    assert again.in_place_reads == {}


def _dp(n: int, plan_id: str) -> Plan:
    """LLaMA-7B, ``n`` data-parallel replicas of one TP8 stage, one node each."""
    last = LLAMA_7B.num_all_layers - 1
    replica = ReplicaGroup(gpu_type="A100-80", zone="z", tp=8, gpus_per_node=8)
    stage = Stage(first_layer=0, last_layer=last, replica=replica)
    pipe = Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=8)
    return Plan(
        plan_id=plan_id, model=LLAMA_7B.name, global_batch_size=8 * n, pipelines=(pipe,) * n
    )


_DP3 = {"n1": tuple(range(8)), "n2": tuple(range(8, 16)), "n3": tuple(range(16, 24))}
_DP2 = {"n1": tuple(range(8)), "n2": tuple(range(8, 16))}


def _dp_teardown(aborted: bool) -> DesiredState:
    """Generation 2 of three DP nodes in TEARDOWN, n3 gone, the next plan on n1 and n2."""
    return DesiredState(
        epoch=3,
        generation=2,
        phase=Phase.TEARDOWN,
        plan=_dp(3, "dp3"),
        placement=_DP3,
        membership=("n1", "n2", "n3"),
        load_step=12,
        aborted=aborted,
        cause="n3 lost without notice" if aborted else "preemption notice",
        next_plan=_dp(2, "dp2"),
        next_placement=_DP2,
        next_membership=("n1", "n2"),
    )


def test_an_in_place_load_after_an_abort_is_sized_as_a_full_read() -> None:
    """A loss without notice: the abort asks the survivors to leave their world mid-step,
    and they hold broken (the agent reports no failure for a hold it asked for): the
    engine takes none as a holder, and each reads its whole stage. Sized as if they held
    the commit, the in-place LOAD got the 120 s floor for 80.9 GB a node (the restart
    path's LOAD allows ~1254 s), and fell back to the restart path every time. Now it is
    sized as the restart path's; after a notice (no abort) the survivors hold the commit
    and read nothing."""
    cfg = large_cfg(in_place=True)
    old, new = _dp(3, "dp3"), _dp(2, "dp2")
    assert len(schedule(old, {}, new).of(0).checkpoint) == LLAMA_7B.num_all_layers
    full = read_bytes_per_node(new, _DP2, LLAMA_7B)
    assert full["n1"] == pytest.approx(80.9e9, rel=1e-3)
    launch = {"generation": 3, "plan": new, "placement": _DP2, "path": "in_place"}
    up = move_to(_dp_teardown(aborted=True), Phase.LAUNCH, NOW, cfg, **launch)
    assert up.in_place_reads == full
    load = move_to(up, Phase.LOAD, NOW + 1, cfg)
    restart = move_to(up.model_copy(update={"path": "restart"}), Phase.LOAD, NOW + 1, cfg)
    assert load.phase_deadline == pytest.approx(restart.phase_deadline)
    assert load.phase_deadline - NOW > 1200
    clean = move_to(_dp_teardown(aborted=False), Phase.LAUNCH, NOW, cfg, **launch)
    assert clean.in_place_reads == {}


def test_an_in_place_launch_takes_as_holders_only_nodes_whose_status_holds_the_commit() -> None:
    """Without an abort the statuses say who holds: a node held at another step than the
    one loaded, or whose held workers report their world broke, holds nothing the engine
    takes (``in_place.handshake``), and its stage is read from the checkpoint."""
    cfg = large_cfg(in_place=True)
    d = _dp_teardown(aborted=False)
    full = read_bytes_per_node(_dp(2, "dp2"), _DP2, LLAMA_7B)

    def reads(**by_node: dict[str, Any]) -> dict[str, int]:
        status = {
            n: AgentStatus(node_id=n, generation=2, state="held", held_step=12).model_copy(
                update=by_node.get(n, {})
            )
            for n in ("n1", "n2")
        }
        o = Observed(now=NOW, nodes=_ns("n1", "n2"), status=status)
        (a,) = launch_next(d, o, cfg, 12)
        assert isinstance(a, SetDesired) and a.state.path == "in_place"
        return dict(a.state.in_place_reads)

    assert reads() == {}
    assert reads(n1={"held_step": 11}) == {}  # n2 holds a whole replica: n1 receives it
    assert reads(n1={"held_step": 11}, n2={"failure": "world aborted: peer n3 gone"}) == full
    assert reads(n1={"generation": 1}, n2={"state": "running"}) == full


def _mixed_layout(
    shapes: list[tuple[tuple[int, int], ...]], gpu: list[str]
) -> tuple[Plan, dict[str, tuple[int, ...]]]:
    """Pipelines of (last layer, TP) stages; pipeline p on GPU type ``gpu[p]``; a TP-4 stage
    shares an 8-GPU node with the pipeline's next TP-4 stage (GPUs 4-7), every other stage
    has a node of its own."""
    pipes = []
    placement: dict[str, list[int]] = {}
    rank = 0
    for p, shape in enumerate(shapes):
        stages = []
        first = 0
        for s, (last, tp) in enumerate(shape):
            upper = tp == 4 and s % 2 == 1
            node = f"p{p}s{s - 1 if upper else s}"
            stages.append(
                Stage(
                    first_layer=first,
                    last_layer=last,
                    replica=ReplicaGroup(
                        gpu_type=gpu[p],
                        zone="z",
                        tp=tp,
                        gpus_per_node=8,
                        first_gpu=4 if upper else 0,
                        node_id=node,
                    ),
                )
            )
            placement.setdefault(node, []).extend(range(rank, rank + tp))
            rank += tp
            first = last + 1
        pipes.append(Pipeline(stages=tuple(stages), microbatch_size=1, num_microbatches=8))
    plan = Plan(
        plan_id=f"mixed-{len(shapes)}",
        model=LLAMA_7B.name,
        global_batch_size=8 * len(shapes),
        pipelines=tuple(pipes),
    )
    return plan, {n: tuple(r) for n, r in placement.items()}


def _old_schedule_and_holders(
    old: Plan,
    old_place: dict[str, tuple[int, ...]],
    new: Plan,
    new_place: dict[str, tuple[int, ...]],
) -> tuple[dict[int, int], object]:
    """The in-place sizing as it was computed, one rank at a time: each held worker's GPU by
    ``Plan.local_gpu`` and each rank's layers by ``roles.role_of`` (a pass over the plan per
    rank)."""

    def gpu(plan: Plan, rank: int) -> int:
        pi, si, _ = plan.ranks()[rank]
        if is_cpu_type(plan.pipelines[pi].stages[si].replica.gpu_type):
            return -1
        return plan.local_gpu(rank)

    holders: dict[int, int] = {}
    for node, new_ranks in new_place.items():
        ranks = sorted(new_ranks)
        free = sorted(old_place.get(node, ()), key=lambda r: (r not in ranks, r))
        picked = match_held(
            [(gpu(old, w), w) for w in free], ranks, {r: gpu(new, r) for r in ranks}
        )
        holders.update((r, free[i]) for r, i in picked.items())
    survivors = {o: r for r, o in holders.items()}
    groups: dict[int, list[tuple[int, ...]]] = {}
    for pi, p in enumerate(old.pipelines):
        for si, s in enumerate(p.stages):
            group = replica_ranks(old, pi, si)
            if all(o in survivors for o in group):
                for layer in s.layers:
                    groups.setdefault(layer, []).append(tuple(survivors[o] for o in group))
    spread: dict[int, int] = {}
    rows: list[RankSchedule] = []
    transfers: list[Transfer] = []
    for r in range(len(new.ranks())):
        role = role_of(new, r)
        was = role_of(old, holders[r]) if r in holders else None
        kept: list[int] = []
        received: list[int] = []
        ckpt: list[int] = []
        for layer in role.layers:
            if (
                was is not None
                and layer in was.layers
                and (was.tp, was.tp_rank)
                == (
                    role.tp,
                    role.tp_rank,
                )
            ):
                kept.append(layer)
                continue
            cands = groups.get(layer, [])
            if not cands:
                ckpt.append(layer)
                continue
            own = [g for g in cands if r in g]
            if own:
                src = own[0]
            else:
                i = spread.get(layer, 0)
                spread[layer] = i + 1
                src = cands[i % len(cands)]
            received.append(layer)
            transfers.append(Transfer(receiver=r, layer=layer, sources=src))
        rows.append(RankSchedule(r, tuple(kept), tuple(received), tuple(ckpt)))
    return holders, Schedule(tuple(rows), tuple(transfers))


def test_the_in_place_sizing_places_each_rank_once_and_decides_as_rank_by_rank() -> None:
    """The LAUNCH decision's in-place sizing looked up every held worker's GPU and every
    rank's layers with a pass over the plan each (4,096 ranks: ~15 s inside a decide pass).
    Each plan's ranks are now placed once (``Plan.rank_table``); on a mixed layout of 232
    ranks (TP 8 and TP 4 sharing nodes, a CPU kind, a pipeline dropped, one split moved,
    new nodes) the holders and the schedule are those of the rank-by-rank computation."""
    a = ((8, 8), (16, 8), (25, 8), (33, 8))
    b = ((5, 4), (11, 4), (22, 8), (33, 8))
    shapes = [a, b, a, b, a, a, b, a]
    gpu = ["A100-80"] * 5 + ["cpu"] + ["A100-80"] * 2
    old, old_place = _mixed_layout(shapes, gpu)
    moved = ((8, 8), (20, 8), (25, 8), (33, 8))
    new_shapes = [a, b, b, a, a, b, moved]  # pipeline 2 dropped
    new_gpu = ["A100-80"] * 4 + ["cpu"] + ["A100-80"] * 2
    new, new_place = _mixed_layout(new_shapes, new_gpu)
    # the new pipelines keep their old nodes (pipeline p >= 2 was p + 1), but for the moved
    # one's stage 1 and every last stage: on nodes new to the job (no surviving replica holds
    # the last layers: read from the checkpoint)
    rename = {f"p{q}s{s}": f"p{q + 1 if q >= 2 else q}s{s}" for q in range(7) for s in range(3)}
    rename.update({f"p{q}s3": f"fresh{q}" for q in range(7)})
    new_place = {rename[n]: r for n, r in new_place.items()}
    new_place["fresh"] = new_place.pop("p7s1")
    old_table, new_table = old.rank_table(), new.rank_table()
    assert len(old_table) == 232
    for plan, table in ((old, old_table), (new, new_table)):
        assert [(p.pipeline, p.stage, p.tp_rank) for p in table] == plan.ranks()
        for r, place in enumerate(table):
            role = role_of(plan, r)
            assert place.local_gpu == plan.local_gpu(r)
            assert (place.tp, place.layers, place.first_rank) == (
                role.tp,
                role.layers,
                role.tp_group[0],
            )
    holders, sched = _old_schedule_and_holders(old, old_place, new, new_place)
    assert _held_ranks(old, old_place, new, new_place) == holders
    got = schedule(old, holders, new)
    assert got == sched
    assert got.transfers and any(rs.checkpoint for rs in got.ranks)  # every kind of source
    assert any(rs.kept for rs in got.ranks)


def test_held_workers_take_the_ranks_whose_layers_they_keep_and_send_fewer_bytes() -> None:
    """n1 held old ranks 0 (layers 0-16) and 1 (17-33) of a two-stage pipeline; the new plan
    puts rank 1 (layers 0-16) and rank 2 (17-33) of its second pipeline there. Matched by
    rank number, old rank 1 took new rank 1 and old rank 0 the other: neither kept a layer,
    and n1 received its whole model over the network. Matched by the layers each keeps
    (``relayout.kept_layers``), each keeps its stage: the controller's sizing and the
    agent's match agree, and half the bytes are transferred."""
    from sailor.agent.supervisor import _match_held
    from sailor.agent.worker_view import WorkerView

    last = LLAMA_7B.num_all_layers - 1
    half = last // 2

    def stage(first: int, end: int) -> Stage:
        rg = ReplicaGroup(gpu_type="cpu", zone="z", gpus_per_node=1)
        return Stage(first_layer=first, last_layer=end, replica=rg)

    def pipe(*stages: Stage) -> Pipeline:
        return Pipeline(stages=stages, microbatch_size=1, num_microbatches=2)

    two = pipe(stage(0, half), stage(half + 1, last))
    old = Plan(plan_id="old", model=LLAMA_7B.name, global_batch_size=2, pipelines=(two,))
    new = Plan(
        plan_id="new",
        model=LLAMA_7B.name,
        global_batch_size=4,
        pipelines=(pipe(stage(0, last)), two),
    )
    old_place, new_place = {"n1": (0, 1)}, {"n2": (0,), "n1": (1, 2)}

    def sent(holders: dict[int, int]) -> int:
        return sum(
            checkpoint_layer_bytes(LLAMA_7B, t.layer) for t in schedule(old, holders, new).transfers
        )

    free = [1, 0]  # the agent's preference order: rank not kept, rank
    by_number = {
        r: free[i] for r, i in match_held([(-1, w) for w in free], [1, 2], {1: -1, 2: -1}).items()
    }
    assert by_number == {1: 1, 2: 0}
    by_layers = _held_ranks(old, old_place, new, new_place)
    assert by_layers == {1: 0, 2: 1}
    held = [WorkerView(rank=w, proc=None, gpu=-1) for w in free]  # type: ignore[arg-type]
    agent = _match_held(held, [1, 2], {1: -1, 2: -1}, old, new)
    assert {r: w.rank for r, w in agent.items()} == by_layers
    whole = sum(checkpoint_layer_bytes(LLAMA_7B, x) for x in range(last + 1))
    assert sent(by_number) == 2 * whole  # n2's rank 0 and n1's two ranks: every layer
    assert sent(by_layers) == whole  # n2's rank 0 alone
    assert not any(in_place_read_bytes(old, old_place, new, new_place, LLAMA_7B).values())


# ---- the stretch is bounded by deadlines.stretch_max_s, not only by its factor ----


def _slow_cfg() -> DecideConfig:
    """The 7B's LOAD at 1 MiB/s: ~80,000 s by the plan, capped at 3 h (derive.max_s)."""
    slow = PhaseDeadlines(derive=DeadlineModel(read_mib_s=1.0))
    return large_cfg(deadlines=slow)


def test_a_stalled_load_at_the_derived_cap_doubles_once_then_the_job_is_charged() -> None:
    """A LOAD whose derived deadline is at its cap (3 h) stalls: its next deadline is 6 h
    (deadlines.stretch_max_s); stalled again, it is stretched no further and the job is
    charged, the text naming the ceiling. Before, it doubled to 12 h and 24 h (x8): the job
    was charged after 3 + 6 + 12 + 24 h of a hang."""
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"))
    cfg = _slow_cfg()
    need = phase_need(Phase.LOAD, plan, placement, LLAMA_7B, cfg.deadlines.derive)
    assert need is not None and need.seconds == 3 * 3600.0 and need.uncapped_s > 3 * 3600
    idle = {n: _st(n, 3, 12, "idle") for n in placement}
    d = _stretched_load(plan, placement, 3 * 3600.0)  # stalled at x2: 6 h
    (a,) = [x for x in decide(d, Observed(T, _ns("n1", "n2"), idle), cfg) if _set(x)]
    assert a.state.deadline_stretch == {"load": 2}  # type: ignore[union-attr]
    assert a.state.job_health.cause.startswith("DeadlineMissed")  # type: ignore[union-attr]
    assert "stretched no further (deadlines.stretch_max_s 21600 s)" in a.reason  # type: ignore[union-attr]
    # at x1 (3 h) it still doubles once, to the ceiling
    first = d.model_copy(update={"deadline_stretch": {}, "phase_since": T - 3 * 3600.0 - 1})
    (b,) = [x for x in decide(first, Observed(T, _ns("n1", "n2"), idle), cfg) if _set(x)]
    assert b.state.deadline_stretch == {"load": 2}  # type: ignore[union-attr]
    assert "the next load deadline is 21600 s" in b.reason  # type: ignore[union-attr]


def test_a_stretch_learned_on_a_smaller_plan_is_halved_to_the_ceiling_and_kept_so() -> None:
    """x8 learned where the LOAD was 120 s; the next launch's plan needs 3 h: its LOAD
    gets 6 h, not 24 h, and the stretch it keeps is the x2 it got, so that the phase's
    length over it is its base again (a standby's stretch arithmetic)."""
    plan, placement = even_plan(LLAMA_7B, 2, 8, ("n1", "n2"))
    cfg = _slow_cfg()
    d = DesiredState(
        epoch=3,
        generation=2,
        phase=Phase.LAUNCH,
        phase_since=NOW - 5,
        phase_deadline=NOW + 20,
        plan=plan,
        placement=placement,
        membership=("n1", "n2"),
        load_step=12,
        deadline_stretch={"load": 8, "verify": 2},
    )
    load = move_to(d, Phase.LOAD, NOW, cfg)
    assert load.phase_deadline == pytest.approx(NOW + 6 * 3600.0)
    assert load.deadline_stretch == {"load": 2, "verify": 2}
    assert phase_deadline(load, Phase.LOAD, cfg).why().endswith("stretched x2: 21600 s")
    # under a ceiling below the derived 3 h the phase is not stretched at all
    low = cfg.model_copy(
        update={"deadlines": cfg.deadlines.model_copy(update={"stretch_max_s": 3600.0})}
    )
    flat = move_to(d, Phase.LOAD, NOW, low)
    assert flat.phase_deadline == pytest.approx(NOW + 3 * 3600.0)
    assert flat.deadline_stretch == {"verify": 2}
