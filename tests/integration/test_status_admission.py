"""``sailor status`` through a real etcd: the nodes the controller does not admit (another
NCCL version, another Sailor release, a GPU type that cannot run the job's precision), why,
the job's precision and the last failed search, as the leader's own rules read the records
(``controller/runtime_admission.py``)."""

from __future__ import annotations

from sailor.controller.config import ControllerConfig
from sailor.controller.planning import DataParallelPlanner
from sailor.controller.planning.in_process import planner_reach_of
from sailor.controller.status import read_status
from sailor.coordination import Keys, connect_etcd
from sailor.schemas.hardware import NodeSpec, TorchRuntime
from sailor.schemas.runtime import AgentStatus, DesiredState, Phase
from sailor.schemas.training import BuiltinModel, TrainingConfig
from tests.integration.conftest import Server
from tests.integration.secure_servers import CONTROLLER, JOB, NODES, Pki

KEYS = Keys(job=JOB)
CU126 = TorchRuntime(torch_version="2.13.0+cu126", torch_cuda="12.6", nccl_version="2.29.3")
CU130 = TorchRuntime(torch_version="2.13.0", torch_cuda="13.0", nccl_version="2.29.7")


async def test_sailor_status_names_the_nodes_not_admitted_and_why(
    secure_etcd_server: Server, pki: Pki
) -> None:
    ep = f"127.0.0.1:{secure_etcd_server.port}"
    n1, n2 = NODES[:2]
    a100 = NodeSpec(node_id=n1, gpu_type="A100-40", gpus=1, zone="z-a", runtime=CU126)
    res = DataParallelPlanner("m", 4, 8).plan((a100,), None, "bf16")
    desired = DesiredState(
        epoch=3,
        generation=1,
        phase=Phase.RUNNING,
        plan=res.plan,
        placement=res.placement,
        membership=(n1,),
        job_precision="bf16",
        plan_failed="no GPU available",
    )
    ctl = await connect_etcd(ep, security=pki.security(CONTROLLER))
    agents = {n: await connect_etcd(ep, security=pki.security(n)) for n in (n1, n2)}
    try:
        await ctl.put(KEYS.desired, desired.model_dump_json().encode())
        await agents[n1].put(KEYS.node(n1), a100.model_dump_json().encode())
        v100 = NodeSpec(node_id=n2, gpu_type="V100-16", gpus=4, zone="z-a", runtime=CU126)
        await agents[n2].put(KEYS.node(n2), v100.model_dump_json().encode())
        snap = await read_status(ep, JOB, pki.security(CONTROLLER))
        assert set(snap["not_admitted"]) == {n2}
        assert "no bf16 units" in snap["not_admitted"][n2]
        assert snap["job_precision"] == "bf16" and snap["plan_failed"] == "no GPU available"
        rows = {r["node"]: r for r in snap["nodes"]}
        assert rows[n1]["nccl"] == "2.29.3" and rows[n1]["admitted"] == ""
        assert rows[n2]["admitted"] == "no"
        # read by the controller's training config, as the leader admits: a forced fp16
        # with the change allowed takes the V100
        fp16 = TrainingConfig(
            model=BuiltinModel(name="tiny-gpt"), precision="fp16", allow_precision_change=True
        )
        snap = await read_status(ep, JOB, pki.security(CONTROLLER), training=fp16)
        assert snap["not_admitted"] == {} and snap["admission_precision"] == "fp16"
        assert snap["job_precision"] == "bf16"  # what runs
        # the same node re-registered with another torch build: refused for its NCCL
        other = a100.model_copy(update={"node_id": n2, "runtime": CU130})
        await agents[n2].put(KEYS.node(n2), other.model_dump_json().encode())
        snap = await read_status(ep, JOB, pki.security(CONTROLLER))
        assert "NCCL 2.29.7" in snap["not_admitted"][n2]
        assert {r["node"]: r["nccl"] for r in snap["nodes"]}[n2] == "2.29.7"
    finally:
        for c in (ctl, *agents.values()):
            await c.close()


async def test_sailor_status_names_a_node_the_planner_cannot_use(
    secure_etcd_server: Server, pki: Pki
) -> None:
    """An agent of a GPU type the controller's planner has no figure for registers: the
    status reads it with the controller's reach and says why it is left out."""
    ep = f"127.0.0.1:{secure_etcd_server.port}"
    n1, n2 = NODES[:2]
    agents = {n: await connect_etcd(ep, security=pki.security(n)) for n in (n1, n2)}
    try:
        a100 = NodeSpec(node_id=n1, gpu_type="A100-40", gpus=4, zone="us-central1-a")
        odd = a100.model_copy(update={"node_id": n2, "gpu_type": "NoSuchGPU"})
        for spec in (a100, odd):
            await agents[spec.node_id].put(KEYS.node(spec.node_id), spec.model_dump_json().encode())
        reach = planner_reach_of(ControllerConfig(model="OPT-350"))
        snap = await read_status(ep, JOB, pki.security(CONTROLLER), reach=reach)
        assert set(snap["not_admitted"]) == {n2}
        assert "the planner cannot use it: pool GPU type 'NoSuchGPU'" in snap["not_admitted"][n2]
        assert {r["node"]: r["admitted"] for r in snap["nodes"]} == {n1: "", n2: "no"}
        # without the reach (the stand-in planner) the node is not judged by it
        assert (await read_status(ep, JOB, pki.security(CONTROLLER)))["not_admitted"] == {}
    finally:
        for c in agents.values():
            await c.close()


async def test_sailor_status_believes_a_record_only_under_its_own_key(
    secure_etcd_server: Server, pki: Pki
) -> None:
    """An agent may write only its own keys (RBAC), but what it writes there could name
    another node: ``sailor status`` showed n2's records as n1's (its GPUs, zone, a failed
    state). It now takes a record only under the key of the node it names, as the leader
    does (``ObservedCache``)."""
    ep = f"127.0.0.1:{secure_etcd_server.port}"
    n1, n2 = NODES[:2]
    agents = {n: await connect_etcd(ep, security=pki.security(n)) for n in (n1, n2)}
    try:
        mine = NodeSpec(node_id=n1, gpu_type="A100-40", gpus=8, zone="z-a")
        await agents[n1].put(KEYS.node(n1), mine.model_dump_json().encode())
        await agents[n1].put(
            KEYS.status(n1), AgentStatus(node_id=n1, state="idle").model_dump_json().encode()
        )
        posing = NodeSpec(node_id=n1, gpu_type="H100-80", gpus=1, zone="evil-zone")
        await agents[n2].put(KEYS.node(n2), posing.model_dump_json().encode())
        failed = AgentStatus(node_id=n1, state="failed", failure="forged")
        await agents[n2].put(KEYS.status(n2), failed.model_dump_json().encode())
        snap = await read_status(ep, JOB, pki.security(CONTROLLER))
        rows = {r["node"]: r for r in snap["nodes"]}
        assert set(rows) == {n1}
        assert (rows[n1]["gpu"], rows[n1]["gpus"], rows[n1]["zone"]) == ("A100-40", 8, "z-a")
        assert rows[n1]["state"] == "idle"
    finally:
        for s in agents.values():
            await s.close()
