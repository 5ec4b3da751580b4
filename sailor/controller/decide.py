"""The controller's pure decision: ``decide(desired, observed, config) -> list[Action]``.

Level-triggered: the decision depends only on the desired state (etcd ``desired``) and the
observed state (registered nodes, agent statuses, preemption notices, committed checkpoints,
acks of this epoch and the time), never on which event woke the loop. So a duplicated, late
or reordered event cannot change what happens, and replaying an audit log's observations
through ``decide`` reproduces the run. No I/O, no clock, no state of its own: the one
module-level value is a memo of the last plan's digest and world size (:func:`_plan_facts`),
a function of that plan object alone. What it must remember across passes it keeps in the
desired state it writes: which checkpoints could not be read (``bad_checkpoints``) and which
nodes keep failing, or whether the job does (``node_health``, ``job_health``: their rules
in ``controller/node_health.py``, what a pass makes of them in
``controller/failing_nodes.py``). An operator's request to forget those records
(``sailor node readmit``) is part of the observed state, and deleted once applied.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, TypeVar

from pydantic import Field

from sailor.controller import failing_nodes
from sailor.controller.node_health import ExclusionPolicy, checkpoint_unreadable, trained
from sailor.controller.phases import PhaseDeadlines, check_transition
from sailor.schemas._base import Frozen
from sailor.schemas.commands import (
    Abort,
    Checkpoint,
    Command,
    Launch,
    Stop,
    plan_digest,
    training_digest,
)
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.plan import Plan
from sailor.schemas.runtime import (
    AgentStatus,
    CommitRecord,
    DesiredState,
    NoticeRecord,
    Phase,
    ReadmitRequest,
)
from sailor.schemas.training import TrainingConfig

__all__ = [
    "Action",
    "ClearNotice",
    "ClearReadmit",
    "Commit",
    "DecideConfig",
    "Observed",
    "RecalibrationAdvice",
    "Replan",
    "Send",
    "SetDesired",
    "decide",
    "prune_below",
    "unusable",
]


class DecideConfig(Frozen):
    """Knobs of the decision."""

    deadlines: PhaseDeadlines = Field(default_factory=PhaseDeadlines, description="Per phase.")
    checkpoint_dir: str = Field(description="Checkpoint root handed to the workers.")
    notice_margin_s: float = Field(
        default=5.0, ge=0, description="Finish the checkpoint this long before a notice deadline."
    )
    stop_ahead_steps: int = Field(
        default=1, ge=1, description="Agreed stop step = highest reported step + this."
    )
    base_port: int = Field(default=29500, gt=0, description="Rendezvous port of generation 0.")
    keep_checkpoints: int | None = Field(
        default=1,
        ge=1,
        description="Recorded checkpoints under ``checkpoint_dir`` a new save leaves in "
        "place; older ones (files and records) are deleted once it commits. None: keep all.",
    )
    in_place: bool = Field(
        default=False,
        description="Launch in place (``Launch.in_place``: the workers survive, hold and "
        "are handed the next generation's ranks) unless the in-place launch of the current "
        "generation failed, which falls back to the restart path once.",
    )
    notice_expiry_s: float = Field(
        default=60.0,
        gt=0,
        description=(
            "A notice is forgotten this long after its deadline, in any phase: a node still "
            "registered then was never reclaimed or came back with the same id (a new VM), and "
            "is usable again. Longer than the agents' registration lease TTL."
        ),
    )
    training: TrainingConfig | None = Field(
        default=None,
        description="Training config every launch hands to the workers (its paths absolute); "
        "a generation keeps the one it was launched with. None: the workers' defaults.",
    )
    exclusion: ExclusionPolicy = Field(
        default_factory=ExclusionPolicy,
        description="When a node whose workers keep failing is left out of the layouts, and "
        "for how long (controller/node_health.py).",
    )


@dataclass(frozen=True)
class RecalibrationAdvice:
    """Online calibration's verdict that another layout pays (``controller/recalibrate.py``,
    audited as a ``replan_decision`` record): the plan to switch to, placed on the nodes it
    was made for, in the generation it was decided in."""

    generation: int
    plan: Plan
    placement: Mapping[str, tuple[int, ...]]
    membership: tuple[str, ...]
    cause: str


@dataclass(frozen=True)
class Observed:
    """What the controller sees, read from etcd (plus acks it received in this epoch, and the
    online-calibration verdict, if one says to reconfigure)."""

    now: float
    nodes: Mapping[str, NodeSpec]
    status: Mapping[str, AgentStatus]
    notices: Mapping[str, NoticeRecord] = field(default_factory=dict)
    commits: tuple[CommitRecord, ...] = ()
    acked: frozenset[str] = frozenset()
    recalibration: RecalibrationAdvice | None = None
    excluded: frozenset[str] = frozenset()
    """Registered nodes no layout may use at ``now`` (:func:`unusable`): ``decide`` derives
    it from the desired state and the statuses itself; the daemon fills it for the other
    readers of ``usable``."""
    readmit: Mapping[str, ReadmitRequest] = field(default_factory=dict)
    """Operators' requests to forget failure records, by request id (``sailor node
    readmit``), not yet applied."""

    @cached_property
    def usable(self) -> tuple[str, ...]:
        """Registered nodes without a notice and not excluded, sorted (once per ``Observed``:
        a pass asks up to three times, ~0.25 ms each at 512 nodes)."""
        return tuple(
            sorted(n for n in self.nodes if n not in self.notices and n not in self.excluded)
        )

    def resumable(self, bad: tuple[int, ...] = ()) -> CommitRecord | None:
        """The newest recorded commit a launch may load: not one a launch failed to read."""
        good = [c for c in self.commits if c.step not in bad]
        return max(good, key=lambda c: c.step) if good else None


@dataclass(frozen=True)
class SetDesired:
    """Write a new desired state (phase change, plan, stop step)."""

    state: DesiredState
    reason: str


@dataclass(frozen=True)
class Send:
    """Send one command and wait (bounded) for its ack."""

    command: Command


@dataclass(frozen=True)
class Replan:
    """Compute the next plan for ``nodes``; the executor writes it into ``next_plan``."""

    nodes: tuple[NodeSpec, ...]
    previous: Plan | None
    cause: str


@dataclass(frozen=True)
class Commit:
    """Record a checkpoint whose shards every node reported durable; then forget the records
    of ``drop`` (steps whose files its committer deleted: ``prune_below``)."""

    record: CommitRecord
    drop: tuple[int, ...] = ()


@dataclass(frozen=True)
class ClearNotice:
    """Forget the notice of a node that is gone, or whose deadline is long past."""

    node_id: str


@dataclass(frozen=True)
class ClearReadmit:
    """Delete an operator's readmit request: the desired state written before it in the
    same actions no longer holds the records it named (or, with ``reason``, why it was
    not applied)."""

    request_id: str
    reason: str = ""


Action = SetDesired | Send | Replan | Commit | ClearNotice | ClearReadmit


def _move(
    d: DesiredState, phase: Phase, now: float, cfg: DecideConfig, **kw: object
) -> DesiredState:
    check_transition(d.phase, phase)
    length = cfg.deadlines.of(phase)
    update: dict[str, object] = {
        "phase": phase,
        "phase_since": now,
        "phase_deadline": now + length if length else 0.0,
        "phase_epoch": d.epoch,
    }
    update.update(kw)
    return d.model_copy(update=update)


def _cid(d: DesiredState, kind: str, node: str, extra: int | str = "") -> str:
    return f"e{d.epoch}-g{d.generation}-{kind}{extra}-{node}"


_C = TypeVar("_C", Stop, Checkpoint, Abort, Launch)


def _command(cls: type[_C], **fields: Any) -> _C:
    """A command built from the desired state's own values, without validating it again.

    Every field is a value of a validated ``DesiredState`` or ``DecideConfig`` (its epoch,
    generation, steps, deadline, node ids of its placement, ranks, the plan's id and digest)
    or a string made of them, so validating each command again re-checked known values:
    at 512 nodes that was ~1 s of the controller's CPU per measured run, 150,000 commands
    built by passes during fan-outs (benchmarks/runtime_decision_latency.py --profile). The
    agent still validates every command it receives (``CommandAdapter``), and
    ``tests/unit/test_controller_decide.py`` checks that each command ``decide`` returns
    validates to itself.
    """
    return cls.model_construct(**fields)


_facts: tuple[weakref.ref[Plan], str, int] | None = None


def _plan_facts(plan: Plan) -> tuple[str, int]:
    """The plan's digest and world size, remembered for the last plan asked about.

    A function of the (frozen) plan only, so ``decide`` stays a function of its inputs: the
    cache holds a weak reference and answers only for that very object. Every LAUNCH pass
    sends the same plan's Launch to its nodes; at 512 nodes recomputing both took ~5 ms a
    pass (the digest serialises a plan of ~350 pipelines).
    """
    global _facts
    hit = _facts
    if hit is not None and hit[0]() is plan:
        return hit[1], hit[2]
    digest, world = plan_digest(plan), plan.num_gpus
    _facts = (weakref.ref(plan), digest, world)
    return digest, world


def _unhealthy(d: DesiredState, o: Observed) -> str:
    """Why the current layout cannot go on ('' if it can)."""
    lost = sorted(n for n in d.placement if n not in o.nodes)
    if lost:
        return f"node lost without notice: {','.join(lost)}"
    failed = failing_nodes.failed(d, o.status)
    if failed:
        # name the node the failure began on, not a peer that failed because of it
        n = failing_nodes.began_on(failed)
        return f"worker failed on {n}: {failed[n][:200]}"
    for n in sorted(d.placement):
        st = o.status.get(n)
        if st is None or st.generation != d.generation:
            continue
        if st.state == "held" and st.failure:
            # in-place workers whose world broke (a peer died) hold instead of exiting
            return f"worker world broke on {n}: {st.failure[:200]}"
    return ""


_LAUNCHING = (Phase.LAUNCH, Phase.LOAD, Phase.VERIFY)


def _in_place_next(d: DesiredState, cfg: DecideConfig) -> bool:
    """Whether the next launch (and the teardown before it) takes the in-place path."""
    return cfg.in_place and not d.in_place_failed


def _unreadable_checkpoint(d: DesiredState, o: Observed) -> bool:
    """Whether a worker of the generation coming up failed because the checkpoint it loads
    is corrupt or gone (its failure record names the reader's error)."""
    if d.phase not in _LAUNCHING or d.load_step < 0:
        return False
    return checkpoint_unreadable(failing_nodes.failed(d, o.status))


def _abort(d: DesiredState, o: Observed, cfg: DecideConfig, cause: str) -> list[Action]:
    # A checkpoint that cannot be read is not loaded again (relaunching from it failed the
    # same way forever): the next launch falls back to the newest other recorded commit.
    bad = d.bad_checkpoints
    if _unreadable_checkpoint(d, o) and d.load_step not in bad:
        bad = (*bad, d.load_step)
        cause = f"checkpoint {d.load_step} unreadable, falling back: {cause}"
    last = o.resumable(bad)
    # A failure while an in-place generation comes up (a worker that cannot rebuild, a peer
    # dying mid-transfer, a deadline) is a failure of the in-place path: fall back once.
    failed_in_place = d.phase in _LAUNCHING and d.path == "in_place"
    # The nodes the failure began on are remembered (or the job, when most failed alike):
    # relaunching on a node that cannot run a rank aborted again, forever
    # (controller/failing_nodes.py).
    counted = failing_nodes.charge_abort(d, o.status, o.now, cfg.exclusion)
    state = _move(
        d,
        Phase.TEARDOWN,
        o.now,
        cfg,
        load_step=last.step if last else -1,
        next_plan=None,
        next_placement={},
        next_membership=(),
        stop_step=-1,
        aborted=True,
        cause=cause,
        in_place_failed=d.in_place_failed or failed_in_place,
        bad_checkpoints=bad,
        **failing_nodes.health_update(counted),
    )
    return [SetDesired(state, "; ".join([f"abort: {cause}", *counted.notes]))]


def _replan_if_needed(d: DesiredState, o: Observed, cause: str) -> list[Action]:
    usable = o.usable
    if not usable:
        return []
    if d.next_plan is not None and d.next_membership == usable:
        return []
    return [Replan(tuple(o.nodes[n] for n in usable), d.plan, cause)]


def _master(
    o: Observed, placement: Mapping[str, tuple[int, ...]], gen: int, cfg: DecideConfig
) -> str:
    first = min(placement, key=lambda n: min(placement[n]))
    addr = o.nodes[first].address if first in o.nodes else ""
    return f"{_host_of(addr) or '127.0.0.1'}:{cfg.base_port + gen % 1000}"


def _host_of(addr: str) -> str:
    """The host of a node's address (``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or a
    bare IPv6 address), an IPv6 one in brackets: ``tcp://fd00::17:29507`` is not a URL."""
    if addr.startswith("["):
        return addr[: addr.index("]") + 1] if "]" in addr else addr
    if addr.count(":") == 1:
        return addr.rsplit(":", 1)[0]
    if addr.count(":") > 1:
        return f"[{addr}]"
    return addr


def _launch(d: DesiredState, o: Observed, cfg: DecideConfig, load_step: int) -> list[Action]:
    plan = d.next_plan
    if plan is None:
        return []
    if any(n not in o.status for n in d.next_placement):
        # A registered node without a status record: its agent has just started, or its
        # lease has just expired and the node key's deletion is still on its way (the two
        # keys' watches report independently). Launching now would abort at once on a loss
        # (and count against the in-place path): wait for the next observation.
        return []
    gen = d.generation + 1
    if _in_place_next(d, cfg):
        path, why = "in_place", "in place (configured)"
    elif cfg.in_place:
        path, why = "restart", f"fallback: the in-place launch of generation {d.generation} failed"
    else:
        path, why = "restart", "restart (in place not configured)"
    state = _move(
        d,
        Phase.LAUNCH,
        o.now,
        cfg,
        generation=gen,
        plan=plan,
        placement=dict(d.next_placement),
        membership=d.next_membership,
        next_plan=None,
        next_placement={},
        next_membership=(),
        load_step=load_step,
        master=_master(o, d.next_placement, gen, cfg),
        training=cfg.training,
        path=path,
        path_reason=why,
    )
    return [SetDesired(state, f"launch generation {gen} from step {load_step}: {why}")]


def _plan_nodes_at(d: DesiredState, o: Observed, pred: Callable[[AgentStatus], bool]) -> bool:
    """True when every node of the current layout reports ``pred`` for this generation."""
    for n in d.placement:
        st = o.status.get(n)
        if st is None or st.generation != d.generation or not pred(st):
            return False
    return True


def _running(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    why = _unhealthy(d, o)
    if why:
        return _abort(d, o, cfg, why)
    noticed = sorted(n for n in d.placement if n in o.notices)
    usable = o.usable
    joined = sorted(set(usable) - set(d.membership))
    # In place, a joined node counts once its warm spares are up: quiescing for it earlier
    # would put its workers' start (importing torch, CUDA) back into the gap.
    new_nodes = [n for n in joined if not cfg.in_place or _spares_ready(o, n)]
    if not noticed and not new_nodes:
        known = tuple(n for n in usable if n not in joined)
        if known != d.membership:
            # an unused node left: nothing runs there, just remember the new membership
            return [SetDesired(d.model_copy(update={"membership": known}), "membership shrank")]
        adv = o.recalibration
        if adv is not None and adv.generation == d.generation and adv.membership == usable:
            return _recalibrate(d, o, cfg, adv)
        return []
    steps = [o.status[n].step for n in d.placement if n in o.status]
    stop = max(steps, default=0) + cfg.stop_ahead_steps
    deadline = o.now + cfg.deadlines.quiesce
    if noticed:
        first = min(o.notices[n].deadline for n in noticed)
        deadline = min(deadline, first - cfg.notice_margin_s)
        cause = f"preemption notice: {','.join(noticed)}"
    else:
        cause = f"nodes joined: {','.join(new_nodes)}"
    state = _move(d, Phase.QUIESCE, o.now, cfg, stop_step=stop, cause=cause, aborted=False)
    state = state.model_copy(update={"phase_deadline": deadline, "next_plan": None})
    return [SetDesired(state, cause), *_replan_if_needed(state, o, cause)]


def _spares_ready(o: Observed, node: str) -> bool:
    """The node's agent reported as many warm spare workers as it keeps."""
    st = o.status.get(node)
    return st is not None and st.spares >= st.spares_wanted


def _recalibrate(
    d: DesiredState, o: Observed, cfg: DecideConfig, adv: RecalibrationAdvice
) -> list[Action]:
    """Quiesce toward the layout online calibration found better: the plan is known already
    (made for these very nodes), so it is the next plan at once and nothing is replanned."""
    steps = [o.status[n].step for n in d.placement if n in o.status]
    stop = max(steps, default=0) + cfg.stop_ahead_steps
    state = _move(
        d,
        Phase.QUIESCE,
        o.now,
        cfg,
        stop_step=stop,
        cause=adv.cause[:1024],
        aborted=False,
        next_plan=adv.plan,
        next_placement=dict(adv.placement),
        next_membership=adv.membership,
    )
    return [SetDesired(state, adv.cause[:1024])]


def _quiesce_like(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    why = _unhealthy(d, o)
    if why:
        return _abort(d, o, cfg, f"during {d.phase.value}: {why}")
    if o.now > d.phase_deadline:
        return _abort(d, o, cfg, f"{d.phase.value} deadline passed")
    # a later notice tightens the deadline instead of aborting a checkpoint that can still make it
    noticed = [o.notices[n].deadline - cfg.notice_margin_s for n in d.placement if n in o.notices]
    if noticed and min(noticed) < d.phase_deadline:
        tighter = d.model_copy(update={"phase_deadline": min(noticed)})
        return [SetDesired(tighter, "notice tightened the deadline")]
    actions: list[Action] = []
    plan_id = d.plan.plan_id if d.plan else ""
    for n in sorted(d.placement):
        cid = _cid(d, "stop", n, d.stop_step)
        if cid not in o.acked:
            stop = _command(
                Stop,
                command_id=cid,
                epoch=d.epoch,
                plan_id=plan_id,
                node_id=n,
                deadline=d.phase_deadline,
                at_step=d.stop_step,
            )
            actions.append(Send(stop))
        cid = _cid(d, "ckpt", n, d.stop_step)
        if cid not in o.acked:
            ckpt = _command(
                Checkpoint,
                command_id=cid,
                epoch=d.epoch,
                plan_id=plan_id,
                node_id=n,
                deadline=d.phase_deadline,
                step=d.stop_step,
                directory=cfg.checkpoint_dir,
                prune_below=min(_prune_below(d, o, cfg), d.stop_step),
            )
            actions.append(Send(ckpt))
    actions += _replan_if_needed(d, o, d.cause)
    if d.phase is Phase.QUIESCE and _plan_nodes_at(d, o, lambda s: s.step >= d.stop_step):
        actions.append(SetDesired(_move(d, Phase.CHECKPOINT, o.now, cfg), "reached stop step"))
    elif d.phase is Phase.CHECKPOINT and _plan_nodes_at(
        d, o, lambda s: s.saved_step >= d.stop_step
    ):
        # Workers that learned of the stop step late stop and save a little after it (all at
        # the same step: they agree on it collectively); commit the step they saved.
        saved = min(o.status[n].saved_step for n in d.placement)
        nxt = _move(d, Phase.COMMIT, o.now, cfg, stop_step=saved)
        actions.append(SetDesired(nxt, f"all shards of step {saved} durable"))
    return actions


def _recorded(commits: Sequence[CommitRecord], directory: str) -> set[int]:
    """The steps of the commits recorded under ``directory``."""
    return {c.step for c in commits if c.directory == directory}


def prune_below(
    commits: Sequence[CommitRecord], directory: str, keep: int | None, bad: tuple[int, ...] = ()
) -> int:
    """The oldest step a new save under ``directory`` leaves in place: that of the
    ``keep``-th newest commit recorded there; -1 (delete nothing) with fewer records, or
    ``keep`` None. Only recorded commits count: one on disk that no leader recorded (lost
    between the marker and the record) never pushes out one a restart may load; nor does
    one a launch could not read (``bad``)."""
    steps = sorted(_recorded(commits, directory) - set(bad), reverse=True)
    if keep is None or len(steps) < keep:
        return -1
    return steps[keep - 1]


def _prune_below(d: DesiredState, o: Observed, cfg: DecideConfig) -> int:
    """:func:`prune_below` of the controller's directory, its retention and the desired
    state's unreadable checkpoints: what the next save's committer may delete below."""
    return prune_below(o.commits, cfg.checkpoint_dir, cfg.keep_checkpoints, d.bad_checkpoints)


def _commit(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    record = CommitRecord(
        step=d.stop_step,
        directory=cfg.checkpoint_dir,
        plan_id=d.plan.plan_id if d.plan else "",
        generation=d.generation,
        epoch=d.epoch,
        time=o.now,
    )
    below = _prune_below(d, o, cfg)
    drop = tuple(sorted(s for s in _recorded(o.commits, cfg.checkpoint_dir) if s < below))
    nxt = _move(d, Phase.TEARDOWN, o.now, cfg, load_step=d.stop_step)
    return [Commit(record, drop), SetDesired(nxt, f"committed step {d.stop_step}")]


def unusable(d: DesiredState, o: Observed) -> frozenset[str]:
    """The registered nodes no layout may use at ``o.now`` (``failing_nodes.unusable``):
    what ``decide`` puts in ``Observed.excluded``, and the daemon for the other readers."""
    return failing_nodes.unusable(d, o.nodes, o.status, o.now)


def _abort_acked(d: DesiredState, o: Observed, nodes: Sequence[str]) -> frozenset[str]:
    """The ``nodes`` whose Abort (or hold) of this teardown was acked."""
    return frozenset(n for n in nodes if any(_cid(d, k, n) in o.acked for k in ("abort", "hold")))


def _teardown(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    if d.phase_epoch >= 0 and d.phase_epoch != d.epoch:
        # Adopted from another leader (a restart, a failover): the acks of its epoch are
        # lost and the Aborts go out again, so the deadline counts from this adoption; it
        # charged every node still busy the moment a leader came back late.
        length = cfg.deadlines.teardown
        restarted = d.model_copy(update={"phase_deadline": o.now + length, "phase_epoch": d.epoch})
        why = f"teardown adopted from epoch {d.phase_epoch}: its deadline restarts ({length:.0f} s)"
        return [SetDesired(restarted, why), *_teardown(restarted, o, cfg)]
    late = failing_nodes.late_failures(d, o.status, o.now, cfg.exclusion)
    if late is not None:
        return [SetDesired(*late)]
    actions: list[Action] = []
    in_place = _in_place_next(d, cfg)

    def abort(n: str, hold: bool) -> None:
        kind = "hold" if hold else "abort"
        send = _abort_send(d, o, n, kind, d.phase_deadline, d.cause[:200], hold)
        if send is not None:
            actions.append(send)

    live = {n: st for n, st in o.status.items() if n in o.nodes}
    if in_place:
        # Workers leave their world and hold (kept for the in-place launch); held ones wait,
        # unless the next layout does not use their node (then they are let go).
        busy = sorted(n for n, st in live.items() if st.state not in ("idle", "held"))
        for n in busy:
            abort(n, hold=True)
        if d.next_plan is not None:
            for n, st in sorted(live.items()):
                if st.state == "held" and n not in d.next_placement:
                    abort(n, hold=False)
    else:
        busy = sorted(n for n, st in live.items() if st.state != "idle")
        for n in busy:
            abort(n, hold=False)
    for n in sorted(o.notices):
        if n not in o.nodes:
            actions.append(ClearNotice(n))
    acked = _abort_acked(d, o, busy)
    busy = failing_nodes.holding_up(busy, o.status, o.excluded, acked)
    if busy and d.phase_deadline and o.now > d.phase_deadline:
        # Past the deadline the teardown goes on without the nodes still busy: each that
        # never acked its Abort is charged and excluded, so the next layout leaves it out;
        # one that acked is done (failing_nodes.miss_deadline).
        missed = failing_nodes.miss_deadline(d, busy, o.status, acked, o.now, cfg.exclusion)
        if missed is not None:
            return [*actions, SetDesired(*missed)]
        busy = []
    if not o.usable:
        if busy:
            return actions
        why = failing_nodes.nothing_usable(d, o.nodes, o.status, o.excluded, o.now)
        idle = _move(
            d, Phase.IDLE, o.now, cfg, placement={}, plan=None, membership=(), cause=why[:1024]
        )
        return [*actions, SetDesired(idle, why)]
    # Plan while the old workers are torn down (after an abort nothing was planned yet):
    # waiting for every Abort's ack and idle status first put the whole fan-out (~0.3 s
    # at 512 nodes) in front of the planner.
    replan = _replan_if_needed(d, o, d.cause)
    if busy or replan:
        return actions + replan
    return actions + _launch(d, o, cfg, d.load_step)


def _launching(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    why = _unhealthy(d, o)
    if why:
        return _abort(d, o, cfg, f"during {d.phase.value}: {why}")
    if o.now > d.phase_deadline:
        return _abort(d, o, cfg, f"{d.phase.value} deadline passed")
    if d.plan is None:
        return _abort(d, o, cfg, "no plan to launch")
    if d.phase is Phase.LAUNCH:
        actions: list[Action] = []
        pending = False
        # By reference: the plan is in the desired state this phase was written with. The
        # digest and world size once per plan, not per node: at 512 nodes recomputing them
        # per command cost 135 ms a pass (benchmarks/runtime_decision_latency.py --profile).
        digest, world = _plan_facts(d.plan)
        training = training_digest(d.training) if d.training is not None else ""
        for n in sorted(d.placement):
            cid = _cid(d, "launch", n)
            if cid in o.acked:
                continue
            pending = True
            cmd = _command(
                Launch,
                command_id=cid,
                epoch=d.epoch,
                plan_id=d.plan.plan_id,
                node_id=n,
                deadline=d.phase_deadline,
                plan_sha256=digest,
                ranks=d.placement[n],
                world_size=world,
                master=d.master,
                checkpoint=cfg.checkpoint_dir if d.load_step >= 0 else "",
                load_step=d.load_step,
                generation=d.generation,
                training_sha256=training,
                in_place=d.path == "in_place",
            )
            actions.append(Send(cmd))
        if not pending:
            actions.append(SetDesired(_move(d, Phase.LOAD, o.now, cfg), "every node launched"))
        return actions
    if d.phase is Phase.LOAD:
        if _plan_nodes_at(d, o, lambda s: s.state == "running"):
            return [SetDesired(_move(d, Phase.VERIFY, o.now, cfg), "workers up")]
        return []
    if _plan_nodes_at(d, o, lambda s: s.state == "running" and s.step > d.load_step):
        # they trained: no failure streak, theirs nor the job's
        health, job = trained(d.node_health, d.job_health, d.placement)
        done = _move(
            d,
            Phase.RUNNING,
            o.now,
            cfg,
            aborted=False,
            in_place_failed=False,
            node_health=health,
            job_health=job,
        )
        return [SetDesired(done, f"first step after {d.load_step} done")]
    return []


def _idle(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    if not o.usable:
        return []
    replan = _replan_if_needed(d, o, "nodes available")
    if replan:
        return replan
    last = o.resumable(d.bad_checkpoints)
    return _launch(d, o, cfg, last.step if last else -1)


def _readmit(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    """Apply the operators' readmit requests (oldest id first), then delete them. A request
    is applied whatever its age: ``ReadmitRequest.time`` is the operator's clock, and a
    ``sailor node readmit`` that gives up withdraws its request."""
    actions: list[Action] = []
    readmitted = failing_nodes.apply_readmits(d, dict(o.readmit))
    if readmitted is not None:
        d = readmitted[0]
        actions.append(SetDesired(*readmitted))
    actions.extend(ClearReadmit(rid) for rid in sorted(o.readmit))
    return [*actions, *decide(d, replace(o, readmit={}), cfg)]


def decide(desired: DesiredState, observed: Observed, config: DecideConfig) -> list[Action]:
    """What to do next. Empty when the world matches the desired state."""
    d, o = desired, observed
    expired = sorted(n for n, r in o.notices.items() if o.now > r.deadline + config.notice_expiry_s)
    if expired:
        kept = {n: r for n, r in o.notices.items() if n not in expired}
        rest = decide(d, replace(o, notices=kept), config)
        return [*(ClearNotice(n) for n in expired), *rest]
    if o.readmit:
        return _readmit(d, o, config)
    forgot = failing_nodes.forget(d, o.nodes, o.now, config.exclusion, config.training)
    if forgot is not None:
        d = forgot[0]
        return [SetDesired(d, forgot[1]), *decide(d, o, config)]
    out = unusable(d, o)
    if out != o.excluded:  # the desired state says which nodes are out, whatever o was given
        o = replace(o, excluded=out)
    if d.phase is Phase.TEARDOWN:  # it aborts every busy node itself
        return _teardown(d, o, config)
    return [*_phase(d, o, config), *_clear_stale(d, o, config)]


def _phase(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    if d.phase is Phase.IDLE:
        return _idle(d, o, cfg)
    if d.phase is Phase.RUNNING:
        return _running(d, o, cfg)
    if d.phase in (Phase.QUIESCE, Phase.CHECKPOINT):
        return _quiesce_like(d, o, cfg)
    if d.phase is Phase.COMMIT:
        return _commit(d, o, cfg)
    return _launching(d, o, cfg)


def _clear_stale(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    """An Abort, in any phase, to each registered node outside the layout still reporting a
    failure an Abort clears (``failing_nodes.to_clear``): one of an older generation (a
    lease flap kept the teardown's Abort from it) left the node out of every layout, for
    good. Its own command id (``clear``): a later teardown's Abort of this generation is
    another command."""
    out: list[Action] = []
    for n in failing_nodes.to_clear(d, o.nodes, o.status):
        why = f"clear a failure outside the layout (generation {o.status[n].generation})"
        send = _abort_send(d, o, n, "clear", o.now + cfg.deadlines.teardown, why, False)
        if send is not None:
            out.append(send)
    return out


def _abort_send(
    d: DesiredState, o: Observed, n: str, kind: str, deadline: float, reason: str, hold: bool
) -> Send | None:
    """The Abort of kind ``kind`` (its command id's) to node ``n``; None once it acked."""
    cid = _cid(d, kind, n)
    if cid in o.acked:
        return None
    cmd = _command(
        Abort,
        command_id=cid,
        epoch=d.epoch,
        plan_id=d.plan.plan_id if d.plan else "",
        node_id=n,
        deadline=deadline,
        reason=reason,
        hold=hold,
    )
    return Send(cmd)
