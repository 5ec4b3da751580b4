"""A real multi-process gloo run under the strict layer: its logs obey NCCL's rules.

Every rank of a heterogeneous plan (TP change between stages, two pipelines, uneven
splits, tied embeddings) runs the worker with ``SAILOR_STRICT_COMM`` set: each call is
checked at the call (device, contiguity, buffer sizes) and logged; the logs of all ranks
then replay under NCCL's semantics without deadlock or mismatch. Before the paired
schedule, the same replay reported a deadlock (lone sends crossing between neighbours).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sailor.comm.nccl_replay import replay
from sailor.comm.strict import ENV_VAR, read_logs
from sailor.megatron_patch.launch import launch_local
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage


def _stage(a: int, b: int, tp: int = 1) -> Stage:
    return Stage(
        first_layer=a,
        last_layer=b,
        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=tp, gpus_per_node=4),
    )


def test_gloo_run_logs_pass_the_nccl_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = Pipeline(
        stages=(_stage(0, 1), _stage(2, 3, tp=2), _stage(4, 5)),
        microbatch_size=1,
        num_microbatches=3,
    )
    b = Pipeline(stages=(_stage(0, 4), _stage(5, 5)), microbatch_size=1, num_microbatches=2)
    plan = Plan(model="tiny-gpt", global_batch_size=a.samples + b.samples, pipelines=(a, b))
    logdir = tmp_path / "comm"
    monkeypatch.setenv(ENV_VAR, str(logdir))
    run = launch_local(plan, 2, tmp_path / "run", deadline_s=240)
    assert run.ok, [e for e in run.errors if e]
    logs = read_logs(logdir)
    assert sorted(logs) == list(range(len(plan.ranks())))
    res = replay(logs)
    assert res.ok, res.message
    ops = [op for log in logs.values() for op in log if op.kind != "wait"]
    assert {op.device for op in ops if op.device} == {"cpu"}
    assert {op.kind for op in ops} >= {"send", "recv", "all_reduce"}
