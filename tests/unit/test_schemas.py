"""Schemas: validation messages name the field and value; segments; round trips."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError, create_model

from sailor import catalog
from sailor.schemas import (
    BandwidthCurve,
    CommandAdapter,
    EventAdapter,
    ModelSpec,
    Pipeline,
    Plan,
    Pool,
    PoolEntry,
    PreemptionNotice,
    ReplicaGroup,
    Stage,
    Stop,
    _base,
)
from sailor.schemas._base import SCHEMA_VERSION
from sailor.schemas.commands import Checkpoint
from sailor.schemas.runtime import (
    MAX_DROP_STEPS,
    Accusations,
    AgentStatus,
    CommitRecord,
    DesiredState,
    NodeHealth,
    PeriodicCheckpoint,
    ReadmitRequest,
    SigabrtReports,
    SuspectCheckpoint,
)


def _stage(a: int, b: int, tp: int = 1, gpu: str = "A100-40") -> Stage:
    return Stage(
        first_layer=a,
        last_layer=b,
        replica=ReplicaGroup(gpu_type=gpu, zone="us-central1-a", tp=tp, gpus_per_node=4),
    )


def test_plan_rejects_gap_between_stages_naming_field() -> None:
    with pytest.raises(ValidationError, match=r"stages\[1\]\.first_layer"):
        Pipeline(stages=(_stage(0, 3), _stage(5, 9)), microbatch_size=1, num_microbatches=1)


def test_plan_rejects_samples_not_adding_up() -> None:
    p = Pipeline(stages=(_stage(0, 9),), microbatch_size=2, num_microbatches=3)
    with pytest.raises(ValidationError, match="global_batch_size=8"):
        Plan(model="m", global_batch_size=8, pipelines=(p,))


def test_plan_rejects_pipelines_covering_different_layers() -> None:
    a = Pipeline(stages=(_stage(0, 9),), microbatch_size=1, num_microbatches=1)
    b = Pipeline(stages=(_stage(0, 8),), microbatch_size=1, num_microbatches=1)
    with pytest.raises(ValidationError, match="every pipeline must cover"):
        Plan(model="m", global_batch_size=2, pipelines=(a, b))
    # a broken first pipeline is the one named, against what the others agree on
    with pytest.raises(ValidationError) as err:
        Plan(model="m", global_batch_size=3, pipelines=(b, a, a))
    assert "pipelines[0].stages[-1].last_layer=8" in str(err.value)
    assert "2 of 3 cover 0..9" in str(err.value)


def test_replica_tp_must_fit_node_and_be_power_of_two() -> None:
    with pytest.raises(ValidationError, match="tp=8"):
        ReplicaGroup(gpu_type="A100-40", zone="z", tp=8, gpus_per_node=4)
    with pytest.raises(ValidationError, match="power of two"):
        ReplicaGroup(gpu_type="A100-40", zone="z", tp=3, gpus_per_node=4)


def test_frozen_and_extra_forbidden() -> None:
    r = ReplicaGroup(gpu_type="A100-40", zone="z", tp=1, gpus_per_node=4)
    with pytest.raises(ValidationError):
        r.tp = 2  # type: ignore[misc]
    with pytest.raises(ValidationError, match="bogus"):
        ReplicaGroup.model_validate({"gpu_type": "x", "zone": "z", "bogus": 1})


def test_model_spec_heads_must_divide_hidden() -> None:
    with pytest.raises(ValidationError, match="num_heads=7"):
        ModelSpec(
            name="m",
            num_layers=2,
            hidden_size=64,
            num_heads=7,
            ffn_hidden_size=4,
            seq_length=8,
            vocab_size=10,
            global_batch_size=1,
        )


def test_catalog_models_match_public_parameter_counts() -> None:
    # Public sizes: OPT-350M ~331M (+ untied projection), GPT-Neo 2.7B, Llama-3 8.03B.
    m = catalog.models()
    assert 0.3e9 < m["OPT-350"].total_params < 0.45e9
    assert 2.6e9 < m["GPT-Neo-2.7"].total_params < 2.9e9
    assert 7.9e9 < m["LLAMA-3-8"].total_params < 8.2e9
    assert 29e9 < m["OPT-30"].total_params < 31e9


def test_catalog_has_required_gpus_and_prices() -> None:
    need = {
        "A100-40",
        "A100-80",
        "H100-80",
        "H200",
        "GH-96",
        "L4",
        "T4",
        "V100-16",
        "RTX-3090",
        "Titan-RTX",
        "RTX-2080",
        "cpu",
    }
    assert need <= set(catalog.gpus())
    p = catalog.prices()
    assert p.read_on
    for g in need:
        assert p.gpu_hour(g, "us-central1-a") > 0
    with pytest.raises(KeyError, match="gpu_type='nope'"):
        catalog.gpu("nope")


def test_bandwidth_curve_is_clamped_positive_and_bounded() -> None:
    c = BandwidthCurve(coeffs=(-1.0, 0.0, 5.0), max_gbps=4.0, min_bytes=10**6, max_bytes=10**9)
    assert c.gbps(10**6) == 4.0  # L=0 → 5, clamped to max
    assert c.gbps(10**12) == c.gbps(10**9)  # clamped to the measured range
    assert c.gbps(10**9) > 0  # the fit is negative there; never returned
    assert c.transfer_time(0) == 0.0


def test_pool_rejects_duplicates_and_aggregates() -> None:
    e = PoolEntry(gpu_type="A100-40", zone="z", nodes=2, gpus_per_node=4)
    with pytest.raises(ValidationError, match="duplicate"):
        Pool(entries=(e, e))
    assert Pool(entries=(e,)).total_gpus == 8


def test_wire_messages_round_trip_and_read_newer_versions() -> None:
    ev = PreemptionNotice(event_id="e1", node_id="n1", time=1.0, deadline=31.0)
    again = EventAdapter.validate_json(ev.model_dump_json())
    assert again == ev
    cmd = Stop(command_id="c1", epoch=3, node_id="n1", at_step=10)
    assert CommandAdapter.validate_python(json.loads(cmd.model_dump_json())) == cmd
    # a newer release's message: its new field is dropped, what both know is checked
    newer = json.loads(ev.model_dump_json()) | {"schema_version": 99, "urgency": "high"}
    assert EventAdapter.validate_python(newer) == ev  # and it is this release's version now
    with pytest.raises(ValidationError, match="deadline"):
        EventAdapter.validate_python(newer | {"deadline": "soon"})
    # a new kind of event is not something an older release can act on
    with pytest.raises(ValidationError):
        EventAdapter.validate_python(newer | {"kind": "node_upgraded"})
    # at this release's version an unknown field is an error (a typo, or a writer that did
    # not raise the version), named
    same = json.loads(ev.model_dump_json()) | {"urgency": "high"}
    with pytest.raises(ValidationError, match="urgency"):
        EventAdapter.validate_python(same)
    with pytest.raises(ValidationError, match="schema_version=0"):
        EventAdapter.validate_python(json.loads(ev.model_dump_json()) | {"schema_version": 0})


def test_a_newer_desired_state_is_read_with_its_nested_additions_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nested models lose their unknown keys too (a plan's replica group, a placement's
    map), through optional fields and tuples; the drop is logged once, by path."""
    plan = Plan(
        model="m",
        global_batch_size=4,
        pipelines=(
            Pipeline(stages=(_stage(0, 1),), microbatch_size=1, num_microbatches=2),
            Pipeline(stages=(_stage(0, 1),), microbatch_size=1, num_microbatches=2),
        ),
    )
    d = DesiredState(epoch=2, generation=3, plan=plan, placement={"n1": (0, 1)})
    raw = json.loads(d.model_dump_json())
    raw |= {"schema_version": SCHEMA_VERSION + 1, "rollout": {"wave": 1}}  # the next release
    raw["plan"]["pipelines"][1]["stages"][0]["replica"]["nic"] = "efa"
    raw["plan"]["pipelines"][0]["overlap"] = True
    with caplog.at_level("WARNING", logger="sailor.schemas"):
        got = DesiredState.model_validate_json(json.dumps(raw))
        DesiredState.model_validate_json(json.dumps(raw))
    assert got == d and got.schema_version == SCHEMA_VERSION
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    for path in ("rollout", "plan.pipelines[0].overlap", "plan.pipelines[1].stages[0].replica.nic"):
        assert path in warned[0]
    # the same keys at this release's version: refused
    raw["schema_version"] = SCHEMA_VERSION
    with pytest.raises(ValidationError, match="rollout"):
        DesiredState.model_validate_json(json.dumps(raw))


