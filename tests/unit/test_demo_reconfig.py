"""The demo's measurements of a reconfiguration and its loss comparison (pure functions)."""

from __future__ import annotations

from typing import Any

import pytest

from sailor.cli.demo.observe import StepPoint, plan_summary
from sailor.cli.demo.reconfig import Injection, reconfigurations
from sailor.cli.demo.report import LOSS_ATOL, compare_losses
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage


def _phase(t: float, phase: str, gen: int, load: int = -1) -> dict[str, Any]:
    return {"kind": "phase", "time": t, "phase": phase, "generation": gen, "load_step": load}


def _pt(gen: int, step: int, t: float, loss: float = 1.0) -> StepPoint:
    return StepPoint(generation=gen, step=step, loss=loss, samples_per_s=4.0, time=t)


RECORDS = [
    _phase(1.0, "launch", 1),
    _phase(1.1, "load", 1),
    _phase(3.0, "verify", 1),
    _phase(3.2, "running", 1),
    _phase(3.3, "running", 1),  # same phase written again: not a change
    # node lost at 10.0: abort, relaunch from commit 0 (none) -> generation 2
    _phase(12.0, "teardown", 1),
    _phase(12.5, "launch", 2, 0),
    _phase(12.6, "load", 2, 0),
    _phase(15.0, "verify", 2, 0),
    _phase(15.5, "running", 2, 0),
]
POINTS = [_pt(1, s, 3.0 + 0.5 * s) for s in range(1, 14)] + [
    _pt(2, s, 15.0 + 0.5 * s) for s in range(1, 4)
]


def test_phases_recovery_gap_and_redone_steps() -> None:
    injs = [Injection("start", "n1", 0.5), Injection("node lost", "n2", 10.0)]
    start, lost = reconfigurations(RECORDS, injs, POINTS)
    assert start.resumed and start.generation == 1
    want = {"detect": 0.5, "launch": 0.1, "load": 1.9, "verify": 0.2}
    assert start.phases == pytest.approx(want)
    assert lost.generation == 2 and lost.load_step == 0
    assert lost.phases["detect"] == 2.0 and lost.phases["teardown"] == 0.5
    assert lost.recovery_s == pytest.approx(5.5)
    # the last old step before the new layout ran: step 13 at 9.5 (points up to running)
    assert lost.gap_s == pytest.approx(15.5 - 9.5)
    assert lost.redone_steps == 13


def test_not_resumed_when_running_never_comes() -> None:
    (r,) = reconfigurations(RECORDS[:7], [Injection("node lost", "n2", 10.0)], POINTS)
    assert not r.resumed and r.recovery_s is None and r.gap_s is None


def test_a_fallback_names_the_abort_that_failed_in_place() -> None:
    """A relayout whose in-place launch failed says why it restarted: a flaky run of the
    demo test shows the cause, not only the path."""
    launch_in_place = {**_phase(10.5, "launch", 2), "path": "in_place", "path_reason": "ok"}
    teardown = {**_phase(12.0, "teardown", 2), "cause": "abort: during load: n3 stalled"}
    restart = {
        **_phase(12.5, "launch", 3, 0),
        "path": "restart",
        "path_reason": "fallback: the in-place launch of generation 2 failed",
    }
    recs = [*RECORDS[:5], launch_in_place, teardown, restart, _phase(15.5, "running", 3, 0)]
    (r,) = reconfigurations(recs, [Injection("preemption notice", "n2", 10.0)], POINTS)
    assert r.path == "restart" and r.generation == 3
    assert r.path_reason == (
        "fallback: the in-place launch of generation 2 failed (abort: during load: n3 stalled)"
    )
    assert r.as_dict()["path_reason"] == r.path_reason
    (ok,) = reconfigurations(
        [*RECORDS[:5], launch_in_place, _phase(11.0, "running", 2)],
        [Injection("preemption notice", "n2", 10.0)],
        POINTS,
    )
    assert ok.path == "in_place" and ok.path_reason == "ok"


def test_compare_losses_every_step_and_commits() -> None:
    ref = [3.0, 2.5, 2.0, 1.5]
    pts = [_pt(1, 1, 1, 3.0), _pt(1, 2, 2, 2.5), _pt(2, 2, 5, 2.5 + 1e-7), _pt(2, 3, 6, 2.0)]
    c = compare_losses(pts, ref, commits=[2])
    assert c.ok and c.steps_compared == 4 and c.committed == ((2, 2.5, 2.5),)
    bad = compare_losses([*pts, _pt(2, 4, 7, 1.5 + 10 * LOSS_ATOL)], ref, commits=[2])
    assert not bad.ok
    missing = compare_losses(pts, ref, commits=[4])  # a commit no reported step covers
    assert not missing.ok


def _cpu() -> ReplicaGroup:
    return ReplicaGroup(gpu_type="cpu", zone="local-a", tp=1, gpus_per_node=1)


def test_plan_summary() -> None:
    pp = Plan(
        plan_id="p",
        model="tiny-gpt",
        global_batch_size=4,
        pipelines=(
            Pipeline(
                stages=(
                    Stage(first_layer=0, last_layer=2, replica=_cpu()),
                    Stage(first_layer=3, last_layer=5, replica=_cpu()),
                ),
                microbatch_size=1,
                num_microbatches=4,
            ),
        ),
    )
    assert plan_summary(pp, {"n2": (1,), "n1": (0,)}) == "2 stages layers 0-2|3-5 on n1,n2"
    one = Stage(first_layer=0, last_layer=5, replica=_cpu())
    dp = Plan(
        plan_id="q",
        model="tiny-gpt",
        global_batch_size=12,
        pipelines=(
            Pipeline(stages=(one,), microbatch_size=2, num_microbatches=4),
            Pipeline(stages=(one,), microbatch_size=4, num_microbatches=1),
        ),
    )
    want = "DP 2 × layers 0-5 (8 + 4 samples) on n2,n3"
    assert plan_summary(dp, {"n3": (0,), "n2": (1,)}) == want
    assert plan_summary(None, {}) == "—"
