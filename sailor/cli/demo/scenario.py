"""The demo's script: start the nodes, train, preempt one, lose one, add one; watch it.

1. ``initial_nodes`` agents register (n1…); then the controller starts and plans for all
   of them (so the first layout already uses every node).
2. After ``steps_between`` steps: a spot-preemption notice for n1 (``notice_s`` ahead)
   through its file watcher → checkpoint inside the deadline → new layout without n1; n1's
   agent is then stopped, as its VM would be.
3. After ``steps_between`` steps: n2's agent and its workers are SIGKILLed (no notice) →
   its lease expires → abort → relaunch from the newest commit on the survivors.
4. After ``steps_between`` steps: a new agent joins → replan → resume with it.
5. Train ``steps_between`` more steps.

Each wait has a timeout (``phase_timeout_s``); the live view is refreshed from etcd and the
progress files while waiting. Must never clean up: :mod:`sailor.cli.demo.run` owns that.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import RenderableType

from sailor.cli.demo.cluster import DemoCluster
from sailor.cli.demo.live import render
from sailor.cli.demo.observe import ClusterView, StateReader, StepReader
from sailor.cli.demo.plot import throughput_series
from sailor.cli.demo.reconfig import Injection
from sailor.localservers import ADMIN

__all__ = ["DemoSettings", "DemoTimeoutError", "Driver", "Scenario", "stuck_note"]


class DemoTimeoutError(RuntimeError):
    """The cluster did not reach the expected state in time (not retried)."""


@dataclass(frozen=True)
class DemoSettings:
    initial_nodes: int = 3
    steps_between: int = 30
    min_step_s: float = 0.05
    notice_s: float = 20.0
    global_batch_size: int = 4
    phase_timeout_s: float = 90.0
    poll_s: float = 0.25
    in_place: bool = True
    """Reconfigure in place (the workers survive); False: restart them (the older path)."""

    def __post_init__(self) -> None:
        if self.initial_nodes < 3:
            raise ValueError(f"initial_nodes={self.initial_nodes}: the demo needs >= 3")
        if self.steps_between < 1:
            raise ValueError(f"steps_between={self.steps_between}: must be >= 1")
        if not 2.0 < self.notice_s < math.inf:  # nan fails too (it compares False)
            raise ValueError(
                f"notice_s={self.notice_s}: a finite deadline long enough to checkpoint (> 2 s)"
            )
        if not 0 < self.phase_timeout_s < math.inf:  # -1 started the cluster to time out
            raise ValueError(f"phase_timeout_s={self.phase_timeout_s}: must be finite and > 0")
        if not 0 <= self.min_step_s < math.inf:
            raise ValueError(f"min_step_s={self.min_step_s}: must be finite and >= 0")
        if not 0 < self.poll_s < math.inf:
            raise ValueError(f"poll_s={self.poll_s}: must be finite and > 0")


STALE_VIEW_S = 2.0
"""A view of etcd older than this when a wait runs out is said to be old in its error."""


def stuck_note(
    view: ClusterView,
    records: Sequence[dict[str, Any]],
    view_age_s: float = 0.0,
    read_error: str = "",
    exited: Sequence[tuple[str, int]] = (),
) -> str:
    """What the cluster was doing when a wait ran out, for its error: the desired state's
    phase, generation and cause, each registered node's state, and the nodes the controller
    last left out of every layout (the audit's newest ``not_admitted`` record: another
    Sailor release, say, which a node started from a checkout edited since the others
    runs), with why. A failed run's one line then says what it waited on.

    Also, so that "never registered" can be told from "not seen": how old the view of etcd
    is when older than :data:`STALE_VIEW_S` (``view_age_s``; reads that kept failing, with
    the last one's ``read_error``), and the demo's processes that had exited, with their
    exit codes (``exited``: a joining agent that died is not one that is slow)."""
    cause = f" ({view.cause[:200]})" if view.cause else ""
    parts = [f"desired: {view.phase}, generation {view.generation}{cause}"]
    nodes = ", ".join(f"{r.node} {r.state}" for r in view.nodes)
    parts.append(f"nodes: {nodes or 'none registered'}")
    if view_age_s > STALE_VIEW_S:
        failed = f"; last read failed: {read_error[:300]}" if read_error else ""
        parts.append(f"view of etcd {view_age_s:.0f} s old{failed}")
    if exited:
        parts.append("exited: " + ", ".join(f"{name} ({code})" for name, code in exited))
    left_out = next((r for r in reversed(records) if r.get("kind") == "not_admitted"), None)
    refused = left_out.get("nodes") if left_out is not None else None
    if isinstance(refused, dict) and refused:
        why = "; ".join(f"{n}: {str(reason)[:300]}" for n, reason in sorted(refused.items()))
        parts.append(f"not admitted: {why}")
    return "; ".join(parts)


@dataclass
class Driver:
    """Waits on the cluster as an operator would (etcd and progress files), and logs injections.

    The demo's script is :class:`Scenario`; the chaos suite (tests/chaos) writes its own
    scripts on this.
    """

    cluster: DemoCluster
    settings: DemoSettings
    show: Callable[[RenderableType], None] | None = None
    say: Callable[[str], None] | None = None
    injections: list[Injection] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    view: ClusterView = field(default_factory=ClusterView)
    t0: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self._read_at = time.monotonic()  # of the last view read from etcd
        self._read_error = ""  # of the last read, if it failed
        self.steps = StepReader(self.cluster.agents_dir)
        srv = self.cluster.servers
        self.state = StateReader(srv.etcd_endpoints, self.cluster.job, srv.security(ADMIN))

    def note(self, text: str) -> None:
        line = f"{time.time() - self.t0:6.1f}s  {text}"
        self.log.append(line)
        if self.say is not None:
            self.say(line)

    async def tick(self) -> None:
        # a failed read (etcd busy on 2 cores) only skips one refresh; a wait that runs out
        # says how old the view is and why (stuck_note)
        try:
            self.view = await self.state.read()
            self._read_at = time.monotonic()
            self._read_error = ""
        except Exception as exc:
            self._read_error = f"{type(exc).__name__}: {exc}"
        self.steps.poll()
        if self.show is not None:
            series = throughput_series(self.steps.series()[-12:], self.settings.global_batch_size)
            thr = series[-1][1] if series else None
            self.show(render(self.view, self.steps.latest(), thr, self.log, time.time() - self.t0))

    async def until(self, ok: Callable[[], bool], what: str) -> None:
        end = time.monotonic() + self.settings.phase_timeout_s
        while True:
            await self.tick()
            if ok():
                return
            if time.monotonic() > end:
                limit = f"{what}: not within {self.settings.phase_timeout_s:.0f} s"
                note = stuck_note(
                    self.view,
                    self._audit(),
                    view_age_s=time.monotonic() - self._read_at,
                    read_error=self._read_error,
                    exited=self._exited(),
                )
                raise DemoTimeoutError(f"{limit}; {note}")
            await asyncio.sleep(self.settings.poll_s)

    def _exited(self) -> list[tuple[str, int]]:
        """The run's processes that have exited, with their exit codes (started order)."""
        return [
            (name, code)
            for name, proc in self.cluster.reg.procs.items()
            if (code := proc.poll()) is not None
        ]

    def _audit(self) -> list[dict[str, Any]]:
        """The controllers' audit records so far ([] if they cannot be read)."""
        from sailor.controller.audit import read_records

        try:
            return read_records(self.cluster.audit_logs())
        except Exception:  # the error it is for must still be raised
            return []

    async def current(self, gen: int) -> int:
        """The generation running now, ``gen`` or a later one: a replan (the online fit's)
        may have relaunched meanwhile, and waiting for a generation after ``gen`` would then
        take that relaunch for the change about to be injected."""
        await self.tick()
        return max(gen, self.view.generation)

    async def running_after(self, gen: int) -> int:
        await self.until(
            lambda: self.view.phase == "running" and self.view.generation > gen,
            f"RUNNING after generation {gen}",
        )
        self.note(f"RUNNING generation {self.view.generation}: {self.view.plan}")
        return self.view.generation

    async def train(self, gen: int, steps: int) -> None:
        start = self.view.load_step if self.view.load_step > 0 else 0

        def reached() -> bool:
            top = max(
                (p.step for p in self.steps.points.values() if p.generation == gen), default=-1
            )
            return top >= start + steps

        await self.until(reached, f"{steps} steps of generation {gen}")

    def _kinds(self, nodes: list[str]) -> str:
        """``n1 cpu-full 0.5 cores, n2 cpu-slow 0.2 cores`` (``cpu`` nodes: ``cpu nodes``)."""
        kinds = self.cluster.kinds
        if not any(n in kinds for n in nodes):
            return "cpu nodes"
        parts = []
        for n in nodes:
            kind, cores = kinds.get(n, ("cpu", None))
            parts.append(f"{n} {kind}" + (f" {cores:g} cores" if cores is not None else ""))
        return ", ".join(parts)

    def inject(self, kind: str, node: str) -> None:
        self.injections.append(Injection(kind=kind, node=node, time=time.time()))


@dataclass
class Scenario(Driver):
    """The demo's script (module docstring)."""

    async def run(self) -> list[Injection]:
        s, c = self.settings, self.cluster
        try:
            names = [f"n{i + 1}" for i in range(s.initial_nodes)]
            for n in names:
                c.start_agent(n)
            self.note(f"agents {', '.join(names)} started ({self._kinds(names)}, zone local-a)")
            await self.until(lambda: len(self.view.nodes) >= len(names), "agents registered")
            self.inject("start", ",".join(names))
            c.start_controller()
            self.note("controller started: plans for the registered nodes")
            gen = await self.running_after(-1)
            await self.train(gen, s.steps_between)

            gen = await self.current(gen)
            self.inject("preemption notice", "n1")
            c.preempt("n1", s.notice_s)
            self.note(f"spot-preemption notice for n1 ({s.notice_s:.0f} s ahead)")
            gen = await self.running_after(gen)
            c.reg.stop(["agent-n1"], grace_s=5.0)
            self.note("n1's VM is gone (agent stopped)")
            await self.train(gen, s.steps_between)

            gen = await self.current(gen)
            self.inject("node lost", "n2")
            c.lose("n2")
            self.note("n2 lost without notice: agent and workers SIGKILLed")
            gen = await self.running_after(gen)
            await self.train(gen, s.steps_between)

            new = f"n{s.initial_nodes + 1}"
            gen = await self.current(gen)
            self.inject("node joined", new)
            c.start_agent(new)
            self.note(f"{new} joins ({self._kinds([new])})")
            gen = await self.running_after(gen)
            await self.train(gen, s.steps_between)
            self.note("done: stopping the cluster")
            return self.injections
        finally:
            await self.state.close()
