"""CPU test scaffolding: plans whose ranks share one CPU host's cores, replayed together.

Only the CPU end-to-end check (``benchmarks/simulator_vs_cpu.py``) uses this module, to compare
the simulator with plans run on this machine; the GPU path of :func:`~sailor.simulator.simulate`
never reads it. Its entry point, :func:`simulate_on_shared_host`, runs the simulator with a
:class:`SharedHost` (``simulate_with_timeline(..., ranks=SharedHost(profiles, plan))`` for the
replay's timeline): a :class:`~sailor.simulator.rank_timing.RankTiming` of ranks sharing the
host, as the profile's :class:`~sailor.schemas.profile.HostSharing` for their device measured
it (:mod:`sailor.profiler.cpu_host`); without such an entry each rank keeps a device of its
own, and a note says so.

On GPUs every rank owns its device, and :func:`~sailor.simulator.pipeline.replay_1f1b` replays
each pipeline on its own. Ranks started together on one CPU host (``launch_local``: the
1-4 ranks of a plan on this machine) share the host's cores, and two effects of that sharing
decide their step time (``docs/simulator-model.md``, "Ranks sharing a host"):

* **Processor sharing.** While ``n`` ranks compute at once, each computes at
  ``1 / slowdown(n)`` of its speed alone. ``slowdown`` is measured by the profiler with ``n``
  copies of the model's own layers running together (``sailor.profiler.cpu_host.sharing``); it is
  about 1 while ``n`` fits the cores and grows past them.
* **Wake-up.** A rank blocked on a receive whose message arrives while at least ``cores``
  ranks compute is not run at once: it waits for the scheduler to give it a core, ``wake_s``
  on average (measured by a ping-pong under load). A rank that is computing when its message
  arrives needs no wake-up, nor does one woken on a free core.
* **Bound ranks** (``host.pinned``: the profile was measured, and the plan is run, with
  global rank ``g`` bound to core ``g % cores``). Each core is shared by the computing ranks
  bound to it: a rank runs ``k`` times slower than alone while ``k`` ranks compute on its core
  (a TP stage: its most loaded core), times what is left of the measured factor once the fair
  share of its measurement is taken out (:func:`residual`: for bound ranks the profiler
  measures each rank's own compute time, whose mean over ranks ``0..n-1`` is that residual
  times their mean per-core share, :func:`fair_share`).
* **Rendezvous.** A receive posted after its message was sent waits for the hand-over: the
  backend (gloo) sends an unmatched message only when the receiver asks for it, and the
  sender's communication thread must run to write it. ``rendezvous_s`` on average with a core
  free, ``rendezvous_busy_s`` while at least ``cores`` ranks compute (both measured by the
  profiler with the model's layers). A receive posted first pays only the link delay.

Every pipeline of the plan is replayed at once, in event order: a computing rank's remaining
work drains at the rate set by how many ranks compute (a stage of TP degree ``t`` counts as
``t`` ranks). The order of operations on each stage is 1F1B's, as in the replay of one
pipeline, so with ``slowdown = 1`` and no wake-up or rendezvous delay the answer is that
replay's.

Pure: no I/O, no clock. Must never be imported by the GPU path (simulate, planner).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from sailor.schemas import (
    Calibration,
    Estimate,
    GPUSpec,
    ModelSpec,
    NetworkProfile,
    Pipeline,
    Plan,
    PriceTable,
    ProfileDB,
)
from sailor.schemas.profile import HostSharing
from sailor.simulator.network_model import AllReduce
from sailor.simulator.pipeline import PipelineRun, TimelineOp, one_f_one_b_order
from sailor.simulator.pipeline_kinds import PipelineKind
from sailor.simulator.rank_timing import Method, OwnDevices, PipelineRuns
from sailor.simulator.sim_inputs import Notes
from sailor.simulator.simulate import simulate

__all__ = [
    "SharedHost",
    "SharedPipe",
    "fair_share",
    "replay_shared",
    "residual",
    "simulate_on_shared_host",
    "slowest",
]

_EPS = 1e-12
_ARRIVE, _START = 0, 1  # event kinds


@dataclass(frozen=True)
class SharedPipe:
    """One pipeline's per-microbatch F and B per stage, link delays, microbatches, TP."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    delay: tuple[float, ...]
    m: int
    tp: tuple[int, ...]


