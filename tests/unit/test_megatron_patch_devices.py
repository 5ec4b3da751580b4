"""Backend and GPU of every rank: decided from the plan, checked before anything starts.

The worker used to pick NCCL whenever CUDA was visible and put every TP-1 rank of a plan
without ``first_gpu`` on ``cuda:0``; it set the device after the process group had started
(no ``device_id``). These tests pin the decisions (pure) and the order of the worker's calls
(torch.cuda and the process group faked: no GPU needed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sailor.megatron_patch import launch, rank_args, rank_main
from sailor.megatron_patch.devices import (
    DeviceMappingError,
    backend_for,
    check_devices,
    check_rank_device,
    choose_backend,
    cuda_alloc_env,
    device_of,
    local_device,
    nccl_env,
    nccl_error_env,
    pack_one_host,
    worker_env,
)
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage


def _rg(gpu: str = "A100-40", tp: int = 1, node: str = "", first: int = 0) -> ReplicaGroup:
    return ReplicaGroup(
        gpu_type=gpu, zone="z", tp=tp, gpus_per_node=4, node_id=node, first_gpu=first
    )


def _plan(*groups: tuple[ReplicaGroup, ...]) -> Plan:
    """One pipeline per tuple, one stage per replica group (6 layers split evenly)."""
    pipes = []
    for stages in groups:
        n = len(stages)
        cut = [6 * i // n for i in range(n + 1)]
        pipes.append(
            Pipeline(
                stages=tuple(
                    Stage(first_layer=cut[i], last_layer=cut[i + 1] - 1, replica=rg)
                    for i, rg in enumerate(stages)
                ),
                microbatch_size=1,
                num_microbatches=2,
            )
        )
    return Plan(model="tiny-gpt", global_batch_size=2 * len(pipes), pipelines=tuple(pipes))


CPU_PLAN = _plan((_rg("cpu"),), (_rg("cpu"),))
GPU_PLAN = _plan((_rg(),), (_rg(),))


def test_the_backend_is_the_plans_not_the_hosts() -> None:
    assert backend_for(CPU_PLAN) == "gloo"
    assert backend_for(GPU_PLAN) == "nccl"
    # A cpu plan stays on gloo with CUDA visible (the CPU suite on a GPU host).
    assert choose_backend(CPU_PLAN, None, cuda_available=True) == "gloo"
    assert choose_backend(GPU_PLAN, None, cuda_available=True) == "nccl"
    # A GPU plan runs on the CPU only when asked to.
    assert choose_backend(GPU_PLAN, "gloo", cuda_available=False) == "gloo"
    with pytest.raises(DeviceMappingError, match=r"CUDA is not available.*gloo"):
        choose_backend(GPU_PLAN, None, cuda_available=False)
    with pytest.raises(DeviceMappingError, match="NCCL needs GPUs"):
        choose_backend(CPU_PLAN, "nccl", cuda_available=True)
    with pytest.raises(DeviceMappingError, match="mixes cpu and GPU"):
        backend_for(_plan((_rg("cpu"),), (_rg(),)))


def test_each_rank_uses_first_gpu_plus_its_tp_rank() -> None:
    plan = _plan(
        (_rg(node="a", first=0), _rg(tp=2, node="a", first=2)),
        (_rg(node="b", first=3), _rg(tp=2, node="b", first=0)),
    )
    assert [local_device(plan, r) for r in range(6)] == [0, 2, 3, 3, 0, 1]
    assert device_of(plan, 2, "nccl") == "cuda:3"
    assert device_of(plan, 2, "gloo") == "cpu"
    for node in ("a", "b"):
        check_devices(plan, 4, node=node)


def test_two_ranks_on_one_gpu_are_refused_with_where_they_are() -> None:
    # Two TP-1 stages placed on one node without first_gpu: both would use cuda:0.
    plan = _plan((_rg(node="n1"), _rg(node="n1")))
    with pytest.raises(DeviceMappingError) as e:
        check_devices(plan, 8, node="n1")
    msg = str(e.value)
    assert "cuda:0" in msg and "pipelines[0].stages[0] (rank 0)" in msg
    assert "pipelines[0].stages[1] (rank 1)" in msg
    # An unplaced plan launched on one host: every rank on cuda:0 unless packed.
    with pytest.raises(DeviceMappingError, match="cuda:0"):
        check_devices(GPU_PLAN, 8)
    # The other node's groups are not this node's business.
    check_devices(_plan((_rg(node="a"),), (_rg(node="b"),)), 1, node="a")


def test_a_gpu_the_host_lacks_is_refused() -> None:
    plan = _plan((_rg(tp=2, node="a", first=2),))
    with pytest.raises(DeviceMappingError, match=r"ranks 0\.\.1\) needs cuda:2\.\.cuda:3.*2 GPU"):
        check_devices(plan, 2, node="a")


def test_a_rank_checks_its_node_or_only_itself_when_unplaced() -> None:
    placed = _plan((_rg(node="n1"),), (_rg(node="n1"),))
    with pytest.raises(DeviceMappingError, match="cuda:0 on node 'n1'"):
        check_rank_device(placed, 0, 4)
    # Unplaced: one rank per host (run by hand) is legitimate; only its own GPUs are checked.
    check_rank_device(GPU_PLAN, 1, 1)
    with pytest.raises(DeviceMappingError, match=r"pipelines\[1\]\.stages\[0\] \(ranks 1\.\.2\)"):
        check_rank_device(_plan((_rg(),), (_rg(tp=2),)), 2, 1)


def test_an_unplaced_plan_is_packed_onto_distinct_gpus() -> None:
    plan = _plan((_rg(), _rg(tp=2)), (_rg(tp=2), _rg()))
    packed = pack_one_host(plan)
    assert [local_device(packed, r) for r in range(6)] == [0, 1, 2, 3, 4, 5]
    check_devices(packed, 6)
    with pytest.raises(DeviceMappingError, match=r"needs cuda:3\.\.cuda:4"):
        check_devices(packed, 4)
    # Packing keeps everything else; a placed plan is not repacked.
    assert packed.ranks() == plan.ranks() and packed.segments() == plan.segments()
    placed = _plan((_rg(node="a"), _rg(node="a", first=1)))
    assert pack_one_host(placed) is placed


def test_launch_local_packs_and_checks_a_gpu_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    backend, plan = launch._local_backend(GPU_PLAN, None)
    assert backend == "nccl"
    assert [device_of(plan, r, backend) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert launch._local_backend(CPU_PLAN, None) == ("gloo", CPU_PLAN)
    assert launch._local_backend(GPU_PLAN, "gloo") == ("gloo", GPU_PLAN)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(DeviceMappingError, match="1 GPU"):
        launch._local_backend(GPU_PLAN, None)


def test_nccl_error_handling_is_set_unless_the_user_chose() -> None:
    assert nccl_error_env({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert nccl_error_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {}


def test_nvls_is_off_for_nccl_workers_unless_the_user_chose() -> None:
    """NCCL enables NVLink SHARP by itself on NVSwitch systems; the memory model prices a
    communicator without its buffers, so the workers turn it off (a user's value is kept)."""
    assert nccl_env({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "NCCL_NVLS_ENABLE": "0"}
    mine = {"NCCL_NVLS_ENABLE": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert nccl_env(mine) == {}
    assert nccl_env({"NCCL_NVLS_ENABLE": "1"}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def test_expandable_segments_for_every_worker_unless_the_user_configured_the_allocator() -> None:
    assert cuda_alloc_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    # the user's configuration wins whole (not merged): theirs may set other options
    assert cuda_alloc_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) == {}
    assert cuda_alloc_env({"PYTORCH_CUDA_ALLOC_CONF": ""}) == {}
    assert cuda_alloc_env({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) == {}


def test_a_worker_process_is_started_with_the_allocator_settings() -> None:
    parent = {"PATH": "/usr/bin", "SAILOR_X": "1"}
    assert worker_env(parent) == {**parent, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for own in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, {"PYTORCH_ALLOC_CONF": ""}):
        assert worker_env({**parent, **own}) == {**parent, **own}  # the user's, whole
    assert parent == {"PATH": "/usr/bin", "SAILOR_X": "1"}  # not changed


_WORKER_ENV = (
    "NCCL_CONF_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_NVLS_ENABLE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
)


class _StartedError(Exception):
    """Raised by the fake init_process_group: the test only needs what came before it."""


def _start_worker(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    plan: Plan,
    rank: int,
    env: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """Run the worker up to its process group on a faked 4-GPU host, started with ``env``
    on top of this one's (less the variables it sets); the calls it made."""
    calls: list[str] = []
    seen: dict[str, Any] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)

    def fake_set_device(d: Any) -> None:
        calls.append(f"set_device {d}")
        seen["alloc_at_set_device"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")

    monkeypatch.setattr(torch.cuda, "set_device", fake_set_device)

    def fake_allocator_settings(conf: str) -> None:
        calls.append(f"allocator {conf}")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", fake_allocator_settings)

    def fake_init(backend: str, **kw: Any) -> None:
        calls.append(f"init {backend}")
        seen.update(kw, env=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
        seen["nvls"] = os.environ.get("NCCL_NVLS_ENABLE")
        raise _StartedError

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    for name in _WORKER_ENV:  # restored after the test: the worker sets them in os.environ
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    monkeypatch.setattr(os, "environ", {**os.environ, **(env or {})})
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    args = rank_args.build_parser().parse_args(
        [
            *("--plan", str(path), "--rank", str(rank)),
            *("--world-size", str(len(plan.ranks())), "--master", "127.0.0.1:1"),
        ]
    )
    with pytest.raises(_StartedError):
        rank_main.run(args, rank_main._Status())
    return calls, seen


def test_the_worker_binds_its_gpu_before_the_process_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plan = _plan((_rg(node="a", first=0),), (_rg(node="b", first=0), _rg(node="b", first=1)))
    calls, seen = _start_worker(monkeypatch, tmp_path, plan, rank=2)
    # started by hand: the allocator is given its settings too (an import may have used it)
    assert calls == ["allocator expandable_segments:True", "set_device 1", "init nccl"]
    assert seen["device_id"] == torch.device("cuda", 1)
    assert seen["env"] == "2"
    assert seen["nvls"] == "0"
    # set before the first CUDA call (the allocator reads it once)
    assert seen["alloc_at_set_device"] == "expandable_segments:True"


def test_a_cpu_plan_runs_on_gloo_with_cuda_visible(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls, seen = _start_worker(monkeypatch, tmp_path, CPU_PLAN, rank=1)
    assert calls == ["allocator expandable_segments:True", "init gloo"]
    assert seen["device_id"] is None


def test_two_ranks_of_a_node_on_one_gpu_stop_the_worker_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plan = _plan((_rg(node="a"),), (_rg(node="a"),))
    with pytest.raises(DeviceMappingError, match=r"cuda:0 on node 'a'.*rank 0.*rank 1"):
        _start_worker(monkeypatch, tmp_path, plan, rank=1)


def test_a_worker_started_with_the_settings_leaves_the_allocator_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    plan = _plan((_rg(node="a", first=0),))
    calls, seen = _start_worker(monkeypatch, tmp_path, plan, 0, worker_env({}))
    assert calls == ["set_device 0", "init nccl"]  # read from the environment at start
    assert seen["alloc_at_set_device"] == "expandable_segments:True"


def test_an_nvls_setting_in_nccl_s_own_file_is_not_overridden(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    conf = tmp_path / "nccl.conf"
    conf.write_text("# the administrator's\nNCCL_NVLS_ENABLE=1\n")
    plan = _plan((_rg(node="a", first=0),))
    _, seen = _start_worker(monkeypatch, tmp_path, plan, 0, {"NCCL_CONF_FILE": str(conf)})
    assert seen["nvls"] is None  # NCCL takes the file's 1: the environment would win over it
    assert seen["env"] == "2"
