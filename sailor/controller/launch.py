"""A launch in a ``decide`` pass.

The move to LAUNCH of the next plan on its placement (``launch_next``: the in-place or the
restart path and why, the rendezvous master of the new generation: ``base_port +
generation % 1000`` on rank 0's node, the next port after a generation whose port was taken,
``controller/rendezvous_ports.py``), then the LAUNCH, LOAD
and VERIFY phases (``launching``): a Launch to every node of the layout, the workers up,
their first step after the loaded checkpoint, which clears the failure streaks (and a
suspect checkpoint's record); past a phase's deadline, an abort that charges the nodes that
held it up (``_behind``), or the job when no node got through and none is to blame more
than the others (``_short``); at LAUNCH, not a node whose agent refuses the Launch while it
kills the previous workers (``_waited``: waited for, up to the kill's bound, also once the
kill has ended and before the re-sent Launch is acked; a Launch its agent refused while the
kill goes on is sent again slowly, ``REFUSED_RESEND``, until its status says the kill is
over); at a LAUNCH
deadline, each refusal's reason (``Observed.refused``) in the abort's reason and the charge.

Holds the decision's one module-level value: a memo of the last plan's digest and world
size (``_plan_facts``), a function of that (frozen) plan object alone. Otherwise pure: no
I/O, no clock. Internal to the decision: its public names are for ``decide.py`` and
``teardown.py``, which call them; nothing outside the decision should.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

from sailor.controller import failing_nodes, rendezvous_ports, suspect_checkpoint
from sailor.controller.aborts import abort, unhealthy
from sailor.controller.decision_types import (
    Action,
    DecideConfig,
    Observed,
    Send,
    SetDesired,
    build_command,
    command_id_for,
    move_to,
    phase_deadline,
    plan_nodes_at,
    replan_if_needed,
)
from sailor.controller.forgetting import trained, trained_agreed
from sailor.controller.job_precision import job_precision, plan_precision, precision_conflict
from sailor.controller.phases import stretch_key
from sailor.schemas.commands import Launch, plan_digest, training_digest
from sailor.schemas.plan import Plan
from sailor.schemas.runtime import (
    CAUSE_MAX,
    Accusations,
    DesiredState,
    Phase,
    SigabrtReports,
    StretchedPhase,
)

__all__ = [
    "REFUSED_RESEND",
    "UNLOADABLE_PREFIX",
    "in_place_next",
    "launch_next",
    "launching",
    "load_directory",
    "unloadable",
]

REFUSED_RESEND = 8
"""A Launch its agent refused while the node's status says a kill goes on is re-sent every
this many ``resend_s`` (4 s at the default 0.5 s), not every one: the agent refuses each
copy until the kill is over (up to ~123 s: ``kill_grace_s`` plus ``teardown_timeout_s``),
a ``command`` and an ``ack`` record a time. Not never, though: the agent writes its status
only when it changes, so a status lost on the way (etcd restored from a snapshot that held
``killing > 0``, a stale read) kept the Launch unsent until the kill's bound, and a
healthy node was charged then; now it costs at most this many ``resend_s``."""


UNLOADABLE_PREFIX = "held: no recorded checkpoint is readable"
"""How an idle job's cause begins while every recorded commit is marked bad
(:func:`unloadable`)."""


def unloadable(d: DesiredState, o: Observed, cfg: DecideConfig) -> str | None:
    """Why no launch may go on, when the job has recorded commits and every one is marked
    bad (``DesiredState.bad_checkpoints``); None when one is readable, or none is recorded
    (a new job starts fresh).

    Launching with nothing to load would start from random weights over every step the
    job trained: what a checkpoint mount that did not come back after a reboot does (each
    node reads an empty directory, ``NoCheckpointError``; every placed node failing marks
    the step bad, and the next launch falls back to the next commit, down to none). The
    job is held in IDLE instead, with this as its cause, until an operator repaired the
    storage and cleared the marks (``sailor checkpoint clear-bad``).

    Records that name another directory than ``checkpoint_dir`` are named apart: the
    checkpoint storage moved (/old copied to /new, ``checkpoint_dir: /new``, /old gone)
    fails every launch of them alike, and clearing the marks alone only loops. Their files
    moved, the records are re-pointed (``clear-bad --all --repoint``, ``bad_marks``); or
    the old path is made readable again."""
    if not o.commits or o.resumable(d.bad_checkpoints) is not None:
        return None
    newest = sorted(o.commits, key=lambda c: -c.step)
    steps = ", ".join(str(c.step) for c in newest)
    dirs = ", ".join(sorted({c.directory for c in o.commits}))
    why = (
        f"{UNLOADABLE_PREFIX}: every recorded commit (step {steps}, under {dirs}) is marked "
        "bad, and a launch from none would start from step 0. Check the checkpoint storage "
        "on the nodes (a mount that did not come back?), then clear the marks: sailor "
        "checkpoint clear-bad"
    )
    moved = [c for c in newest if c.directory != cfg.checkpoint_dir]
    if moved:
        dirs_moved = sorted({c.directory for c in moved})
        where = ", ".join(dirs_moved)
        names = ", ".join(str(c.step) for c in moved)
        sources = " ".join(f"--from {x}" for x in dirs_moved)
        why += (
            f". Step {names} recorded under {where}, not checkpoint_dir {cfg.checkpoint_dir}: "
            f"if their files are under {cfg.checkpoint_dir} now, sailor checkpoint clear-bad "
            f"--all --repoint {sources} loads them from there; else make {where} readable on "
            "the nodes "
            "again (until keep_checkpoints commits are recorded under the new directory)"
        )
    if d.cause.startswith(why):  # held already: the cause it was held with, the last kept
        return d.cause
    return (f"{why}; last: {d.cause}" if d.cause else why)[:CAUSE_MAX]


def load_directory(d: DesiredState, o: Observed, cfg: DecideConfig) -> str:
    """The checkpoint root a launch of ``d`` loads from: that of the commit recorded for its
    load step (the controller's ``checkpoint_dir`` may have changed since it was saved:
    the files stay where they were written), else ``checkpoint_dir``; '' for a fresh
    start. Commits are recorded by step (``ckpt/<step>``), one record per step."""
    if d.load_step < 0:
        return ""
    for c in o.commits:
        if c.step == d.load_step:
            return c.directory
    return cfg.checkpoint_dir


def in_place_next(d: DesiredState, cfg: DecideConfig) -> bool:
    """Whether the next launch (and the teardown before it) takes the in-place path."""
    return cfg.in_place and not d.in_place_failed


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


def launch_next(d: DesiredState, o: Observed, cfg: DecideConfig, load_step: int) -> list[Action]:
    plan = d.next_plan
    if plan is None:
        return []
    if load_step < 0:
        unread = unloadable(d, o, cfg)
        if unread is not None:
            return _held(d, o, cfg, unread)
    if any(n not in o.status for n in d.next_placement):
        # A registered node without a status record: its agent has just started, or its
        # lease has just expired and the node key's deletion is still on its way (the two
        # keys' watches report independently). Launching now would abort at once on a loss
        # (and count against the in-place path): wait for the next observation.
        return []
    held = precision_conflict(d, cfg.training)
    if held is not None:
        return _held(d, o, cfg, held)
    want = job_precision(d, cfg.training)
    got = plan_precision(plan, cfg.model)
    if want is not None and got != want:
        # never launched: a plan made before the job's precision was fixed (or changed)
        why = (
            f"next plan {plan.plan_id or '(unnamed)'} has precision={got!r}, the job's is "
            f"{want!r}: planned again in it"
        )
        drop: dict[str, object] = {"next_plan": None, "next_placement": {}, "next_membership": ()}
        state = d.model_copy(update=drop)
        return [SetDesired(state, why), *replan_if_needed(state, o, why, cfg)]
    gen = d.generation + 1
    if in_place_next(d, cfg):
        path, why = "in_place", "in place (configured)"
    elif cfg.in_place and d.path == "in_place":
        path, why = "restart", f"fallback: the in-place launch of generation {d.generation} failed"
    elif cfg.in_place:  # the path stays failed until a generation runs: this one did not
        path, why = (
            "restart",
            f"fallback: an in-place launch failed, and generation {d.generation} (restart) did "
            "not run either",
        )
    else:
        path, why = "restart", "restart (in place not configured)"
    port_note = rendezvous_ports.launch_note(d)
    if port_note:  # the last abort was only a taken port: the same path, the next port
        why = f"{why}; {port_note}"
    state = move_to(
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
        job_precision=got,
        path=path,
        path_reason=why,
        holders=_holders(d, o, load_step),
        plan_failed="",  # a launch: any earlier failed search is behind it
        # the previous generation's abort: its lost nodes, SIGABRTs and accusations are its own
        lost_nodes=(),
        sigabrt_reports=SigabrtReports(),
        accusations=Accusations(),
        launch_waited=(),
        forgiven_nodes={},  # the readmitted nodes' forgiveness was for the previous one
        reads_spent_through=-1,  # so were the read failures a clear of marks answered
    )
    fixed = "" if d.job_precision == got else f"; the job's precision is {got} from now on"
    why = f"launch generation {gen} from step {load_step}: {why}{fixed}"
    return [SetDesired(state, why, load_directory=load_directory(state, o, cfg))]


def _holders(d: DesiredState, o: Observed, load_step: int) -> frozenset[str]:
    """The nodes of ``d``'s layout whose workers hold ``load_step`` unbroken, as their
    statuses say (held, this generation, no failure, at that step): what the engine takes
    as holders at an in-place launch (``in_place.handshake``), the rest read their stage
    from the checkpoint. Sizes the in-place LOAD (``decision_types._in_place_reads``:
    after an abort, none, whatever the statuses say)."""
    return frozenset(
        n
        for n in d.placement
        if (st := o.status.get(n)) is not None
        and st.state == "held"
        and st.generation == d.generation
        and not st.failure
        and st.held_step == load_step
    )


def _held(d: DesiredState, o: Observed, cfg: DecideConfig, why: str) -> list[Action]:
    """No launch while the config contradicts the job's precision (``precision_conflict``)
    or no recorded commit is readable (:func:`unloadable`): IDLE, the reason as the desired
    state's cause (``sailor status``, the audit's phase record), written once; the next pass
    after the config changes (or the marks are cleared) launches."""
    if d.phase is Phase.IDLE:
        if d.cause == why:
            return []
        return [SetDesired(d.model_copy(update={"cause": why}), why)]
    idle = move_to(d, Phase.IDLE, o.now, cfg, placement={}, plan=None, membership=(), cause=why)
    return [SetDesired(idle, why)]


def _launched(d: DesiredState, o: Observed, n: str) -> bool:
    """Whether node ``n``'s Launch of ``d``'s LAUNCH is done: acked in this epoch, or, in a
    LAUNCH adopted from another epoch (its acks lost with its leader), the node's status
    reports this generation's workers of this plan running. Such a node is sent no Launch
    again (its agent would acknowledge it without applying it: ``Supervisor.runs``)."""
    if command_id_for(d, "launch", n) in o.acked:
        return True
    if d.phase_epoch == d.epoch or d.plan is None:
        return False
    st = o.status.get(n)
    return (
        st is not None
        and st.generation == d.generation
        and st.plan_id == d.plan.plan_id
        and st.state == "running"
    )


def _behind(d: DesiredState, o: Observed) -> list[str]:
    """The placed nodes that held up this LAUNCH, LOAD or VERIFY past its deadline, to be
    charged (``failing_nodes.missed_launching`` spares them all when it is every one: the
    job is charged then, ``failing_nodes.stalled``).

    LAUNCH: those whose Launch of this epoch was not acked (a hung agent, a dead VM whose
    lease still holds); none when the phase was begun under another epoch (adopted by this
    leader: the acks of that epoch are lost, and a node may have acked its Launch). LOAD and
    VERIFY: those that report nothing, or not this generation (their agent never started its
    workers), or workers of it that are neither starting nor running (stopped, held). A node
    whose workers of this generation are still starting is not to blame: workers report
    ``running`` only after the rendezvous, the world's first collective and the checkpoint's
    load, so one hung before the rendezvous keeps every node starting, and after it the last
    to report is the heaviest stage or the slowest storage, not a broken node (charged on
    every relaunch of the same plan, it would be excluded). Nor, at VERIFY, are workers all
    running and stuck at one step (a collective waits for the slowest rank): when no node
    got through, the job is charged instead (:func:`_short`)."""
    if d.phase is Phase.LAUNCH:
        if d.phase_epoch >= 0 and d.phase_epoch != d.epoch:
            return []
        return [n for n in sorted(d.placement) if command_id_for(d, "launch", n) not in o.acked]
    return [
        n
        for n in sorted(d.placement)
        if (st := o.status.get(n)) is None
        or st.generation != d.generation
        or st.state not in ("idle", "running")
    ]


def _short(d: DesiredState, o: Observed) -> list[str]:
    """The placed nodes that did not get as far as this LAUNCH, LOAD or VERIFY waits for,
    those :func:`_behind` blames among them: at LAUNCH the same (none for a LAUNCH adopted
    from another epoch: its acks are lost); at LOAD those whose workers of this generation
    are not running; at VERIFY those that did not report a step past the loaded one. When
    it is every one, and none or all are to blame, the job is
    (``failing_nodes.stalled``)."""
    if d.phase is Phase.LAUNCH:
        return _behind(d, o)

    def through(n: str) -> bool:
        st = o.status.get(n)
        if st is None or st.generation != d.generation or st.state != "running":
            return False
        return d.phase is Phase.LOAD or st.step > d.load_step

    return [n for n in sorted(d.placement) if not through(n)]


def _base(d: DesiredState, cfg: DecideConfig) -> tuple[float, bool]:
    """The length ``d``'s LOAD or VERIFY deadline had before its stretch, and whether the
    plan's need set it (above ``deadlines.<phase>``): what the leader that began the phase
    gave it (``phase_deadline - phase_since``) over the phase's stretch factor. A function
    of the desired state and the config, not of this controller's reading of the model: a
    standby whose model did not load (the floors alone) fitted another factor, and named
    the floor, for a phase the leader before it had derived. A state without the phase's
    start (0) is sized again (``phase_deadline``)."""
    length = d.phase_deadline - d.phase_since
    if d.phase_since <= 0 or length <= 0:
        dl = phase_deadline(d, d.phase, cfg)
        return dl.base_s, dl.derived
    base = length / cfg.deadlines.factor(d.phase, d.deadline_stretch)
    # a millisecond above the floor: the subtraction of two Unix times loses ~1e-7 s
    return base, base > cfg.deadlines.of(d.phase) + 1e-3


def _basis(d: DesiredState, cfg: DecideConfig) -> str:
    """The setting ``d``'s LOAD or VERIFY deadline came from, for an abort's text:
    ``deadlines.load``, or ``load as derived from the plan`` (``deadlines.derive``)."""
    key = stretch_key(d.phase)
    return f"{key} as derived from the plan" if _base(d, cfg)[1] else f"deadlines.{key}"


def _stretch(d: DesiredState, cfg: DecideConfig) -> tuple[dict[StretchedPhase, int], str] | None:
    """At a LOAD or VERIFY deadline no node is to blame for: the deadlines' stretch with
    this phase's doubled (up to ``deadlines.stretch_cap``) and why, or None at the cap (the
    job, or a one-node job's node, is charged then: ``failing_nodes.stalled``). A default
    made for the CPU demo held healthy jobs whose checkpoint load or first step takes
    longer on every node of a real cluster; now such a job costs a few relaunches."""
    key = stretch_key(d.phase)
    factor, cap = d.deadline_stretch.get(key, 1), cfg.deadlines.stretch_cap
    if factor >= cap:
        return None
    new = min(factor * 2, cap)
    base, what = _base(d, cfg)[0], _basis(d, cfg)
    ceiling = cfg.deadlines.stretch_max_s
    if base * new > ceiling:  # 3 h x8 was 24 h, after 3 + 6 + 12 h of stalls
        return None
    why = (
        f"nobody counted: the next {key} deadline is {base * new:.0f} s ({what} "
        f"{base:.0f} s x{new}, up to x{cap} (deadlines.stretch_cap) and {ceiling:.0f} s "
        "(deadlines.stretch_max_s) before anyone is charged)"
    )
    return {**d.deadline_stretch, key: new}, why


def _stretch_limit(d: DesiredState, cfg: DecideConfig) -> str:
    """The setting that stopped ``d``'s LOAD or VERIFY deadline from stretching further:
    ``deadlines.stretch_cap 8``, or ``deadlines.stretch_max_s 21600 s`` when the next
    doubling would have passed it."""
    dl = cfg.deadlines
    if d.deadline_stretch.get(stretch_key(d.phase), 1) >= dl.stretch_cap:
        return f"deadlines.stretch_cap {dl.stretch_cap}"
    return f"deadlines.stretch_max_s {dl.stretch_max_s:.0f} s"


def _fitted(d: DesiredState, o: Observed, cfg: DecideConfig) -> dict[StretchedPhase, int]:
    """The deadlines' stretch once ``d``'s LOAD or VERIFY got through: the phase's factor
    becomes the least power of two its time needed over its deadline before the stretch (the
    configured one, or what the plan needs: :func:`_base`; none when within it; at most
    ``deadlines.stretch_cap``). Kept, not dropped, when it is needed:
    dropping it at each generation that trained made every later reconfiguration of a job
    whose load takes longer than ``deadlines.load`` stall again; shrunk to what is needed,
    so that a real hang does not wait the whole cap. An in-place launch reads no checkpoint:
    its time says nothing of the restart path's, whose stretch stays."""
    key, rest = stretch_key(d.phase), dict(d.deadline_stretch)
    if d.path == "in_place":
        return rest
    base = _base(d, cfg)[0]
    need = (o.now - d.phase_since) / base if base > 0 else 0.0
    rest.pop(key, None)
    if need > 1.0:
        rest[key] = min(1 << math.ceil(math.log2(need)), cfg.deadlines.stretch_cap)
    return rest


