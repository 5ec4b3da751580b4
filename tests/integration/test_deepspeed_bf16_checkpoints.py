"""The DeepSpeed adapter saves and resumes bf16 runs in Sailor's format (real DeepSpeed, gloo).

In bf16 DeepSpeed steps a ``BF16_Optimizer`` holding the fp32 master weights and AdamW moments
in flat partitions across the data-parallel ranks; the checkpoint must hold those masters
(not the bf16 copies) and moments by layer key. The ranks run bf16 on the CPU through
``deepspeed_bf16_rank`` (DeepSpeed's CPU accelerator runs bf16; it refuses fp16), against one
uninterrupted bf16 run of the same plan (two pipelines of two uneven stages) which saves step
2 on the agent's control file and trains on (a save reads the state: one that changed it
would make the run differ from a resume of what it wrote):

- saved at step 2, resumed under the same layout: the losses and the fp32 masters
  are *equal* to the uninterrupted run's (the same computation from the same state: a master,
  moment or step count restored inexactly shows);
- the same checkpoint resumed under another layout (one pipeline: the masters partitioned
  over one rank instead of two) and in Sailor's engine (one pipeline of two stages cut
  elsewhere, fp32 on the CPU, with ``allow_precision_change``): bf16 rounding now differs
  (another reduction order; the engine computes in fp32), so the bounds are the measured
  noise with a margin, far below what a lost moment or step count moves (below).

That run goes through ``deepspeed_fault_rank`` (the same rank, its collectives and the
checkpointer's host copies counted: ``SAVE_TRACE``), whose records show the save's traffic
and memory:

- each full master and moment is reduced to the rank that writes its layer: a rank receives
  exactly what it writes, and the checkpoint is written from that host copy (none made
  again). Before, every tensor was all-reduced to every data-parallel rank (each received
  its whole stage) and the writer's checkpointer copied what it wrote a second time;
- a save holds one parameter's full fp32 tensor at a time beyond the layers the rank writes
  (each collective recorded with the bytes of the earlier ones still alive). Before an
  earlier change, every rank built the full masters and both moments of its whole stage at
  once (12 B per parameter, DP times the optimizer state it keeps).

Its checkpoint also serves the loads at start: the resume under another layout stalls one
rank's first read past the process groups' timeout, and the other waits on the rendezvous
store (``load_barrier``) while the world trains on (before, it waited in the first
boundary's collective, which gloo timed out); a rank failing before its restore (after the
world formed) ends the other, restoring, with its error as a peer's (before, that rank's
failure was never written and it never beat: the other waited out the liveness, 60 s, and
named no cause).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sailor.checkpoint import LocalStorage, committed_steps, load
from sailor.megatron_patch.launch import LocalRun, launch_local
from sailor.schemas.training import TrainingConfig
from tests.integration.test_deepspeed_checkpoints import (
    DS_1X2,
    DS_2X2,
    ENGINE,
    ENGINE_1X2,
    FAST_POLL,
    GBS,
    MODEL,
    _dumped,
    _losses,
    _run,
)

pytest.importorskip("deepspeed")

BF16_RANK = "tests.integration.deepspeed_bf16_rank"
FAULT_RANK = "tests.integration.deepspeed_fault_rank"
# the resume under another layout: gloo's timeout, which its stalled load exceeds 1.5 times
LOAD_TIMEOUT_S = 8.0
SLOW_LOAD_S = 1.5 * LOAD_TIMEOUT_S
REPO = Path(__file__).resolve().parents[2]
# Another layout or engine than the uninterrupted run's, measured over 2 steps after the
# resume: per tensor the median |difference| was <= 2.1e-6 (adapter, one pipeline) and
# <= 5e-6 (engine); the 2 steps moved each tensor's median element by 0.8e-3 to 1.8e-3
# (lr 1e-3: Adam moves an element ~lr a step), and a resume that lost the moments or the
# step count changes each update by a fraction of lr. 2e-5 sits between the two. Single
# elements differ more where the gradient is noise (a key bias: softmax ignores it) or
# appears after quiet steps (an embedding row: 2.3e-3 in the engine): Adam scales either up
# to lr (1 - beta1) / sqrt(1 - beta2) ~ 3.2 lr a step (Kingma & Ba, sec. 2.1), so elements
# are bounded by two such steps, 7e-3.
MEDIAN_TOL, MAX_TOL = 2e-5, 7e-3
# losses: the adapter in another layout differed by 3e-6 relative, the engine (fp32
# compute from the same state, bf16 rounding gone) by 2e-4: bf16 keeps 8 bits (4e-3).
LAYOUT_LOSS_REL, ENGINE_LOSS_REL = 1e-4, 1e-3


@dataclass(frozen=True)
class _Saved:
    full: LocalRun
    """The uninterrupted bf16 run of 4 steps, which saved step 2 on the agent's control
    file without stopping."""
    full_params: dict[str, torch.Tensor]
    """Its fp32 masters at its end (``--dump-state``)."""
    at_2: dict[str, torch.Tensor]
    """Its fp32 masters right after its save of step 2 (``deepspeed_fault_rank``:
    ``DUMP_AT_SAVE``)."""
    ckpt: Path
    traces: list[list[dict[str, int]]]
    """Its save, per rank, one record per save (``deepspeed_fault_rank``: ``SAVE_TRACE``)."""


@pytest.fixture(scope="module", autouse=True)
def _ranks_find_the_tests() -> Iterator[None]:
    """The ranks start as ``python -m tests.integration.deepspeed_bf16_rank`` in their
    work directories: the repository must be on their path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> _Saved:
    """One run is both the uninterrupted run and the saving one: a save only reads the
    state (a save that changed the live masters or moments would make the run differ from a
    resume of what it wrote, and its masters after the save from what it wrote)."""
    work = tmp_path_factory.mktemp("bf16")
    ckpt = work / "ckpt"
    control = work / "control.json"
    control.write_text(json.dumps({"save_step": 2, "save_dir": str(ckpt)}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAVE_TRACE", str(work / "trace-{rank}.jsonl"))
        mp.setenv("DUMP_AT_SAVE", str(work / "at-{step}-{rank}.pt"))
        full = _run(DS_2X2, 4, work / "full", FAULT_RANK, "--control", str(control))
    assert committed_steps(LocalStorage(str(ckpt))) == [2]
    assert [s["step"] for s in full.steps(0)] == [1, 2, 3, 4]  # it did not stop
    traces = [
        [json.loads(x) for x in (work / f"trace-{r}.jsonl").read_text().splitlines()]
        for r in range(4)
    ]
    at_2: dict[str, torch.Tensor] = {}
    for r in range(4):
        at_2.update({k: t for k, (t, _d) in torch.load(work / f"at-2-{r}.pt").items()})
    return _Saved(full, _dumped(work / "full", range(4)), at_2, ckpt, traces)


@pytest.fixture(scope="module")
def other_layout(
    saved: _Saved, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LocalRun, dict[str, torch.Tensor]]:
    """The checkpoint resumed under another layout (one pipeline), rank 1's first read of
    it stalled past the process groups' timeout (``deepspeed_fault_rank``:
    ``SLOW_LOAD_RANK``): the stall changes when a rank starts training, not what it loads.
    The run and the masters it dumped at its end."""
    work = tmp_path_factory.mktemp("ds1x2")
    resume = ["--ckpt-dir", str(saved.ckpt), "--load-step", "2"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLOW_LOAD_RANK", "1")
        mp.setenv("SLOW_LOAD_S", str(SLOW_LOAD_S))
        run = launch_local(
            DS_1X2,
            2,
            work,
            module=FAULT_RANK,
            extra_args=[*resume, *FAST_POLL],
            timeout_s=LOAD_TIMEOUT_S,
            deadline_s=240.0,
        )
    assert run.ok, (run.returncodes, run.errors, [e[-2000:] for e in run.stderr])
    return run, _dumped(work, range(2))


def test_a_bf16_checkpoint_holds_the_fp32_masters_and_resumes_exactly(
    saved: _Saved, tmp_path: Path
) -> None:
    got = load(LocalStorage(str(saved.ckpt)), range(DS_2X2.num_layers), step=2)
    extra = got.globals.extra
    assert (got.globals.step, got.globals.consumed_samples) == (2, 2 * GBS)
    assert (extra["precision"], extra["adam_step"], extra["skipped_steps"]) == ("bf16", 2, 0)
    assert set(got.params) == set(saved.at_2)
    for key, ps in got.params.items():
        assert ps.weight.dtype == torch.float32, key
        # the masters, not the bf16 copies: few of them are bf16 numbers
        in_bf16 = (ps.weight.bfloat16().float() == ps.weight).float().mean()
        assert in_bf16 < 0.1, (key, float(in_bf16))
        assert torch.equal(ps.weight, saved.at_2[key]), key
        assert ps.exp_avg.abs().sum() > 0 and (ps.exp_avg_sq > 0).any(), key

    resume = ["--ckpt-dir", str(saved.ckpt), "--load-step", "2"]
    second = _run(DS_2X2, 2, tmp_path / "b", BF16_RANK, *resume)
    assert _losses(second) == {s: x for s, x in _losses(saved.full).items() if s > 2}
    resumed = _dumped(tmp_path / "b", range(4))
    assert set(resumed) == set(saved.full_params)
    for key, value in resumed.items():
        assert torch.equal(value, saved.full_params[key]), key


def _check_close(
    got: dict[int, float],
    params: dict[str, torch.Tensor],
    saved: _Saved,
    loss_rel: float,
) -> None:
    want = _losses(saved.full)
    assert sorted(got) == [3, 4]
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=loss_rel), step
    assert set(params) == set(saved.full_params)
    for key, value in params.items():
        diff = (value - saved.full_params[key]).abs()
        moved = (saved.full_params[key] - saved.at_2[key]).abs().median()
        assert diff.median() <= MEDIAN_TOL, (key, float(diff.median()))
        assert diff.max() <= MAX_TOL, (key, float(diff.max()))
        assert moved > 20 * MEDIAN_TOL, (key, float(moved))  # the steps moved it


def test_a_bf16_checkpoint_resumes_under_another_layout_and_in_sailors_engine(
    saved: _Saved, other_layout: tuple[LocalRun, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    resume = ["--ckpt-dir", str(saved.ckpt), "--load-step", "2"]
    other, params = other_layout
    _check_close(_losses(other), params, saved, LAYOUT_LOSS_REL)

    # the engine computes fp32 on the CPU: it loads bf16 state with allow_precision_change;
    # AdamW as the adapter's without a training config (weight decay on every parameter)
    tc = TrainingConfig.model_validate(
        {"model": {"kind": "builtin", "name": MODEL}, "allow_precision_change": True}
    )
    tc = tc.model_copy(update={"optimizer": tc.optimizer.model_copy(update={"no_decay": ()})})
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(tc.model_dump_json())
    engine = _run(ENGINE_1X2, 2, tmp_path / "e", ENGINE, *resume, "--train-config", str(cfg_file))
    _check_close(_losses(engine), _dumped(tmp_path / "e", range(2)), saved, ENGINE_LOSS_REL)


def test_a_bf16_save_reduces_each_tensor_to_its_writer_and_hands_its_host_copy_over(
    saved: _Saved,
) -> None:
    received, written = 0, 0
    for rank, records in enumerate(saved.traces):
        assert len(records) == 1, (rank, records)
        t = {k: v for k, v in records[0].items() if k != "live_bytes"}
        # the masters and both moments of every parameter, each reduced to its writer
        assert (t["all_reduces"], t["reduces"]) == (0, 3 * t["params"]), (rank, t)
        # the rank received the full tensors of the layers it writes, and nothing else
        assert t["received_bytes"] == t["written_bytes"], (rank, t)
        # and its checkpointer kept those host copies: none was made a second time
        assert t["host_copy_bytes"] == 0, (rank, t)
        received += t["received_bytes"]
        written += t["written_bytes"]
    # the world received what the save writes, once: each layer's state on one rank, where
    # the all-reduce delivered each stage's state to both of its data-parallel ranks
    stages = sum(records[0]["stage_bytes"] for records in saved.traces)
    assert received == written == stages // 2, (received, written, stages)


def test_a_bf16_save_holds_one_full_tensor_beyond_the_layers_the_rank_writes(
    saved: _Saved,
) -> None:
    bounds: list[int] = []
    for rank, records in enumerate(saved.traces):
        assert len(records) == 1, (rank, records)
        t = records[0]
        # the masters and both moments of every parameter: 3 collectives each, on every
        # rank of the stage alike (a writer or not)
        calls = t["all_reduces"] + t["reduces"]
        peer = saved.traces[rank ^ 2][0]  # its data-parallel peer
        assert calls == 3 * t["params"] == peer["all_reduces"] + peer["reduces"], (rank, t)
        # what the rank writes, plus the tensor being summed and the one before it: gloo's
        # worker thread drops its reference to a finished collective's buffer a moment after
        # the caller returns (measured: a non-kept buffer now and then still alive at the
        # next collective, never two)
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


def test_a_resume_slower_than_the_process_group_timeout_is_waited_for_off_the_collectives(
    other_layout: tuple[LocalRun, dict[str, torch.Tensor]],
) -> None:
    run, _params = other_layout
    ready = [next(e for e in p if e.get("event") == "ready") for p in run.progress]
    assert ready[0]["load_wait_s"] >= SLOW_LOAD_S - 1.0, ready  # rank 0 waited on the store
    assert ready[1]["load_wait_s"] < LOAD_TIMEOUT_S, ready
    assert [s["step"] for s in run.steps(0)] == [3, 4]


def test_a_rank_failing_before_its_restore_ends_the_other_with_its_error(
    saved: _Saved, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIL_BEFORE_LOAD_RANK", "1")
    resume = ["--ckpt-dir", str(saved.ckpt), "--load-step", "2"]
    run = launch_local(
        DS_1X2,
        2,
        tmp_path / "c",
        module=FAULT_RANK,
        extra_args=[*resume, *FAST_POLL],
        deadline_s=240.0,
    )
    errors = run.errors
    assert run.returncodes == [1, 1], (run.returncodes, [e[-2000:] for e in run.stderr])
    assert errors[1] is not None and "building the run" in errors[1]["message"], errors[1]
    err = errors[0]
    assert err is not None and err["origin"] == "peer", err
    assert "rank 1" in err["message"] and "MemoryError: building the run" in err["message"], err
    # promptly: within a poll or two of rank 1's exit, not after the 60 s liveness
    assert run.exit_times_s[0] - run.exit_times_s[1] < 15.0, run.exit_times_s
