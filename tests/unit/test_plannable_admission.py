"""Admission by what the planner can use (``controller/plannable.py``): a registered node of
a GPU type the planner has no figure for, or with more GPUs than it takes per node, is left
out with the reason, and the other nodes are planned. Before, such a node went into every
replan, the planner raised for the whole pool, and no node was planned while it stayed
registered."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from sailor import catalog
from sailor.agent.agent_config import AgentConfig
from sailor.cli.main import app
from sailor.controller.config import ControllerConfig
from sailor.controller.daemon import Controller
from sailor.controller.decide import decide, exclusion, not_admitted
from sailor.controller.decision_types import DecideConfig, Observed, Replan, SetDesired
from sailor.controller.planning import DataParallelPlanner
from sailor.controller.planning.in_process import SailorPlanner, planner_reach_of
from sailor.controller.planning.process import ProcessPlanner
from sailor.planner import Constraints, NoFeasiblePlanError
from sailor.planner.reach import PlannerReach
from sailor.schemas import PriceTable, ProfileDB
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.prices import GPUPrice
from sailor.schemas.runtime import AgentStatus, DesiredState, Phase

ZONE = "us-central1-a"
SPEC = catalog.model("OPT-350").model_copy(update={"global_batch_size": 16})


def _node(node_id: str, gpu_type: str = "A100-40", gpus: int = 4) -> NodeSpec:
    return NodeSpec(node_id=node_id, gpu_type=gpu_type, gpus=gpus, zone=ZONE, address="h")


def _pass(d: DesiredState, o: Observed, cfg: DecideConfig) -> tuple[Observed, dict[str, str]]:
    """What the daemon's pass does before ``decide``: fill ``excluded`` (daemon._observe)."""
    excluded, refused = exclusion(d, o, None, cfg.planner_reach)
    return replace(o, excluded=excluded), refused


def test_one_node_the_planner_cannot_use_does_not_block_the_others() -> None:
    planner = SailorPlanner(SPEC, risk="median")
    cfg = DecideConfig(checkpoint_dir="/ck", planner_reach=planner.reach())
    nodes = {
        "a": _node("a"),
        "big": _node("big", gpus=65),  # an agent of an older release: no local bound
        "odd": _node("odd", gpu_type="NoSuchGPU"),
    }
    # the planner itself leaves them out of a pool it is given (a node of a running layout
    # is kept in it whatever the reach) and says so; before, it raised for the whole pool
    res = planner.plan(tuple(nodes.values()), None)
    assert res.placement == {"a": (0, 1, 2, 3)}
    assert "left out, the planner cannot use them: big: gpus=65" in res.reason
    assert "odd: pool GPU type 'NoSuchGPU' is unknown" in res.reason
    with pytest.raises(NoFeasiblePlanError, match="can use none of the nodes: odd: pool GPU"):
        planner.plan((nodes["odd"],), None)
    o, refused = _pass(DesiredState(epoch=1), Observed(now=10.0, nodes=nodes, status={}), cfg)
    assert set(refused) == {"big", "odd"}
    assert "gpus=65: over the 64 GPUs per node" in refused["big"]
    assert "GPU type 'NoSuchGPU' is unknown: no profile and no spec" in refused["odd"]
    assert all(w.startswith("the planner cannot use it") for w in refused.values())
    (replan,) = [a for a in decide(DesiredState(epoch=1), o, cfg) if isinstance(a, Replan)]
    assert [n.node_id for n in replan.nodes] == ["a"]
    assert planner.plan(replan.nodes, None).placement == {"a": (0, 1, 2, 3)}


def test_without_a_reach_every_node_goes_to_the_planner() -> None:
    """The stand-in planner takes any node: it has no reach, and nothing is refused."""
    nodes = {"odd": _node("odd", gpu_type="NoSuchGPU", gpus=65)}
    assert not_admitted(DesiredState(epoch=1), Observed(now=1.0, nodes=nodes, status={})) == {}


def test_an_idle_job_says_no_node_is_admitted_when_the_planner_can_use_none() -> None:
    cfg = DecideConfig(checkpoint_dir="/ck", planner_reach=SailorPlanner(SPEC).reach())
    nodes = {"odd": _node("odd", gpu_type="NoSuchGPU")}
    o, _ = _pass(DesiredState(epoch=1), Observed(now=1.0, nodes=nodes, status={}), cfg)
    (act,) = decide(DesiredState(epoch=1), o, cfg)
    assert isinstance(act, SetDesired)
    assert act.state.cause.startswith("waiting: no registered node is admitted: odd: the planner")
    assert decide(act.state, o, cfg) == []  # said once


