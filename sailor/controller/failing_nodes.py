"""The failing-node decisions of a ``decide`` pass: the desired state's failure records
(``node_health``, ``job_health``) read against what the agents report.

``controller/node_health.py`` holds the records' rules (what counts against a node or the
job, the exclusion backoff, when a record is forgotten). This module applies them to a
pass: which nodes of the layout failed, which node a failure is named after, which
registered nodes no layout may use, why none is usable, which busy nodes hold up a
teardown and what one still busy at its deadline is charged with, which placed nodes a
LAUNCH, LOAD or VERIFY deadline is charged to (``missed_launching``), or whether the job is,
no node having got past it (``stalled``), which placed nodes a generation lost
(``lost_nodes``: their peers' SIGABRTs are no hang), which records a pass forgets (nodes
long away, configuration errors of a changed training config, operators' readmit
requests). The phase machine in ``controller/decide.py`` (and its phase modules
``aborts.py``, ``teardown.py``) calls it and turns what it returns (records, and the reason
that goes with them) into actions.

Pure: no I/O, no clock (the caller passes ``now``), inputs never modified, and no actions
built here. Must never import ``controller/decide.py`` or its phase modules (they import
this one): it takes the observed state's parts it reads (statuses, registered nodes, the
excluded set).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import replace

from sailor.controller.agreed_health import agreed_name, holds
from sailor.controller.failure_text import parse_failure
from sailor.controller.forgetting import forget_config, forget_gone, readmit
from sailor.controller.node_health import (
    DEADLINE_MISSED,
    JOB,
    Charged,
    ExclusionPolicy,
    charge,
    describe,
    excluded,
    miss_teardown,
    stall,
)
from sailor.controller.phases import stretch_key
from sailor.schemas import SCHEMA_VERSION
from sailor.schemas.commands import training_digest
from sailor.schemas.runtime import (
    MAX_NODE_LIST,
    AgentStatus,
    DesiredState,
    Phase,
    ReadmitRequest,
)
from sailor.schemas.training import TrainingConfig

__all__ = [
    "LOST_RECORDED",
    "LOST_WITHOUT_NOTICE",
    "apply_readmits",
    "began_on",
    "charge_abort",
    "failed",
    "forget",
    "health_update",
    "held_reports",
    "holding_up",
    "late_failures",
    "lost_in_teardown",
    "lost_nodes",
    "miss_deadline",
    "missed_launching",
    "nothing_usable",
    "progressed",
    "recorded_lost",
    "stalled",
    "to_clear",
    "unusable",
    "upgraded",
]

LOST_WITHOUT_NOTICE = "node lost without notice"
"""How an abort's cause begins when a placed node's registration is gone (``aborts.py``),
followed by the nodes (shortened past ``CAUSE_MAX``): for people, and for a leader reading
a state of an older one (:func:`recorded_lost`); the abort records them in
``DesiredState.lost_nodes``."""

_LOST_NAMES = re.compile(re.escape(LOST_WITHOUT_NOTICE) + r": ([^\s:;]+)")


def failed(
    d: DesiredState, status: Mapping[str, AgentStatus], stale: bool = False
) -> dict[str, str]:
    """node -> failure text, for the nodes of the layout whose workers of this generation
    failed; with ``stale``, also those still reporting a failure of an older one (at a
    LAUNCH abort: their agent did not start this generation, as one whose killed worker
    outlived SIGKILL refuses every launch)."""
    out = {}
    for n in d.placement:
        st = status.get(n)
        if st is None or st.state != "failed":
            continue
        if st.generation == d.generation or (stale and st.generation < d.generation):
            out[n] = st.failure
    return out


def held_reports(d: DesiredState, status: Mapping[str, AgentStatus]) -> dict[str, str]:
    """node -> a ``peer`` failure record naming the culprit, for the placed nodes whose
    in-place workers hold ``d``'s generation's world, broken of a rank's fault: their
    status names it (``AgentStatus.culprit``), their failure text is the cause and no record
    (``node_health.charge``'s ``held``: weighed as any accusation, ``controller/culprits.py``)."""
    out = {}
    for n in d.placement:
        st = status.get(n)
        if st is None or st.state != "held" or st.generation != d.generation or st.culprit < 0:
            continue
        record = {"origin": "peer", "retry": True, "culprit": st.culprit, "message": st.failure}
        out[n] = json.dumps(record)
    return out


def began_on(failures: Mapping[str, str]) -> str:
    """The node a failure (node -> failure text, not empty) is named after: one whose
    failure began there, not a peer that failed because of it; the first such by id."""
    return min(failures, key=lambda n: (not parse_failure(failures[n]).own, n))


LOST_RECORDED = 4
"""The wire version from which a leader records an abort's lost nodes
(``DesiredState.lost_nodes``); a state of an older leader names them in its cause only."""


def lost_nodes(d: DesiredState, nodes: Collection[str], notices: Collection[str]) -> frozenset[str]:
    """The placed nodes ``d``'s generation lost: not registered (``nodes``), or with a
    preemption notice (``notices``), or, in the TEARDOWN of an abort, those it lost when it
    was aborted (:func:`recorded_lost`: back by now, or not). NCCL's watchdog on the others
    gives up on their ranks: those SIGABRTs are no hang of the job (``node_health.charge``)."""
    out = {n for n in d.placement if n not in nodes or n in notices}
    if d.phase is Phase.TEARDOWN and d.aborted:
        out |= recorded_lost(d)  # at the abort, or later in its TEARDOWN (lost_in_teardown)
    return frozenset(out)


def lost_in_teardown(d: DesiredState, lost: Collection[str]) -> tuple[DesiredState, str] | None:
    """In the TEARDOWN of ``d``'s abort, with ``lost`` its generation's lost nodes
    (:func:`lost_nodes`): ``d`` with those not recorded yet added to
    ``DesiredState.lost_nodes``, and why; None when every one is recorded (or the record is
    full), and for a one-node layout (its SIGABRT is its node's, lost peer or not) or a
    TEARDOWN without an abort (its workers are let go, not hung). Recorded once, as at the
    abort, so that a node lost only during the teardown stays lost when its registration
    comes back: worked out again in each pass from the registrations, it was forgotten
    then, and its peers' SIGABRTs counted later were taken for a hang of the job."""
    if d.phase is not Phase.TEARDOWN or not d.aborted or len(d.placement) < 2:
        return None
    have = set(d.lost_nodes)
    new = sorted(set(lost) - have)
    if not new or len(have) >= MAX_NODE_LIST:
        return None
    kept = tuple(sorted(have | set(new)))[:MAX_NODE_LIST]
    why = f"lost during the teardown: {', '.join(new[:_SHOWN])}{_more(new)}"
    return d.model_copy(update={"lost_nodes": kept}), why


def recorded_lost(d: DesiredState) -> frozenset[str]:
    """The placed nodes ``d``'s abort recorded as lost: ``DesiredState.lost_nodes``, or, in
    a state an older leader wrote (wire version below :data:`LOST_RECORDED`), the nodes its
    cause names after :data:`LOST_WITHOUT_NOTICE`. A cause is shortened to ``CAUSE_MAX``
    characters: the one of a zone's outage named only the first nodes, and the others'
    peers' SIGABRTs were counted as a hang of the job."""
    out = {n for n in d.lost_nodes if n in d.placement}
    if d.schema_version < LOST_RECORDED:
        for m in _LOST_NAMES.finditer(d.cause):
            out |= {n for n in m.group(1).split(",") if n in d.placement}
    return frozenset(out)


def upgraded(d: DesiredState) -> DesiredState:
    """``d``, a state an older leader may have written, as this release writes it: the
    lost nodes its cause names recorded (:func:`recorded_lost`; a TEARDOWN's only) and its
    wire version this release's. A new leader takes it over so (``daemon``): written back
    at the old version with a field of this one, an older standby or agent refused it,
    and the cause would be parsed for every later abort."""
    if d.schema_version >= SCHEMA_VERSION:
        return d
    # only a TEARDOWN's: a state in LAUNCH (or later) keeps ``aborted`` and the cause of
    # the abort before it, whose lost nodes are no loss of the new generation's
    torn = d.aborted and d.phase is Phase.TEARDOWN
    lost = tuple(sorted(recorded_lost(d)))[:MAX_NODE_LIST] if torn else d.lost_nodes
    return d.model_copy(update={"lost_nodes": lost, "schema_version": SCHEMA_VERSION})


def health_update(c: Charged) -> dict[str, object]:
    """The desired state's fields a charge writes."""
    out: dict[str, object] = {"node_health": c.health, "job_health": c.job}
    if c.agreed is not None:
        out["agreed_health"] = c.agreed
    if c.sigabrts is not None:
        out["sigabrt_reports"] = c.sigabrts
    if c.accusations is not None:
        out["accusations"] = c.accusations
    return out


def charge_abort(
    d: DesiredState,
    status: Mapping[str, AgentStatus],
    now: float,
    policy: ExclusionPolicy,
    late: Mapping[str, str] | None = None,
    stall_what: str = "",
    lost: Collection[str] = (),
) -> Charged:
    """The records once the failures behind an abort of ``d``'s generation are counted.

    The nodes the failure began on are remembered (or the job, when most failed alike):
    relaunching on a node that cannot run a rank aborted again, forever. At a LAUNCH abort
    a node still failed from an older generation counts too (:func:`failed`, ``stale``).
    ``late``: at a LAUNCH, LOAD or VERIFY deadline, the nodes that held it up (node -> what
    it still reports, :func:`missed_launching`), each charged with a ``DeadlineMissed``
    failure of its own (counted by the policy, never the job's) unless it reports a failure
    of its own; the notes name those counted. ``stall_what``: at a LOAD or VERIFY deadline
    no placed node got past (stretched to its cap) and none is to blame more than the
    others, what the job is charged with (:func:`stalled`; once a generation, as every
    failure of the job); a one-node job's node instead, as a late node. ``lost``: the placed
    nodes the generation lost (:func:`lost_nodes`)."""
    if stall_what and len(d.placement) == 1:  # one node's failure is its own
        late, stall_what = {**(late or {}), **dict.fromkeys(d.placement, stall_what)}, ""
    failures = failed(d, status, stale=d.phase is Phase.LAUNCH)
    held = held_reports(d, status)
    # an older generation's record: a culprit it names is a rank of that layout, not this one's
    old = {n for n in failures if status[n].generation != d.generation}
    for n, what in (late or {}).items():
        failures.setdefault(n, f"{DEADLINE_MISSED}: {what}")
    c = charge(d, failures, now, policy, progressed(d, status), lost, _steps(d, status), held, old)
    # a late node whose own report was not counted (an old SIGABRT, a failure the job's):
    # its missed deadline is (else a hung agent with an old SIGABRT was relaunched on forever)
    redo = [
        n
        for n in sorted(late or ())
        if c.health.get(n) == d.node_health.get(n) and not failures[n].startswith(DEADLINE_MISSED)
    ]
    if redo:
        for n in redo:
            failures[n] = f"{DEADLINE_MISSED}: {(late or {})[n]}"
        c = charge(
            d, failures, now, policy, progressed(d, status), lost, _steps(d, status), held, old
        )
    counted = [n for n in sorted(late or ()) if c.health.get(n) != d.node_health.get(n)]

    # what was counted: the missed deadline, or the failure the node reports of its own
    def counted_as(n: str) -> str:
        cause = c.health[n].cause
        return (late or {})[n] if cause.startswith(DEADLINE_MISSED) else cause

    if counted:
        whom = "; ".join(f"{n} ({counted_as(n)})" for n in counted)
        c = replace(c, notes=[f"counted against {whom}", *c.notes])
    if stall_what:
        job, note = stall(d, c.job, stall_what, now, policy)
        c = replace(c, job=job, notes=[*c.notes, note] if note else c.notes)
    return c


def missed_launching(
    d: DesiredState,
    late: Collection[str],
    status: Mapping[str, AgentStatus],
    now: float,
    refused: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], list[str]]:
    """At the deadline of ``d``'s LAUNCH, LOAD or VERIFY: the placed nodes ``late`` (those
    that did not get as far as the phase waits for) to charge, node -> what it still
    reports (for :func:`charge_abort`; at LAUNCH with its agent's last refusal of the
    Launch, ``refused``: node -> reason), and the notes for the abort's reason.

    Not those the records exclude at ``now`` already: they were charged. And none when every placed
    node of several is late: nothing tells a fault of the nodes from the job's, the
    controller's or the network's (a rendezvous that never completes, a deadline too short for
    the checkpoint's load), so no node is charged (the job may be: :func:`stalled`). Nor the
    one node of a one-node job at LAUNCH, nor any: agents ack a Launch once they read the
    plan, so no ack at all is the command bus's (NATS) or the controller's fault, or, for
    those whose agent refused it, the refusal's (the note names both:
    :func:`_unacked`)."""
    if not late:
        return {}, []
    placed = set(d.placement)
    if placed <= set(late) and (len(placed) > 1 or d.phase is Phase.LAUNCH):
        why = (
            f"not counted against the {len(placed)} placed node(s): every one missed the "
            f"{d.phase.value} deadline, no node is to blame more than the others"
        )
        if d.phase is Phase.LAUNCH:
            why += f" (no Launch acked at all: {_unacked(placed, refused or {})})"
        return {}, [why]
    out = excluded(d.node_health, now)
    said = refused or {}
    charged: dict[str, str] = {}
    for n in sorted(n for n in late if n not in out):
        charged[n] = _still_at(d, status.get(n))
        if said.get(n):
            charged[n] += f", refused: {said[n][:300]}"
    return charged, []


