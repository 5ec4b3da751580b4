"""The aborts of a ``decide`` pass.

Why the current layout cannot go on (``unhealthy``: a node lost without notice, a worker
failed, an in-place world broke); the move to TEARDOWN after a failure (``abort``: a
checkpoint that could not be read is suspect, or not loaded again, by the rule of
``controller/suspect_checkpoint.py``; a failed in-place launch falls back to the restart
path once, unless only its rendezvous port was taken (``controller/rendezvous_ports.py``:
the next generation tries the next port on the same path, nobody charged); the nodes the
failure began on, and those that held up a LAUNCH, LOAD or VERIFY deadline, are charged
through ``controller/failing_nodes.py``); and the Abort commands themselves
(``abort_send``, and ``clear_stale`` for a failure still reported outside the layout, in
any phase).

Pure: no I/O, no clock, no module-level state. Internal to the decision: its public names
are for ``decide.py``, ``launch.py``, ``checkpointing.py`` and ``teardown.py``, which call
them; nothing outside the decision should.
Must never import those modules (they import this one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sailor.controller import failing_nodes, rendezvous_ports, suspect_checkpoint
from sailor.controller.decision_types import (
    Action,
    DecideConfig,
    Observed,
    Send,
    SetDesired,
    build_command,
    command_id_for,
    move_to,
)
from sailor.controller.failure_text import parse_failure
from sailor.schemas.commands import Abort
from sailor.schemas.runtime import (
    MAX_NODE_LIST,
    DesiredState,
    NodeHealth,
    Phase,
    StretchedPhase,
)

__all__ = [
    "abort",
    "abort_send",
    "clear_stale",
    "unhealthy",
]


def unhealthy(d: DesiredState, o: Observed) -> str:
    """Why the current layout cannot go on ('' if it can)."""
    lost = sorted(n for n in d.placement if n not in o.nodes)
    if lost:
        return f"{failing_nodes.LOST_WITHOUT_NOTICE}: {','.join(lost)}"
    failed = failing_nodes.failed(d, o.status)
    if failed:
        # name the node the failure began on, not a peer that failed because of it
        # quoted as ``error_type: message`` (``FailureCause.summary``): the record's first
        # 200 characters were ~115 of JSON keys, and its message was cut where it said why
        # (a rendezvous port in use: "... port: 11263" without ", name: EADDRINUSE")
        n = failing_nodes.began_on(failed)
        return f"worker failed on {n}: {parse_failure(failed[n]).summary}"
    for n in sorted(d.placement):
        st = o.status.get(n)
        if st is None or st.generation != d.generation:
            continue
        if st.state == "held" and st.failure:
            # in-place workers whose world broke (a peer died) hold instead of exiting
            return f"worker world broke on {n}: {parse_failure(st.failure).summary}"
    return ""


_LAUNCHING = (Phase.LAUNCH, Phase.LOAD, Phase.VERIFY)


def _suspect(
    d: DesiredState, o: Observed, cfg: DecideConfig, health: dict[str, NodeHealth]
) -> suspect_checkpoint.Verdict | None:
    """At an abort of a generation coming up, the verdict on the checkpoint it loads when a
    worker failed because it could not read it (its failure record names the reader's
    error; ``controller/suspect_checkpoint.py``): None otherwise."""
    if d.phase not in _LAUNCHING or d.load_step < 0 or d.load_step in d.bad_checkpoints:
        return None
    failures = failing_nodes.failed(d, o.status)
    return suspect_checkpoint.at_abort(d, failures, health, o.now, cfg.exclusion)


def abort(
    d: DesiredState,
    o: Observed,
    cfg: DecideConfig,
    cause: str,
    late: Mapping[str, str] | None = None,
    notes: Sequence[str] = (),
    stall_what: str = "",
    stretch: Mapping[StretchedPhase, int] | None = None,
) -> list[Action]:
    """The move to TEARDOWN. ``late``: at a LAUNCH, LOAD or VERIFY deadline, the nodes to
    charge for it (node -> what it still reports, ``failing_nodes.missed_launching``),
    counted in the same desired state; ``stall_what``: at such a deadline no node got past,
    what the job is charged with instead (``failing_nodes.stalled``); ``stretch``: the
    deadlines' new stretch (``DesiredState.deadline_stretch``), None to keep it; ``notes``:
    more for the reason."""
    # Rank 0's rendezvous port taken by another process on its node (and no other failure
    # of a node's own): nobody's fault, the next generation's port is another; counted in a
    # row, and within the bound neither the in-place path nor the node is charged
    # (controller/rendezvous_ports.py).
    taken = rendezvous_ports.port_taken(failing_nodes.failed(d, o.status))
    tries = rendezvous_ports.retries_after(d, taken)
    d_tried = d.model_copy(update={"rendezvous_retries": tries})
    port_only = bool(taken) and rendezvous_ports.forgiven(d_tried)
    # A failure while an in-place generation comes up (a worker that cannot rebuild, a peer
    # dying mid-transfer, a deadline) is a failure of the in-place path: fall back once.
    failed_in_place = d.phase in _LAUNCHING and d.path == "in_place" and not port_only
    # The nodes the failure began on are remembered (or the job, when most failed alike):
    # relaunching on a node that cannot run a rank aborted again, forever
    # (controller/failing_nodes.py).
    # a placed node lost: its peers' SIGABRTs are the watchdog giving up on it, not a hang;
    # recorded (lost_nodes) for the TEARDOWN's later passes, when it may be back
    lost = failing_nodes.lost_nodes(d, o.nodes, o.notices)
    counted = failing_nodes.charge_abort(
        d_tried, o.status, o.now, cfg.exclusion, late, stall_what, lost
    )
    # A checkpoint that cannot be read is not loaded again (relaunching from it failed the
    # same way forever), once two launches from different nodes (or every placed node)
    # failed to read it: the next launch falls back to the newest other recorded commit.
    # After a first strike it is loaded again without the nodes that failed to read it.
    bad, suspect, health = d.bad_checkpoints, d.suspect_checkpoint, counted.health
    judged: list[str] = []
    verdict = _suspect(d, o, cfg, health)
    if verdict is not None:
        bad, suspect, health = verdict.bad, verdict.suspect, verdict.health
        cause, judged = f"{verdict.cause}: {cause}", verdict.notes
    last = o.resumable(bad)
    state = move_to(
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
        rendezvous_retries=tries,
        bad_checkpoints=bad,
        suspect_checkpoint=suspect,
        node_health=health,
        job_health=counted.job,
        agreed_health=d.agreed_health if counted.agreed is None else counted.agreed,
        lost_nodes=tuple(sorted(lost))[:MAX_NODE_LIST],
        sigabrt_reports=counted.sigabrts or d.sigabrt_reports,
        accusations=counted.accusations or d.accusations,
        deadline_stretch=dict(d.deadline_stretch if stretch is None else stretch),
    )
    port_note = rendezvous_ports.abort_note(d, taken, tries)
    reason = [f"abort: {cause}", *([port_note] if port_note else []), *counted.notes, *judged]
    reason += notes
    return [SetDesired(state, "; ".join(reason))]


def clear_stale(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    """An Abort, in any phase, to each registered node outside the layout still reporting a
    failure an Abort clears (``failing_nodes.to_clear``): one of an older generation (a
    lease flap kept the teardown's Abort from it) left the node out of every layout, for
    good. Its own command id (``clear``): a later teardown's Abort of this generation is
    another command."""
    out: list[Action] = []
    for n in failing_nodes.to_clear(d, o.nodes, o.status):
        why = f"clear a failure outside the layout (generation {o.status[n].generation})"
        send = abort_send(d, o, n, "clear", o.now + cfg.deadlines.teardown, why, False)
        if send is not None:
            out.append(send)
    return out


def abort_send(
    d: DesiredState, o: Observed, n: str, kind: str, deadline: float, reason: str, hold: bool
) -> Send | None:
    """The Abort of kind ``kind`` (its command id's) to node ``n``; None once it acked."""
    cid = command_id_for(d, kind, n)
    if cid in o.acked:
        return None
    cmd = build_command(
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