def test_the_reach_refuses_what_the_search_refuses() -> None:
    """One rule for both: a type known by a profile alone is taken; one without a price is
    not; one at $0/h only when cost is ranked."""
    mine = GPUPrice(
        gpu_type="Mine", region="us-central1", on_demand_usd_per_hour=0, spot_usd_per_hour=0
    )
    free = PriceTable(gpus=(mine,))
    row = {"gpu_type": "Mine", "tp": 1, "microbatch_size": 1, "layer": 1, "kind": "block"}
    timing = row | {"fwd_s": 0.1, "bwd_s": 0.2, "update_s": 0.01}
    prof = ProfileDB.model_validate({"model": "m", "timings": [timing]})
    specs = catalog.gpus()
    thr = PlannerReach.of(
        specs, prof, free, spot=False, objective="throughput", constraints=Constraints()
    )
    assert thr.why_not("Mine", ZONE, 8, False) == ""
    assert "'A100-40' has no price" in thr.why_not("A100-40", ZONE, 8, False)
    cost = PlannerReach.of(
        specs, prof, free, spot=False, objective="cost", constraints=Constraints()
    )
    assert "costs $0/h: objective='cost'" in cost.why_not("Mine", ZONE, 8, False)
    capped = PlannerReach.of(
        specs,
        prof,
        free,
        spot=False,
        objective="throughput",
        constraints=Constraints(max_cost_per_hour_usd=10.0),
    )
    assert "costs $0/h: a cost limit" in capped.why_not("Mine", ZONE, 8, False)
    # a CPU kind without an entry of its own takes the cpu spec, as the search does
    assert thr.unknown_type("cpu-slow") == "" and thr.unknown_type("cpux") != ""


def test_the_controller_admits_by_its_planners_reach(tmp_path: Path) -> None:
    base = {"job": "r", "audit_log": tmp_path / "audit.jsonl", "model": "OPT-350"}
    sailor = ControllerConfig(**base, planner_process=False)
    ctl = Controller(sailor)
    try:
        reach = ctl.decide_cfg.planner_reach
        assert reach is not None and reach == planner_reach_of(sailor)
        assert "unknown" in reach.why_not("NoSuchGPU", ZONE, 1, True)
    finally:
        ctl.audit.close()
    # the worker process's planner is built from the same config: the same reach
    assert ProcessPlanner(sailor.model_copy(update={"planner_process": True})).reach() == reach
    stand_in = Controller(ControllerConfig(**base, planner="data_parallel"))
    try:
        assert stand_in.decide_cfg.planner_reach is None
    finally:
        stand_in.audit.close()


def test_an_agent_config_refuses_more_gpus_than_the_planner_takes() -> None:
    node = {"node_id": "a", "gpu_type": "A100-40", "gpus": 65, "zone": ZONE}
    with pytest.raises(ValidationError, match=r"node.gpus=65: over the 64 GPUs per node"):
        AgentConfig.model_validate({"node": node})
    assert AgentConfig.model_validate({"node": node | {"gpus": 64}}).node.gpus == 64


def test_config_check_errors_on_a_node_the_controllers_planner_cannot_use(
    tmp_path: Path,
) -> None:
    agent = tmp_path / "agent.yaml"
    agent.write_text(f"node: {{node_id: a, gpu_type: NoSuchGPU, gpus: 1, zone: {ZONE}}}\n")
    controller = tmp_path / "controller.yaml"
    controller.write_text("model: OPT-350\n")
    run = CliRunner().invoke
    alone = run(app, ["config", "check", str(agent)])
    assert alone.exit_code == 0 and "warning" in alone.output and "--controller" in alone.output
    res = run(app, ["config", "check", str(agent), "--controller", str(controller)])
    assert res.exit_code == 1, res.output
    assert "cannot use this node" in res.output and "gpu_type='NoSuchGPU'" in res.output
    ok = tmp_path / "ok.yaml"
    ok.write_text(f"node: {{node_id: a, gpu_type: A100-40, gpus: 1, zone: {ZONE}}}\n")
    assert run(app, ["config", "check", str(ok), "--controller", str(controller)]).exit_code == 0
    stand_in = tmp_path / "dp.yaml"
    stand_in.write_text("planner: data_parallel\n")
    assert run(app, ["config", "check", str(agent), "--controller", str(stand_in)]).exit_code == 0