_SHOWN = 3
"""Nodes a LAUNCH note names in each group (:func:`_unacked`); the others are counted."""


def _unacked(nodes: Collection[str], refused: Mapping[str, str]) -> str:
    """Why none of ``nodes`` acked its Launch, for the note: their agents' refusals when
    every one refused (the abort's cause gives the reasons); the command bus's or the
    controller's fault when none did; when some did, both: those that refused with their
    reasons, and those whose Launch went unanswered (a refusal on one node said nothing
    of the Launches lost on the others, and the bus went unnamed for them)."""
    said = sorted(n for n in nodes if n in refused)
    silent = sorted(n for n in nodes if n not in refused)
    bus = "the command bus's or the controller's fault"
    if not said:
        return bus
    if not silent:
        return "their agents' refusals say why"
    reasons = "; ".join(f"{n}: {refused[n][:200]}" for n in said[:_SHOWN])
    return (
        f"{len(said)} refused ({reasons}{_more(said)}), {len(silent)} not answered "
        f"({', '.join(silent[:_SHOWN])}{_more(silent)}): {bus}"
    )


def _more(nodes: Collection[str]) -> str:
    return f"; and {len(nodes) - _SHOWN} more" if len(nodes) > _SHOWN else ""


def stalled(
    d: DesiredState, late: Collection[str], short: Collection[str], setting: str = ""
) -> str:
    """At the deadline of ``d``'s LOAD or VERIFY: what the job is charged with once the
    phase's deadline is stretched to its cap (``launch.py``; :func:`charge_abort`), or ''
    when it is not. Never at LAUNCH (:func:`missed_launching`).

    ``late``: the placed nodes that held the phase up, to charge (``launch._behind``);
    ``short``: those that did not get as far as the phase waits for (a Launch acked, workers
    running, at VERIFY a step past the loaded one), ``late`` among them. The job's when no
    placed node got that far and every one is late or none is: a generation hung with every
    node alike (a rendezvous that never completes, a checkpoint store every node reads too
    slowly, every worker running and stuck at its first step). Nothing tells a fault of the
    nodes from the job's, the controller's or the network's, and relaunching it at once,
    forever, hid it; the job's backoff slows it and its record tells an operator. Not when
    some are late and others not (those late are charged: :func:`missed_launching`), nor
    when a node got through, nor when the only node of a one-node job is late (charged as
    late). The text names the phase's setting, ``setting`` (``launch._basis``: ``load as
    derived from the plan`` when the plan's need set it; empty: ``deadlines.<phase>``), and
    its stretch."""
    placed = set(d.placement)
    if d.phase not in (Phase.LOAD, Phase.VERIFY) or not placed or not placed <= set(short):
        return ""
    if late and (not placed <= set(late) or len(placed) == 1):
        return ""
    phase = d.phase.value
    key = stretch_key(d.phase)
    waited = "had its workers running" if key == "load" else f"reported a step past {d.load_step}"
    length = d.phase_deadline - d.phase_since
    factor = d.deadline_stretch.get(key, 1)
    setting = (setting or f"deadlines.{phase}") + (f" x{factor}" if factor > 1 else "")
    return (
        f"none of the {len(placed)} placed node(s) {waited} by the {phase} deadline "
        f"({length:.0f} s, {setting})"
    )


