"""The TEARDOWN phase of a ``decide`` pass.

An Abort to every busy node (in place: a hold, and an Abort to held workers the next layout
does not use), the notices of nodes that are gone cleared, and the deadline kept: one
adopted from another leader restarts, and past it the nodes still busy that never acked
their Abort are charged and left out (``controller/failing_nodes.py``). Failures of the
torn-down generation reported late are counted, among them a checkpoint's reads
(``controller/suspect_checkpoint.py``: ``late``). Then IDLE when no
node is usable, else the next plan is asked for while the old workers go, and the next
generation launched (``controller/launch.py``) once every node is idle.

Pure: no I/O, no clock, no module-level state. Internal to the decision: ``teardown`` is
public for ``decide.py``, which calls it; nothing outside the decision should.
"""

from __future__ import annotations

from collections.abc import Sequence

from sailor.controller import failing_nodes, suspect_checkpoint
from sailor.controller.aborts import abort_send
from sailor.controller.decision_types import (
    Action,
    ClearNotice,
    DecideConfig,
    Observed,
    SetDesired,
    command_id_for,
    move_to,
    replan_if_needed,
)
from sailor.controller.launch import in_place_next, launch_next
from sailor.schemas.runtime import DesiredState, Phase

__all__ = [
    "teardown",
]


def _abort_acked(d: DesiredState, o: Observed, nodes: Sequence[str]) -> frozenset[str]:
    """The ``nodes`` whose Abort (or hold) of this teardown was acked."""
    return frozenset(
        n for n in nodes if any(command_id_for(d, k, n) in o.acked for k in ("abort", "hold"))
    )


def _late_reads(d: DesiredState, o: Observed, cfg: DecideConfig) -> tuple[DesiredState, str] | None:
    """``d`` once the nodes of a suspect checkpoint's own generation that reported failing
    to read it after the abort are judged (``suspect_checkpoint.late``: charged alike, or,
    every placed node having failed to read it, the step marked bad and the load step
    fallen back), and why; None when nothing changes."""
    failures = failing_nodes.failed(d, o.status)
    verdict = suspect_checkpoint.late(d, failures, o.now, cfg.exclusion)
    if verdict is None:
        return None
    update: dict[str, object] = {
        "bad_checkpoints": verdict.bad,
        "suspect_checkpoint": verdict.suspect,
        "node_health": verdict.health,
    }
    if verdict.bad != d.bad_checkpoints:
        last = o.resumable(verdict.bad)
        update["load_step"] = last.step if last else -1
        # the abort's cause said "suspect, loaded again": the Aborts and an IDLE say this
        update["cause"] = verdict.cause
    return d.model_copy(update=update), "; ".join([verdict.cause, *verdict.notes])


def teardown(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    if d.phase_epoch >= 0 and d.phase_epoch != d.epoch:
        # Adopted from another leader (a restart, a failover): the acks of its epoch are
        # lost and the Aborts go out again, so the deadline counts from this adoption; it
        # charged every node still busy the moment a leader came back late.
        length = cfg.deadlines.teardown
        restarted = d.model_copy(update={"phase_deadline": o.now + length, "phase_epoch": d.epoch})
        why = f"teardown adopted from epoch {d.phase_epoch}: its deadline restarts ({length:.0f} s)"
        return [SetDesired(restarted, why), *teardown(restarted, o, cfg)]
    lost = failing_nodes.lost_nodes(d, o.nodes, o.notices)
    recorded = failing_nodes.lost_in_teardown(d, lost)
    if recorded is not None:  # once: its registration may be back by the next pass
        return [SetDesired(*recorded), *teardown(recorded[0], o, cfg)]
    late = failing_nodes.late_failures(d, o.status, o.now, cfg.exclusion, lost)
    if late is not None:
        return [SetDesired(*late)]
    judged = _late_reads(d, o, cfg)
    if judged is not None:
        return [SetDesired(*judged)]
    actions: list[Action] = []
    in_place = in_place_next(d, cfg)

    def abort(n: str, hold: bool) -> None:
        kind = "hold" if hold else "abort"
        send = abort_send(d, o, n, kind, d.phase_deadline, d.cause[:200], hold)
        if send is not None:
            actions.append(send)

    live = {n: st for n, st in o.status.items() if n in o.nodes}
    if in_place:
        # Workers leave their world and hold (kept for the in-place launch); held ones wait,
        # unless the next layout does not use their node (then they are let go).
        busy = sorted(n for n, st in live.items() if st.state not in ("idle", "held") or st.killing)
        for n in busy:
            abort(n, hold=True)
        if d.next_plan is not None:
            for n, st in sorted(live.items()):
                if st.state == "held" and n not in d.next_placement:
                    abort(n, hold=False)
    else:
        # a node killing workers is busy whatever its state: its Abort is acked once the
        # signals are sent, and a killed rank holds its GPU until its process is gone
        busy = sorted(n for n, st in live.items() if st.state != "idle" or st.killing)
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
        idle = move_to(
            d, Phase.IDLE, o.now, cfg, placement={}, plan=None, membership=(), cause=why[:1024]
        )
        return [*actions, SetDesired(idle, why)]
    # Plan while the old workers are torn down (after an abort nothing was planned yet):
    # waiting for every Abort's ack and idle status first put the whole fan-out (~0.3 s
    # at 512 nodes) in front of the planner.
    replan = replan_if_needed(d, o, d.cause, cfg)
    if busy or replan:
        return actions + replan
    return actions + launch_next(d, o, cfg, d.load_step)
