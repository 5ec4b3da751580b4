"""1F1B replay of pipelines whose ranks share one host's cores.

On GPUs every rank owns its device, and :func:`~sailor.simulator.pipeline.replay_1f1b` replays
each pipeline on its own. Ranks started together on one CPU host (``launch_local``: the
1-4 ranks of a plan on this machine) share the host's cores, and two effects of that sharing
decide their step time (``docs/simulator-model.md``, "Ranks sharing a host"):

* **Processor sharing.** While ``n`` ranks compute at once, each computes at
  ``1 / slowdown(n)`` of its speed alone. ``slowdown`` is measured by the profiler with ``n``
  copies of the model's own layers running together (``sailor.profiler.host_sharing``); it is
  about 1 while ``n`` fits the cores and grows past them.
* **Wake-up.** A rank blocked on a receive whose message arrives while at least ``cores``
  ranks compute is not run at once: it waits for the scheduler to give it a core, ``wake_s``
  on average (measured by a ping-pong under load). A rank that is computing when its message
  arrives needs no wake-up, nor does one woken on a free core.
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

Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sailor.schemas.profile import HostSharing
from sailor.simulator.pipeline import PipelineRun, TimelineOp, one_f_one_b_order

__all__ = ["SharedPipe", "replay_shared"]

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


def replay_shared(
    pipes: Sequence[SharedPipe], host: HostSharing, *, record: bool = False
) -> list[PipelineRun]:
    """Replay every pipeline at once on one shared host (its measured
    :class:`~sailor.schemas.profile.HostSharing`); one :class:`PipelineRun` each."""
    ranks: list[tuple[int, int]] = [(pi, s) for pi, p in enumerate(pipes) for s in range(len(p.f))]
    for pi, p in enumerate(pipes):
        if not p.f or len(p.f) != len(p.b) or len(p.tp) != len(p.f):
            raise ValueError(f"pipeline {pi}: F, B and TP need one entry per stage")
        if len(p.delay) != len(p.f) - 1:
            raise ValueError(f"pipeline {pi}: {len(p.delay)} delays for {len(p.f)} stages")
        if p.m < 1:
            raise ValueError(f"pipeline {pi}: m={p.m}: need at least one microbatch")
    index = {r: i for i, r in enumerate(ranks)}
    orders = [one_f_one_b_order(len(pipes[pi].f), s, pipes[pi].m) for pi, s in ranks]
    weight = [pipes[pi].tp[s] for pi, s in ranks]
    ptr = [0] * len(ranks)
    arrived: list[dict[_Key, float]] = [{} for _ in ranks]  # message arrival times
    waiting: list[_Key | None] = [None] * len(ranks)  # what a blocked rank waits for
    running: dict[int, float] = {}  # rank -> remaining work (seconds alone)
    started: dict[int, float] = {}
    end = [0.0] * len(ranks)
    ops: list[TimelineOp] = []
    events: list[tuple[float, int, int, int, _Key | None]] = []  # (t, seq, kind, rank, key)
    seq = 0
    busy = 0  # ranks computing, weighted by TP
    t = 0.0
    remaining = sum(len(o) for o in orders)

    def work(r: int) -> float:
        kind, _ = orders[r][ptr[r]]
        pi, s = ranks[r]
        return pipes[pi].f[s] if kind == "F" else pipes[pi].b[s]

    def need(r: int) -> _Key | None:
        """The message the next operation of rank ``r`` waits for (None: none)."""
        kind, i = orders[r][ptr[r]]
        pi, s = ranks[r]
        if kind == "F":
            return ("F", i) if s > 0 else None
        return ("B", i) if s < len(pipes[pi].f) - 1 else None

    def start(r: int, now: float) -> None:
        nonlocal busy
        running[r] = work(r)
        started[r] = now
        busy += weight[r]

    def push(when: float, kind: int, r: int, key: _Key | None) -> None:
        nonlocal seq
        heapq.heappush(events, (when, seq, kind, r, key))
        seq += 1

    def advance(r: int, now: float) -> None:
        """Rank ``r`` is awake at ``now`` with its next operation to run, if any."""
        if ptr[r] >= len(orders[r]):
            return
        key = need(r)
        if key is None:
            start(r, now)
            return
        landed = arrived[r].get(key)
        if landed is None or landed > now:
            waiting[r] = key
            return
        # the message was sent before this receive was posted: the backend hands it over
        # only now that the receiver asks for it (rendezvous)
        hand = host.rendezvous_busy_s if busy >= host.cores else host.rendezvous_s
        if hand > 0:
            push(now + hand, _START, r, None)
        else:
            start(r, now)

    for r in range(len(ranks)):
        advance(r, 0.0)
    while remaining:
        rate = host.factor(busy)
        t_done = min((t + w * rate for w in running.values()), default=float("inf"))
        t_event = events[0][0] if events else float("inf")
        t_next = min(t_done, t_event)
        if t_next == float("inf"):
            raise RuntimeError(f"shared-host replay stalled with {remaining} operations left")
        for r in running:
            running[r] -= (t_next - t) / rate
        t = t_next
        if t_event <= t_done:
            _, _, kind, r, key = heapq.heappop(events)
            if kind == _START:
                start(r, t)
            elif key is not None:
                arrived[r][key] = t
                if waiting[r] == key:
                    waiting[r] = None
                    delay = host.wake_s if busy >= host.cores else 0.0
                    if delay > 0:
                        push(t + delay, _START, r, None)
                    else:
                        start(r, t)
            continue
        done = [r for r, w in running.items() if w * rate <= _EPS * max(1.0, t)]
        for r in done:
            del running[r]
            busy -= weight[r]
            kind_op, i = orders[r][ptr[r]]
            pi, s = ranks[r]
            p = pipes[pi]
            end[r] = t
            if record:
                ops.append(TimelineOp(pi, s, i, kind_op, started[r], t))
            if kind_op == "F" and s < len(p.f) - 1:
                push(t + p.delay[s], _ARRIVE, index[(pi, s + 1)], ("F", i))
            elif kind_op == "B" and s > 0:
                push(t + p.delay[s - 1], _ARRIVE, index[(pi, s - 1)], ("B", i))
            ptr[r] += 1
            remaining -= 1
        for r in done:
            advance(r, t)
    out: list[PipelineRun] = []
    for pi, p in enumerate(pipes):
        stage_end = tuple(end[index[(pi, s)]] for s in range(len(p.f)))
        mine = tuple(op for op in ops if op.pipeline == pi)
        out.append(PipelineRun(end_s=max(stage_end), stage_end_s=stage_end, ops=mine))
    return out