def _still_at(d: DesiredState, st: AgentStatus | None) -> str:
    """What a placed node that held up a LAUNCH, LOAD or VERIFY deadline still reports."""
    phase = d.phase.value
    if st is None:
        return f"no status at the {phase} deadline"
    what = f"still {st.state} (generation {st.generation}) at the {phase} deadline"
    return what + (", its Launch not acked" if d.phase is Phase.LAUNCH else "")


def progressed(d: DesiredState, status: Mapping[str, AgentStatus]) -> frozenset[str]:
    """The placed nodes whose workers of ``d``'s generation reported a step past its start
    (``load_step``; in TEARDOWN the checkpoint the next launch loads, never older than the
    generation's own: a node counted here trained)."""
    return frozenset(
        n
        for n in d.placement
        if (st := status.get(n)) is not None
        and st.generation == d.generation
        and st.step > d.load_step
    )


def _steps(d: DesiredState, status: Mapping[str, AgentStatus]) -> dict[str, int]:
    """The step each placed node's workers of ``d``'s generation reported (a failed one's
    too): where a failure was reported, for ``NodeHealth.step``."""
    return {
        n: st.step
        for n in d.placement
        if (st := status.get(n)) is not None and st.generation == d.generation
    }


def late_failures(
    d: DesiredState,
    status: Mapping[str, AgentStatus],
    now: float,
    policy: ExclusionPolicy,
    lost: Collection[str] = (),
) -> tuple[DesiredState, str] | None:
    """``d`` with the failures of the torn-down generation reported after the abort was
    decided counted (a peer's status came first; or the rest of a failure of the whole job,
    which takes back what was counted against the first node), and why; None when nothing
    changes. ``lost``: the placed nodes the generation lost (:func:`lost_nodes`)."""
    c = charge(
        d,
        failed(d, status),
        now,
        policy,
        progressed(d, status),
        lost,
        _steps(d, status),
        held_reports(d, status),
    )
    same_agreed = c.agreed is None or c.agreed == d.agreed_health
    if c.health == d.node_health and c.job == d.job_health and same_agreed:
        if c.accusations is not None and c.accusations != d.accusations:
            # an accusation that charges nobody yet: kept to weigh the later ones with
            why = "; ".join(c.notes) or "an accusation recorded"
            return d.model_copy(update=health_update(c)), why
        if c.sigabrts is None or c.sigabrts == d.sigabrt_reports:
            return None
        # a SIGABRT reported now, counted against nobody yet: kept for the later passes
        return d.model_copy(update=health_update(c)), f"SIGABRT reported by {_new_aborts(d, c)}"
    counted = sorted(
        n for n, r in c.health.items() if r != d.node_health.get(n) and r.generation == d.generation
    )
    head = f"failure after the abort counted on {','.join(counted)}" if counted else ""
    why = "; ".join([x for x in (head, *c.notes) if x]) or "failures after the abort counted"
    return d.model_copy(update=health_update(c)), why