_V3 = ("job_health", "forgiven_through", "phase_epoch", "suspect_checkpoint", "deadline_stretch")
"""``DesiredState``'s fields of wire version 3 (added after 2, which did not know them)."""

_V4 = ("lost_nodes", "sigabrt_reports")
"""``DesiredState``'s fields of wire version 4."""

_V5 = ("agreed_health", "launch_waited", "job_precision", "plan_failed")
"""``DesiredState``'s fields of wire version 5."""

_V6 = ("in_place_reads", "reads_spent_through", "forgiven_nodes")
"""``DesiredState``'s fields of wire version 6."""

_V7 = ("periodic",)
"""``DesiredState``'s fields of wire version 7."""

_V11 = ("accusations",)
"""``DesiredState``'s fields of wire version 11."""


def _release(without: tuple[str, ...]) -> type[_base.WireMessage]:
    """``DesiredState`` as a release without the fields ``without`` defined it, its
    ``NodeHealth`` without ``signature`` and ``origin`` before version 3."""
    before_3 = "job_health" in without
    health = {
        name: (f.annotation, f)
        for name, f in NodeHealth.model_fields.items()
        if not before_3 or name not in ("signature", "origin")
    }
    old_health = create_model("NodeHealth", __base__=_base.Frozen, **health)  # type: ignore[call-overload]
    fields = {
        name: (dict[str, old_health] if name == "node_health" else f.annotation, f)  # type: ignore[valid-type]
        for name, f in DesiredState.model_fields.items()
        if name not in (*without, "schema_version")
    }
    return create_model("DesiredState", __base__=_base.WireMessage, **fields)  # type: ignore[call-overload,no-any-return]


