"""Step timings from worker progress lines to the agent's status record; the toy's made-up ones."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from sailor.agent.step_timings import WINDOW, StepWindow, bad_timing, sample_of
from sailor.agent.toy_timings import ToyTimings, parse_slowness
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.runtime import AgentStatus


def line(step: int, fwd: float = 0.01, **kw: object) -> dict[str, object]:
    return {
        "event": "step",
        "step": step,
        "loss": 1.0,
        "fwd_s": fwd,
        "bwd_s": 2 * fwd,
        "p2p_s": 0.003,
        "sync_s": 0.004,
        "optim_s": 0.005,
        "step_s": 0.1,
        "microbatches": 4,
        **kw,
    }


def test_window_skips_the_first_step_and_keeps_medians_of_the_last_ones() -> None:
    w = StepWindow(rank=3)
    assert w.summary() is None
    w.add(line(1, fwd=9.0))  # start-up: not summarized
    assert w.summary() is None
    for s, fwd in zip(range(2, 7), (0.010, 0.012, 0.011, 0.013, 0.50), strict=True):
        w.add(line(s, fwd=fwd))
    t = w.summary()
    assert t is not None
    assert (t.rank, t.steps, t.last_step, t.microbatches) == (3, 5, 6, 4)
    assert t.fwd_s == pytest.approx(0.012) and t.bwd_s == pytest.approx(0.024)
    assert t.step_s == 0.1 and t.p2p_s == 0.003 and t.sync_s == 0.004 and t.optim_s == 0.005
    xs = [3 * f for f in (0.010, 0.012, 0.011, 0.013, 0.50)]
    assert t.compute_spread == pytest.approx(statistics.stdev(xs) / statistics.median(xs))
    for s in range(7, 7 + 2 * WINDOW):
        w.add(line(s))
    assert w.summary().steps == WINDOW  # type: ignore[union-attr]


def test_lines_without_timings_add_nothing_and_old_status_records_still_parse() -> None:
    assert sample_of({"event": "step", "step": 3, "loss": 1.0}) is None
    assert sample_of(line(3, step_s=0)) is None
    assert sample_of(line(3, fwd_s="fast")) is None
    w = StepWindow(rank=0, skip_first=0)
    w.add({"event": "step", "step": 1, "loss": 0.5})
    assert w.summary() is None
    old = {"node_id": "n1", "generation": 2, "state": "running", "step": 5}
    assert AgentStatus.model_validate_json(json.dumps(old)).timings == ()


def test_toy_timings_follow_the_slowness_of_the_kinds(tmp_path: Path) -> None:
    from sailor.controller.planning.in_process import SailorPlanner

    nodes = tuple(
        NodeSpec(node_id=f"n{i}", gpu_type=g, gpus=1, zone="z-a-1", address="h")
        for i, g in ((1, "A100-40"), (2, "A100-40"))
    )
    res = SailorPlanner.from_files("tiny-gpt", 8).plan(nodes, None)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(res.plan.model_dump_json())
    fast = ToyTimings(plan_file, 0, {}, noise=0.0).step(4)
    slow = ToyTimings(plan_file, 0, parse_slowness("A100-40=3"), noise=0.0).step(4)
    assert slow["fwd_s"] == pytest.approx(3 * fast["fwd_s"])
    assert slow["bwd_s"] == pytest.approx(3 * fast["bwd_s"])
    assert slow["optim_s"] == pytest.approx(fast["optim_s"])
    noisy = ToyTimings(plan_file, 0, {}, noise=0.05)
    assert noisy.step(4) == noisy.step(4) != noisy.step(5)  # deterministic per step
    with pytest.raises(ValueError, match="KIND=FACTOR"):
        parse_slowness("A100-40")
    with pytest.raises(ValueError, match="KIND=FACTOR"):
        parse_slowness("A100-40=-1")


def test_a_change_of_speed_drops_the_steps_before_it() -> None:
    """A neighbour slowed down (this rank's step time rose 2.5x): three steps at the new
    speed replace the window, so its medians are the new speed, not a mix."""
    w = StepWindow(rank=0, skip_first=0)
    for s in range(1, 9):
        w.add(line(s, step_s=0.1))
    for s in range(9, 12):
        w.add(line(s, step_s=0.25, sync_s=0.15))
    t = w.summary()
    assert t is not None and w.restarts == 1
    assert (t.steps, t.step_s, t.sync_s) == (3, 0.25, 0.15)
    # its own compute slowed (its quota lowered) while the step time is paced: also a change
    w2 = StepWindow(rank=1, skip_first=0)
    for s in range(1, 7):
        w2.add(line(s, fwd=0.01))
    for s in range(7, 10):
        w2.add(line(s, fwd=0.03))
    assert w2.summary().steps == 3 and w2.summary().fwd_s == 0.03  # type: ignore[union-attr]


def test_jitter_and_a_lone_slow_step_are_no_change_of_speed() -> None:
    w = StepWindow(rank=0, skip_first=0)
    steps = [0.1, 0.12, 0.09, 0.11, 0.125, 0.5, 0.1, 0.12, 0.125, 0.12, 0.08, 0.11]
    for s, x in enumerate(steps, start=1):
        w.add(line(s, step_s=x))
    assert w.restarts == 0 and w.summary().steps == len(steps)  # type: ignore[union-attr]


def test_restart_drops_everything_and_the_next_step_counts() -> None:
    w = StepWindow(rank=0)
    for s in range(1, 6):
        w.add(line(s))
    w.restart()
    assert w.summary() is None and w.restarts == 1
    w.add(line(6, fwd=0.02))
    assert w.summary().steps == 1 and w.summary().fwd_s == 0.02  # type: ignore[union-attr]


def test_the_agent_drops_timings_when_its_quota_changes(tmp_path: Path) -> None:
    """The kernel's quota read in the status loop differs from the last one (set by the agent
    or from outside): the workers' windows restart; the first reading is no change."""
    from sailor.agent.agent_config import AgentConfig
    from sailor.agent.daemon import Agent
    from sailor.agent.worker_view import WorkerView

    node = NodeSpec(node_id="n1", gpu_type="cpu-slow", gpus=1, zone="z")
    agent = Agent(AgentConfig(node=node, work_dir=tmp_path))
    window = StepWindow(rank=0, skip_first=0)
    for s in range(1, 5):
        window.add(line(s))
    agent.supervisor.workers = [WorkerView(rank=0, proc=None, argv=(), timings=window)]  # type: ignore[arg-type]

    class Quota:
        cores: float | None = 0.5

        def state(self) -> float | None:
            return self.cores

    q = Quota()
    agent.quota = q  # type: ignore[assignment]
    agent._follow_quota()
    assert window.summary().steps == 4  # type: ignore[union-attr]
    agent._follow_quota()
    assert window.summary().steps == 4  # type: ignore[union-attr]
    q.cores = 0.2
    agent._follow_quota()
    assert window.summary() is None and window.restarts == 1