def _new_aborts(d: DesiredState, c: Charged) -> str:
    """The nodes whose SIGABRT a charge added to the generation's reports."""
    kept = set(d.sigabrt_reports.nodes) if d.sigabrt_reports.generation == d.generation else set()
    return ",".join(n for n in (c.sigabrts.nodes if c.sigabrts else ()) if n not in kept)


def _refusing(
    d: DesiredState, nodes: Collection[str], status: Mapping[str, AgentStatus]
) -> frozenset[str]:
    """Registered nodes whose agent reports a failure outside the current layout: not a
    worker of this generation failing (that aborts it), but a failure the agent keeps after
    an Abort — a killed worker that outlived SIGKILL holds its GPU, and the agent refuses
    every launch until the process is gone. Planning on it only bought a LAUNCH timeout (or,
    from RUNNING, a whole reconfiguration for a node that cannot take a rank)."""
    out = []
    for n, st in status.items():
        if st.state != "failed" or n not in nodes:
            continue
        if n not in d.placement or st.generation != d.generation:
            out.append(n)
    return frozenset(out)


def to_clear(
    d: DesiredState, nodes: Collection[str], status: Mapping[str, AgentStatus]
) -> list[str]:
    """Registered nodes outside the layout still reporting a failure that an Abort clears
    (sorted): an older generation's (a lease flap took the node out before the teardown's
    Abort reached it) would keep it out of every layout for good. Not a killed worker that
    outlived SIGKILL (``OutlivedKill``): its agent withdraws that once the process is gone,
    and the node stays out until then."""
    return sorted(
        n
        for n in _refusing(d, nodes, status)
        if n not in d.placement and not parse_failure(status[n].failure).outlived_kill
    )