@pytest.mark.parametrize(
    ("version", "without"),
    [
        (1, ("node_health", *_V3, *_V4, *_V5, *_V6, *_V7)),
        (2, (*_V3, *_V4, *_V5, *_V6, *_V7)),
        (3, (*_V4, *_V5, *_V6, *_V7)),
        (4, (*_V5, *_V6, *_V7)),
        (5, (*_V6, *_V7)),
        (6, _V7),
        (10, _V11),
    ],
    ids=["v1", "v2", "v3", "v4", "v5", "v6", "v10"],
)
def test_the_failing_node_records_raised_the_wire_version_and_older_readers_drop_them(
    monkeypatch: pytest.MonkeyPatch, version: int, without: tuple[str, ...]
) -> None:
    """``DesiredState.node_health`` came with wire version 2, the job's record, the
    forgiveness, the phase's epoch, the suspect checkpoint and the deadlines' stretch with 3
    (added after 2 without raising it: a release-2 agent refused every desired state that
    held one). A release of each older version reads the state without its unknown fields,
    through ``_newer``, and would refuse them at its own version. Version 4 added the
    abort's lost nodes and the generation's SIGABRT reports: a release-3 reader drops them;
    version 5 the agreed errors' records and the LAUNCH's nodes waited for past their kill,
    which a release-4 reader drops; version 6 an in-place launch's reads per node and the
    generation whose read failures an operator's clear spent and the nodes an operator
    readmitted, which a release-5 reader drops; version 7 the controller's periodic
    checkpoint, which a release-6 reader drops; version 11 the generation's accusations,
    which a release-10 reader drops."""
    assert SCHEMA_VERSION >= 7
    rec = NodeHealth(
        failures=3, generation=4, exclusions=1, excluded_until=99.0, cause="X", origin="config"
    )
    job = NodeHealth(failures=1, generation=4, cause="ValueError: x", origin="config")
    d = DesiredState(
        epoch=2,
        generation=4,
        node_health={"n2": rec},
        job_health=job,
        forgiven_through=3,
        phase_epoch=2,
        suspect_checkpoint=SuspectCheckpoint(step=30, nodes=("n3",), generation=4),
        deadline_stretch={"load": 2},
        lost_nodes=("n1",),
        sigabrt_reports=SigabrtReports(generation=4, nodes=("n3",), cause="Signal: SIGABRT"),
        agreed_health={"NonFiniteGradientsError": NodeHealth(failures=2, generation=4, step=9)},
        launch_waited=("n2",),
        job_precision="bf16",
        in_place_reads={"n2": 1 << 20},
        reads_spent_through=3,
        forgiven_nodes={"n2": 4},
        periodic=PeriodicCheckpoint(step=120, requested=50.0, deadline=90.0, directory="/ck"),
        accusations=Accusations(generation=4, named={"n1": "n3"}),
    )
    raw = d.model_dump_json()
    assert DesiredState.model_validate_json(raw) == d
    previous = _release(without)
    monkeypatch.setattr(_base, "SCHEMA_VERSION", version)
    old = previous.model_validate_json(raw)
    assert old.generation == 4 and old.schema_version == version
    if "node_health" in previous.model_fields:  # the nested record's additions dropped too
        assert old.node_health["n2"].failures == 3  # type: ignore[attr-defined]
        kept = "origin" in type(old.node_health["n2"]).model_fields  # type: ignore[attr-defined]
        assert kept == (version >= 3)
    assert not set(without) & set(previous.model_fields)
    with pytest.raises(ValidationError, match=without[0]):
        previous.model_validate_json(json.dumps(json.loads(raw) | {"schema_version": version}))
    # a record without ``origin`` (the first form of NodeHealth) reads as none counted
    plain = json.loads(raw)
    del plain["node_health"]["n2"]["origin"]
    assert DesiredState.model_validate(plain).node_health["n2"].origin == ""


