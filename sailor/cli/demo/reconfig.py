"""The demo's reconfigurations, measured from the audit log and the workers' steps (pure).

For each injected change (start, preemption notice, node loss, node join) the controller's
phase records after it, up to the first RUNNING of a newer generation, give the seconds
spent in each phase (``detect`` = injection → first phase change: the watcher poll and the
event for a notice or a join, the lease TTL for a lost node). ``recovery_s`` is injection →
RUNNING; ``gap_s`` is the time the job made no step: the last step of the old layout → the
first step of the new one. ``redone_steps`` are steps trained after the newest commit and
lost with a node that left without notice (retrained from that commit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sailor.cli.demo.observe import StepPoint

__all__ = ["Injection", "Reconfiguration", "reconfigurations"]


@dataclass(frozen=True)
class Injection:
    """What the demo did to the cluster, and when (unix time)."""

    kind: str  # "start" | "preemption notice" | "node lost" | "node joined"
    node: str
    time: float


@dataclass(frozen=True)
class Reconfiguration:
    cause: str
    node: str
    injected_at: float
    running_at: float | None
    generation: int
    load_step: int
    phases: dict[str, float] = field(default_factory=dict)
    gap_s: float | None = None
    redone_steps: int = 0
    path: str = ""
    """How the new generation came up: ``in_place`` or ``restart`` (its launch record)."""
    path_reason: str = ""
    """Why it came up that way (the launch record's ``path_reason``); after a fallback, with
    the cause of the abort that failed the in-place launch."""

    @property
    def resumed(self) -> bool:
        return self.running_at is not None

    @property
    def recovery_s(self) -> float | None:
        return None if self.running_at is None else self.running_at - self.injected_at

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "node": self.node,
            "resumed": self.resumed,
            "generation": self.generation,
            "load_step": self.load_step,
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 3),
            "gap_s": None if self.gap_s is None else round(self.gap_s, 3),
            "redone_steps": self.redone_steps,
            "path": self.path,
            "path_reason": self.path_reason,
            "phases_s": {k: round(v, 3) for k, v in self.phases.items()},
        }


def _phase_changes(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in records:
        if r.get("kind") != "phase":
            continue
        if out and out[-1]["phase"] == r["phase"] and out[-1]["generation"] == r["generation"]:
            continue
        out.append(r)
    return out


def _one(
    inj: Injection, until: float, changes: list[dict[str, Any]], points: Sequence[StepPoint]
) -> Reconfiguration:
    before = [c for c in changes if float(c["time"]) < inj.time]
    gen0 = int(before[-1]["generation"]) if before else -1
    phases: dict[str, float] = {}
    last_t, last_name = inj.time, "detect"
    running_at: float | None = None
    gen, load = gen0, -1
    path, why, aborted = "", "", ""
    for c in changes:
        t = float(c["time"])
        if t < inj.time or t >= until:
            continue
        phases[last_name] = phases.get(last_name, 0.0) + t - last_t
        last_t, last_name = t, str(c["phase"])
        if c["phase"] == "teardown" and c.get("cause"):
            aborted = str(c["cause"])
        if c["phase"] == "launch":
            path, why = str(c.get("path", "")), str(c.get("path_reason", ""))
            if why.startswith("fallback") and aborted:
                why = f"{why} ({aborted})"
        if c["phase"] == "running" and int(c["generation"]) > gen0:
            running_at, gen, load = t, int(c["generation"]), int(c["load_step"])
            break
    old = [p for p in points if p.generation <= gen0 and p.time <= (running_at or until)]
    new = sorted((p for p in points if p.generation == gen), key=lambda p: p.time)
    gap = None
    if running_at is not None and new:
        gap = new[0].time - (max(p.time for p in old) if old else inj.time)
    reached = max((p.step for p in old), default=load)
    return Reconfiguration(
        cause=inj.kind,
        node=inj.node,
        injected_at=inj.time,
        running_at=running_at,
        generation=gen,
        load_step=load,
        phases=phases,
        gap_s=gap,
        redone_steps=max(0, reached - max(load, 0)) if inj.kind == "node lost" else 0,
        path=path,
        path_reason=why,
    )


def reconfigurations(
    records: Sequence[dict[str, Any]],
    injections: Sequence[Injection],
    points: Sequence[StepPoint],
) -> list[Reconfiguration]:
    """One entry per injection, in order."""
    changes = _phase_changes(records)
    injs = sorted(injections, key=lambda i: i.time)
    out: list[Reconfiguration] = []
    for i, inj in enumerate(injs):
        until = injs[i + 1].time if i + 1 < len(injs) else float("inf")
        out.append(_one(inj, until, changes, points))
    return out