def unusable(
    d: DesiredState, nodes: Collection[str], status: Mapping[str, AgentStatus], now: float
) -> frozenset[str]:
    """The registered ``nodes`` no layout may use at ``now``: those the desired state's
    failure records exclude, every one while the job is excluded, and those whose agent
    reports a failure outside the layout (:func:`_refusing`)."""
    if holds(d.job_health, d.agreed_health, now):
        return frozenset(nodes)
    out = excluded(d.node_health, now)
    return frozenset(n for n in nodes if n in out) | _refusing(d, nodes, status)


def nothing_usable(
    d: DesiredState,
    nodes: Collection[str],
    status: Mapping[str, AgentStatus],
    out: frozenset[str],
    now: float,
) -> str:
    """Why no node is usable (``out``: the unusable ones): the job or the excluded nodes
    named, until when and why."""
    holding = holds(d.job_health, d.agreed_health, now)
    if holding:
        return "no usable node: " + "; ".join(describe(n, r, now) for n, r in holding)
    notes = []
    for n in sorted(out & set(nodes)):
        rec = d.node_health.get(n)
        if rec is not None and rec.excluded_until > now:
            notes.append(describe(n, rec, now))
        else:
            cause = parse_failure(status[n].failure).summary if n in status else ""
            notes.append(f"{n} reports a failure outside the layout, refusing launches: {cause}")
    return "no usable node: " + "; ".join(notes) if notes else "no usable node"