_V7_OTHERS = [
    (
        Checkpoint,
        ("periodic",),
        {"command_id": "c", "epoch": 1, "node_id": "n1", "step": 5, "directory": "/ck"},
    ),
    (CommitRecord, ("periodic",), {"step": 5, "directory": "/ck"}),
    (AgentStatus, ("save_failed_step", "save_failure"), {"node_id": "n1"}),
]


@pytest.mark.parametrize(
    ("cls", "fields", "base"), _V7_OTHERS, ids=[c.__name__ for c, _, _ in _V7_OTHERS]
)
def test_a_failed_periodic_save_is_reported_in_wire_version_7(
    monkeypatch: pytest.MonkeyPatch,
    cls: type[_base.WireMessage],
    fields: tuple[str, ...],
    base: dict[str, object],
) -> None:
    """A periodic save's fields of the command, the commit record and the agent's status
    (a failure reported, training going on) came with version 7: a release-6 reader drops
    them (its agent takes the save as required, as before) and refuses them at its own
    version."""
    assert SCHEMA_VERSION >= 7
    values = {"periodic": True, "save_failed_step": 12, "save_failure": "rank 1: OSError"}
    msg = cls(**base, **{f: values[f] for f in fields})
    raw = msg.model_dump_json()
    assert cls.model_validate_json(raw) == msg
    kept = {
        name: (f.annotation, f)
        for name, f in cls.model_fields.items()
        if name not in (*fields, "schema_version")
    }
    previous = create_model(cls.__name__, __base__=_base.WireMessage, **kept)  # type: ignore[call-overload]
    monkeypatch.setattr(_base, "SCHEMA_VERSION", 6)
    old = previous.model_validate_json(raw)
    assert not set(fields) & set(type(old).model_fields)
    with pytest.raises(ValidationError, match=fields[0]):
        previous.model_validate_json(json.dumps(json.loads(raw) | {"schema_version": 6}))


