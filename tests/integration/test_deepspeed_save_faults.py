"""The DeepSpeed adapter's bf16 save under failure.

Real DeepSpeed ranks in bf16 on the CPU (gloo) through ``deepspeed_fault_rank``, two pipelines
of two uneven stages (every stage's masters partitioned over two data-parallel ranks): a rank
whose read of one moment fails partway through its stage (DeepSpeed's own error for a
fragment without it) still takes part in every later collective: the save fails on every
rank at once, that rank with its error, the others as its peers. Before, it left its
data-parallel peer in an all-reduce it never entered, each waited in a different collective
until the process group's timeout, and every rank died of that timeout.

The save's traffic and memory, and the loads at start of a bf16 checkpoint, are tested with
the checkpoint they need (test_deepspeed_bf16_checkpoints.py): one saving run serves both.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sailor.checkpoint import LocalStorage, committed_steps
from sailor.megatron_patch.launch import LocalRun, launch_local
from sailor.schemas.plan import Plan
from tests.integration.test_deepspeed_checkpoints import DS_2X2, FAST_POLL, _stop_and_save

pytest.importorskip("deepspeed")

FAULT_RANK = "tests.integration.deepspeed_fault_rank"
REPO = Path(__file__).resolve().parents[2]
# gloo's timeout for the runs whose collectives are expected to complete: room for four
# DeepSpeed ranks sharing two loaded cores
SLACK_TIMEOUT_S = 60.0


@pytest.fixture(autouse=True)
def _ranks_find_the_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def _launch(plan: Plan, steps: int, work: Path, timeout_s: float, *args: str) -> LocalRun:
    return launch_local(
        plan,
        steps,
        work,
        module=FAULT_RANK,
        extra_args=[*args, *FAST_POLL],
        timeout_s=timeout_s,
        deadline_s=240.0,
    )


def test_a_bf16_read_failing_partway_fails_the_save_on_every_rank_promptly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BREAK_FRAGMENT_RANK", "2")
    stop = _stop_and_save(tmp_path / "control.json", tmp_path / "ckpt")
    t_launch = time.time()
    run = _launch(DS_2X2, 4, tmp_path / "a", SLACK_TIMEOUT_S, "--control", stop)
    errors = run.errors
    assert run.returncodes == [1, 1, 1, 1], (run.returncodes, [e[-2000:] for e in run.stderr])
    assert errors[2] is not None and errors[2]["origin"] == "local", errors[2]
    assert "exp_avg_sq not found" in errors[2]["message"], errors[2]
    for r in (0, 1, 3):
        err = errors[r]
        assert err is not None and err["origin"] == "peer", (r, err)
        assert "rank(s) 2" in err["message"] and "exp_avg_sq" in err["message"], (r, err)
    # promptly: every rank ended soon after the last step before the save, not after a
    # collective's timeout
    step_2 = max(s["time"] for r in range(4) for s in run.steps(r) if s["step"] == 2)
    last_exit = t_launch + max(run.exit_times_s)
    assert last_exit - step_2 < SLACK_TIMEOUT_S / 2, (last_exit - step_2, run.exit_times_s)
    assert (
        not (tmp_path / "ckpt").exists()
        or committed_steps(LocalStorage(str(tmp_path / "ckpt"))) == []
    )


def test_a_rank_failing_in_deepspeed_initialize_ends_every_other_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rank 1 fails inside deepspeed.initialize: rank 3 (its stage's other replica) is in
    # initialize's collectives with it, ranks 0 and 2 would be in the first step's; each
    # ends with rank 1's error, not a closed socket of its own (under NCCL: a timeout)
    monkeypatch.setenv("FAIL_INIT_RANK", "1")
    run = _launch(DS_2X2, 2, tmp_path / "i", SLACK_TIMEOUT_S)
    errors = run.errors
    assert run.returncodes == [1, 1, 1, 1], (run.returncodes, [e[-2000:] for e in run.stderr])
    assert errors[1] is not None and "injected: DeepSpeed refused" in errors[1]["message"]
    for r in (0, 2, 3):
        err = errors[r]
        assert err is not None and err["origin"] == "peer", (r, err)
        assert err["message"].startswith("rank 1 ("), (r, err)
        assert "ValueError: injected: DeepSpeed refused this rank's engine" in err["message"]
