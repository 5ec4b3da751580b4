"""Job names and node ids the runtime accepts (``coordination/names.py``): a job name with a
``/`` let one job's etcd prefix (and an agent's RBAC) cover another's keys, and names
differing only in case shared one event stream; a node id like ``../../x`` put the agent's
fence file and run directory outside its work directory; node ids differing only in ``.``
and ``_`` shared every NATS permission (``token_clashes``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sailor.agent.agent_config import AgentConfig
from sailor.agent.daemon import Agent
from sailor.controller.config import ControllerConfig
from sailor.coordination import Keys
from sailor.coordination.names import check_job, check_node_id, token_clashes
from sailor.schemas.hardware import NodeSpec


def _node(node_id: str) -> NodeSpec:
    return NodeSpec(node_id=node_id, gpu_type="A100-40", gpus=1, zone="z-a-1")


@pytest.mark.parametrize("job", ["default", "x_y", "X_Y", "job-7", "a" * 64, "llama-3.1", "a.b."])
def test_job_names_taken(job: str) -> None:
    assert check_job(job) == job
    assert Keys(job=job).job == job


@pytest.mark.parametrize(
    "job", ["a/b", "a b", "", "é", "a" * 65, "a*", "a>", ".", "..", ".a", "a/../b"]
)
def test_job_names_refused_naming_field_and_value(job: str) -> None:
    with pytest.raises(ValidationError, match="job"):
        Keys(job=job)
    with pytest.raises(ValidationError, match="job"):
        ControllerConfig(job=job)
    with pytest.raises(ValidationError, match="job"):
        AgentConfig(job=job, node=_node("n1"))


def test_a_job_prefix_holds_no_other_jobs_keys() -> None:
    """With ``/`` refused no job's root is a prefix of another job's keys."""
    a = Keys(job="a")
    for other in ("ab", "a-b", "a_b"):
        assert not Keys(job=other).node("n1").startswith(a.root)


def test_stream_names_differ_for_jobs_that_differ_in_case() -> None:
    names = {Keys(job=j).stream for j in ("x_y", "X_Y", "x_Y", "X-Y", "x-y")}
    assert len(names) == 5
    # a name without upper-case letters keeps the name every release gave its stream
    assert Keys(job="default").stream == "SAILOR_DEFAULT_EVENTS"
    assert Keys(job="x_y").stream == Keys(job="x_y").legacy_stream == "SAILOR_X_Y_EVENTS"
    assert Keys(job="X_Y").legacy_stream == "SAILOR_X_Y_EVENTS"  # the clash, now renamed


@pytest.mark.parametrize("node_id", ["n1", "gpu.1", "gpu_1", "a-b.c", "_x", "n" * 128])
def test_node_ids_taken(node_id: str) -> None:
    assert check_node_id(node_id) == node_id
    assert AgentConfig(node=_node(node_id)).node.node_id == node_id


@pytest.mark.parametrize(
    "node_id", ["../../../tmp/x", "..", ".", ".hidden", "a/b", "a b", "n1\x00", "n" * 129]
)
def test_node_ids_refused_in_the_agent_config(node_id: str) -> None:
    with pytest.raises(ValidationError, match=r"node\.node_id"):
        AgentConfig(node=_node(node_id))


def test_the_agent_refuses_a_node_id_that_leaves_its_work_dir(tmp_path: Path) -> None:
    """A config copied with an update is not validated again: the agent checks before it
    builds a path from the id (nothing is created outside work_dir)."""
    cfg = AgentConfig(node=_node("n1"), work_dir=tmp_path / "work")
    bad = cfg.model_copy(update={"node": _node("../../escaped")})
    with pytest.raises(ValueError, match=r"node\.node_id='\.\./\.\./escaped'"):
        Agent(bad)
    assert not (tmp_path / "escaped").exists()
    assert not list(tmp_path.parent.glob("escaped*"))


def test_base_port_bounded_so_every_generations_port_is_a_port() -> None:
    assert ControllerConfig(base_port=64536).base_port == 64536
    with pytest.raises(ValidationError, match="base_port"):
        ControllerConfig(base_port=64537)


def test_token_clashes() -> None:
    assert token_clashes(["gpu.1", "gpu_1", "gpu-1", "n1", "n1"]) == [("gpu.1", "gpu_1")]
    assert token_clashes(["a.b", "a_b", "a:b", "c"]) == [("a.b", "a:b", "a_b")]
    assert token_clashes(["n1", "n2"]) == []
