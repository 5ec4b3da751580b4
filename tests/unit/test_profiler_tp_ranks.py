"""Where the TP ranks of a layer measurement run: gloo on the CPU, one NCCL rank per GPU."""

from __future__ import annotations

import pytest

from sailor import catalog
from sailor.profiler.layers import LayerRun
from sailor.profiler.procs import rank_device
from sailor.profiler.timing import RepeatSettings
from sailor.profiler.tp_procs import measure_tp


def test_cpu_ranks_are_gloo_processes_and_gpu_ranks_own_one_gpu_each() -> None:
    assert rank_device("cpu", 3, 0) == ("gloo", "cpu")
    assert [rank_device("cuda", r, 4) for r in range(4)] == [
        ("nccl", "cuda:0"),
        ("nccl", "cuda:1"),
        ("nccl", "cuda:2"),
        ("nccl", "cuda:3"),
    ]
    with pytest.raises(ValueError, match="needs GPU 4, but this host has 4"):
        rank_device("cuda", 4, 4)
    with pytest.raises(ValueError, match="device='tpu'"):
        rank_device("tpu", 0, 1)


def test_tp_above_one_is_accepted_on_cuda_and_refused_without_the_gpus() -> None:
    spec = catalog.model("tiny-gpt")
    run = LayerRun(spec=spec, gpu_type="A100-40", device="cuda", tps=(1, 2, 4))
    assert run.tps == (1, 2, 4)
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has GPUs: the refusal is for hosts without enough of them")
    # no rank process is started: the count of GPUs is checked first
    with pytest.raises(ValueError, match="--tp 2 on cuda: one rank per GPU, but this host"):
        measure_tp(spec, 2, [1], RepeatSettings(), device="cuda")


def test_ranks_on_other_hosts_need_the_address_of_rank_0() -> None:
    from sailor.profiler.procs import run_ranks

    with pytest.raises(ValueError, match="master"):
        run_ranks("sailor.profiler.network_probe", 2, {}, ranks=[1])
    with pytest.raises(ValueError, match="ranks=\\[2\\]"):
        run_ranks("sailor.profiler.network_probe", 2, {}, ranks=[2], master="h:1")
