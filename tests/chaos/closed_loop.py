"""Closed-loop runs on real processes: node kinds under CPU quotas, a prior, and the figures of
online calibration (issue 20, 5a and 5b; docs/runtime.md, "Measured with real workers").

Built on the chaos harness (:class:`~tests.chaos.harness.ChaosRun`: servers, the demo's
cluster of real controller, agent and worker processes, the uninterrupted reference and the
verdict): this module adds what both closed-loop tests need and the harness does not have.

- :func:`prior_profiles`: the prior the controller plans with. The demo model's layers are
  profiled here as ``cpu-full`` (``sailor profile layers``, unthrottled), and the same figures
  are written again as ``cpu-slow``: the slow kind *profiled as full speed*, which is wrong by
  whatever its quota makes it.
- :func:`closed_loop_run`: a :class:`ChaosRun` whose nodes have kinds and quotas, whose
  controller plans with the prior and fits online with replanning on.
- :func:`start_all`: agents, then the controller, RUNNING (without the harness's training
  steps: the controller may reconfigure on its own at any step).
- :func:`figures`: what one calibration-driven replan measured, from the audit log and the
  workers' progress files (steps and seconds to detect, prediction error before and after,
  step before and after, downtime).
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sailor.cli.demo.observe import StepPoint
from sailor.controller.config import OnlineCalibrationSettings
from sailor.schemas.network import NetworkProfile
from sailor.schemas.profile import ProfileDB
from tests.chaos.harness import ChaosRun, demo_training

__all__ = [
    "FULL",
    "SLOW",
    "LoopFigures",
    "closed_loop_run",
    "decision_of",
    "dump",
    "error",
    "figures",
    "judged",
    "layout_nodes",
    "prior_network",
    "prior_profiles",
    "records_of",
    "replan_away_from",
    "settle",
    "settled_judgements",
    "start_all",
]

FULL, SLOW = "cpu-full", "cpu-slow"
ZONE = "local-a"
"""The demo cluster's zone (every node's)."""

SETTINGS = OnlineCalibrationSettings(
    # a fit per half second once every rank has 3 steps of one speed; two fits that agree
    # before a verdict (the defaults, 3 fits 10 s apart, are for jobs of hours)
    interval_s=0.5,
    min_steps=3,
    stable_reports=2,
    # before the first reconfiguration of the run is measured: what runtime_reconfig.py
    # measured here (2.2-4.4 s), rounded up
    default_downtime_s=5.0,
)


@functools.cache
def _full_profile() -> Path:
    spec = demo_training().spec_file
    full = spec.parent / f"prior-{FULL}.json"
    cmd = [
        sys.executable, "-m", "sailor.cli.main", "profile", "layers", "--model-file", str(spec),
        "--kind", FULL, "--mbs", "1,2,4", "-o", str(full),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return full


def prior_profiles(kinds: Sequence[str] = (FULL, SLOW)) -> tuple[Path, ...]:
    """``cpu-full`` profiled on this machine, unthrottled, and its figures under each other
    kind's name (the prior that says every kind computes at full speed). Profiled once per
    process (~40 s: the framework's time outside the layers is measured too, so that the fit
    can tell it from the layers'); microbatch sizes 1, 2 and 4, all that the harness's global
    batch of 4 allows."""
    full = _full_profile()
    out = []
    for kind in kinds:
        if kind == FULL:
            out.append(full)
            continue
        path = full.with_name(f"prior-{kind}.json")
        # every mention of the kind: timings, sizes, memory, and the meta keys "cpu-full.<what>"
        path.write_text(full.read_text().replace(f'"{FULL}', f'"{kind}'))
        if ProfileDB.model_validate_json(path.read_text()).gpu_types() != [kind]:
            raise AssertionError(f"{path}: not a profile of {kind} alone")
        out.append(path)
    return tuple(out)


@functools.cache
def _loopback_probe() -> dict[str, Any]:
    spec = demo_training().spec_file
    out = spec.parent / "probe-network.json"
    cmd = [
        sys.executable, "-m", "sailor.cli.main", "profile", "network", "-o", str(out),
        "--zone", ZONE, "--gpu-type", FULL, "--min-bytes", "1024", "--max-bytes", "4194304",
        "--bytes-per-size", "8388608", "--collectives", "2",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    data: dict[str, Any] = json.loads(out.read_text())
    return data


def prior_network(kinds: Sequence[str]) -> Path:
    """The network the controller plans with: gloo on this machine's loopback, probed once
    per process (``sailor profile network``, ~20 s: send/recv from 1 KiB to 4 MiB with its
    per-message latency, and a 2-rank all-reduce), recorded between every pair of kinds
    (one loopback carries them all; the kinds only name the endpoints). Without it the
    simulator's default network has no per-message latency, and on loopback gloo each
    pipeline exchange costs milliseconds under load (2.0 ms fitted at load average 6)."""
    probe = _loopback_probe()
    link, coll = probe["links"][0], probe["collectives"][0]
    data = {
        **probe,
        "links": [
            {**link, "src": {**link["src"], "gpu_type": a}, "dst": {**link["dst"], "gpu_type": b}}
            for a in kinds
            for b in kinds
        ],
        "collectives": [{**coll, "endpoint": {**coll["endpoint"], "gpu_type": k}} for k in kinds],
    }
    path = demo_training().spec_file.parent / f"prior-network-{'-'.join(kinds)}.json"
    path.write_text(NetworkProfile.model_validate(data).model_dump_json(indent=1))
    return path


def closed_loop_run(
    tmp: Path,
    scenario: str,
    kinds: Mapping[str, tuple[str, float | None]],
    steps_between: int = 6,
    **cluster: Any,
) -> ChaosRun:
    """A chaos run of nodes with kinds and quotas, planned with :func:`prior_profiles`, fitting
    online with replanning on (``cluster`` overrides any DemoCluster field)."""
    options: dict[str, Any] = {
        "kinds": dict(kinds),
        "profiles": prior_profiles(sorted({k for k, _ in kinds.values()})),
        "network": prior_network(sorted({k for k, _ in kinds.values()})),
        "online_calibration": SETTINGS,
        **cluster,
    }
    return ChaosRun(tmp, scenario, steps_between=steps_between, cluster=options)


async def start_all(run: ChaosRun, nodes: Sequence[str]) -> int:
    """Agents first (the first plan uses them all), then the controller; the first RUNNING
    generation."""
    for n in nodes:
        run.cluster.start_agent(n)
    await run.drive.until(lambda: len(run.drive.view.nodes) >= len(nodes), "registered")
    run.cluster.start_controller("c1")
    return await run.drive.running_after(-1)


def layout_nodes(run: ChaosRun, generation: int) -> set[str]:
    """The nodes of a generation's layout (its ``launch`` record)."""
    for r in records_of(run, "phase", generation):
        if r.get("phase") == "launch":
            return {n for p in r.get("layout", []) for st in p["stages"] for n in st["nodes"]}
    return set()


def replan_away_from(run: ChaosRun, nodes: set[str], since: float = 0.0) -> dict[str, Any] | None:
    """The first calibration-driven replan decided after ``since`` in a generation whose
    layout uses one of ``nodes``."""
    for r in records_of(run, "replan_decision"):
        if (
            r["reconfigure"]
            and float(r["time"]) > since
            and layout_nodes(run, int(r["generation"])) & nodes
        ):
            return r
    return None


def records_of(run: ChaosRun, kind: str, generation: int | None = None) -> list[dict[str, Any]]:
    return [
        r
        for r in run.records()
        if r.get("kind") == kind and (generation is None or r.get("generation") == generation)
    ]


def decision_of(run: ChaosRun, since: float = 0.0) -> dict[str, Any] | None:
    """The first calibration-driven replan decided (a ``replan_decision`` that reconfigured)
    after time ``since``."""
    return next(
        (
            r
            for r in records_of(run, "replan_decision")
            if r["reconfigure"] and float(r["time"]) > since
        ),
        None,
    )


async def settle(run: ChaosRun, gen: int, rounds: int = 6) -> int:
    """The generation the fitted model keeps: follow calibration-driven replans until a
    generation's fits are stable and it stays. The prior's first fits may move the layout,
    and with kinds the prior prices alike the controller tries each: a kind not running
    keeps its prior, so it looks faster than one measured slower than its profile (one
    replan per generation, each after the new layout reported); hence up to six."""
    for _ in range(rounds):

        def judged(g: int = gen) -> bool:
            return any(
                r["reconfigure"] or r["stable_reports"] >= r["required_stable"]
                for r in records_of(run, "replan_decision", g)
            )

        await run.drive.until(judged, f"a stable judgement of generation {gen}")
        if not any(r["reconfigure"] for r in records_of(run, "replan_decision", gen)):
            return gen
        gen = await run.drive.running_after(gen)
    raise AssertionError(f"no layout kept after {rounds} calibration-driven replans")


def error(r: Mapping[str, Any]) -> float:
    """A replan decision's prediction error on the running plan: predicted / measured - 1."""
    return float(r["running_s"]) / float(r["measured_s"]) - 1.0


@dataclass(frozen=True)
class LoopFigures:
    """What one calibration-driven replan measured (a row of docs/runtime.md's table)."""

    old_generation: int
    new_generation: int
    steps_to_detect: int
    """Steps the old layout trained, from its first (or from the slowdown), until the replan
    was decided."""
    seconds_to_detect: float
    """From the old layout's first step (or the slowdown) to the decision."""
    error_first: float
    """The first prediction error of the old layout: the first fit's ``error_before`` (the
    plan as the prior priced it against its measured step), or after a slowdown the first
    fit's after it (as the calibration kept before the slowdown prices it)."""
    error_last: float
    """The new layout's last three judgements once a fit of it was kept (median of their
    errors): predicted under the kept calibration against the measured step."""
    step_before_s: float
    """The old layout's measured step (the workers' ``step_s``, median over ranks and the last
    window, as the last fit of it saw it)."""
    step_after_s: float
    wall_before_s: float
    """Median wall-clock time between the old layout's consecutive steps (from the slowdown,
    if any; the agents' pacing of ``min_step_s`` included)."""
    wall_after_s: float
    downtime_s: float
    """Last step of the old layout to the first of the new one."""
    decision: Mapping[str, Any]

    def row(self) -> str:
        return (
            f"detected after {self.steps_to_detect} steps ({self.seconds_to_detect:.1f} s); "
            f"error {self.error_first:+.0%} -> {self.error_last:+.0%}; step "
            f"{self.step_before_s:.3f} -> {self.step_after_s:.3f} s (wall {self.wall_before_s:.3f}"
            f" -> {self.wall_after_s:.3f} s); downtime {self.downtime_s:.1f} s"
        )


def _wall_step(points: Sequence[StepPoint], gen: int) -> float:
    mine = sorted((p for p in points if p.generation == gen), key=lambda p: p.step)
    gaps = [b.time - a.time for a, b in itertools.pairwise(mine) if b.step == a.step + 1]
    return statistics.median(gaps) if gaps else float("nan")


def settled_judgements(run: ChaosRun, gen: int) -> list[dict[str, Any]]:
    """The judgements of generation ``gen`` priced with a calibration fitted on it (after its
    first kept fit; all of them if none was kept: the calibration before it held)."""
    judged = [r for r in records_of(run, "replan_decision", gen) if r.get("measured_s")]
    fitted = records_of(run, "calibration", gen)
    if not fitted:
        return judged
    return [r for r in judged if float(r["time"]) > float(fitted[0]["time"])]


async def judged(run: ChaosRun, gen: int, enough: int = 5) -> None:
    """Wait until generation ``gen`` is judged ``enough`` times with a calibration of its own
    (or with the one before, if its fits moved nothing), or gets a verdict or a failed fit
    (no judgement follows either; the caller asserts). Five: a fit of a new layout is kept
    once its fits agree (two at least), so the first judgements may still price it with the
    previous layout's calibration (:func:`figures` takes the last three)."""

    def done() -> bool:
        again = any(r["reconfigure"] for r in records_of(run, "replan_decision", gen))
        failed = records_of(run, "calibration_failed", gen)
        return len(settled_judgements(run, gen)) >= enough or again or bool(failed)

    await run.drive.until(done, f"judgements of generation {gen}")


def figures(
    run: ChaosRun, decided: Mapping[str, Any], new: int, since: float | None = None
) -> LoopFigures:
    """The figures of the replan ``decided`` (a ``replan_decision`` that reconfigured) from
    its generation to ``new`` (both have run). Without ``since`` detection counts from the old
    layout's first step and the first error is its first fit's; with it (the time a node
    slowed down) both count from then."""
    old = int(decided["generation"])
    run.drive.steps.poll()
    points = run.drive.steps.series()
    olds = [p for p in points if p.generation == old]
    news = [p for p in points if p.generation == new]
    start = min(p.time for p in olds) if since is None else since
    t = float(decided["time"])
    judged_old = [r for r in records_of(run, "replan_decision", old) if r.get("measured_s")]
    if since is None:
        cal_old = records_of(run, "calibration", old)
        if not cal_old:
            raise AssertionError(f"no fit of generation {old}")
        first = float(cal_old[0]["error_before"])
    else:
        # the first fit after the slowdown: its error_before is the plan as the calibration
        # kept before the slowdown prices it, against the slowed step
        cal_after = [r for r in records_of(run, "calibration", old) if float(r["time"]) > since]
        if not cal_after:
            raise AssertionError(f"no fit of generation {old} after {since}")
        first = float(cal_after[0]["error_before"])
    settled = settled_judgements(run, new)[-3:]
    if not settled:
        raise AssertionError(f"no judgement of generation {new}")
    return LoopFigures(
        old_generation=old,
        new_generation=new,
        steps_to_detect=sum(1 for p in olds if start <= p.time <= t),
        seconds_to_detect=round(t - start, 2),
        error_first=first,
        error_last=statistics.median(error(r) for r in settled),
        step_before_s=float(judged_old[-1]["measured_s"]),
        step_after_s=statistics.median(float(r["measured_s"]) for r in settled),
        wall_before_s=_wall_step([p for p in points if p.time >= start], old),
        wall_after_s=_wall_step(points, new),
        downtime_s=round(min(p.time for p in news) - max(p.time for p in olds), 2),
        decision=decided,
    )


def dump(run: ChaosRun, fig: LoopFigures, path: Path | None = None) -> str:
    """The figures and the run's fits and decisions, one JSON object (for the docs' table)."""
    rows = {
        "figures": {k: v for k, v in fig.__dict__.items() if k != "decision"},
        "decision": dict(fig.decision),
        "calibrations": [
            {k: r.get(k) for k in ("generation", "version", "error_before", "error_after", "notes")}
            | {
                "constants": [
                    f"{c['gpu_type']}.{c['name']}={c['value']:.4g} [{c['low']:.4g}, "
                    f"{c['high']:.4g}]{'' if c['fitted'] else ' (kept)'}"
                    for c in r.get("constants", [])
                ]
            }
            for r in records_of(run, "calibration")
        ],
        "decisions": [
            {
                k: r.get(k)
                for k in ("generation", "running_s", "best_s", "measured_s", "reason", "corners")
            }
            for r in records_of(run, "replan_decision")
        ],
    }
    text = json.dumps(rows, indent=1, default=str)
    if path is not None:
        path.write_text(text)
    return text
