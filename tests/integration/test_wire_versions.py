"""A rolling upgrade through a real etcd: records a newer release writes (a higher
``schema_version``, fields this release does not know) are read by this release's controller
status, the controller's view of the registered nodes and the agent's plan source, their new
fields dropped (docs/operations.md, "Wire versions across releases"). Before, each was
refused as a whole: ``sailor status`` showed the node without its status, the agent could not
read the desired state at all, and a node registered by a newer agent (``NodeSpec`` carried
no version) was rejected by the controller, which never planned on it."""

from __future__ import annotations

import json

from sailor.agent.plan_source import PlanSource
from sailor.controller.observed import ObservedCache
from sailor.controller.status import read_status
from sailor.coordination import Keys, connect_etcd
from sailor.schemas import SCHEMA_VERSION
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.runtime import AgentStatus, DesiredState, Phase
from tests.integration.conftest import Server
from tests.integration.secure_servers import CONTROLLER, JOB, NODES, Pki

KEYS = Keys(job=JOB)


def _plan() -> Plan:
    rg = ReplicaGroup(gpu_type="A100-40", zone="z-a", tp=1, gpus_per_node=4)
    stage = Stage(first_layer=0, last_layer=3, replica=rg)
    pipe = Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=4)
    return Plan(model="tiny-gpt", global_batch_size=4, pipelines=(pipe,))


def _newer(raw: str, extra: dict[str, object]) -> bytes:
    """``raw`` as the next release writes it: its version, and fields this one lacks."""
    return json.dumps(json.loads(raw) | {"schema_version": SCHEMA_VERSION + 1} | extra).encode()


async def test_records_of_a_newer_release_are_read_without_their_new_fields(
    secure_etcd_server: Server, pki: Pki
) -> None:
    ep = f"127.0.0.1:{secure_etcd_server.port}"
    node = NODES[0]
    agent = await connect_etcd(ep, security=pki.security(node))
    ctl = await connect_etcd(ep, security=pki.security(CONTROLLER))
    try:
        spec = NodeSpec(node_id=node, gpu_type="A100-40", gpus=4, zone="z-a")
        await agent.put(KEYS.node(node), _newer(spec.model_dump_json(), {"nics": 4}))
        status = AgentStatus(node_id=node, epoch=3, state="running", step=41, loss=2.5)
        await agent.put(
            KEYS.status(node),
            _newer(status.model_dump_json(), {"gpu_temps_c": [61, 63, 60, 62]}),
        )
        desired = DesiredState(epoch=3, generation=2, phase=Phase.RUNNING, plan=_plan())
        raw = json.loads(desired.model_dump_json())
        raw["plan"]["pipelines"][0]["stages"][0]["replica"]["nic"] = "efa"
        await ctl.put(KEYS.desired, _newer(json.dumps(raw), {"rollout_wave": 1}))

        snap = await read_status(ep, JOB, pki.security(CONTROLLER))
        assert snap["phase"] == "running" and snap["generation"] == 2
        assert snap["plan_id"] == desired.plan.plan_id  # type: ignore[union-attr]
        (row,) = snap["nodes"]
        assert row["state"] == "running" and row["step"] == 41

        got = await PlanSource(lambda: agent.get(KEYS.desired)).desired()
        assert got is not None and got.plan == desired.plan and got.generation == 2

        # the controller's own view of the registered nodes (before, a node registered by a
        # newer agent was rejected: the controller never planned on it)
        rejected: list[tuple[str, str]] = []
        cache = ObservedCache(ctl, KEYS, lambda k, why: rejected.append((k, why)))
        await cache.start()
        try:
            snap_nodes = cache.snapshot().nodes
        finally:
            await cache.close()
        assert not rejected
        assert snap_nodes[node].model_dump(exclude={"schema_version"}) == spec.model_dump(
            exclude={"schema_version"}
        )
    finally:
        await agent.close()
        await ctl.close()