def test_a_node_of_the_running_layout_stays_whatever_the_reach() -> None:
    """A controller restarted with a price table without V100s: the V100 node the running
    layout trains on stays in the membership (it was dropped, "nothing runs there", and a
    restart with the old prices counted it as newly joined: quiesce, checkpoint, relaunch);
    the next replan leaves it out and says so, and once out of the layout it is judged."""
    nodes = {"a": _node("a", gpus=1), "v": _node("v", gpu_type="V100-16", gpus=1)}
    res = DataParallelPlanner("m", 4, 8).plan(tuple(nodes.values()), None)
    d = DesiredState(
        epoch=7,
        generation=1,
        phase=Phase.RUNNING,
        plan=res.plan,
        placement=res.placement,
        membership=("a", "v"),
    )
    status = {n: AgentStatus(node_id=n, generation=1, state="running", step=10) for n in nodes}
    prices = catalog.prices()
    no_v100 = PriceTable(gpus=tuple(p for p in prices.gpus if p.gpu_type != "V100-16"))
    planner = SailorPlanner(SPEC, prices=no_v100, risk="median")
    cfg = DecideConfig(checkpoint_dir="/ck", planner_reach=planner.reach())
    o, refused = _pass(d, Observed(now=1000.0, nodes=nodes, status=status), cfg)
    assert refused == {} and o.usable == ("a", "v")
    assert decide(d, o, cfg) == []  # the membership is kept: nothing to do
    back = DecideConfig(checkpoint_dir="/ck", planner_reach=SailorPlanner(SPEC).reach())
    assert decide(d, _pass(d, o, back)[0], back) == []  # not "joined" either
    # a replan (here for a node joining) hands the planner the pool; it leaves v out
    joined = nodes | {"b": _node("b", gpus=1)}
    o, _ = _pass(d, Observed(now=1000.0, nodes=joined, status=status), cfg)
    (replan,) = [a for a in decide(d, o, cfg) if isinstance(a, Replan)]
    assert [n.node_id for n in replan.nodes] == ["a", "b", "v"]
    planned = planner.plan(replan.nodes, d.plan)
    assert set(planned.placement) == {"a", "b"}
    assert "left out, the planner cannot use them: v: pool GPU type 'V100-16' has no price" in (
        planned.reason
    )
    # out of the layout, it is judged like any other node, with how to fix it
    later = d.model_copy(update={"placement": planned.placement})
    _, refused = _pass(later, Observed(now=1001.0, nodes=joined, status=status), cfg)
    assert set(refused) == {"v"}
    assert "restart the controller (it reads them once, at its start)" in refused["v"]


def test_each_node_shape_is_priced_once_across_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """512 nodes of 4 shapes: the first pass prices each shape once, later passes none (a
    scan of the price table per node and per pass took ~50-110 ms on the event loop)."""
    calls: list[str] = []
    real = PriceTable.gpu_hour

    def counted(self: PriceTable, gpu_type: str, zone: str, spot: bool = False) -> float:
        calls.append(gpu_type)
        return real(self, gpu_type, zone, spot)

    monkeypatch.setattr(PriceTable, "gpu_hour", counted)
    types = ("A100-40", "V100-16", "H100-80", "L4")
    nodes = {f"n{i}": _node(f"n{i}", gpu_type=types[i % 4], gpus=8) for i in range(512)}
    cfg = DecideConfig(checkpoint_dir="/ck", planner_reach=SailorPlanner(SPEC).reach())
    o = Observed(now=1.0, nodes=nodes, status={})
    _pass(DesiredState(epoch=1), o, cfg)
    assert sorted(calls) == sorted(types)
    for _ in range(3):
        _pass(DesiredState(epoch=1), o, cfg)
    assert len(calls) == 4


def test_a_copy_with_other_inputs_is_judged_afresh() -> None:
    """The verdicts and the price index kept on a frozen value are not carried to a copy
    with other fields (``model_copy`` copies the instance's ``__dict__``)."""
    prices = catalog.prices()
    reach = SailorPlanner(SPEC, prices=prices).reach()
    assert reach.why_not("V100-16", ZONE, 1, True) == ""
    no_v100 = prices.model_copy(
        update={"gpus": tuple(p for p in prices.gpus if p.gpu_type != "V100-16")}
    )
    with pytest.raises(KeyError, match="V100-16"):
        no_v100.gpu_hour("V100-16", ZONE)
    other = reach.model_copy(update={"prices": no_v100})
    assert "'V100-16' has no price" in other.why_not("V100-16", ZONE, 1, True)
    assert reach.why_not("V100-16", ZONE, 1, True) == "" and other != reach
    assert reach == SailorPlanner(SPEC, prices=prices).reach()  # the memo is not a field