def _waited(d: DesiredState, o: Observed, cfg: DecideConfig) -> dict[str, str]:
    """At LAUNCH, the placed nodes :func:`_behind` names that are waited for past the
    deadline, while the kill's bound (``deadlines.teardown`` past the LAUNCH deadline) is
    not over, with why: those whose status reports a kill under way
    (``AgentStatus.killing``), and those waited for so before (``DesiredState.launch_waited``)
    whose status reports no failure. Their agent refuses the Launch until the kill ends,
    with that reason (no rank starts on a GPU a killed worker may hold); the Launch is
    re-sent and taken once it has ended. The status says what the refusal's reason does,
    and ``decide`` reads the status: charged at the LAUNCH deadline as a missing ack was
    (20 s, where the agent's kill takes up to 123 s), a healthy node slow to kill was
    excluded after three. The kill's end wakes a pass before the re-sent Launch is acked
    (the agent publishes ``killing`` 0 at once; a Launch is re-sent only by a pass): the
    record keeps that node waited for, where reading the status alone charged it then. A
    kill that outlives its bound is the agent's ``OutlivedKill`` failure (node-bound,
    charged as a failure); one reported past ``deadlines.teardown`` is charged as a late
    ack."""
    if d.phase is not Phase.LAUNCH or o.now > d.phase_deadline + cfg.deadlines.teardown:
        return {}
    out: dict[str, str] = {}
    for n in _behind(d, o):
        st = o.status.get(n)
        if st is None:
            continue
        if st.killing:
            out[n] = "still killing workers"
        elif n in d.launch_waited and not st.failure:
            out[n] = "its kill just over, the Launch re-sent"
    return out


