"""The controller's pure decision: ``decide(desired, observed, config) -> list[Action]``.

Level-triggered: the decision depends only on the desired state (etcd ``desired``) and the
observed state (registered nodes, agent statuses, preemption notices, committed checkpoints,
acks of this epoch and the time), never on which event woke the loop. So a duplicated, late
or reordered event cannot change what happens, and replaying an audit log's observations
through ``decide`` reproduces the run. No I/O, no clock, no state of its own: the one
module-level value is a memo of the last plan's digest and world size (``_plan_facts`` in
``controller/launch.py``), a function of that plan object alone. What it must remember
across passes it keeps in the desired state it writes: which checkpoints could not be read
(``bad_checkpoints``), or were not read by some nodes (``suspect_checkpoint``: its rule in
``controller/suspect_checkpoint.py``), and which nodes keep failing, or whether the job does
(``node_health``, ``job_health``: their rules in ``controller/node_health.py``, what a pass
makes of them in ``controller/failing_nodes.py``), and which saves it gave up on, for the
next save's committer to delete (``drop_steps``: ``controller/drop_steps.py``). An
operator's request to forget those records (``sailor node readmit``), or to clear checkpoint
marks once the storage is repaired (``sailor checkpoint clear-bad``:
``controller/bad_marks.py``), is part of the observed state, and deleted once applied.

This module holds the entry points (``decide``, ``unusable``, ``not_admitted``: nodes the
planner cannot use, ``controller/plannable.py``, or of another NCCL version than the job's,
``controller/runtime_admission.py``), the pass's order (expired
notices, readmit requests, clear-bad requests, forgotten records, then the phase) and the
IDLE and RUNNING phases (RUNNING's periodic checkpoint in ``controller/periodic.py``). Its
inputs and actions are in ``controller/decision_types.py``; the
other phases in ``controller/aborts.py`` (a failure's move to TEARDOWN),
``controller/launch.py`` (LAUNCH, LOAD, VERIFY), ``controller/checkpointing.py`` (QUIESCE,
CHECKPOINT, COMMIT) and ``controller/teardown.py`` (TEARDOWN).
"""

from __future__ import annotations

from dataclasses import replace

from sailor.controller import (
    bad_marks,
    drop_steps,
    failing_nodes,
    periodic,
    plannable,
    runtime_admission,
    token_admission,
)
from sailor.controller.aborts import abort, clear_stale, unhealthy
from sailor.controller.checkpointing import committing, quiesce_like
from sailor.controller.decision_types import (
    Action,
    ClearBadDone,
    ClearNotice,
    ClearReadmit,
    DecideConfig,
    Observed,
    RecalibrationAdvice,
    Replan,
    SetDesired,
    move_to,
    replan_if_needed,
)
from sailor.controller.forgetting import trained_past, trained_past_agreed
from sailor.controller.job_precision import HELD_PREFIX, job_precision, precision_conflict
from sailor.controller.launch import UNLOADABLE_PREFIX, launch_next, launching, unloadable
from sailor.controller.teardown import teardown
from sailor.planner.reach import PlannerReach
from sailor.schemas.precision import Precision
from sailor.schemas.runtime import CommitRecord, DesiredState, Phase

__all__ = ["decide", "exclusion", "not_admitted", "unusable", "wanted_replan"]


