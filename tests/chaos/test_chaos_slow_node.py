"""A node that becomes slow mid-run is detected and planned around (issue 20, 5b).

Three nodes of the demo's cluster, each of a CPU kind of its own (``cpu-a``, ``cpu-b``,
``cpu-c``: the planner and the fit tell them apart, as they would nodes of different GPU
types), each profiled as full speed (the ``cpu-full`` profile under its name), each under a
quota of 1 core, which a worker does not reach. Once the layout the fitted model keeps is
running, one node it uses has its quota lowered to 0.05 cores from outside its agent
(``DemoCluster.set_quota``, as under a noisy neighbour): its agent drops the timings of the
old speed, the fit finds its kind slower, and the controller must reconfigure to a layout
that gives it less work or none. The chaos verdict applies: audit ok, no committed step
lost, losses and weights equal to an uninterrupted run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.chaos.closed_loop import (
    closed_loop_run,
    dump,
    figures,
    judged,
    layout_nodes,
    records_of,
    replan_away_from,
    settle,
    start_all,
)
from tests.chaos.harness import verdict
from tests.integration.conftest import favoured_cpu  # noqa: F401  (fixture)

pytestmark = [pytest.mark.chaos, pytest.mark.chaos_long, pytest.mark.usefixtures("favoured_cpu")]

SLOW_QUOTA = 0.05
"""As in tests/integration/test_closed_loop.py: a paced worker uses about 0.1 core."""
PERIOD_MS = 20.0
MAX_STEPS_TO_DETECT = 40
NODES = ("n1", "n2", "n3")


async def test_a_node_that_becomes_slow_is_planned_around(tmp_path: Path) -> None:
    kinds = {n: (f"cpu-{k}", 1.0) for n, k in zip(NODES, "abc", strict=True)}
    async with closed_loop_run(
        tmp_path, "a node becomes slow mid-run", kinds, cpu_quota_period_ms=PERIOD_MS
    ) as run:
        gen = await settle(run, await start_all(run, NODES))
        await run.advance(gen, 3)
        victim = sorted(layout_nodes(run, gen))[0]
        run.fault(f"{victim}'s quota 1 -> {SLOW_QUOTA} cores mid-run")
        slowed = time.time()
        run.cluster.set_quota(victim, SLOW_QUOTA)

        await run.drive.until(
            lambda: replan_away_from(run, {victim}, slowed) is not None,
            f"a replan away from {victim} after the slowdown",
        )
        decided = replan_away_from(run, {victim}, slowed)
        assert decided is not None and decided["generation"] == gen, decided
        new = await run.drive.running_after(gen)

        await judged(run, new)
        fig = figures(run, decided, new, since=slowed)
        failed = records_of(run, "calibration_failed")
        report = dump(run, fig, tmp_path.parent / f"slow-node-{os.getpid()}.json")
        # the slow node leaves (a worker of it would start under the quota: longer than the
        # rendezvous waits), then the drain that commits the last step
        new = await run.preempt(victim, new)
        out = await run.finish(new, drain=next(n for n in NODES if n != victim))
    print(f"a node becomes slow ({victim}): {fig.row()}\n{report}")

    assert fig.steps_to_detect <= MAX_STEPS_TO_DETECT, fig.row()
    assert fig.step_after_s < fig.step_before_s, fig.row()
    assert not failed, failed
    verdict(out, min_reconf=2)