def _refusals(d: DesiredState, o: Observed, nodes: list[str]) -> dict[str, str]:
    """At LAUNCH, those of ``nodes`` whose agent refused this generation's Launch and has
    accepted none since, with its last reason (``Observed.refused``): a refused Launch is
    not a lost one, and the abort says why (the plan unreadable from etcd on that node, its
    epoch fence not persisted, the agent shutting down, a kill under way)."""
    if d.phase is not Phase.LAUNCH:
        return {}
    out: dict[str, str] = {}
    for n in nodes:
        why = o.refused.get(command_id_for(d, "launch", n))
        if why is not None:
            out[n] = why or "no reason given"
    return out


def _waiting_all(d: DesiredState, o: Observed, cfg: DecideConfig) -> bool:
    """Past the LAUNCH deadline, every node that held it up is one :func:`_waited` waits
    for: the phase goes on (the Launch re-sent) until their kill ends."""
    waited = _waited(d, o, cfg)
    return bool(waited) and len(waited) == len(_behind(d, o))


def _deadline_passed(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    """The abort at a LAUNCH, LOAD or VERIFY deadline: the placed nodes that held it up
    charged (``failing_nodes.missed_launching``); at LOAD or VERIFY with none to blame
    (none, or all, held it up) the phase's next deadline stretched, and at the stretch's
    cap, when no placed node got through, the job charged (``failing_nodes.stalled``)."""
    cause = f"{d.phase.value} deadline passed"
    behind = _behind(d, o)
    refused = _refusals(d, o, behind)
    if refused:  # the job's cause (``sailor status``) says why, not only the audit
        said = [f"{n} refused its Launch: {why[:200]}" for n, why in sorted(refused.items())]
        more = f"; and {len(said) - 3} more" if len(said) > 3 else ""
        cause += f": {'; '.join(said[:3])}{more}"
    late, notes = failing_nodes.missed_launching(d, behind, o.status, o.now, refused)
    waited = _waited(d, o, cfg)  # aborted for the others: not charged for their kill
    if waited:
        late = {n: v for n, v in late.items() if n not in waited}
        notes = [*notes, *(f"not counted against {n}: {why}" for n, why in waited.items())]
    if d.path == "in_place":  # the abort falls back to the restart path, which is the remedy
        return abort(d, o, cfg, cause, late, notes)
    short = _short(d, o)
    stretches = d.phase in (Phase.LOAD, Phase.VERIFY)
    what = failing_nodes.stalled(d, behind, short, _basis(d, cfg) if stretches else "")
    blameless = stretches and (what or not behind)
    stretched = _stretch(d, cfg) if blameless else None
    if stretched is not None:
        return abort(d, o, cfg, cause, late, [*notes, stretched[1]], stretch=stretched[0])
    if blameless and not what and short and cfg.deadlines.stretch_cap > 1:
        # at the cap, some nodes through and the others still starting: the deadline was
        # stretched as far as it goes, so those that fell short are charged (each relaunch
        # waited the whole cap on a node whose checkpoint mount hung, for ever); never at a
        # deadline not stretched first (cap 1): the slowest loader is no broken node
        late, notes = failing_nodes.missed_launching(d, short, o.status, o.now)
        limit = _stretch_limit(d, cfg)
        if limit.startswith("deadlines.stretch_cap"):
            limit = f"deadlines.stretch_cap x{cfg.deadlines.stretch_cap}"
        notes = [*notes, f"stretched as far as {limit} and {', '.join(short)} still short of it"]
    if what:
        phase = d.phase.value
        if not _base(d, cfg)[1]:
            fix = f"raise deadlines.{phase}"
        elif d.phase is Phase.LOAD:
            fix = "set deadlines.derive.read_mib_s to what the storage gives, or raise "
            fix += "deadlines.load above the derived length,"
        else:
            fix = "raise deadlines.verify above the derived length (or "
            fix += "deadlines.derive.verify_startup_s)"
        what += (
            f", stretched no further ({_stretch_limit(d, cfg)}): "
            f"{fix} if the phase takes that long on this cluster"
        )
    return abort(d, o, cfg, cause, late, notes, what)


def _through(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    """The move to the next phase once every placed node got as far as ``d``'s LAUNCH,
    LOAD or VERIFY waits for; [] before."""
    if d.phase is Phase.LAUNCH:
        if not all(_launched(d, o, n) for n in d.placement):
            return []
        up = move_to(d, Phase.LOAD, o.now, cfg, launch_waited=())
        return [SetDesired(up, "every node launched")]
    if d.phase is Phase.LOAD:
        if not plan_nodes_at(d, o, lambda s: s.state == "running"):
            return []
        # they loaded the checkpoint: one suspect was read fine (suspect_checkpoint.py)
        suspect, cleared = suspect_checkpoint.loaded(d)
        up = move_to(
            d,
            Phase.VERIFY,
            o.now,
            cfg,
            deadline_stretch=_fitted(d, o, cfg),
            suspect_checkpoint=suspect,
        )
        return [SetDesired(up, "; ".join(x for x in ("workers up", cleared) if x))]
    if not plan_nodes_at(d, o, lambda s: s.state == "running" and s.step > d.load_step):
        return []
    # they trained: no failure streak, theirs nor the job's (unless its last failure was an
    # agreed one this generation is not past yet: controller/forgetting.py); a suspect
    # checkpoint they loaded was read fine (controller/suspect_checkpoint.py)
    low = min((o.status[n].step for n in d.placement), default=-1)
    health, job = trained(d.node_health, d.job_health, d.placement, low)
    suspect, cleared = suspect_checkpoint.trained(d)
    done = move_to(
        d,
        Phase.RUNNING,
        o.now,
        cfg,
        aborted=False,
        in_place_failed=False,
        rendezvous_retries=0,
        node_health=health,
        job_health=job,
        agreed_health=trained_agreed(d.agreed_health, low),
        suspect_checkpoint=suspect,
        deadline_stretch=_fitted(d, o, cfg),
    )
    why = "; ".join(x for x in (f"first step after {d.load_step} done", cleared) if x)
    return [SetDesired(done, why)]


def launching(d: DesiredState, o: Observed, cfg: DecideConfig) -> list[Action]:
    why = unhealthy(d, o)
    if why:
        return abort(d, o, cfg, f"during {d.phase.value}: {why}")
    if d.plan is None:
        return abort(d, o, cfg, "no plan to launch")
    # got through first, the deadline after: a VERIFY adopted after a failover whose nodes
    # all stepped past the loaded step meanwhile (or a pass that came late) was aborted
    through = _through(d, o, cfg)
    if through:
        return through
    if o.now > d.phase_deadline and not _waiting_all(d, o, cfg):
        return _deadline_passed(d, o, cfg)
    if d.phase is not Phase.LAUNCH:
        return []
    actions: list[Action] = []
    checkpoint = load_directory(d, o, cfg)
    if o.now > d.phase_deadline:  # waiting for kills: remembered past the kill's end
        waited = tuple(sorted({*d.launch_waited, *_waited(d, o, cfg)}))
        if waited != d.launch_waited:
            noted = d.model_copy(update={"launch_waited": waited})
            why = f"launch deadline passed: waiting for {', '.join(waited)} to end their kill"
            actions.append(SetDesired(noted, why, load_directory=checkpoint))
    # By reference: the plan is in the desired state this phase was written with. The
    # digest and world size once per plan, not per node: at 512 nodes recomputing them
    # per command cost 135 ms a pass (benchmarks/runtime_decision_latency.py --profile).
    digest, world = _plan_facts(d.plan)
    training = training_digest(d.training) if d.training is not None else ""
    for n in sorted(d.placement):
        if _launched(d, o, n):
            continue
        cid = command_id_for(d, "launch", n)
        # its agent refuses every Launch while it kills workers (and said so): re-sent
        # each ``resend_s`` it was refused each time, two audit records a time through a
        # kill of up to two minutes. The kill's end (its status) wakes the pass that sends
        # it at once; until then it goes out slowly, in case that status never comes
        killing = (st := o.status.get(n)) is not None and st.killing > 0
        every = REFUSED_RESEND if cid in o.refused and killing else 1
        cmd = build_command(
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
            checkpoint=checkpoint,
            load_step=d.load_step,
            generation=d.generation,
            training_sha256=training,
            in_place=d.path == "in_place",
        )
        actions.append(Send(cmd, every))
    return actions
