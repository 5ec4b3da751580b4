"""Admission by NATS token (``controller/token_admission.py``): node ids that share a NATS
subject token (``gpu.1``, ``gpu_1``) are left out with a reason naming both, except the one
the running layout holds. Before, both were admitted: each agent answered the other's
commands, and the wrong one's refusal was recorded as the addressed node's and resent for
ever."""

from __future__ import annotations

from dataclasses import replace

from sailor.controller.decide import decide, exclusion, not_admitted
from sailor.controller.decision_types import DecideConfig, Observed, Replan
from sailor.controller.token_admission import token_clashes
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import DesiredState

ZONE = "us-central1-a"


def _node(node_id: str) -> NodeSpec:
    return NodeSpec(node_id=node_id, gpu_type="A100-40", gpus=4, zone=ZONE, address="h")


NODES = {n: _node(n) for n in ("a", "gpu.1", "gpu_1", "gpu-1")}


def test_a_pair_sharing_a_token_is_left_out_naming_both() -> None:
    refused = not_admitted(DesiredState(epoch=1), Observed(now=1.0, nodes=NODES, status={}))
    assert set(refused) == {"gpu.1", "gpu_1"}  # gpu-1 has a token of its own
    assert "'gpu_1'" in refused["gpu.1"] and "NATS token 'gpu_1'" in refused["gpu.1"]
    assert "'gpu.1'" in refused["gpu_1"]


def test_the_one_the_running_layout_holds_stays() -> None:
    assert set(token_clashes({"gpu_1": (0,)}, NODES, list(NODES))) == {"gpu.1"}
    assert token_clashes({}, NODES, ["a", "gpu-1"]) == {}  # only candidates are judged


def test_the_refused_pair_is_not_planned() -> None:
    cfg = DecideConfig(checkpoint_dir="/ck")
    d = DesiredState(epoch=1)
    o = Observed(now=10.0, nodes=NODES, status={})
    excluded, _ = exclusion(d, o)
    (replan,) = [a for a in decide(d, replace(o, excluded=excluded), cfg) if isinstance(a, Replan)]
    assert sorted(n.node_id for n in replan.nodes) == ["a", "gpu-1"]
