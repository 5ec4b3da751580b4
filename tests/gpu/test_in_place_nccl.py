"""In-place reconfiguration under NCCL (the CPU tests run it under gloo and replay every
world's calls under NCCL's rules; these run the real thing where 2 GPUs are visible).

- a 2-stage pipeline holds at its stop step and relayouts in place to two data-parallel
  replicas: same losses and saved state (weights, both AdamW moments) as fresh processes
  resuming from the same checkpoint (the restart path);
- the same pipeline, its two held workers swapping ranks (each on the other GPU);
- two replicas train, one rank is SIGKILLed: the survivor holds broken (NCCL's error, or
  SIGUSR1 aborting its communicators: ``sailor.comm.abort``), then a directive rolls it back
  to the committed step in process on one GPU, equal to the restart path.

Harness: the CPU test's (tests/integration/test_in_place_worker.py), with plans on this
host's GPUs.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sailor.megatron_patch.launch import free_port
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from tests.gpu.test_engine_gpu import _gpu_type
from tests.integration.test_in_place_worker import (
    GBS,
    _assert_same_state,
    _directive,
    _Job,
    _restart,
    _stop_save,
    running_job,
)


def _gpu_plan(pid: str, pipes: list[list[tuple[int, int]]], nmb: int) -> Plan:
    """Pipelines of TP-1 stages ``(first, last)`` on one node, one GPU each, packed from 0."""
    total = sum(len(p) for p in pipes)
    gpu = 0
    out = []
    for stages in pipes:
        st = []
        for a, b in stages:
            rg = ReplicaGroup(
                gpu_type=_gpu_type(),
                zone="local",
                tp=1,
                gpus_per_node=total,
                first_gpu=gpu,
                node_id="gpu-host",
            )
            st.append(Stage(first_layer=a, last_layer=b, replica=rg))
            gpu += 1
        out.append(Pipeline(stages=tuple(st), microbatch_size=1, num_microbatches=nmb))
    return Plan(
        plan_id=pid, model="tiny-gpt", global_batch_size=GBS, pipelines=tuple(out), precision="fp32"
    )


@pytest.fixture
def job(tmp_path: Path) -> Iterator[_Job]:
    yield from running_job(tmp_path)


def test_pipeline_to_data_parallel_in_place_under_nccl(
    gpus: Callable[[int], None], tmp_path: Path, job: _Job
) -> None:
    gpus(2)
    pp2 = _gpu_plan("pp2", [[(0, 2), (3, 5)]], 4)
    dp2 = _gpu_plan("dp2", [[(0, 5)], [(0, 5)]], 2)
    ip, rs = tmp_path / "ckpt-ip", tmp_path / "ckpt-rs"
    m0 = f"127.0.0.1:{free_port()}"
    for r in range(2):
        job.start(f"w{r}", job.argv("g0", pp2, r, m0))
    _stop_save(job, "g0", range(2), 2, ip)
    job.held("g0", range(2), 2)
    m1 = f"127.0.0.1:{free_port()}"
    _stop_save(job, "g1", range(2), 4, ip)
    for r in range(2):
        _directive(job, "g0", r, 1, job.argv("g1", dp2, r, m1, ip, 2))
    job.held("g1", range(2), 4)
    ready = job.ready("g1", 0)
    assert ready["path"] == "in_place" and ready["device"].startswith("cuda")
    assert ready["received_keys"] > 0 and ready["checkpoint_keys"] == 0
    job.terminate(["w0", "w1"])
    got = {**job.losses("g0"), **job.losses("g1")}
    want = _restart(job, "r1", dp2, ip, 2, 4, rs)
    assert {s: got[s] for s in want} == want
    _assert_same_state(ip, rs, 4)


@pytest.mark.parametrize("offload", ["auto", "never"])
def test_held_workers_that_swap_gpus_relayout_under_nccl(
    gpus: Callable[[int], None], tmp_path: Path, job: _Job, offload: str
) -> None:
    """The same 2-stage plan, the two held workers handed each other's rank: each process
    now runs on the other GPU while its held shards are still on its old one. The exchange
    must send from the new device (NCCL refuses a tensor on another GPU) and free the old
    trainer; the result equals the restart path. ``auto``: each held stage sits on the
    other rank's GPU, so it goes to host memory first, and every shard sent is staged on
    the sender's GPU per batch; ``never``: the shards are sent from copies made from the
    other GPU, as before."""
    gpus(2)
    pp2 = _gpu_plan("pp2", [[(0, 2), (3, 5)]], 4)
    ip, rs = tmp_path / "ckpt-ip", tmp_path / "ckpt-rs"
    m0 = f"127.0.0.1:{free_port()}"
    for r in range(2):
        job.start(f"w{r}", job.argv("g0", pp2, r, m0))
    _stop_save(job, "g0", range(2), 2, ip)
    job.held("g0", range(2), 2)
    m1 = f"127.0.0.1:{free_port()}"
    _stop_save(job, "g1", range(2), 4, ip)
    for r in range(2):
        argv = [*job.argv("g1", pp2, 1 - r, m1, ip, 2), "--relayout-offload", offload]
        _directive(job, "g0", r, 1, argv)
    job.held("g1", range(2), 4)
    for r in range(2):
        ready = job.ready("g1", r)
        assert ready["path"] == "in_place" and ready["device"] == f"cuda:{r}", ready
        assert ready["received_keys"] > 0 and ready["checkpoint_keys"] == 0, ready
        assert ready["memory"] == ("offload" if offload == "auto" else "keep"), ready
        assert (ready["offloaded_bytes"] > 0) == (offload == "auto"), ready
    job.terminate(["w0", "w1"])
    got = {**job.losses("g0"), **job.losses("g1")}
    want = _restart(job, "r1", pp2, ip, 2, 4, rs)
    assert {s: got[s] for s in want} == want
    _assert_same_state(ip, rs, 4)


def test_a_dead_peer_rolls_the_survivor_back_in_process_under_nccl(
    gpus: Callable[[int], None], tmp_path: Path, job: _Job
) -> None:
    gpus(2)
    dp2 = _gpu_plan("dp2", [[(0, 5)], [(0, 5)]], 2)
    one = _gpu_plan("one", [[(0, 5)]], 4)
    ip, rs = tmp_path / "ckpt-ip", tmp_path / "ckpt-rs"
    m0 = f"127.0.0.1:{free_port()}"
    for r in range(2):
        job.start(f"w{r}", job.argv("g0", dp2, r, m0))
    job.control("g0", range(2), {"save_step": 2, "save_dir": str(ip)})
    job.wait_for("g0", range(2), lambda x: x.get("event") == "saved" and x["step"] == 2, "saved")
    job.wait_for("g0", range(1), lambda x: x.get("event") == "step" and x["step"] >= 4, "step 4")
    dead = job.procs.pop("w1")  # the harness's waits stop early on a failed process
    dead.kill()
    dead.wait()
    t = time.monotonic()
    try:
        job.wait_for(
            "g0", range(1), lambda x: x.get("event") == "held" and x["broken"], "broken", 10
        )
    except AssertionError:  # blocked on the dead peer: the agent would send SIGUSR1
        job.procs["w0"].send_signal(signal.SIGUSR1)
        job.wait_for(
            "g0", range(1), lambda x: x.get("event") == "held" and x["broken"], "broken", 30
        )
    print(f"survivor held broken after {time.monotonic() - t:.2f} s")
    m1 = f"127.0.0.1:{free_port()}"
    _stop_save(job, "g1", range(1), 4, ip)
    _directive(job, "g0", 0, 1, job.argv("g1", one, 0, m1, ip, 2))
    job.held("g1", range(1), 4)
    assert job.ready("g1", 0)["checkpoint_keys"] > 0  # rolled back from the commit
    job.terminate(["w0"])
    want = _restart(job, "r1", one, ip, 2, 4, rs)
    assert {s: job.losses("g1")[s] for s in want} == want


def test_host_sync_leaves_a_busy_device_on_abort(gpus: Callable[[int], None]) -> None:
    """Where an in-place worker's host waits for the GPU (a timestamp, a value read back),
    it polls an event: an abort requested meanwhile (SIGUSR1) is seen while the GPU is
    still busy, where ``torch.cuda.synchronize`` would have waited the kernel out."""
    import threading
    import time

    import torch

    from sailor.comm import abort

    gpus(1)
    dev = torch.device("cuda:0")
    abort.set_polling(True)
    try:
        torch.cuda._sleep(int(5e9))  # seconds of GPU work at a few GHz  # type: ignore[attr-defined]
        threading.Timer(0.1, abort.request_abort).start()
        t = time.monotonic()
        with pytest.raises(abort.CommAbortedError):
            abort.host_sync(dev)
        assert time.monotonic() - t < 1.0
    finally:
        abort.clear_abort()
        abort.set_polling(False)
        torch.cuda.synchronize(dev)


def test_offload_moves_the_held_stage_off_the_gpu(gpus: Callable[[int], None]) -> None:
    """The held stage (weights and both moments) goes to host memory: the
    device's allocated bytes fall by what it held, the parameters stay the same objects
    with the same values, and the rank's figures see the new stage and the free memory."""
    import torch

    from sailor.megatron_patch.engine import TrainConfig, Trainer
    from sailor.megatron_patch.groups import ProcessGroups
    from sailor.megatron_patch.in_place_steps import offload_held, relayout_memory
    from sailor.megatron_patch.model import tiny_model
    from sailor.megatron_patch.roles import role_of
    from sailor.megatron_patch.tp_layers import TPContext

    gpus(1)
    dev = torch.device("cuda:0")
    plan = _gpu_plan("one", [[(0, 5)]], 4)
    spec = tiny_model("tiny-gpt", GBS)
    groups = ProcessGroups(tp=TPContext())
    tr = Trainer(plan, spec, role_of(plan, 0), groups, TrainConfig(), dev)
    for p in tr.stage.parameters():
        tr.optimizer.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.full_like(p, 0.5),
            "exp_avg_sq": torch.full_like(p, 0.25),
        }
    tr.step = 1
    new = Trainer(plan, spec, role_of(plan, 0), groups, TrainConfig(), dev, 1, empty=True)
    from sailor.megatron_patch.relayout import schedule

    mem = relayout_memory(new, tr, schedule(plan, {0: 0}, plan), 1 << 20)
    assert mem is not None
    n = sum(p.numel() for p in tr.stage.parameters())
    assert mem.new_bytes == mem.held_bytes == mem.kept_bytes == 12 * n and mem.free_bytes > 0
    assert mem.keep_exchange_bytes == 0 and mem.host_free_bytes is not None
    before = torch.cuda.memory_allocated(dev)
    values = {id(p): p.detach().cpu().clone() for p in tr.stage.parameters()}
    params = list(tr.stage.parameters())
    moved = offload_held(tr, torch.device("cpu"))
    assert moved == 12 * n
    assert before - torch.cuda.memory_allocated(dev) >= moved
    assert [id(p) for p in tr.stage.parameters()] == [id(p) for p in params]
    for p in params:
        assert p.device.type == "cpu" and torch.equal(p.detach(), values[id(p)])
        assert tr.optimizer.state[p]["exp_avg"].device.type == "cpu"
