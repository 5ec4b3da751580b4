"""The DeepSpeed adapter's bf16 save under memory and failure, and its loads at start.

Real DeepSpeed ranks in bf16 on the CPU (gloo) through ``deepspeed_fault_rank``, two pipelines
of two uneven stages (every stage's masters partitioned over two data-parallel ranks):

- a save holds one parameter's full fp32 tensor at a time beyond the layers the rank writes:
  each all-reduce of the save is recorded with the bytes of the earlier ones still alive.
  Before, every rank built the full masters and both moments of its whole stage at once (on
  the device, writers or not): 12 B per parameter, DP times the optimizer state it keeps;
- a rank whose read of one moment fails partway through its stage (DeepSpeed's own error for
  a fragment without it) still takes part in every later all-reduce: the save fails on every
  rank at once, that rank with its error, the others as its peers. Before, it left its
  data-parallel peer in an all-reduce it never entered, each waited in a different
  collective until the process group's timeout, and every rank died of that timeout;
- a resume whose one rank's load stalls past the process groups' timeout: the other waits on
  the rendezvous store (``load_barrier``) and the world trains on. Before, it waited in the
  first boundary's collective, which gloo timed out;
- a rank failing before its restore (after the world formed): the other, restoring, raises
  its error at once as a peer's. Before, the adapter's barrier began with the restore: that
  rank's failure was never written and it never beat, so the other waited out the liveness
  (60 s) and named no cause.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sailor.checkpoint import LocalStorage, committed_steps
from sailor.megatron_patch.launch import LocalRun, launch_local
from sailor.schemas.plan import Plan
from tests.integration.test_deepspeed_checkpoints import DS_1X2, DS_2X2, _stop_and_save

pytest.importorskip("deepspeed")

FAULT_RANK = "tests.integration.deepspeed_fault_rank"
REPO = Path(__file__).resolve().parents[2]
# gloo's timeout for the runs whose collectives are expected to complete: room for four
# DeepSpeed ranks sharing two loaded cores
SLACK_TIMEOUT_S = 60.0
# the resume's timeout, which the stalled load exceeds 2.5 times
LOAD_TIMEOUT_S = 8.0


@dataclass(frozen=True)
class _Saved:
    run: LocalRun
    ckpt: Path
    traces: list[list[dict[str, int]]]
    """Per rank, one record per save (``deepspeed_fault_rank``: ``SAVE_TRACE``)."""


@pytest.fixture(autouse=True)
def _ranks_find_the_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def _launch(plan: Plan, steps: int, work: Path, timeout_s: float, *args: str) -> LocalRun:
    return launch_local(
        plan,
        steps,
        work,
        module=FAULT_RANK,
        extra_args=list(args),
        timeout_s=timeout_s,
        deadline_s=240.0,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Saved]:
    work = tmp_path_factory.mktemp("dsfaults")
    ckpt = work / "ckpt"
    stop = _stop_and_save(work / "control.json", ckpt)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        mp.setenv("SAVE_TRACE", str(work / "trace-{rank}.jsonl"))
        run = _launch(DS_2X2, 4, work / "a", SLACK_TIMEOUT_S, "--control", stop)
    assert run.ok, (run.returncodes, run.errors, [e[-2000:] for e in run.stderr])
    assert committed_steps(LocalStorage(str(ckpt))) == [2]
    traces = [
        [json.loads(x) for x in (work / f"trace-{r}.jsonl").read_text().splitlines()]
        for r in range(4)
    ]
    yield _Saved(run, ckpt, traces)


def test_a_bf16_save_holds_one_full_tensor_beyond_the_layers_the_rank_writes(
    saved: _Saved,
) -> None:
    bounds: list[int] = []
    for rank, records in enumerate(saved.traces):
        assert len(records) == 1, (rank, records)
        t = records[0]
        # the masters and both moments of every parameter: 3 all-reduces each, on every
        # rank of the stage alike (a writer or not)
        assert t["all_reduces"] == 3 * t["params"], (rank, t)
        assert t["all_reduces"] == saved.traces[rank ^ 2][0]["all_reduces"], rank  # DP peer
        # what the rank writes, plus the tensor being summed and the one before it: gloo's
        # worker thread drops its reference to a finished all-reduce's buffer a moment after
        # the caller returns (measured: a non-kept buffer now and then still alive at the
        # next all-reduce, never two)
        bound = t["written_bytes"] + 2 * t["largest_bytes"]
        assert t["peak_live_bytes"] <= bound, (
            rank,
            {k: v for k, v in t.items() if k != "live_bytes"},
        )
        bounds.append(bound)
    # and the bounds are well below the stages' whole state, which every rank held before
    # (a rank writing most of its stage is close to it; one writing little is far below)
    stages = sum(records[0]["stage_bytes"] for records in saved.traces)
    assert sum(bounds) < 0.7 * stages, (bounds, stages)


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


def test_a_resume_slower_than_the_process_group_timeout_is_waited_for_off_the_collectives(
    saved: _Saved, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    delay = 2.5 * LOAD_TIMEOUT_S
    monkeypatch.setenv("SLOW_LOAD_RANK", "1")
    monkeypatch.setenv("SLOW_LOAD_S", str(delay))
    resume = ["--ckpt-dir", str(saved.ckpt), "--load-step", "2"]
    run = _launch(DS_1X2, 2, tmp_path / "b", LOAD_TIMEOUT_S, *resume)
    assert run.ok, (run.returncodes, run.errors, [e[-2000:] for e in run.stderr])
    ready = [next(e for e in p if e.get("event") == "ready") for p in run.progress]
    assert ready[0]["load_wait_s"] >= delay - 1.0, ready  # rank 0 waited on the store
    assert ready[1]["load_wait_s"] < LOAD_TIMEOUT_S, ready
    assert [s["step"] for s in run.steps(0)] == [3, 4]


def test_a_rank_failing_before_its_restore_ends_the_other_with_its_error(
    saved: _Saved, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIL_BEFORE_LOAD_RANK", "1")
    resume = ["--ckpt-dir", str(saved.ckpt), "--load-step", "2"]
    run = _launch(DS_1X2, 2, tmp_path / "c", SLACK_TIMEOUT_S, *resume)
    errors = run.errors
    assert run.returncodes == [1, 1], (run.returncodes, [e[-2000:] for e in run.stderr])
    assert errors[1] is not None and "building the run" in errors[1]["message"], errors[1]
    err = errors[0]
    assert err is not None and err["origin"] == "peer", err
    assert "rank 1" in err["message"] and "MemoryError: building the run" in err["message"], err
    # promptly: within a poll or two of rank 1's exit, not after the 60 s liveness
    assert run.exit_times_s[0] - run.exit_times_s[1] < 15.0, run.exit_times_s


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
