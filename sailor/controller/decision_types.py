"""What a ``decide`` pass reads and returns, and the primitives its phases build actions with.

``DecideConfig`` holds the knobs, ``Observed`` what the controller sees (with online
calibration's ``RecalibrationAdvice``), and ``Action`` the actions ``decide`` returns
(``SetDesired``, ``Send``, ``Replan``, ``Commit``, ``ClearNotice``, ``ClearReadmit``,
``ClearBadDone``, ``PeriodicOutcome``), which
the executor (``controller/executor.py``) carries out. The helpers the decision's phase
modules share (``decide.py``, ``aborts.py``, ``launch.py``, ``checkpointing.py``,
``teardown.py``; no one else needs them): a phase move checked against the state machine
(``move_to``), command ids and commands (``command_id_for``, ``build_command``), whether
every node of the layout reports something (``plan_nodes_at``) and a replan when the usable
nodes changed (``replan_if_needed``).

Values and pure functions only: no I/O, no clock, no module-level state. Must never import
the phase modules (they import this one).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, TypeVar

from pydantic import Field

from sailor.controller.job_precision import job_precision, plan_precision
from sailor.controller.node_health import ExclusionPolicy
from sailor.controller.phases import PhaseDeadlines, check_transition, stretch_key
from sailor.controller.plan_deadlines import (
    DERIVED_PHASES,
    MeasuredIteration,
    PhaseNeed,
    in_place_read_bytes,
    mismatch,
    phase_need,
)
from sailor.planner.reach import PlannerReach
from sailor.schemas._base import Frozen
from sailor.schemas.commands import Abort, Checkpoint, Command, Launch, Stop
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan
from sailor.schemas.precision import Precision
from sailor.schemas.runtime import (
    AgentStatus,
    ClearBadRequest,
    CommitRecord,
    DesiredState,
    NoticeRecord,
    PeriodicCheckpoint,
    Phase,
    ReadmitRequest,
)
from sailor.schemas.training import TrainingConfig

__all__ = [
    "MAX_BASE_PORT",
    "Action",
    "ClearBadDone",
    "ClearNotice",
    "ClearReadmit",
    "Commit",
    "Deadline",
    "DecideConfig",
    "Observed",
    "PeriodicOutcome",
    "RecalibrationAdvice",
    "Replan",
    "Send",
    "SetDesired",
    "build_command",
    "command_id_for",
    "move_to",
    "phase_deadline",
    "plan_nodes_at",
    "replan_if_needed",
]


MAX_BASE_PORT = 65535 - 999
"""Highest rendezvous port base: generation g's master port is ``base_port + g % 1000``
(``launch.py``), which must stay a TCP port."""


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
    base_port: int = Field(
        default=29500,
        gt=0,
        le=MAX_BASE_PORT,
        description="Rendezvous port of generation 0 (of generation g: + g % 1000).",
    )
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
    planner_reach: PlannerReach | None = Field(
        default=None,
        description="What the controller's planner can use (GPU types, prices, GPUs per "
        "node: ``planner.reach``): a registered node outside it is not admitted "
        "(``controller/plannable.py``). None: any node (the stand-in planner).",
    )
    model: ModelSpec | None = Field(
        default=None,
        description="The model the plans train (the controller config's ``model``): what "
        "sizes a plan's checkpoint for its phase deadlines (``deadlines.derive``). None: the "
        "configured deadlines alone.",
    )
    checkpoint_every_s: float = Field(
        default=0.0,
        ge=0,
        description="A periodic checkpoint of the RUNNING job this long after the phase "
        "began or the last was asked for (``controller/periodic.py``); 0: none. The "
        "controller config's default is an hour; this one is off, so a table of states "
        "says when it wants one.",
    )
    measured: MeasuredIteration | None = Field(
        default=None,
        description="The iteration time the running cluster measured for a plan (online "
        "calibration's latest fit; the daemon sets it each pass): QUIESCE and VERIFY of that "
        "plan are sized by it instead of its prediction. None: predictions alone.",
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
    refused: Mapping[str, str] = field(default_factory=dict)
    """Commands of this epoch an agent refused and none accepted since, by command id, with
    the agent's last reason (``CommandAck.reason``): a Launch refused while its node kills
    workers waits for the kill's end (``launch.py``), and the LAUNCH deadline's abort says
    why each refused."""
    excluded: frozenset[str] = frozenset()
    """Registered nodes no layout may use at ``now`` (:func:`unusable`): ``decide`` derives
    it from the desired state and the statuses itself; the daemon fills it for the other
    readers of ``usable``."""
    readmit: Mapping[str, ReadmitRequest] = field(default_factory=dict)
    """Operators' requests to forget failure records, by request id (``sailor node
    readmit``), not yet applied."""
    clear_bad: Mapping[str, ClearBadRequest] = field(default_factory=dict)
    """Operators' requests to clear bad checkpoint marks, by request id (``sailor checkpoint
    clear-bad``), not yet applied."""

    @cached_property
    def usable(self) -> tuple[str, ...]:
        """Registered nodes without a notice and not excluded, sorted (once per ``Observed``:
        a pass asks up to three times, ~0.25 ms each at 512 nodes)."""
        return tuple(
            sorted(n for n in self.nodes if n not in self.notices and n not in self.excluded)
        )

    def resumable(self, bad: tuple[int, ...] = ()) -> CommitRecord | None:
        """The newest recorded commit a launch may load: not one a launch failed to read.
        Under whichever directory it was saved: the launch loads it from there
        (``launch.load_directory``)."""
        good = [c for c in self.commits if c.step not in bad]
        return max(good, key=lambda c: c.step) if good else None


@dataclass(frozen=True)
class SetDesired:
    """Write a new desired state (phase change, plan, stop step)."""

    state: DesiredState
    reason: str
    load_directory: str | None = None
    """A LAUNCH state's: the checkpoint root its Launch commands load from
    (``launch.load_directory``: the load step's recorded directory, '' for a fresh start),
    named in its phase record; None for any other state."""


@dataclass(frozen=True)
class Send:
    """Send one command and wait (bounded) for its ack."""

    command: Command
    resend_every: int = 1
    """Copies of an unacked command go out at most every this many of the executor's
    ``resend_s``: a Launch its agent refused while the node kills workers is re-sent slowly
    (``launch.REFUSED_RESEND``), not at the pace of one lost on the way."""


@dataclass(frozen=True)
class Replan:
    """Compute the next plan for ``nodes``; the executor writes it into ``next_plan``."""

    nodes: tuple[NodeSpec, ...]
    previous: Plan | None
    cause: str
    precision: Precision | None = None
    """The job's precision (``controller/job_precision.py``): the plan is made in it, on
    the nodes whose GPU type can run it. None: not fixed yet (the job's first plan)."""


@dataclass(frozen=True)
class Commit:
    """Record a checkpoint whose shards every node reported durable; then forget the records
    of ``drop`` (steps below ``prune_below``: under ``checkpoint_dir`` its committer deleted
    their files; under an earlier directory their files stay)."""

    record: CommitRecord
    drop: tuple[int, ...] = ()
    periodic: bool = False
    """A periodic checkpoint's (``controller/periodic.py``), not a reconfiguration's."""
    drop_steps: tuple[int, ...] | None = None
    """The save's ``Checkpoint.drop_steps`` (``drop_steps.for_checkpoint``: the saves given
    up on; its committer deleted those it found committed); None: no such deletion was
    asked (``keep_checkpoints`` null)."""


@dataclass(frozen=True)
class ClearNotice:
    """Forget the notice of a node that is gone, or whose deadline is long past."""

    node_id: str


@dataclass(frozen=True)
class ClearReadmit:
    """Delete an operator's readmit request: the desired state written before it in the
    same actions no longer holds the records it named. ``reason``: what it forgot, or why
    nothing (no record of a node it named), for the audit record of the deletion."""

    request_id: str
    reason: str = ""


@dataclass(frozen=True)
class ClearBadDone:
    """Delete an operator's request to clear bad checkpoint marks: the desired state
    written before it in the same actions no longer holds the marks it named. ``who`` and
    ``steps`` (``all``: every mark) are the request's, ``reason`` what it cleared or why
    nothing, for the audit record of the deletion (``cleared``: the steps whose marks went,
    which the audit checker takes as readable again)."""

    request_id: str
    who: str = ""
    steps: tuple[int, ...] = ()
    all: bool = False
    cleared: tuple[int, ...] = ()
    reason: str = ""
    repointed: tuple[CommitRecord, ...] = ()
    """``repoint``: the commit records it re-points to the leader's ``checkpoint_dir``,
    written in the transaction that deletes the request (and writes the desired state)."""
    repointed_from: tuple[str, ...] = ()
    """The directory each record of ``repointed`` named before (same order), for the audit."""


@dataclass(frozen=True)
class PeriodicOutcome:
    """An audit record of a periodic checkpoint (``controller/periodic.py``): ``requested``,
    ``committed`` or ``abandoned`` (with why), of ``step`` in ``generation``."""

    outcome: Literal["requested", "committed", "abandoned"]
    step: int
    generation: int
    reason: str = ""


Action = (
    SetDesired
    | Send
    | Replan
    | Commit
    | ClearNotice
    | ClearReadmit
    | ClearBadDone
    | PeriodicOutcome
)


@dataclass(frozen=True)
class Deadline:
    """The length a phase gets in a desired state (:func:`phase_deadline`), and why."""

    phase: Phase
    seconds: float
    """``base_s`` times ``factor``; 0 for a phase without a deadline."""
    base_s: float
    """The longer of ``configured_s`` and what the plan needs."""
    configured_s: float
    factor: int = 1
    """The stretch of a LOAD or VERIFY deadline (``DesiredState.deadline_stretch``)."""
    need: PhaseNeed | None = None
    """What the plan needs, when derived."""
    plan_id: str = ""
    not_derived: str = ""
    """Why a phase that may be derived was not (derivation off, no model spec, ...)."""

    @property
    def derived(self) -> bool:
        """The plan's need set it (above the configured floor)."""
        return self.need is not None and self.need.seconds > self.configured_s

    def why(self) -> str:
        """What an operator reads in the audit's phase record, e.g. ``derived from plan p7:
        node n1 writes 42.1 GB at 125 MiB/s x2 + 10 s start-up = 684 s (above
        deadlines.checkpoint 60 s)``."""
        floor = f"deadlines.{self.phase.value} {self.configured_s:g} s"
        if self.need is not None:
            need = f"{self.need.why()} = {self.need.seconds:.0f} s"
            if self.derived:
                text = f"derived from plan {self.plan_id}: {need} (above {floor})"
            else:
                text = f"configured {floor} (plan {self.plan_id} needs {need})"
        elif self.not_derived:
            text = f"configured {floor} (not derived: {self.not_derived})"
        else:
            text = f"configured {floor}"
        if self.factor > 1:
            text += f", stretched x{self.factor}: {self.seconds:.0f} s"
        return text


def _reads_checkpoint(d: DesiredState) -> bool:
    """Whether ``d``'s LOAD is sized as a full checkpoint read: a launch that loads one, on
    the restart path. An in-place launch exchanges the state its live ranks hold, and reads
    only the layers none holds: ``DesiredState.in_place_reads``, sized at its LAUNCH from
    the previous plan (:func:`_in_place_reads`). Sized as a full read (a 7B plan: ~640 s), a
    hung in-place launch waited over ten minutes before falling back to the restart path."""
    return d.load_step >= 0 and d.path != "in_place"


def _in_place_reads(
    prev: DesiredState,
    nxt: DesiredState,
    cfg: DecideConfig,
    holders: Collection[str] | None = None,
) -> dict[str, int]:
    """The checkpoint bytes per node an in-place launch from ``prev``'s layout to ``nxt``'s
    reads (``plan_deadlines.in_place_read_bytes``); {} on the restart path, without a
    checkpoint to load, or when the plans cannot be sized (no model spec, derivation off,
    another model's plan): LOAD is then sized as reading nothing.

    ``holders``: the nodes whose held workers hold ``nxt``'s load step unbroken (None: every
    node of both layouts). After an abort (``prev.aborted``) none does, whatever their
    status says: the abort asks the workers to leave their world mid-step (they hold
    *broken*: the agent's status reports the cause, ``world aborted (SIGUSR1)``, as its
    failure while its hold waits for the other workers, and clears it once the hold is
    over, when they look unbroken) or finds them held at a stop step whose checkpoint did
    not commit, and the engine takes as holders only workers unbroken at the load step
    (``in_place.handshake``). Each survivor then reads its whole stage: a loss without
    notice of one of three TP8 DP nodes of LLaMA-7B reads 80.9 GB a node, which the 120 s
    floor the valid-holder sizing gave could not cover (the restart path allowed ~1254 s),
    and the in-place path failed back to it every time."""
    model, old, new = cfg.model, prev.plan, nxt.plan
    if nxt.path != "in_place" or nxt.load_step < 0 or not cfg.deadlines.derive.enabled:
        return {}
    if model is None or old is None or new is None:
        return {}
    if mismatch(old, model) is not None or mismatch(new, model) is not None:
        return {}
    if prev.aborted:
        holders = ()
    reads = in_place_read_bytes(old, prev.placement, new, nxt.placement, model, holders)
    return {n: b for n, b in sorted(reads.items()) if b}


def phase_deadline(d: DesiredState, phase: Phase, cfg: DecideConfig) -> Deadline:
    """The deadline ``phase`` gets in ``d`` (the state entering it: its plan, placement and
    load step): the longer of the configured one and what the plan needs
    (``controller/plan_deadlines.py``) for QUIESCE, CHECKPOINT, LOAD and VERIFY, times the
    phase's stretch. Pure; what ``move_to`` sets, the stretch's base and the audit's why."""
    dl = cfg.deadlines
    configured = dl.of(phase)
    plan_id = d.plan.plan_id if d.plan is not None else ""
    need: PhaseNeed | None = None
    off = ""
    if phase in DERIVED_PHASES:
        if not dl.derive.enabled:
            off = "deadlines.derive.enabled is false"
        elif cfg.model is None:
            off = "no model spec"
        elif d.plan is None:
            off = "no plan"
        elif (why := mismatch(d.plan, cfg.model)) is not None:
            off = why
        else:
            need = phase_need(
                phase,
                d.plan,
                d.placement,
                cfg.model,
                dl.derive,
                loads_checkpoint=_reads_checkpoint(d),
                stop_ahead_steps=cfg.stop_ahead_steps,
                measured=cfg.measured,
                in_place_reads=d.in_place_reads if d.path == "in_place" else None,
            )
    base = max(configured, need.seconds if need is not None else 0.0)
    factor = dl.fitted(phase, d.deadline_stretch, base)  # within deadlines.stretch_max_s
    return Deadline(phase, base * factor, base, configured, factor, need, plan_id, off)


def move_to(
    d: DesiredState,
    phase: Phase,
    now: float,
    cfg: DecideConfig,
    *,
    holders: Collection[str] | None = None,
    **kw: object,
) -> DesiredState:
    """``d`` in ``phase`` since ``now`` with ``kw`` applied, its deadline
    :func:`phase_deadline`'s of that state (a LAUNCH's new plan and placement included).
    ``holders``, at a LAUNCH: the nodes whose held workers are valid holders of its load
    step (:func:`_in_place_reads`; None: every node)."""
    check_transition(d.phase, phase)
    update: dict[str, object] = {"phase": phase, "phase_since": now, "phase_epoch": d.epoch}
    if d.phase is Phase.RUNNING and phase is not Phase.RUNNING:
        # a periodic checkpoint belongs to its RUNNING phase: one in flight is dropped (the
        # caller audits it: ``periodic.superseded``), never recorded by a later phase
        update["periodic"] = PeriodicCheckpoint()
    update.update(kw)
    nxt = d.model_copy(update=update)
    if phase is Phase.LAUNCH and "in_place_reads" not in kw:
        # the previous layout is known here only: what its LOAD reads is sized now
        reads = _in_place_reads(d, nxt, cfg, holders)
        nxt = nxt.model_copy(update={"in_place_reads": reads})
    if "phase_deadline" in kw:
        return nxt
    dl = phase_deadline(nxt, phase, cfg)
    update = {"phase_deadline": now + dl.seconds if dl.seconds else 0.0}
    if phase in (Phase.LOAD, Phase.VERIFY):
        key = stretch_key(phase)
        if cfg.deadlines.factor(phase, nxt.deadline_stretch) > dl.factor:
            # halved to stay within deadlines.stretch_max_s (a larger plan than the one that
            # stalled): the factor kept is the one used, so that the phase's length over it
            # is its base again (``launch._base``)
            stretch = {k: v for k, v in nxt.deadline_stretch.items() if k != key}
            update["deadline_stretch"] = {**stretch, **({key: dl.factor} if dl.factor > 1 else {})}
    return nxt.model_copy(update=update)


def command_id_for(d: DesiredState, kind: str, node: str, extra: int | str = "") -> str:
    return f"e{d.epoch}-g{d.generation}-{kind}{extra}-{node}"


_C = TypeVar("_C", Stop, Checkpoint, Abort, Launch)


def build_command(cls: type[_C], **fields: Any) -> _C:
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


def plan_nodes_at(d: DesiredState, o: Observed, pred: Callable[[AgentStatus], bool]) -> bool:
    """True when every node of the current layout reports ``pred`` for this generation."""
    for n in d.placement:
        st = o.status.get(n)
        if st is None or st.generation != d.generation or not pred(st):
            return False
    return True


def replan_if_needed(d: DesiredState, o: Observed, cause: str, cfg: DecideConfig) -> list[Action]:
    """A replan for the usable nodes, in the job's precision, unless the next plan is made
    for them already (in that precision)."""
    usable = o.usable
    if not usable:
        return []
    want = job_precision(d, cfg.training)
    if (
        d.next_plan is not None
        and d.next_membership == usable
        and (want is None or plan_precision(d.next_plan, cfg.model) == want)
    ):
        return []
    return [Replan(tuple(o.nodes[n] for n in usable), d.plan, cause, want)]