def holding_up(
    busy: list[str],
    status: Mapping[str, AgentStatus],
    out: frozenset[str],
    acked: Collection[str],
) -> list[str]:
    """The busy nodes the next launch waits for: not one whose Abort (or hold) of this
    teardown was acked (``acked``) and that still reports a failure while no layout may use
    it (``out``) — excluded, or failed in an older generation than this one. Such a node
    stays ``failed`` for long (a killed worker that outlived SIGKILL keeps its GPU, and its
    agent reports so until the process is gone); waiting for it held up every launch on the
    others, for good once its exclusion had ended (it was no longer excluded, and still
    failed)."""
    kept = []
    for n in busy:
        st = status.get(n)
        if n in acked and st is not None and st.state == "failed" and n in out:
            continue
        kept.append(n)
    return kept


def _still(st: AgentStatus, acked: bool) -> str:
    """What a node holding up a teardown past its deadline still reports."""
    what = f"still {st.state} (generation {st.generation}) at the teardown deadline, "
    what += "its Abort acked" if acked else "its Abort not acked"
    if st.killing:
        what += f", {st.killing} worker process group(s) still being killed"
    if st.failure:
        what += f": {parse_failure(st.failure).summary}"
    return what


def miss_deadline(
    d: DesiredState,
    busy: list[str],
    status: Mapping[str, AgentStatus],
    acked: Collection[str],
    now: float,
    policy: ExclusionPolicy,
) -> tuple[DesiredState, str] | None:
    """Past the teardown's deadline: ``d`` with each node still ``busy`` whose Abort was not
    acked, or that still reports workers being killed (``AgentStatus.killing``: its agent
    acks an Abort once the signals are sent, not once the kill is over), and not excluded
    already, charged and excluded, and why; None when there is none (the teardown goes on
    without them as it is). Any other node that acked is done: its status may lag.

    Its workers may hold its GPUs; the backoff brings it back, and the next layout leaves
    it out. Before, TEARDOWN waited for such nodes for good.

    Not a node an operator readmitted (its record of the generation forgotten:
    ``DesiredState.forgiven_nodes``, as in :func:`node_health.charge`): the pass that
    applied ``sailor node readmit`` for a node still killing charged and excluded it again
    at once, while the command reported it readmitted. The teardown goes on without it; a
    Launch it is sent is refused until the kill is over, and waited for (``launch.py``).
    Only that node: the others still busy are charged (a generation's forgiveness, one
    number for the whole state, spared them all, and the next layout used a node whose
    workers may hold its GPUs). A changed training config, which forgives the
    generation's configuration errors, spares no node here."""
    out = excluded(d.node_health, now)
    spared = {n for n, g in d.forgiven_nodes.items() if g >= d.generation}
    owed = {
        n: _still(status[n], n in acked)
        for n in busy
        if n not in out and n not in spared and (n not in acked or status[n].killing)
    }
    if not owed:
        return None
    c = miss_teardown(d, owed, now, policy)
    why = f"teardown deadline passed, going on without {','.join(sorted(owed))}"
    return d.model_copy(update=health_update(c)), "; ".join([why, *c.notes])


