"""The controller hands its training config to every worker, through etcd and the agent.

Real nats-server and etcd (secure), a controller whose config names a training file with
relative paths, and an agent launching toy trainers from a custom argv template. The
worker's run directory must hold ``training.json`` equal to the controller's resolved config
(paths absolute against the training file's directory), the worker's argv must name it with
``--train-config``, and the audit's launch record must carry its digest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sailor.controller.audit import read_records
from sailor.localservers import LocalServers
from sailor.schemas.commands import training_digest
from sailor.schemas.runtime import Phase
from sailor.schemas.training import IndexedData, parse_training_config
from tests.integration.cluster_kit import Cluster

pytestmark = pytest.mark.usefixtures("no_task_leak")

TRAINING = """
model: {kind: builtin, name: tiny-gpt}
data: {kind: indexed, prefix: data/corpus}
seed: 7
metrics: {jsonl: out/metrics.jsonl}
"""


class TrainingCluster(Cluster):
    def __init__(self, tmp: Path, servers: LocalServers) -> None:
        super().__init__(tmp, servers)
        (tmp / "job").mkdir()
        self.training_file = tmp / "job" / "run.yaml"
        self.training_file.write_text(TRAINING)
        self.ctl_update = {"training": self.training_file}


@pytest.fixture
async def cluster(tmp_path: Path, servers: LocalServers) -> AsyncIterator[TrainingCluster]:
    async with TrainingCluster(tmp_path, servers) as c:
        yield c


async def test_launch_delivers_the_controllers_training_config(cluster: TrainingCluster) -> None:
    cluster.start_controller("c1")
    agent = cluster.start_agent("n1")
    ctl = await cluster.wait_phase(Phase.RUNNING, 30)
    d = ctl.desired
    assert d is not None and d.training is not None
    job = cluster.tmp / "job"
    assert d.training == ctl.training
    assert d.training.data == IndexedData(prefix=f"{job}/data/corpus")
    assert d.training.metrics.jsonl == f"{job}/out/metrics.jsonl"

    path = cluster.tmp / "agents" / "n1" / f"gen-{d.generation:05d}" / "training.json"
    assert parse_training_config(path.read_text(), str(path)) == d.training
    (worker,) = agent.supervisor.workers
    assert worker.argv[-2:] == ("--train-config", str(path))
    assert worker.argv[2] == "sailor.agent.toy_trainer"  # a custom template gets it too
    await cluster.wait_step(ctl, ["n1"], 1, 10)  # the toy trainer accepted the config

    launches = [
        r
        for r in read_records([cluster.tmp / "audit-c1.jsonl"])
        if r["kind"] == "phase" and r["phase"] == "launch"
    ]
    assert launches and {r["training_sha256"] for r in launches} == {training_digest(d.training)}
    await cluster.audit()
