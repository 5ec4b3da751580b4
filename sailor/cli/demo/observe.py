"""What the demo shows, read from where the runtime writes it: etcd, progress files, audit.

- etcd (through :mod:`sailor.coordination`, read-only): the leader's ``desired`` state
  (phase, generation, plan, placement) and each agent's node and status.
- Workers' progress files ``agents/<node>/gen-<g>/progress-<rank>.jsonl``: one record per
  step with its loss (on the ranks that hold the last stage), samples/s and wall time.
- The controller's audit log: phase changes, commits.

Must never write anything: the demo observes the run as an operator would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sailor.coordination import EtcdStore, Keys, connect_etcd
from sailor.coordination.security import SecurityConfig
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.json_text import load_json
from sailor.schemas.plan import Plan
from sailor.schemas.runtime import AgentStatus, DesiredState

__all__ = ["ClusterView", "NodeRow", "StateReader", "StepPoint", "StepReader", "plan_summary"]


@dataclass(frozen=True)
class NodeRow:
    node: str
    gpu: str
    zone: str
    state: str
    step: int
    loss: float | None
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ClusterView:
    """One reading of etcd."""

    phase: str = "—"
    generation: int = -1
    plan: str = "—"
    cause: str = ""
    load_step: int = -1
    nodes: tuple[NodeRow, ...] = ()
    """Registered nodes (one whose lease expired is gone, even while the layout uses it)."""
    placement: tuple[str, ...] = ()
    """The nodes the desired layout uses, registered or not."""


@dataclass(frozen=True)
class StepPoint:
    """One training step of one generation, as its loss-holding rank recorded it."""

    generation: int
    step: int
    loss: float
    samples_per_s: float
    time: float


def plan_summary(plan: Plan | None, placement: dict[str, tuple[int, ...]]) -> str:
    """``3 stages 0-1|2-3|4-5 on n1,n2,n3`` / ``DP 2 × 0-5 on n2,n3`` / ``DP 2 × layers 0-5
    (8 + 4 samples) on n2,n3`` (replicas with different shares of the batch)."""
    if plan is None:
        return "—"
    pipes = ["|".join(f"{s.first_layer}-{s.last_layer}" for s in p.stages) for p in plan.pipelines]
    shape = pipes[0] if len(set(pipes)) == 1 else " + ".join(pipes)
    dp = f"DP {len(pipes)} × " if len(pipes) > 1 else ""
    stages = len(plan.pipelines[0].stages)
    pp = f"{stages} stages " if stages > 1 else ""
    samples = [p.microbatch_size * p.num_microbatches for p in plan.pipelines]
    share = f" ({' + '.join(map(str, samples))} samples)" if len(set(samples)) > 1 else ""
    on = ",".join(sorted(placement))
    return f"{dp}{pp}layers {shape}{share} on {on}"


class StateReader:
    """Reads ``desired``, nodes and statuses of the demo job from etcd over one connection."""

    def __init__(
        self, endpoint: str | Sequence[str], job: str, security: SecurityConfig | None = None
    ) -> None:
        self.endpoint = endpoint
        self.security = security
        self.keys = Keys(job=job)
        self._store: EtcdStore | None = None

    async def read(self) -> ClusterView:
        if self._store is None:
            self._store = await connect_etcd(self.endpoint, security=self.security)
        s = self._store
        desired_kv = await s.get(self.keys.desired)
        node_kvs = await s.get_prefix(self.keys.nodes)
        status_kvs = await s.get_prefix(self.keys.statuses)
        d: DesiredState | None = None
        if desired_kv is not None:
            with contextlib.suppress(ValidationError):
                d = DesiredState.model_validate_json(desired_kv.value)
        st: dict[str, AgentStatus] = {}
        for kv in status_kvs:
            with contextlib.suppress(ValidationError):
                a = AgentStatus.model_validate_json(kv.value)
                st[a.node_id] = a
        rows: list[NodeRow] = []
        placement = d.placement if d else {}
        for kv in node_kvs:
            with contextlib.suppress(ValidationError):
                n = NodeSpec.model_validate_json(kv.value)
                a2 = st.get(n.node_id)
                rows.append(
                    NodeRow(
                        node=n.node_id,
                        gpu=n.gpu_type,
                        zone=n.zone,
                        state=a2.state if a2 else "?",
                        step=a2.step if a2 else -1,
                        loss=a2.loss if a2 else None,
                        ranks=tuple(placement.get(n.node_id, ())),
                    )
                )
        if d is None:
            return ClusterView(nodes=tuple(rows))
        return ClusterView(
            phase=d.phase.value,
            generation=d.generation,
            plan=plan_summary(d.plan, dict(d.placement)),
            cause=d.cause,
            load_step=d.load_step,
            nodes=tuple(sorted(rows, key=lambda r: r.node)),
            placement=tuple(sorted(d.placement)),
        )

    async def close(self) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):
                await self._store.close()
            self._store = None


@dataclass
class StepReader:
    """Incremental reader of every worker's progress file under ``agents_dir``."""

    agents_dir: Path
    points: dict[tuple[int, int], StepPoint] = field(default_factory=dict)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def poll(self) -> None:
        for f in sorted(self.agents_dir.glob("*/gen-*/progress-*.jsonl")):
            gen = int(f.parent.name.split("-")[1])
            try:
                with f.open("rb") as fh:
                    fh.seek(self._offsets.get(f, 0))
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            self._offsets[f] = self._offsets.get(f, 0) + end
            for line in data[:end].splitlines():
                self._add(gen, line)

    def _add(self, gen: int, line: bytes) -> None:
        try:
            rec: dict[str, Any] = load_json(line, "a worker's log line")
        except ValueError:
            return
        if rec.get("event") != "step" or rec.get("loss") is None:
            return
        key = (gen, int(rec["step"]))
        if key not in self.points:
            self.points[key] = StepPoint(
                generation=gen,
                step=int(rec["step"]),
                loss=float(rec["loss"]),
                samples_per_s=float(rec.get("samples_per_s") or 0.0),
                time=float(rec["time"]),
            )

    def series(self) -> list[StepPoint]:
        """Every recorded step in time order."""
        return sorted(self.points.values(), key=lambda p: p.time)

    def latest(self) -> StepPoint | None:
        return max(self.points.values(), key=lambda p: p.time, default=None)
