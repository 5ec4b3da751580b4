"""A node that becomes slow mid-run is detected and planned around (issue 20, 5b).

Three nodes of the demo's cluster: n1 and n2 of kind ``cpu-full`` without a quota, n3 of a
kind of its own (``cpu-b``: the planner and the fit tell it from the others, as they would a
node of another GPU type) under a quota of 1 core, which a worker does not reach: at first it
computes as fast as the others, as its profile (the ``cpu-full`` one under its name) says.
Once the layout the fitted model keeps uses n3, its quota is lowered from outside its agent
(``DemoCluster.set_quota``, as under a noisy neighbour): its agent drops the timings of the
old speed, the fit finds the kind slower, and the controller must reconfigure to a layout
that gives n3 less work or none. The chaos verdict applies: audit ok, no committed step lost,
losses and weights equal to an uninterrupted run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.chaos.closed_loop import (
    FULL,
    closed_loop_run,
    decision_of,
    dump,
    figures,
    records_of,
    settle,
    start_all,
)
from tests.chaos.harness import verdict
from tests.integration.conftest import favoured_cpu  # noqa: F401  (fixture)

pytestmark = [pytest.mark.chaos, pytest.mark.chaos_long, pytest.mark.usefixtures("favoured_cpu")]

LONE = "cpu-b"
SLOW_QUOTA = 0.05
"""As in tests/integration/test_closed_loop.py: a paced worker uses about 0.1 core."""
PERIOD_MS = 20.0
MAX_STEPS_TO_DETECT = 40


async def test_a_node_that_becomes_slow_is_planned_around(tmp_path: Path) -> None:
    kinds = {"n1": (FULL, None), "n2": (FULL, None), "n3": (LONE, 1.0)}
    async with closed_loop_run(
        tmp_path, "a node becomes slow mid-run", kinds, cpu_quota_period_ms=PERIOD_MS
    ) as run:
        gen = await settle(run, await start_all(run, ("n1", "n2", "n3")))
        assert "n3" in run.placed(), f"the kept layout leaves n3 out: {run.drive.view.plan}"
        await run.advance(gen, 3)
        run.fault(f"n3's quota 1 -> {SLOW_QUOTA} cores mid-run")
        slowed = time.time()
        run.cluster.set_quota("n3", SLOW_QUOTA)

        await run.drive.until(
            lambda: decision_of(run, slowed) is not None, "a replan after the slowdown"
        )
        decided = decision_of(run, slowed)
        assert decided is not None and decided["generation"] == gen, decided
        new = await run.drive.running_after(gen)

        def judged() -> bool:
            return any(r.get("measured_s") for r in records_of(run, "replan_decision", new))

        await run.drive.until(judged, f"a judgement of generation {new}")
        fig = figures(run, gen, new, since=slowed)
        report = dump(run, fig, tmp_path.parent / f"slow-node-{os.getpid()}.json")
        if "n3" not in run.placed():  # its workers would start under the quota: it leaves
            new = await run.preempt("n3", new)
        out = await run.finish(new, drain="n1")
    print(f"a node becomes slow: {fig.row()}\n{report}")

    assert fig.steps_to_detect <= MAX_STEPS_TO_DETECT, fig.row()
    assert fig.step_after_s < fig.step_before_s, fig.row()
    verdict(out, min_reconf=2)