def _training_changed(d: DesiredState, training: TrainingConfig | None) -> bool:
    """The next launch hands out another training config than the current generation's."""
    a, b = d.training, training
    if a == b:
        return False
    if a is None or b is None:
        return True
    return training_digest(a) != training_digest(b)


def forget(
    d: DesiredState,
    nodes: Mapping[str, object],
    now: float,
    policy: ExclusionPolicy,
    training: TrainingConfig | None,
) -> tuple[DesiredState, str] | None:
    """``d`` without the failure records that have nothing left to say, and why; None if
    none: those of nodes long away (``forget_gone``; ``nodes``: the registered ones) and,
    when the training config the next launch hands out (``training``) is not the one the
    current generation ran (a controller restarted with a fixed config), every record of a
    configuration error and the job's of an agreed one (``forget_config``)."""
    health = forget_gone(d, nodes, now, policy)
    notes = []
    names: list[str] = []
    gone = sorted(set(d.node_health) - set(health))
    if gone:
        notes.append(f"forgot the failures of {', '.join(gone)}: away, nothing left to say")
    job, agreed = d.job_health, d.agreed_health
    if _training_changed(d, training):
        health, job, names = forget_config(health, job)
        names += [agreed_name(k) for k in sorted(agreed)]
        agreed = {}
        if names:
            notes.append(
                "training config changed: forgot the configuration (or agreed) errors of "
                + ", ".join(names)
            )
    if not notes:
        return None
    update = {
        "node_health": health,
        "job_health": job,
        "agreed_health": agreed,
        "forgiven_through": _forgiven(d, names),
    }
    return d.model_copy(update=update), "; ".join(notes)


def _forgiven(d: DesiredState, names: Collection[str]) -> int:
    """``d.forgiven_through`` once the records of ``names`` (:data:`JOB`: the job's) are
    forgiven: the newest generation they counted. Its failures, still reported, are not
    counted again: before, a pass forgot a configuration error of the current generation
    and the same pass counted it again (two desired states a pass, for ever)."""
    gens = [d.node_health[n].generation for n in names if n in d.node_health]
    if JOB in names:
        gens.append(d.job_health.generation)
    gens += [r.generation for k, r in d.agreed_health.items() if agreed_name(k) in names]
    return max([d.forgiven_through, *gens])


def apply_readmits(
    d: DesiredState, requests: Mapping[str, ReadmitRequest]
) -> tuple[tuple[DesiredState, str] | None, dict[str, str]]:
    """``d`` after the operators' readmit requests (by request id, oldest id first), and
    why, or None when they named no record there is (the caller deletes them either way);
    and per request, for the audit record of its deletion, what it forgot or why nothing.

    A node whose record of the current generation is forgotten is forgiven that generation
    (``DesiredState.forgiven_nodes``: :func:`node_health.forgiven`), that node alone; a
    request for every record (``all``) forgives the generation (``forgiven_through``)."""
    health, job, names = d.node_health, d.job_health, []
    agreed = d.agreed_health
    whom = []
    outcome: dict[str, str] = {}
    for rid in sorted(requests):
        req = requests[rid]
        health, job, gone = readmit(health, job, req.nodes, req.all)
        if req.all:  # every record: the job's of agreed errors too
            gone += [agreed_name(k) for k in sorted(agreed)]
            agreed = {}
        names += gone
        whom.append(f"{rid}" + (f" by {req.who}" if req.who else ""))
        missing = sorted(set(req.nodes) - set(gone))
        said = [f"forgot {', '.join(gone)}"] if gone else []
        if req.all and not gone:
            said.append("no failure record to forget")
        if missing:
            said.append(f"no failure record of {', '.join(missing)}")
        outcome[rid] = "; ".join(said)
    if not names:
        return None, outcome
    # each node forgotten forgives that node's failures of the generation; only ``--all``
    # (the job's record with them) forgives the generation's
    everything = any(req.all for req in requests.values())
    nodes = {
        n: r.generation
        for n, r in d.node_health.items()
        if n in names and r.generation >= d.generation
    }
    kept = {n: g for n, g in d.forgiven_nodes.items() if g >= d.generation}
    d = d.model_copy(
        update={
            "node_health": health,
            "job_health": job,
            "agreed_health": agreed,
            "forgiven_through": _forgiven(d, names) if everything else d.forgiven_through,
            "forgiven_nodes": kept | nodes,
        }
    )
    why = f"readmitted {', '.join(sorted(set(names)))} (operator request {', '.join(whom)})"
    return (d, why), outcome