def test_the_steps_a_checkpoint_drops_are_wire_version_8(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Checkpoint.drop_steps`` came with version 8: a release-7 agent drops it (its
    workers prune below ``prune_below`` only, as before) and refuses it at its own version;
    a release-7 controller's Checkpoint has none, which this release reads as None (no
    deletion of abandoned saves). Negative steps are named; the steps are kept sorted,
    once each."""
    assert SCHEMA_VERSION >= 8
    base = {"command_id": "c", "epoch": 1, "node_id": "n1", "step": 50, "directory": "/ck"}
    msg = Checkpoint(**base, prune_below=30, drop_steps=(40, 30, 40))
    assert msg.drop_steps == (30, 40)
    raw = msg.model_dump_json()
    assert Checkpoint.model_validate_json(raw) == msg
    older = json.loads(raw)
    del older["drop_steps"]
    assert Checkpoint.model_validate(older | {"schema_version": 7}).drop_steps is None
    kept = {
        name: (f.annotation, f)
        for name, f in Checkpoint.model_fields.items()
        if name not in ("drop_steps", "schema_version")
    }
    previous = create_model("Checkpoint", __base__=_base.WireMessage, **kept)  # type: ignore[call-overload]
    monkeypatch.setattr(_base, "SCHEMA_VERSION", 7)
    old = previous.model_validate_json(raw)
    assert "drop_steps" not in type(old).model_fields and old.prune_below == 30  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="drop_steps"):
        previous.model_validate_json(json.dumps(json.loads(raw) | {"schema_version": 7}))
    monkeypatch.undo()
    with pytest.raises(ValidationError, match=r"drop_steps=\(3, -1\): steps are >= 0, not -1"):
        Checkpoint(**base, drop_steps=(3, -1))


def test_a_generations_accusations_name_their_generation_and_nodes() -> None:
    """``DesiredState.accusations`` (version 11): the empty record names neither; a record
    with nodes names its generation, and an empty node id is refused by field; a state of
    release 10 (none) reads as the empty record."""
    assert Accusations(generation=3, named={"n1": "n2"}).named == {"n1": "n2"}
    old = DesiredState.model_validate({"epoch": 1, "schema_version": 10})
    assert old.accusations == Accusations()
    with pytest.raises(ValidationError, match=r"generation=-1: accusations name"):
        Accusations(named={"n1": "n2"})
    with pytest.raises(ValidationError, match=r"generation=3: accusations name"):
        Accusations(generation=3)
    with pytest.raises(ValidationError, match="named"):
        Accusations(generation=3, named={"n1": ""})


@pytest.mark.parametrize(
    ("record", "fields", "says"),
    [
        (
            SigabrtReports,
            {"nodes": ("n1",)},
            "generation=-1: reports name their generation and nodes (['n1'])",
        ),
        (
            SigabrtReports,
            {"generation": 2},
            "generation=2: reports name their generation and nodes ([])",
        ),
        (
            SigabrtReports,
            {"generation": 2, "nodes": ("n2", "n1")},
            "nodes=['n2', 'n1']: must be sorted",
        ),
        (SigabrtReports, {"generation": 2, "nodes": ("",)}, "nodes=['']: an empty node id"),
        (
            Accusations,
            {"named": {"n1": "n2"}},
            "generation=-1: accusations name their generation and nodes ({'n1': 'n2'})",
        ),
        (
            Accusations,
            {"generation": 2},
            "generation=2: accusations name their generation and nodes ({})",
        ),
    ],
    ids=[
        "sigabrt-no-generation",
        "sigabrt-no-nodes",
        "sigabrt-unsorted",
        "sigabrt-empty-id",
        "accusations-no-generation",
        "accusations-no-nodes",
    ],
)
def test_a_generations_reports_name_the_field_and_value_that_break_all_or_nothing(
    record: type[SigabrtReports | Accusations], fields: dict[str, object], says: str
) -> None:
    """Both records of one generation's reports (one check, ``GenerationReports``): set
    together or neither, named by field and value; the empty record and a full one stand."""
    assert record() == record(generation=-1)
    with pytest.raises(ValidationError) as info:
        record(**fields)
    assert says in str(info.value)


def test_the_desired_states_abandoned_saves_are_bounded_and_named_once() -> None:
    """``DesiredState.drop_steps`` (version 8) keeps its order (oldest first), refuses a
    negative or repeated step by name, holds at most MAX_DROP_STEPS, and a state of
    release 7 (none) reads as ()."""
    d = DesiredState(epoch=1, drop_steps=(30, 10))
    assert d.drop_steps == (30, 10)
    assert DesiredState.model_validate({"epoch": 1, "schema_version": 7}).drop_steps == ()
    with pytest.raises(ValidationError, match=r"drop_steps=\(3, 3\): a step is named once"):
        DesiredState(epoch=1, drop_steps=(3, 3))
    with pytest.raises(ValidationError, match=r"drop_steps=\(-2,\): steps are >= 0, not -2"):
        DesiredState(epoch=1, drop_steps=(-2,))
    with pytest.raises(ValidationError, match="drop_steps"):
        DesiredState(epoch=1, drop_steps=tuple(range(MAX_DROP_STEPS + 1)))


def test_a_readmit_request_names_nodes_or_all() -> None:
    assert ReadmitRequest(nodes=("n1",)).nodes == ("n1",)
    assert ReadmitRequest(all=True).all
    with pytest.raises(ValidationError, match=r"nodes=\(\): empty: name nodes, or set all"):
        ReadmitRequest()
    with pytest.raises(ValidationError, match="an empty node id"):
        ReadmitRequest(nodes=("n1", ""))
    req = ReadmitRequest(nodes=("n2",), who="ops@head", time=5.0)
    assert ReadmitRequest.model_validate_json(req.model_dump_json()) == req


@st.composite
def _plans(draw: st.DrawFn) -> Plan:
    n_layers = draw(st.integers(2, 12))
    pipes = []
    for _ in range(draw(st.integers(1, 4))):
        cuts = sorted(draw(st.sets(st.integers(1, n_layers - 1), max_size=n_layers - 1)))
        bounds = [0, *cuts, n_layers]
        stages = tuple(_stage(a, b - 1) for a, b in itertools.pairwise(bounds))
        pipes.append(Pipeline(stages=stages, microbatch_size=1, num_microbatches=1))
    return Plan(model="m", global_batch_size=len(pipes), pipelines=tuple(pipes))


@given(_plans())
@settings(max_examples=200, deadline=None)
def test_segments_partition_layers_and_every_pipeline_holds_each(plan: Plan) -> None:
    segs = plan.segments()
    covered = [i for s in segs for i in range(s.first_layer, s.last_layer + 1)]
    assert covered == list(range(plan.num_layers))
    for s in segs:
        assert [h[0] for h in s.holders] == list(range(len(plan.pipelines)))
        for pi, si in s.holders:
            st_ = plan.pipelines[pi].stages[si]
            assert st_.first_layer <= s.first_layer and s.last_layer <= st_.last_layer
    # A segment boundary is exactly a stage boundary of some pipeline.
    starts = {s.first_layer for s in segs}
    assert starts == {st_.first_layer for p in plan.pipelines for st_ in p.stages}


def test_profile_precisions_load_and_are_written_as_before() -> None:
    """``LayerProfile.precision`` and ``LayerSize.precision`` are ``schemas.precision.Precision``
    (each spelt its own ``Literal`` of the same three values): a database as releases wrote it,
    each value, null and absent, loads and is written back the same; another value is refused
    naming the field; the JSON Schema's enum is the type's own order."""
    from typing import get_args

    from sailor.schemas import ProfileDB
    from sailor.schemas.precision import Precision

    def timing(gpu: str, precision: str | None) -> dict[str, object]:
        t: dict[str, object] = {"gpu_type": gpu, "tp": 1, "microbatch_size": 1, "layer": 0}
        t |= {"kind": "embedding", "fwd_s": 0.001, "bwd_s": 0.002, "update_s": 0.0001}
        return t if precision == "absent" else t | {"precision": precision}

    size: dict[str, object] = {"tp": 1, "layer": 0, "params": 8}
    size |= {"activation_bytes_per_sample": 16, "output_bytes_per_sample": 16}
    given = ["fp32", "fp16", "bf16", None, "absent"]
    text = json.dumps(
        {
            "model": "tiny-gpt",
            "timings": [timing(f"G{i}", p) for i, p in enumerate(given)],
            "sizes": [size | {"precision": "fp16"}, size | {"tp": 2}],
        }
    )
    db = ProfileDB.model_validate_json(text)
    back = json.loads(db.model_dump_json())
    assert [t["precision"] for t in back["timings"]] == ["fp32", "fp16", "bf16", None, None]
    assert [s["precision"] for s in back["sizes"]] == ["fp16", None]
    assert ProfileDB.model_validate_json(db.model_dump_json()) == db
    raw = json.loads(text)
    raw["timings"][0]["precision"] = "fp8"
    with pytest.raises(ValidationError, match=r"timings\.0\.precision[\s\S]*'fp8'"):
        ProfileDB.model_validate(raw)
    defs = ProfileDB.model_json_schema()["$defs"]
    for name in ("LayerProfile", "LayerSize"):
        (enum,) = [a for a in defs[name]["properties"]["precision"]["anyOf"] if "enum" in a]
        assert enum["enum"] == list(get_args(Precision)) == ["fp32", "bf16", "fp16"], name
