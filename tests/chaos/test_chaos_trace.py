"""Replay of the original artifact's spot trace (A100, 2-4 GPUs), time-compressed.

``../shared/reference/sailor/traces/a100_trace.json`` samples the number of A100s a spot
cluster held every 63 s for 13,041 s; its 12 changes all fall in the first 6,489 s. Each
GPU is one ``cpu`` node here. The replay is compressed by events, not by a fixed factor: each
change is applied once the previous layout is RUNNING and has trained ``STEPS`` steps (a
reconfiguration takes 5-15 s on 2 shared cores, longer than the trace's shortest gap of 63 s
divided by any factor that keeps the replay short). A drop is a spot preemption with a 30 s
notice for the longest-serving node (a reconfiguration if the layout used it; the planner may
leave a node out); a rise is a new node (fresh id, as a new spot VM).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tests.chaos.harness import NODES, ChaosRun, verdict

pytestmark = [pytest.mark.chaos, pytest.mark.chaos_long]

STEPS = 4


def changes(trace: Path) -> list[tuple[int, int]]:
    """(time s, GPUs) at the start and at every change of the GPU count."""
    rows = json.loads(trace.read_text())
    out: list[tuple[int, int]] = []
    for r in rows:
        if not out or r["GPUs"] != out[-1][1]:
            out.append((int(r["Time"]), int(r["GPUs"])))
    return out


async def test_replay_a100_spot_trace(tmp_path: Path, reference: Path) -> None:
    steps = changes(reference / "traces" / "a100_trace.json")
    assert len(steps) == 12 and all(abs(b[1] - a[1]) == 1 for a, b in itertools.pairwise(steps))
    fresh = iter(NODES)
    live = [next(fresh) for _ in range(steps[0][1])]
    joins = sum(b[1] > a[1] for a, b in itertools.pairwise(steps))
    # five joins: each agent keeps a warm spare, so a join costs no worker start
    spares = {"warm_spares": 1}
    async with ChaosRun(
        tmp_path, "A100 spot trace replay", steps_between=STEPS, cluster=spares
    ) as run:
        run.fault(f"{len(steps) - 1} changes, 2-4 nodes, t=0..{steps[-1][0]} s ({joins} joins)")
        gen = await run.start(live)
        for t, gpus in steps[1:]:
            if gpus < len(live):
                node = live.pop(0)
                run.drive.note(f"trace t={t}s {gpus} GPUs: notice {node}")
                gen = await run.preempt(node, gen)
            else:
                node = next(fresh)
                run.drive.note(f"trace t={t}s {gpus} GPUs: {node} joins")
                live.append(node)
                gen = await run.join(node, gen)
            await run.drive.train(gen, STEPS)
        out = await run.finish(gen, drain=live[0])
    # a join always reconfigures; a notice only when the layout used that node
    verdict(out, min_reconf=joins + 1)