def test_the_rest_of_the_step_outside_compute_sync_and_optimizer() -> None:
    # compute 0.14 = p2p 0.003 + 4 x (0.01 + 0.02) + 0.017 between; sync 0.004, optim 0.005
    s = sample_of(line(3, compute_s=0.14, step_s=0.2))
    assert s is not None and s.rest_s == pytest.approx(0.051)
    assert sample_of(line(3)).rest_s == 0.0  # type: ignore[union-attr]  # no compute_s
    w = StepWindow(rank=0, skip_first=0)
    for st in range(1, 4):
        w.add(line(st, compute_s=0.14, step_s=0.2))
    assert w.summary().rest_s == pytest.approx(0.051)  # type: ignore[union-attr]
    # skewed steps: the parts' medians miss part of the median step, which the rest takes
    w = StepWindow(rank=0, skip_first=0)
    for st, (sync, step) in enumerate([(0.004, 0.2), (0.004, 0.21), (0.02, 0.215)], start=1):
        w.add(line(st, compute_s=0.14, sync_s=sync, step_s=step))
    t = w.summary()
    assert t is not None and t.step_s == 0.21 and t.sync_s == 0.004
    assert t.rest_s == pytest.approx(0.21 - (0.12 + 0.017 + 0.003 + 0.004 + 0.005))


def test_the_pipeline_phase_between_the_timed_passes() -> None:
    # compute 0.14 = p2p 0.003 + 4 microbatches x (0.01 + 0.02) + 0.017 between
    s = sample_of(line(3, compute_s=0.14, step_s=0.2))
    assert s is not None and s.between_s == pytest.approx(0.017)
    assert s.rest_s == pytest.approx(0.051)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("fwd_s", float("inf"), "fwd_s=inf"),
        ("bwd_s", 1e308, "bwd_s=1e+308"),
        ("p2p_s", -0.5, "p2p_s=-0.5"),
        ("step_s", float("nan"), "step_s=nan"),
        ("sync_s", True, "sync_s=True"),
        ("microbatches", -3, "microbatches=-3"),
        ("microbatches", 10**400, "microbatches=1000"),
    ],
    ids=["inf", "huge", "negative", "nan", "bool", "negative-count", "huge-count"],
)
def test_hostile_timings_are_named_and_never_reach_the_summary(
    field: str, value: object, named: str
) -> None:
    """Before, an infinite or overflowing timing made ``summary`` raise (the status record
    refuses non-finite numbers), and the agent's status loop crashed until it exited."""
    assert bad_timing(line(3, **{field: value})).startswith(named)
    assert bad_timing(line(3)) == "" and bad_timing({"event": "step", "step": 3}) == ""
    w = StepWindow(rank=0, skip_first=0)
    for s in range(1, 5):
        w.add(line(s, **{field: value}))
    w.add(line(5))
    t = w.summary()
    assert t is not None and (t.steps, t.last_step) == (1, 5)
