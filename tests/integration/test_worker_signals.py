"""A worker killed by a signal still leaves a failure record: its parent writes it.

Under NCCL a dead or silent peer ends in the watchdog's ``abort()`` from a C++ thread: a
``SIGABRT``, no Python exception, so the worker's own handler never runs. The real worker
(tiny-gpt, one CPU rank) is made to ``abort()`` at step 2 (``--abort-at-step``, the same
signal from the same kind of call) under both parents: the agent's supervisor and
``launch_local``. Each must write the error record with the signal, the rank, the last step
the rank reported and the Python stacks ``faulthandler`` left, and report a "failed" line.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest

from sailor.agent.supervisor import Supervisor, SupervisorClosedError
from sailor.agent.worker_argv import DEFAULT_WORKER_ARGV, TOY_TRAINER_ARGV
from sailor.localnet import free_port
from sailor.megatron_patch.errors import signal_failure_record
from sailor.megatron_patch.launch import launch_local
from sailor.schemas.commands import Launch
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

PLAN = Plan(
    model="tiny-gpt",
    global_batch_size=2,
    pipelines=(
        Pipeline(
            stages=(
                Stage(
                    first_layer=0,
                    last_layer=5,
                    replica=ReplicaGroup(gpu_type="cpu", zone="z", gpus_per_node=1),
                ),
            ),
            microbatch_size=1,
            num_microbatches=2,
        ),
    ),
)


def launch_of(plan: Plan) -> Launch:
    """Generation 1 of a one-rank ``plan`` on node n1, at a free rendezvous port."""
    return Launch(
        command_id="c1",
        epoch=1,
        node_id="n1",
        plan=plan,
        ranks=(0,),
        world_size=1,
        master=f"127.0.0.1:{free_port()}",
        generation=1,
    )


def _check_record(record: dict[str, object] | None) -> None:
    assert record is not None
    assert record["signal"] == "SIGABRT" and record["returncode"] == -signal.SIGABRT
    assert record["rank"] == 0 and record["step"] == 2, record
    assert record["written_by"] == "parent" and record["retry"] is True
    assert isinstance(record["pid"], int)
    # faulthandler's stacks: the main thread was in the worker's iteration-boundary hook.
    assert "Fatal Python error: Aborted" in str(record["traceback"]), record["traceback"]
    assert "rank_main.py" in str(record["traceback"])


def test_signal_record_names_the_signal() -> None:
    rec = signal_failure_record(3, -signal.SIGSEGV, 7, fault_text="stack")
    assert (rec["signal"], rec["step"], rec["traceback"]) == ("SIGSEGV", 7, "stack")
    assert "rank 3 killed by SIGSEGV after step 7" in str(rec["message"])
    assert signal_failure_record(0, 1, -1)["signal"] == ""


def test_launch_local_records_a_rank_killed_by_sigabrt(tmp_path: Path) -> None:
    run = launch_local(
        PLAN, 5, tmp_path, per_rank_args={0: ["--abort-at-step", "2"]}, deadline_s=180
    )
    assert run.backend == "gloo"
    assert run.returncodes == [-signal.SIGABRT], run.stderr
    _check_record(run.errors[0])
    failed = [json.loads(x) for x in run.stderr[0].splitlines() if '"event": "failed"' in x]
    assert failed and failed[-1]["signal"] == "SIGABRT"


async def test_supervisor_records_a_worker_killed_by_sigabrt(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, worker_argv=(*DEFAULT_WORKER_ARGV, "--abort-at-step", "2"))
    cmd = launch_of(PLAN)
    await sup.launch(cmd)
    try:
        async with asyncio.timeout(180):
            while sup.state != "failed":
                sup.changed.clear()
                await sup.changed.wait()
        assert sup.workers[0].exit_code == -signal.SIGABRT
        record = json.loads((tmp_path / "gen-00001" / "error-0.json").read_text())
        _check_record(record)
        assert "SIGABRT" in sup.failure and sup.failure.startswith("{")
        assert '"event": "failed"' in sup.workers[0].stderr_tail[-1]
    finally:
        await sup.abort()


async def test_a_supervisor_closed_mid_launch_leaves_no_worker(tmp_path: Path) -> None:
    """close() while a launch is starting its workers: the launch fails, and the worker it
    was starting is killed (it began before close() and was not yet in its list)."""

    sup = Supervisor(tmp_path, worker_argv=TOY_TRAINER_ARGV)
    cmd = launch_of(PLAN)
    launch = asyncio.create_task(sup.launch(cmd))
    await asyncio.sleep(0)  # the launch is in its first await: starting the process
    await sup.close()
    with pytest.raises(SupervisorClosedError):
        await launch
    assert not [w for w in sup.workers if w.exit_code is None and w.proc.returncode is None]
    with pytest.raises(SupervisorClosedError):
        await sup.launch(cmd.model_copy(update={"command_id": "c2"}))
