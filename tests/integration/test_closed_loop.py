"""The closed loop with real processes (issue 20, 5a): a controller learns a cluster its prior
got wrong, and replans.

Four nodes of the demo's cluster (real ``sailor controller``/``sailor agent`` processes, real
workers training the demo's GPT-2 over gloo): n1 and n2 of kind ``cpu-full`` without a quota,
n3 and n4 of kind ``cpu-slow`` whose workers run every step under a CPU quota of 0.05 cores
(cgroups, see ``SLOW_QUOTA``). The controller's prior is wrong: ``cpu-slow`` is profiled as
full speed (the ``cpu-full`` profile under the other name, tests/chaos/closed_loop.py; the
network is gloo's loopback, probed), so it prices every layout of these nodes alike and
puts the slow kind to work, in its first plan or after its first fits (a kind not running
keeps its prior). Once a layout on a slow node runs, online calibration must notice within a
bounded number of steps, fit, keep the calibration and replan; the new layout's measured
step must be faster than the old one's and it must not be replanned again; the running
plan's prediction error must fall from its first value to at most 10 %; and the losses and
weights must equal an uninterrupted run (the chaos verdict).

The figures are printed (docs/runtime.md, "Measured with real workers"); nothing asserts a
speed beyond the new layout being faster. Takes about a minute: marked ``long``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.closed_loop import (
    FULL,
    SLOW,
    closed_loop_run,
    dump,
    figures,
    judged,
    layout_nodes,
    records_of,
    replan_away_from,
    start_all,
)
from tests.chaos.harness import verdict

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("favoured_cpu")]

NODES = ("n1", "n2", "n3", "n4")
SLOW_QUOTA = 0.05
"""Cores for each slow node. A worker of the demo's model, paced by the agents to a step
per 50 ms, uses about a tenth of a core: under 0.4 cores (the issue's example) it did not
slow at all (measured: the same per-microbatch compute on both kinds). Under 0.05 it
computes several times slower than the full nodes and waits out its quota in every step."""
PERIOD_MS = 20.0
"""The cgroup period: 1 ms of CPU per 20 ms (the kernel's least quota) spreads the stalls
over the step instead of one long stall per 100 ms period."""
MAX_STEPS_TO_DETECT = 40
"""The bound on steps before the replan is decided: a fit needs 3 steps of every rank after
the first (skipped), two fits that agree, and a plan search; measured here 6-7 (docs/runtime.md,
"Measured with real workers"). The bound leaves room for a loaded machine, not for a
controller that never notices."""
MAX_ERROR_AFTER = 0.10


async def test_a_wrong_prior_is_learned_and_replanned(tmp_path: Path) -> None:
    # the slow nodes' workers come under the quota once ready (AgentConfig.cpu_quota_from):
    # start-up under 0.05 cores would outlast the rendezvous; every step runs under it
    kinds = {
        "n1": (FULL, None),
        "n2": (FULL, None),
        "n3": (SLOW, SLOW_QUOTA),
        "n4": (SLOW, SLOW_QUOTA),
    }
    slow = {"n3", "n4"}
    async with closed_loop_run(
        tmp_path,
        "closed loop: slow kind priced as full",
        kinds,
        cpu_quota_period_ms=PERIOD_MS,
        quota_from="ready",
    ) as run:
        run.fault(f"{SLOW} (n3, n4) at {SLOW_QUOTA} cores from their first step, priced as {FULL}")
        first = await start_all(run, NODES)
        # the prior prices every layout of these four nodes alike (the kinds at one speed):
        # the first plan, or the first fits' (a kind not running keeps its prior, so an
        # unmeasured kind looks as fast as the profile), puts the slow kind to work
        await run.drive.until(
            lambda: replan_away_from(run, slow) is not None,
            "a calibration-driven replan of a layout on the slow kind",
        )
        decided = replan_away_from(run, slow)
        assert decided is not None
        old = int(decided["generation"])
        new = await run.drive.running_after(old)
        assert layout_nodes(run, new), new

        # the new layout reports, is fitted and judged
        await judged(run, new)
        fig = figures(run, decided, new)
        report = dump(run, fig, tmp_path.parent / f"closed-loop-{os.getpid()}.json")
        kept = [r for r in records_of(run, "replan_decision", new) if r["reconfigure"]]
        failed = records_of(run, "calibration_failed")
        out = await run.finish(new, drain="n1")
    print(f"closed loop (wrong prior, first layout generation {first}): {fig.row()}\n{report}")

    assert fig.steps_to_detect <= MAX_STEPS_TO_DETECT, fig.row()
    assert fig.step_after_s < fig.step_before_s, fig.row()
    assert abs(fig.error_last) <= MAX_ERROR_AFTER, fig.row()
    assert abs(fig.error_last) < abs(fig.error_first), fig.row()
    assert not kept, f"generation {fig.new_generation} replanned again: {kept}"  # no flapping
    assert not failed, failed
    verdict(out, min_reconf=1)