def _running(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    why = unhealthy(d, o)
    if why:
        return abort(d, o, cfg, why)
    steps = [s.step for n in d.placement if (s := o.status.get(n)) and s.generation == d.generation]
    all_in = steps and len(steps) == len(d.placement)
    job = trained_past(d.job_health, min(steps)) if all_in else None
    if job is not None:  # past the step of the job's agreed failure (non-finite gradients)
        why = f"trained past step {d.job_health.step}, where the job last failed alike"
        d = d.model_copy(update={"job_health": job})
        return [SetDesired(d, why), *_running(d, o, cfg)]
    agreed = trained_past_agreed(d.agreed_health, min(steps)) if all_in else None
    if agreed is not None:  # past the step of an agreed error (non-finite gradients)
        past = [k for k in sorted(d.agreed_health) if agreed.get(k) != d.agreed_health[k]]
        why = f"trained past the step where the job last raised {', '.join(past)}"
        d = d.model_copy(update={"agreed_health": agreed})
        return [SetDesired(d, why), *_running(d, o, cfg)]
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
        return periodic.periodic(d, o, cfg)
    steps = [o.status[n].step for n in d.placement if n in o.status]
    stop = max(steps, default=0) + cfg.stop_ahead_steps
    if noticed:
        cause = f"preemption notice: {','.join(noticed)}"
    else:
        cause = f"nodes joined: {','.join(new_nodes)}"
    state = move_to(d, Phase.QUIESCE, o.now, cfg, stop_step=stop, cause=cause, aborted=False)
    deadline = state.phase_deadline  # the configured one, or what the plan's steps need
    if noticed:
        first = min(o.notices[n].deadline for n in noticed)
        deadline = min(deadline, first - cfg.notice_margin_s)
    state = state.model_copy(update={"phase_deadline": deadline, "next_plan": None})
    return [SetDesired(state, cause), *replan_if_needed(state, o, cause, cfg)]


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
    state = move_to(
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


def unusable(
    d: DesiredState,
    o: Observed,
    precision: Precision | None = None,
    reach: PlannerReach | None = None,
) -> frozenset[str]:
    """The registered nodes no layout may use at ``o.now``: those the failure records keep
    out (``failing_nodes.unusable``) and those the planner cannot use, of another runtime
    than the job's (NCCL version, Sailor release) or whose GPU type cannot compute in its
    precision (:func:`not_admitted`). What ``decide`` puts in ``Observed.excluded``."""
    return exclusion(d, o, precision, reach)[0]


def exclusion(
    d: DesiredState,
    o: Observed,
    precision: Precision | None = None,
    reach: PlannerReach | None = None,
) -> tuple[frozenset[str], dict[str, str]]:
    """:func:`unusable`'s nodes and, among them, those :func:`not_admitted` leaves out with
    the reason, from one computation of each: the daemon's pass puts the first in
    ``Observed.excluded`` and audits the second (``not_admitted`` records), so what it
    reports left out for its runtime or precision is always what its layouts leave out."""
    out = failing_nodes.unusable(d, o.nodes, o.status, o.now)
    refused = not_admitted(d, o, out, precision, reach)
    return out | frozenset(refused), refused


def not_admitted(
    d: DesiredState,
    o: Observed,
    out: frozenset[str] | None = None,
    precision: Precision | None = None,
    reach: PlannerReach | None = None,
) -> dict[str, str]:
    """The registered nodes left out because their NATS token is another's
    (``controller/token_admission.py``), the planner cannot use them (``reach``:
    ``DecideConfig.planner_reach``, ``controller/plannable.py``), or for their runtime or the
    job's precision (``controller/runtime_admission.py``), with the reason; ``out``: the
    nodes the failure records keep out (computed when not given); ``precision``: the job's
    (``job_precision.job_precision``: the recorded one, or the training config's forced one
    before any launch), else the recorded one."""
    if out is None:
        out = failing_nodes.unusable(d, o.nodes, o.status, o.now)
    candidates = [n for n in o.nodes if n not in out and n not in o.notices]
    # a node whose NATS token another's shares cannot be commanded apart from it
    refused = token_admission.token_clashes(d.placement, o.nodes, candidates)
    candidates = [n for n in candidates if n not in refused]
    refused |= plannable.unplannable(o.nodes, candidates, reach, d.placement)
    candidates = [n for n in candidates if n not in refused]
    job = precision if precision is not None else d.job_precision
    refused |= runtime_admission.not_admitted(d.placement, o.nodes, candidates, job)
    return dict(sorted(refused.items()))


_PLANS_AHEAD = (Phase.QUIESCE, Phase.CHECKPOINT, Phase.COMMIT, Phase.TEARDOWN)
"""The phases that lead to the next layout: their passes ask for its plan, but for the one
that does something else first (an abort, a deadline tightened, the commit)."""


def wanted_replan(d: DesiredState, o: Observed, cfg: DecideConfig) -> Replan | None:
    """The replan ``d`` waits for in ``o`` (its ``excluded`` filled for ``d``, as the
    daemon does), whichever pass asks for it: the one for the usable nodes in the job's
    precision in IDLE (not while held) and in the phases that lead to the next layout,
    unless the next plan is made for them already; None otherwise (LAUNCH, LOAD and VERIFY
    launched a plan; RUNNING asks in the very pass that leaves it). What a failed search's
    reason (``DesiredState.plan_failed``) belongs to: once this is another replan, or none,
    the reason no longer describes the job."""
    if d.phase is Phase.IDLE:
        if precision_conflict(d, cfg.training) is not None:
            return None
    elif d.phase not in _PLANS_AHEAD:
        return None
    for a in replan_if_needed(d, o, "", cfg):
        if isinstance(a, Replan):
            return a
    return None


_NONE_ADMITTED = "waiting: no registered node is admitted"
"""How an idle job's cause begins while admission leaves every registered node out."""


def _idle(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    held = precision_conflict(d, cfg.training)
    if held is None and not o.usable:
        held = _none_admitted(d, o, cfg)
    if held is None:
        held = unloadable(d, o, cfg)
    if held is not None:  # the reason as the job's cause (``sailor status``), written once
        return [] if d.cause == held else [SetDesired(d.model_copy(update={"cause": held}), held)]
    if d.cause.startswith((_NONE_ADMITTED, HELD_PREFIX, UNLOADABLE_PREFIX)):  # over: said once
        d = d.model_copy(update={"cause": ""})
        return [SetDesired(d, "no longer held"), *_idle(d, o, cfg)]
    if not o.usable:
        return []
    replan = replan_if_needed(d, o, "nodes available", cfg)
    if replan:
        return replan
    last = o.resumable(d.bad_checkpoints)
    return launch_next(d, o, cfg, last.step if last else -1)


def _none_admitted(d: DesiredState, o: Observed, cfg: DecideConfig) -> str | None:
    """Why no registered node may be used when admission left them all out (the planner
    cannot use them, or their GPU types cannot run the job's precision, forced before any
    launch included: the NCCL version and the release are chosen among the candidates, so
    they never leave out all); None when some node is out for another reason or none is
    registered."""
    refused = not_admitted(d, o, precision=job_precision(d, cfg.training), reach=cfg.planner_reach)
    if not refused or set(refused) != set(o.nodes) - set(o.notices):
        return None
    shown = "; ".join(f"{n}: {why}" for n, why in sorted(refused.items())[:3])
    more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
    return f"{_NONE_ADMITTED}: {shown}{more}"


def _readmit(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    """Apply the operators' readmit requests (oldest id first), then delete them. A request
    is applied whatever its age: ``ReadmitRequest.time`` is the operator's clock, and a
    ``sailor node readmit`` that gives up withdraws its request."""
    actions: list[Action] = []
    readmitted, outcome = failing_nodes.apply_readmits(d, dict(o.readmit))
    if readmitted is not None:
        d = readmitted[0]
        actions.append(SetDesired(*readmitted))
    actions.extend(ClearReadmit(rid, outcome[rid]) for rid in sorted(o.readmit))
    return [*actions, *decide(d, replace(o, readmit={}), cfg)]


def _clear_bad(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    """Apply the operators' requests to clear bad checkpoint marks (oldest id first), then
    delete them (``controller/bad_marks.py``): as readmit requests, whatever their age."""
    actions: list[Action] = []
    cleared, outcome = bad_marks.apply_clear_bad(d, o, cfg.checkpoint_dir)
    if cleared is not None:
        d = cleared[0]
        actions.append(SetDesired(*cleared))
    moved: dict[int, CommitRecord] = {}
    for rid in sorted(o.clear_bad):
        req, done = o.clear_bad[rid], outcome[rid]
        actions.append(
            ClearBadDone(
                rid,
                req.who,
                req.steps,
                req.all,
                done.steps,
                done.reason,
                done.repointed,
                done.repointed_from,
            )
        )
        moved |= {c.step: c for c in done.repointed}
    # the rest of the pass sees the records as they are once written (a launch from IDLE
    # loads a re-pointed step from its new directory)
    commits = tuple(moved.get(c.step, c) for c in o.commits)
    return [*actions, *decide(d, replace(o, clear_bad={}, commits=commits), cfg)]


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
    if o.clear_bad:
        return _clear_bad(d, o, config)
    forgot = failing_nodes.forget(d, o.nodes, o.now, config.exclusion, config.training)
    if forgot is not None:
        d = forgot[0]
        return [SetDesired(d, forgot[1]), *decide(d, o, config)]
    out = unusable(d, o, job_precision(d, config.training), config.planner_reach)
    if out != o.excluded:  # the desired state says which nodes are out, whatever o was given
        o = replace(o, excluded=out)
    if d.phase is Phase.TEARDOWN:  # it aborts every busy node itself
        return teardown(d, o, config)
    # the saves a transition gives up on, remembered in the states written (``drop_steps``)
    return [*drop_steps.track(d, o, config, _phase(d, o, config)), *clear_stale(d, o, config)]


def _phase(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    if d.phase is Phase.IDLE:
        return _idle(d, o, cfg)
    if d.phase is Phase.RUNNING:
        # a periodic save every node reported durable is recorded first: an abort in this
        # pass loads it; one still in flight is dropped by a pass that leaves RUNNING
        done = periodic.committed(d, o, cfg)
        first: list[Action] = []
        if done is not None:
            first, d, o = done
        actions = _running(d, o, cfg)
        return [*first, *periodic.superseded(d, actions), *actions]
    if d.phase in (Phase.QUIESCE, Phase.CHECKPOINT):
        return quiesce_like(d, o, cfg)
    if d.phase is Phase.COMMIT:
        return committing(d, o, cfg)
    return launching(d, o, cfg)
