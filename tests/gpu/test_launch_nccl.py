"""GPU runs of what the CPU suite checks as pure decisions: one GPU per rank, NCCL failures
that end in records, the DeepSpeed adapter on its GPU with its precision.

CPU counterparts: ``tests/unit/test_megatron_patch_devices.py`` (backend and device of a
rank, overlap refusal, the worker binding its GPU before the process group),
``tests/unit/test_megatron_patch_adapters.py`` (DeepSpeed ``LOCAL_RANK``, precision, config)
and ``tests/integration/test_worker_signals.py`` (a ``SIGABRT``'d worker's record).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sailor import catalog
from sailor.catalog.cuda_names import UnknownGPUError, catalog_gpu_name
from sailor.megatron_patch.deepspeed_adapter import deepspeed_precision
from sailor.megatron_patch.launch import launch_local
from sailor.megatron_patch.precision import native_bf16
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage


def _gpu_type() -> str:
    """The catalog name of GPU 0 (so precision follows the real card), else a stand-in."""
    props = torch.cuda.get_device_properties(0)
    try:
        return catalog_gpu_name(props.name, props.total_memory, catalog.gpus())
    except UnknownGPUError:
        return "gpu-under-test"


def _plan(pipelines: int, stages: int) -> Plan:
    rg = ReplicaGroup(gpu_type=_gpu_type(), zone="local", gpus_per_node=pipelines * stages)
    cuts = [6 * i // stages for i in range(stages + 1)]
    pipe = Pipeline(
        stages=tuple(
            Stage(first_layer=cuts[i], last_layer=cuts[i + 1] - 1, replica=rg)
            for i in range(stages)
        ),
        microbatch_size=2,
        num_microbatches=2,
    )
    return Plan(model="tiny-llama", global_batch_size=4 * pipelines, pipelines=(pipe,) * pipelines)


def test_local_ranks_of_a_gpu_plan_get_one_gpu_each(
    gpus: Callable[[int], None], tmp_path: Path
) -> None:
    gpus(2)
    run = launch_local(_plan(2, 1), 2, tmp_path, deadline_s=300)
    assert run.ok, (run.returncodes, run.errors)
    assert run.backend == "nccl"
    ready = [next(e for e in run.progress[r] if e["event"] == "ready") for r in range(2)]
    assert [e["backend"] for e in ready] == ["nccl", "nccl"]
    assert [e["device"] for e in ready] == ["cuda:0", "cuda:1"]


def test_a_failed_rank_under_nccl_ends_every_rank_with_a_record(
    gpus: Callable[[int], None], tmp_path: Path
) -> None:
    """Rank 1 of a two-stage pipeline fails at step 2; rank 0 waits on it inside NCCL until
    the 20 s timeout. With async error handling in mode 2 it raises (a peer record); if NCCL
    aborts it instead, launch_local writes the record from its signal. Either way: no rank
    left running, a record for every rank."""
    gpus(2)
    run = launch_local(
        _plan(1, 2),
        50,
        tmp_path,
        per_rank_args={1: ["--fail-at-step", "2"]},
        timeout_s=20,
        deadline_s=240,
    )
    assert run.killed == [], run.stderr
    assert all(rc not in (0, None) for rc in run.returncodes), run.returncodes
    first = run.errors[1]
    assert first is not None and first["error_type"] == "InjectedFailureError", run.errors
    peer = run.errors[0]
    assert peer is not None, run.stderr[0][-3000:]
    assert peer.get("signal") or peer["origin"] == "peer", peer


def test_deepspeed_runs_on_its_gpus_in_the_plans_precision(
    gpus: Callable[[int], None], tmp_path: Path
) -> None:
    pytest.importorskip("deepspeed")
    gpus(2)
    plan = _plan(1, 2).model_copy(update={"model": "tiny-llama"})
    run = launch_local(
        plan, 3, tmp_path, module="sailor.megatron_patch.deepspeed_adapter", deadline_s=300
    )
    assert run.ok, (run.returncodes, run.errors)
    expected = deepspeed_precision(plan, catalog.model("tiny-llama"), "nccl", native_bf16)
    for rank in range(2):
        steps = run.steps(rank)
        assert len(steps) == 3 and all(s["precision"] == expected for s in steps)
        assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