_Key = tuple[Literal["F", "B"], int]


def fair_share(n: int, cores: int) -> float:
    """Mean over ranks ``0..n-1`` bound round robin of how many of them share its core."""
    if n <= 0:
        return 1.0
    per_core = [len(range(c, n, cores)) for c in range(min(n, cores))]
    return sum(k * k for k in per_core) / n


def residual(host: HostSharing, n: int) -> float:
    """Bound ranks: the measured slowdown of ``n`` ranks at once over their fair per-core
    share, i.e. what sharing the host costs beyond sharing a core (caches, memory, the
    backend's threads). Unbound ranks: the slowdown itself."""
    if not host.pinned:
        return host.factor(n)
    return host.factor(n) / fair_share(n, host.cores) if n > 0 else 1.0


def slowest(host: HostSharing, n: int) -> float:
    """How many times slower than alone the slowest of ``n`` ranks computing at once runs
    (bound: the ``ceil(n / cores)`` ranks of the most shared core)."""
    if not host.pinned:
        return host.factor(n)
    return residual(host, n) * -(-n // host.cores) if n > 0 else 1.0


def replay_shared(
    pipes: Sequence[SharedPipe], host: HostSharing, *, record: bool = False
) -> list[PipelineRun]:
    """Replay every pipeline at once on one shared host (its measured
    :class:`~sailor.schemas.profile.HostSharing`); one :class:`PipelineRun` each."""
    for pi, p in enumerate(pipes):
        if not p.f or len(p.f) != len(p.b) or len(p.tp) != len(p.f):
            raise ValueError(f"pipeline {pi}: F, B and TP need one entry per stage")
        if len(p.delay) != len(p.f) - 1:
            raise ValueError(f"pipeline {pi}: {len(p.delay)} delays for {len(p.f)} stages")
        if p.m < 1:
            raise ValueError(f"pipeline {pi}: m={p.m}: need at least one microbatch")
    replay = _SharedReplay(pipes, host, record)
    replay.run()
    return replay.pipeline_runs()


class _SharedReplay:
    """One replay in progress: each rank's 1F1B order and position in it, what it computes
    or waits for, the messages that reached it, and the queue of events (arrivals, and
    delayed starts after a wake-up or a hand-over)."""

    def __init__(self, pipes: Sequence[SharedPipe], host: HostSharing, record: bool) -> None:
        self.pipes, self.host, self.record = pipes, host, record
        self.ranks = [(pi, s) for pi, p in enumerate(pipes) for s in range(len(p.f))]
        self.index = {r: i for i, r in enumerate(self.ranks)}
        # bound ranks (host.pinned): global rank g runs on core g % cores; a stage of TP
        # degree t is t consecutive global ranks (Plan.ranks order: pipeline, stage, TP rank)
        self.cores_of: list[tuple[int, ...]] = []
        g = 0
        for pi, s in self.ranks:
            width = pipes[pi].tp[s]
            self.cores_of.append(tuple((g + j) % host.cores for j in range(width)))
            g += width
        self.orders = [one_f_one_b_order(len(pipes[pi].f), s, pipes[pi].m) for pi, s in self.ranks]
        self.weight = [pipes[pi].tp[s] for pi, s in self.ranks]
        n = len(self.ranks)
        self.ptr = [0] * n
        self.arrived: list[dict[_Key, float]] = [{} for _ in range(n)]  # message arrival times
        self.waiting: list[_Key | None] = [None] * n  # what a blocked rank waits for
        self.running: dict[int, float] = {}  # rank -> remaining work (seconds alone)
        self.started: dict[int, float] = {}
        self.end = [0.0] * n
        self.ops: list[TimelineOp] = []
        self.events: list[
            tuple[float, int, int, int, _Key | None]
        ] = []  # (t, seq, kind, rank, key)
        self.seq = 0
        self.busy = 0  # ranks computing, weighted by TP
        self.t = 0.0
        self.remaining = sum(len(o) for o in self.orders)

    def run(self) -> None:
        """Advance time from event to event (a message lands, a delayed start, a rank's
        operation done) until every operation has run."""
        for r in range(len(self.ranks)):
            self.advance(r, 0.0)
        running = self.running
        while self.remaining:
            slow = self.slowness()
            t = self.t
            t_done = min((t + w * slow[r] for r, w in running.items()), default=float("inf"))
            t_event = self.events[0][0] if self.events else float("inf")
            t_next = min(t_done, t_event)
            if t_next == float("inf"):
                raise RuntimeError(
                    f"shared-host replay stalled with {self.remaining} operations left"
                )
            for r in running:
                running[r] -= (t_next - t) / slow[r]
            self.t = t_next
            if t_event <= t_done:
                self.on_event()
            else:
                self.finish(
                    [r for r, w in running.items() if w * slow[r] <= _EPS * max(1.0, t_next)]
                )

    def on_event(self) -> None:
        """The next event: a delayed start, or a message landing (which wakes its receiver
        if it waits for it, after the wake-up delay while the host is crowded)."""
        t = self.t
        _, _, kind, r, key = heapq.heappop(self.events)
        if kind == _START:
            self.start(r, t)
        elif key is not None:
            self.arrived[r][key] = t
            if self.waiting[r] == key:
                self.waiting[r] = None
                delay = self.host.wake_s if self.crowded(r) else 0.0
                if delay > 0:
                    self.push(t + delay, _START, r, None)
                else:
                    self.start(r, t)

    def finish(self, done: list[int]) -> None:
        """Ranks ``done`` end their operation now: send its output on, move on to the next."""
        t = self.t
        for r in done:
            del self.running[r]
            self.busy -= self.weight[r]
            kind_op, i = self.orders[r][self.ptr[r]]
            pi, s = self.ranks[r]
            p = self.pipes[pi]
            self.end[r] = t
            if self.record:
                self.ops.append(TimelineOp(pi, s, i, kind_op, self.started[r], t))
            if kind_op == "F" and s < len(p.f) - 1:
                self.push(t + p.delay[s], _ARRIVE, self.index[(pi, s + 1)], ("F", i))
            elif kind_op == "B" and s > 0:
                self.push(t + p.delay[s - 1], _ARRIVE, self.index[(pi, s - 1)], ("B", i))
            self.ptr[r] += 1
            self.remaining -= 1
        for r in done:
            self.advance(r, t)

    def work(self, r: int) -> float:
        kind, _ = self.orders[r][self.ptr[r]]
        pi, s = self.ranks[r]
        return self.pipes[pi].f[s] if kind == "F" else self.pipes[pi].b[s]

    def need(self, r: int) -> _Key | None:
        """The message the next operation of rank ``r`` waits for (None: none)."""
        kind, i = self.orders[r][self.ptr[r]]
        pi, s = self.ranks[r]
        if kind == "F":
            return ("F", i) if s > 0 else None
        return ("B", i) if s < len(self.pipes[pi].f) - 1 else None

    def start(self, r: int, now: float) -> None:
        self.running[r] = self.work(r)
        self.started[r] = now
        self.busy += self.weight[r]

    def push(self, when: float, kind: int, r: int, key: _Key | None) -> None:
        heapq.heappush(self.events, (when, self.seq, kind, r, key))
        self.seq += 1

    def advance(self, r: int, now: float) -> None:
        """Rank ``r`` is awake at ``now`` with its next operation to run, if any."""
        if self.ptr[r] >= len(self.orders[r]):
            return
        key = self.need(r)
        if key is None:
            self.start(r, now)
            return
        landed = self.arrived[r].get(key)
        if landed is None or landed > now:
            self.waiting[r] = key
            return
        # the message was sent before this receive was posted: the backend hands it over
        # only now that the receiver asks for it (rendezvous)
        pi, si = self.ranks[r]
        sender = self.index[(pi, si - 1 if key[0] == "F" else si + 1)]
        host = self.host
        hand = host.rendezvous_busy_s if self.crowded(sender) else host.rendezvous_s
        if hand > 0:
            self.push(now + hand, _START, r, None)
        else:
            self.start(r, now)

    def crowded(self, r: int) -> bool:
        """Whether rank ``r`` would wait for a core now: every core busy (unbound ranks), or
        a rank computing on one of its own cores (bound ranks)."""
        if not self.host.pinned:
            return self.busy >= self.host.cores
        mine = set(self.cores_of[r])
        return any(mine.intersection(self.cores_of[o]) for o in self.running)

    def slowness(self) -> dict[int, float]:
        """How many times slower than alone each computing rank runs now."""
        host, running = self.host, self.running
        if not host.pinned:
            f = host.factor(self.busy)
            return dict.fromkeys(running, f)
        load: dict[int, int] = {}
        for r in running:
            for c in self.cores_of[r]:
                load[c] = load.get(c, 0) + 1
        rest = residual(host, self.busy)
        return {r: rest * max(load[c] for c in self.cores_of[r]) for r in running}

    def pipeline_runs(self) -> list[PipelineRun]:
        """One :class:`PipelineRun` per pipeline: its stages' ends and (recorded) ops."""
        out: list[PipelineRun] = []
        for pi, p in enumerate(self.pipes):
            stage_end = tuple(self.end[self.index[(pi, s)]] for s in range(len(p.f)))
            mine = tuple(op for op in self.ops if op.pipeline == pi)
            out.append(PipelineRun(end_s=max(stage_end), stage_end_s=stage_end, ops=mine))
        return out


def simulate_on_shared_host(
    plan: Plan,
    model: ModelSpec,
    profiles: ProfileDB,
    network: NetworkProfile,
    prices: PriceTable,
    *,
    calibration: Calibration | None = None,
    gpu_specs: Mapping[str, GPUSpec] | None = None,
    method: Method = "closed_form",
    spot: bool = False,
) -> Estimate:
    """:func:`~sailor.simulator.simulate` for a plan whose ranks all run on one host (CPU
    ranks started together, as ``launch_local`` does) and share its cores. With the replay's
    timeline: :func:`~sailor.simulator.simulate_with_timeline` with
    ``ranks=SharedHost(profiles, plan)``."""
    ranks = SharedHost(profiles, plan)
    return simulate(
        plan,
        model,
        profiles,
        network,
        prices,
        calibration=calibration,
        gpu_specs=gpu_specs,
        method=method,
        spot=spot,
        ranks=ranks,
    )


@dataclass
class SharedHost:
    """:class:`~sailor.simulator.rank_timing.RankTiming` of a plan's ranks on one shared host.

    The host's measured sharing is looked up when the pipelines run (its note follows the
    pipelines' own); without one, every step is :class:`OwnDevices`'. One object per
    simulation: it remembers which stages' last act was an all-reduce.
    """

    profiles: ProfileDB
    plan: Plan
    host: HostSharing | None = None
    warm: set[tuple[int, int]] = field(default_factory=set)
    """Stages whose last act was a gradient all-reduce (of some time)."""

    def run_pipelines(
        self,
        pipelines: Sequence[Pipeline],
        kinds: Sequence[PipelineKind],
        method: Method,
        timeline: bool,
        notes: Notes,
    ) -> PipelineRuns:
        self.host = _host_model(self.profiles, self.plan, notes)
        if self.host is None:
            return OwnDevices().run_pipelines(pipelines, kinds, method, timeline, notes)
        if method != "replay":
            notes.add("ranks share one host: pipelines replayed together (no closed form)")
        out = PipelineRuns([], [], [])
        pipes = [
            SharedPipe(
                f=k.fs,
                b=k.bs,
                delay=k.delay or tuple(0.0 for _ in k.fs[1:]),
                m=p.num_microbatches,
                tp=tuple(s.replica.tp for s in p.stages),
            )
            for p, k in zip(pipelines, kinds, strict=True)
        ]
        for prun in replay_shared(pipes, self.host, record=timeline):
            out.end_s.append(prun.end_s)
            out.stage_end_s.append(prun.stage_end_s)
            out.ops.extend(prun.ops)
        return out

    def end_slowdown(self, pipelines: Sequence[Pipeline]) -> float:
        # every rank's end of iteration and optimizer step run at about the same time (after
        # the pipelines drain), at the slowdown of all of them computing
        if self.host is None:
            return 1.0
        return slowest(self.host, sum(s.replica.tp for p in pipelines for s in p.stages))

    def grad_allreduce_s(
        self,
        ar: AllReduce,
        holders: Sequence[tuple[int, int]],
        node_bytes: float,
        *,
        chains: bool,
    ) -> float:
        # how long an all-reduce takes depends on what its ranks did just before
        # (computing, another all-reduce)
        after: Literal["compute", "allreduce"] = (
            "allreduce" if self.warm.issuperset(holders) else "compute"
        )
        took = _host_allreduce(self.host, ar, len(holders), node_bytes, after)
        if chains and ar.time_s > 0:
            self.warm.update(holders)
        return took

    def loss_allreduce_s(self, ar: AllReduce, ranks: int, node_bytes: float) -> float:
        return _host_allreduce(self.host, ar, ranks, node_bytes, "update")


def _host_allreduce(
    host: HostSharing | None,
    ar: AllReduce,
    n: int,
    node_bytes: float,
    after: Literal["compute", "allreduce", "update"],
) -> float:
    """Time of all-reduce ``ar`` among ``n`` ranks entered right after ``after``.

    On a device of its own per rank, the modelled ring. On a shared host whose profile timed
    the engine's all-reduces as it enters them (``HostSharing.allreduce_after_*``): that
    measured time (its latency and the bandwidth time of the probe's bytes), plus the ring's
    bandwidth time for the bytes beyond those. Older host profiles: the ring, plus the
    measured wake-up of the backend's threads on a collective entered after computing.
    """
    if host is None or ar.time_s <= 0:
        return ar.time_s
    if host.measures_allreduce_entries:
        moving = ar.time_s - ar.latency_s
        beyond = max(0.0, 1.0 - host.allreduce_probe_bytes / node_bytes) if node_bytes else 0.0
        return host.allreduce_entry_s(after, n) + moving * beyond
    return ar.time_s + (host.collective_wake_s if after != "allreduce" else 0.0)


def _host_model(profiles: ProfileDB, plan: Plan, notes: Notes) -> HostSharing | None:
    """The measured sharing of the one host all of ``plan``'s ranks run on, if known."""
    kinds = sorted({s.replica.gpu_type for p in plan.pipelines for s in p.stages})
    hs = profiles.host_sharing(kinds[0]) if len(kinds) == 1 else None
    if hs is None:
        notes.add(
            f"shared host: no host-sharing profile for {'/'.join(kinds)}; each rank is "
            "simulated on a device of its own"
        )
        return None
    notes.add(
        f"ranks share one host of {hs.cores} cores (slowdown "
        + "/".join(f"{x:.2f}" for x in hs.slowdown)
        + f", wake-up {hs.wake_s * 1e3:.2f} ms, rendezvous {hs.rendezvous_s * 1e3:.2f}/"
        f"{hs.rendezvous_busy_s * 1e3:.2f} ms, "
        + (
            "2-rank all-reduce after compute / all-reduce / update "
            f"{hs.allreduce_entry_s('compute', 2) * 1e3:.2f}/"
            f"{hs.allreduce_entry_s('allreduce', 2) * 1e3:.2f}/"
            f"{hs.allreduce_entry_s('update', 2) * 1e3:.2f} ms"
            if hs.measures_allreduce_entries
            else f"collective wake-up {hs.collective_wake_s * 1e3:.2f} ms"
        )
        + f"{', ranks bound to cores' if hs.pinned else ''})"
    )
    return hs
