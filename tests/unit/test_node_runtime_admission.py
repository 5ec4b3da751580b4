"""One NCCL version per job: a node registers its torch build and NCCL version, and the
controller places only the nodes of the job's version (the running layout's, else the one
with most GPUs); the others are reported as not admitted, with the reason, in the audit log
and ``sailor status`` (tests/integration/test_status_admission.py, on a real etcd). Tested
through ``decide``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from sailor.agent.node_join import registered_node
from sailor.controller.daemon import Controller
from sailor.controller.decide import decide, exclusion, not_admitted, unusable
from sailor.controller.decision_types import DecideConfig, Observed, Replan, SetDesired
from sailor.controller.planning import DataParallelPlanner
from sailor.controller.runtime_admission import job_nccl
from sailor.schemas.hardware import NodeSpec, TorchRuntime
from sailor.schemas.node_check import NodeFacts
from sailor.schemas.runtime import AgentStatus, DesiredState, NodeHealth, Phase

CFG = DecideConfig(checkpoint_dir="/ck", stop_ahead_steps=2, notice_margin_s=5)
NOW = 1000.0
CU126 = TorchRuntime(torch_version="2.13.0+cu126", torch_cuda="12.6", nccl_version="2.29.3")
CU130 = TorchRuntime(torch_version="2.13.0", torch_cuda="13.0", nccl_version="2.29.7")


def node(i: int, runtime: TorchRuntime | None, gpus: int = 1) -> NodeSpec:
    return NodeSpec(
        node_id=f"n{i}",
        gpu_type="A100-40",
        gpus=gpus,
        zone="z-a-1",
        address="h",
        runtime=runtime,
    )


def nodes(*specs: NodeSpec) -> dict[str, NodeSpec]:
    return {s.node_id: s for s in specs}


def running(ns: dict[str, NodeSpec], ids: tuple[str, ...]) -> DesiredState:
    res = DataParallelPlanner("m", 4, 8).plan(tuple(ns[i] for i in ids), None)
    return DesiredState(
        epoch=7,
        generation=1,
        phase=Phase.RUNNING,
        plan=res.plan,
        placement=res.placement,
        membership=tuple(sorted(ids)),
    )


def st(node_id: str, state: str = "running", gen: int = 1) -> AgentStatus:
    return AgentStatus(node_id=node_id, generation=gen, state=state, step=10)  # type: ignore[arg-type]


def obs(ns: dict[str, NodeSpec], statuses: list[AgentStatus]) -> Observed:
    return Observed(now=NOW, nodes=ns, status={s.node_id: s for s in statuses})


def test_a_node_of_another_nccl_does_not_join_a_running_job() -> None:
    """Before, n3 (the PyPI build, NCCL 2.29.7) joined a job running the CUDA 12.6 build
    (NCCL 2.29.3): the next layout mixed two NCCL versions in one communicator."""
    ns = nodes(node(1, CU126), node(2, CU126), node(3, CU130, gpus=8))
    d = running(ns, ("n1", "n2"))
    o = obs(ns, [st("n1"), st("n2"), st("n3", "idle", gen=-1)])
    assert decide(d, o, CFG) == []  # no quiesce for n3: it waits outside the job
    assert unusable(d, o) == frozenset({"n3"})
    why = not_admitted(d, o)["n3"]
    assert "NCCL 2.29.7 (torch 2.13.0, CUDA 13.0)" in why
    assert "the job's nodes run NCCL 2.29.3 (torch 2.13.0+cu126, CUDA 12.6, n1, n2)" in why
    assert "SAILOR_TORCH_INDEX" in why
    # a node of the job's build joins as before
    ns4 = {**ns, "n4": node(4, CU126)}
    a = decide(d, obs(ns4, [st("n1"), st("n2"), st("n4", "idle", gen=-1)]), CFG)
    assert isinstance(a[0], SetDesired) and a[0].state.phase is Phase.QUIESCE
    assert a[0].reason == "nodes joined: n4"


def test_an_idle_job_plans_on_the_version_with_most_gpus() -> None:
    ns = nodes(node(1, CU126, gpus=4), node(2, CU130, gpus=2), node(3, CU130, gpus=4))
    a = decide(DesiredState(epoch=7), obs(ns, []), CFG)
    (rp,) = [x for x in a if isinstance(x, Replan)]
    assert [n.node_id for n in rp.nodes] == ["n2", "n3"]  # 6 GPUs of 2.29.7 over 4 of 2.29.3


def test_the_running_layouts_version_wins_over_more_gpus_elsewhere() -> None:
    ns = nodes(node(1, CU126), node(2, CU130, gpus=8), node(3, CU130, gpus=8))
    d = running(ns, ("n1",))
    assert job_nccl(d.placement, ns, list(ns)) == "2.29.3"
    assert set(not_admitted(d, obs(ns, [st("n1")]))) == {"n2", "n3"}


def test_nodes_of_unknown_version_are_not_judged_and_excluded_nodes_do_not_vote() -> None:
    ns = nodes(node(1, None), node(2, CU130), node(3, CU126, gpus=8))
    health = {"n3": NodeHealth(failures=3, exclusions=1, excluded_until=NOW + 600, cause="boom")}
    d = DesiredState(epoch=7, node_health=health)
    o = obs(ns, [])
    # n3 (most GPUs) is excluded: its version does not decide, n1 (unknown) is placed
    assert not_admitted(d, o) == {}
    assert unusable(d, o) == frozenset({"n3"})
    (rp,) = [x for x in decide(d, o, CFG) if isinstance(x, Replan)]
    assert [n.node_id for n in rp.nodes] == ["n1", "n2"]


def test_the_agent_registers_its_torch_build_and_nccl_version() -> None:
    configured = node(1, None)
    facts = NodeFacts(
        node_kind="gpu",
        gathered=True,
        cuda_available=True,
        torch_version="2.13.0+cu126",
        torch_cuda="12.6",
        nccl_version="2.29.3",
    )
    reg = registered_node(configured, facts)
    assert reg.runtime == CU126
    assert NodeSpec.model_validate_json(reg.model_dump_json()) == reg  # what etcd holds
    # nothing gathered (a CPU node, check mode off): the node as configured
    assert registered_node(configured, NodeFacts(node_kind="cpu")) is configured
    # an agent of the release before registers no runtime: read as unknown
    old = configured.model_dump(mode="json", exclude={"runtime"}) | {"schema_version": 4}
    assert NodeSpec.model_validate(old).runtime is None


def test_the_controller_audits_each_change_of_the_nodes_not_admitted() -> None:
    ns = nodes(node(1, CU126), node(2, CU126), node(3, CU130))
    d = running(ns, ("n1", "n2"))
    written: list[tuple[str, dict[str, Any]]] = []
    ctl = SimpleNamespace(
        _not_admitted={},
        audit=SimpleNamespace(write=lambda kind, t, **f: written.append((kind, f))),
    )
    o = obs(ns, [st("n1"), st("n2")])
    excluded, refused = exclusion(d, o)
    # one computation: the node audited (n3, of another NCCL) is the one left out, and both
    # are what ``decide`` derives on its own (``unusable``, ``not_admitted``)
    assert set(refused) == {"n3"} and refused == not_admitted(d, o)
    assert excluded == unusable(d, o) == frozenset({"n3"})
    Controller._audit_admission(ctl, refused, o.now)  # type: ignore[arg-type]
    Controller._audit_admission(ctl, refused, o.now)  # type: ignore[arg-type]  (no change)
    assert [k for k, _ in written] == ["not_admitted"]
    assert set(written[0][1]["nodes"]) == {"n3"}
    o = obs(nodes(node(1, CU126)), [st("n1")])
    Controller._audit_admission(ctl, exclusion(d, o)[1], o.now)  # type: ignore[arg-type]
    assert written[-1] == ("not_admitted", {"nodes": {}})


def test_a_node_of_another_release_does_not_join_a_running_job() -> None:
    """Workers of two releases in one world may disagree on a step's collectives or on who
    writes which checkpoint layer: a node upgraded (drained, upgraded, rejoined) waits outside
    a running job of the old release, with the reason; once the old release's nodes have left
    the layout, the job goes to the new one, which has the most GPUs."""
    old = CU126.model_copy(update={"sailor_release": "0.1.0+aaaaaaaaaaaa"})
    new = CU126.model_copy(update={"sailor_release": "0.1.0+bbbbbbbbbbbb"})
    ns = nodes(node(1, old), node(2, old), node(3, new, gpus=8))
    d = running(ns, ("n1", "n2"))
    o = obs(ns, [st("n1"), st("n2"), st("n3", "idle", gen=-1)])
    assert decide(d, o, CFG) == []
    why = not_admitted(d, o)["n3"]
    assert "Sailor 0.1.0+bbbbbbbbbbbb, the job's nodes run Sailor 0.1.0+aaaaaaaaaaaa" in why
    assert "n1, n2" in why
    # the old release's nodes gone from the pool: the job moves to the new one
    rest = nodes(node(3, new, gpus=8), node(4, new))
    idle = DesiredState(epoch=7, generation=2, phase=Phase.IDLE)
    assert not_admitted(idle, obs(rest, [st("n3", "idle", -1), st("n4", "idle", -1)])) == {}
    # the agent registers its release with its build
    facts = NodeFacts(
        node_kind="gpu",
        gathered=True,
        cuda_available=True,
        torch_version="2.13.0+cu126",
        torch_cuda="12.6",
        nccl_version="2.29.3",
    )
    reg = registered_node(node(5, None), facts, "0.1.0+cccccccccccc")
    assert reg.runtime is not None and reg.runtime.sailor_release == "0.1.0+cccccccccccc"


def test_the_release_digest_follows_the_code(tmp_path: Any) -> None:
    from sailor.agent.release import code_digest, sailor_release

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    first = code_digest(tmp_path)
    assert code_digest(tmp_path) == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert code_digest(tmp_path) != first
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "sub" / "b.py").rename(tmp_path / "b.py")  # same bytes, another path
    assert code_digest(tmp_path) != first
    assert sailor_release().startswith("0.1.0+") and len(sailor_release().split("+")[1]) == 12


def test_a_gpu_that_cannot_run_the_jobs_precision_does_not_cost_a_reconfiguration() -> None:
    """A V100 (no bf16 units) joining a job fixed at bf16: the planner would leave it out of
    every plan, so before, its join quiesced, checkpointed and relaunched the same layout.
    Now it waits outside the job with the reason; an fp16 job takes it."""
    ns = nodes(node(1, CU126), node(2, CU126))
    v100 = NodeSpec(node_id="n3", gpu_type="V100-16", gpus=4, zone="z-a-1", address="h")
    ns["n3"] = v100
    d = running(nodes(node(1, CU126), node(2, CU126)), ("n1", "n2"))
    bf16 = d.model_copy(update={"job_precision": "bf16"})
    o = obs(ns, [st("n1"), st("n2"), st("n3", "idle", gen=-1)])
    assert decide(bf16, o, CFG) == []
    why = not_admitted(bf16, o)["n3"]
    assert "V100-16 has no bf16 units" in why and "the job computes in bf16" in why
    fp16 = d.model_copy(update={"job_precision": "fp16"})
    assert "n3" not in not_admitted(fp16, o)
    assert decide(fp16, o, CFG) != []  # it joins: a reconfiguration begins


def test_nodes_without_nccl_are_judged_by_their_release() -> None:
    """A CPU node, or a GPU node whose check is off, registers its release alone: a rolling
    upgrade of such a pool must not mix two releases in one world either."""
    cpu = NodeFacts(node_kind="cpu")
    reg = registered_node(node(1, None), cpu, "0.1.0+aaaaaaaaaaaa")
    assert reg.runtime is not None and reg.runtime.nccl_version == ""
    assert reg.runtime.sailor_release == "0.1.0+aaaaaaaaaaaa"
    old = reg.runtime
    new = old.model_copy(update={"sailor_release": "0.1.0+bbbbbbbbbbbb"})
    ns = nodes(node(1, old), node(2, old), node(3, new))
    d = running(ns, ("n1", "n2"))
    o = obs(ns, [st("n1"), st("n2"), st("n3", "idle", gen=-1)])
    assert decide(d, o, CFG) == []
    assert "the job's nodes run Sailor 0.1.0+aaaaaaaaaaaa" in not_admitted(d, o)["n3"]
    # a node of unknown release (an agent of the release before) is not judged by it
    ns["n4"] = node(4, None)
    o = obs(ns, [st("n1"), st("n2"), st("n3", "idle", gen=-1), st("n4", "idle", gen=-1)])
    assert set(not_admitted(d, o)) == {"n3"}


@pytest.mark.parametrize("field", ["torch_version", "torch_cuda", "nccl_version"])
def test_a_runtime_field_longer_than_a_version_is_refused_by_name(field: str) -> None:
    """A node's record is read on every controller pass: a runtime string is a version,
    64 characters at most, and the error names the field."""
    TorchRuntime(**{field: "2" * 64})
    with pytest.raises(ValidationError, match=field):
        TorchRuntime(**{field: "2" * 65})


def test_an_idle_job_says_why_no_node_is_admitted() -> None:
    """A job forced to bf16 before any launch, on V100s alone: every node is left out, so
    nothing is planned; the reason is the job's cause (``sailor status``), written once. A
    precision contradiction says what to set even when no node is usable."""
    from sailor.schemas.training import BuiltinModel, TrainingConfig

    v100 = NodeSpec(node_id="n1", gpu_type="V100-16", gpus=4, zone="z-a-1", address="h")
    o = obs({"n1": v100}, [st("n1", "idle", gen=-1)])
    train = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), precision="bf16")
    cfg = CFG.model_copy(update={"training": train})
    d = DesiredState(epoch=7)
    (act,) = decide(d, o, cfg)
    assert isinstance(act, SetDesired) and "no registered node is admitted" in act.state.cause
    assert "V100-16 has no bf16 units" in act.state.cause
    assert decide(act.state, o, cfg) == []  # written once
    # recorded bf16, the config forcing fp16 without allowing the change: the hold says so
    fp16 = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), precision="fp16")
    cfg16 = CFG.model_copy(update={"training": fp16})
    rec = DesiredState(epoch=7, job_precision="bf16")
    (act,) = decide(rec, o, cfg16)
    assert isinstance(act, SetDesired) and "allow_precision_change" in act.state.cause


def test_the_hold_cause_goes_once_a_node_is_admitted() -> None:
    """The idle cause written while no node was admitted is cleared, once, when one is:
    status must not name a node that is gone, and the launch must not carry it."""
    from sailor.schemas.training import BuiltinModel, TrainingConfig

    v100 = NodeSpec(node_id="n1", gpu_type="V100-16", gpus=4, zone="z-a-1", address="h")
    train = TrainingConfig(model=BuiltinModel(name="tiny-gpt"), precision="bf16")
    cfg = CFG.model_copy(update={"training": train})
    (held,) = decide(DesiredState(epoch=7), obs({"n1": v100}, [st("n1", "idle", -1)]), cfg)
    assert isinstance(held, SetDesired) and held.state.cause.startswith("waiting:")
    a100 = node(2, None)
    o = obs({"n1": v100, "n2": a100}, [st("n1", "idle", -1), st("n2", "idle", -1)])
    acts = decide(held.state, o, cfg)
    cleared = [a for a in acts if isinstance(a, SetDesired)]
    assert cleared and cleared[0].state.cause == "" and cleared[0].reason == "no longer held"
    assert any(isinstance(a, Replan) for a in acts)  # and the job plans on the A100
    # gone with the V100 alone leaving: cleared as well, nothing else to do
    (gone,) = decide(held.state, obs({}, []), cfg)
    assert isinstance(gone, SetDesired) and gone.state.cause == ""


def test_the_release_digest_reads_code_and_data_not_stray_files(tmp_path: Any) -> None:
    from pathlib import Path

    import sailor
    from sailor.agent.release import code_digest

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "gpus.json").write_text("{}\n")
    first = code_digest(tmp_path)
    (tmp_path / "a.py.swp").write_text("editor state")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert code_digest(tmp_path) == first  # stray files and caches: the same release
    (tmp_path / "gpus.json").write_text('{"x": 1}\n')
    assert code_digest(tmp_path) != first  # the catalog's data: another release
    # every file the package ships is one the digest reads (a new kind of data file would
    # otherwise drop out of it silently)
    shipped = {
        f.suffix
        for f in Path(sailor.__file__).parent.rglob("*")
        if f.is_file() and "__pycache__" not in f.parts
    }
    assert shipped <= {".py", ".json", ".yaml", ".yml", ".typed"}, shipped


def test_equal_gpus_pick_the_newer_release_by_its_version_not_its_digest() -> None:
    a = CU126.model_copy(update={"sailor_release": "1.2+999999999999"})
    b = CU126.model_copy(update={"sailor_release": "1.2.1+000000000000"})
    ns = nodes(node(1, a), node(2, b))
    from sailor.controller.runtime_admission import job_release

    assert job_release((), ns, ["n1", "n2"]) == "1.2.1+000000000000"
