"""Runtime records kept in etcd and replies on NATS: desired state, agent status, acks.

These are the values the controller's pure ``decide`` reads (with the node registrations)
and the records a new leader takes over from. Written by exactly one party each: the leader
writes ``DesiredState``, ``NoticeRecord``, ``CommitRecord`` and ``EventStreamState``
(epoch-guarded); an agent writes its own ``AgentStatus`` and replies ``CommandAck``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from sailor.schemas._base import Frozen, WireMessage, field_error
from sailor.schemas.events import PreemptionNotice
from sailor.schemas.generation_reports import (
    MAX_NODE_LIST,
    Accusations,
    SigabrtReports,
    sorted_node_ids,
)
from sailor.schemas.online_calibration import RankTimings
from sailor.schemas.plan import Plan
from sailor.schemas.precision import Precision
from sailor.schemas.training import TrainingConfig

__all__ = [
    "CAUSE_MAX",
    "MAX_AGREED_KINDS",
    "MAX_DROP_STEPS",
    "MAX_NODE_LIST",
    "MAX_STRETCH",
    "Accusations",
    "AgentState",
    "AgentStatus",
    "ClearBadRequest",
    "CommandAck",
    "CommitRecord",
    "DesiredState",
    "EventStreamState",
    "LaunchPath",
    "NodeHealth",
    "NoticeRecord",
    "PeriodicCheckpoint",
    "Phase",
    "ReadmitRequest",
    "SigabrtReports",
    "StretchedPhase",
    "SuspectCheckpoint",
    "shorten",
]


class Phase(StrEnum):
    """Phase of the reconfiguration state machine (transitions: sailor.controller.phases)."""

    IDLE = "idle"
    RUNNING = "running"
    QUIESCE = "quiesce"
    CHECKPOINT = "checkpoint"
    COMMIT = "commit"
    TEARDOWN = "teardown"
    LAUNCH = "launch"
    LOAD = "load"
    VERIFY = "verify"


AgentState = Literal["idle", "running", "stopped", "failed", "held"]
"""``held``: the workers are alive, out of any process group, waiting to be handed the ranks
of the next generation in place (``Launch.in_place``)."""

LaunchPath = Literal["restart", "in_place"]
"""How a generation's workers came to be: new processes loading the checkpoint, or the
processes of the previous generation (plus warm spares) rebuilt in place."""

StretchedPhase = Literal["load", "verify"]
"""The phases whose deadline a stall stretches (``DesiredState.deadline_stretch``)."""

CAUSE_MAX = 1024
"""Longest ``DesiredState.cause`` and ``path_reason``, in characters."""


def shorten(text: str, limit: int = CAUSE_MAX) -> str:
    """``text`` if it fits in ``limit`` characters, else its head and how much was cut: a
    cause that names every node of a large layout (a zone's outage losing 120 nodes) was
    written to etcd whole, and no reader could parse the state back (a new leader refused
    to lead, agents to launch)."""
    if len(text) <= limit:
        return text
    tail = f" ... (cut: {len(text)} characters in all)"
    return text[: max(limit - len(tail), 0)] + tail[:limit]


MAX_STRETCH = 1024
"""Largest factor ``DesiredState.deadline_stretch`` holds (``deadlines.stretch_cap`` bounds
the factor used; this bounds what a state may hold at all)."""


MAX_DROP_STEPS = 64
"""Most steps ``DesiredState.drop_steps`` holds: the saves given up on since the last commit.
A job gives up on one per aborted reconfiguration or abandoned periodic save, and commits
between them in a healthy run; 64 in a row without a commit is a job failing at every save,
whose oldest forgotten steps stay on disk (a leak, never a wrong deletion)."""

MAX_AGREED_KINDS = 16
"""Most error types ``DesiredState.agreed_health`` holds: the controller knows three
(``controller/failure_text.AGREED_ERRORS``); a bound on what a state may hold at all."""


class NodeHealth(Frozen):
    """The controller's memory of one node's failures (``DesiredState.node_health``): how
    many in a row began on that node, and until when no layout uses it. The policy that
    writes it is ``sailor.controller.node_health``."""

    failures: int = Field(
        default=0,
        ge=0,
        description="Consecutive aborts caused by a failure that began on this node (not a "
        "peer's), since a generation last trained on it.",
    )
    generation: int = Field(
        default=-1, ge=-1, description="Last generation whose failure was counted (once each)."
    )
    exclusions: int = Field(
        default=0,
        ge=0,
        description="Times the node was excluded; each exclusion lasts twice the previous one "
        "(capped).",
    )
    excluded_until: float = Field(
        default=0.0, ge=0, description="Unix time until which no layout uses it; 0: never was."
    )
    cause: str = Field(default="", max_length=256, description="Its last failure, shortened.")
    signature: str = Field(
        default="",
        max_length=256,
        description="Its last failure with numbers and hex addresses left out, taken from the "
        "whole error before shortening: what 'failed alike' compares. '': none (or written "
        "before it was kept: the cause's).",
    )
    origin: Literal["", "local", "config", "unknown"] = Field(
        default="",
        description="Where its last counted failure began, as its record says ('unknown': no "
        "record or none named); a 'config' one is forgotten when the controller's training "
        "config changes. '': none counted.",
    )
    step: int = Field(
        default=-1,
        ge=-1,
        description="The step its last counted failure was reported at (the highest a "
        "failed node's status reported); -1: not known. A failure every rank agreed on "
        "(non-finite gradients) keeps the job's count until a generation gets past it.",
    )

    @model_validator(mode="after")
    def _excluded_only_when_counted(self) -> NodeHealth:
        if self.excluded_until > 0 and self.exclusions == 0:
            raise field_error("excluded_until", self.excluded_until, "set, but exclusions is 0")
        return self


class SuspectCheckpoint(Frozen):
    """A checkpoint some placed nodes, not all, failed to read (``DesiredState.
    suspect_checkpoint``): its files, or those nodes' mounts? Each rank reads only its own
    stage's files, so counting heads cannot tell. The next launch loads it again without
    those nodes, and that launch decides (``sailor.controller.suspect_checkpoint``). The
    empty record (step -1): none."""

    step: int = Field(default=-1, ge=-1, description="Committed step suspected; -1: none.")
    nodes: tuple[str, ...] = Field(
        default=(),
        description="Nodes (sorted) whose workers failed to read it, charged for it and left "
        "out of the next layout: their mount is suspected as much as the files.",
    )
    generation: int = Field(
        default=-1, ge=-1, description="Generation whose launch failed to read it; -1: none."
    )

    @model_validator(mode="after")
    def _all_or_nothing(self) -> SuspectCheckpoint:
        if (self.step < 0) != (not self.nodes) or (self.step < 0) != (self.generation < 0):
            raise field_error(
                "step",
                self.step,
                f"a suspect checkpoint names its nodes ({list(self.nodes)}) and generation "
                f"({self.generation}), the empty record (step -1) neither",
            )
        if list(self.nodes) != sorted(set(self.nodes)):
            raise field_error("nodes", list(self.nodes), "must be sorted, without repeats")
        return self


class PeriodicCheckpoint(Frozen):
    """The controller's periodic checkpoint of a RUNNING generation (``DesiredState.
    periodic``; ``controller/periodic.py``): a save of ``step`` asked of every node without
    stopping them, recorded as a commit once every node reports it durable, abandoned (never
    recorded) at ``deadline``. ``step`` -1: none in flight; ``requested`` stays after the
    save ends, so the next one is due ``checkpoint_every_s`` after it, a retry too."""

    step: int = Field(default=-1, ge=-1, description="Step asked to save; -1: none in flight.")
    requested: float = Field(
        default=0.0, ge=0, description="Unix time the latest periodic save was asked for; 0: none."
    )
    deadline: float = Field(
        default=0.0,
        ge=0,
        description="Unix time the save in flight is abandoned at (not every node reported it "
        "durable); 0 when none is in flight.",
    )
    directory: str = Field(
        default="",
        max_length=4096,
        description="Checkpoint root the save in flight was asked to (the requesting leader's "
        "``checkpoint_dir``), which its commit records; '' when none is in flight.",
    )

    @model_validator(mode="after")
    def _deadline_with_step(self) -> PeriodicCheckpoint:
        if self.step >= 0 and self.deadline < self.requested:
            raise field_error(
                "deadline",
                self.deadline,
                f"a save in flight (step {self.step}) ends after its request ({self.requested})",
            )
        if self.step < 0 and self.deadline:
            raise field_error("deadline", self.deadline, "set, but no save is in flight (step -1)")
        if (self.step >= 0) != bool(self.directory):
            why = "empty, but a save is in flight" if self.step >= 0 else "set, but no save"
            raise field_error("directory", self.directory, f"{why} (step {self.step})")
        return self


class DesiredState(WireMessage):
    """What the leader wants: the plan, its placement and where the reconfiguration is."""

    epoch: int = Field(ge=0, description="Epoch of the leader that wrote it.")
    generation: int = Field(default=0, ge=0, description="Launch counter; one per layout.")
    phase: Phase = Field(default=Phase.IDLE, description="Reconfiguration phase.")
    phase_since: float = Field(default=0.0, ge=0, description="Unix time the phase began.")
    phase_deadline: float = Field(default=0.0, ge=0, description="Unix time it must end by.")
    plan: Plan | None = Field(default=None, description="Plan running or being launched.")
    placement: dict[str, tuple[int, ...]] = Field(
        default_factory=dict, description="node id -> global ranks of ``plan``."
    )
    membership: tuple[str, ...] = Field(
        default=(), description="Usable nodes the plan was made for (sorted)."
    )
    next_plan: Plan | None = Field(default=None, description="Plan computed during quiesce.")
    next_placement: dict[str, tuple[int, ...]] = Field(
        default_factory=dict, description="Placement of ``next_plan``."
    )
    next_membership: tuple[str, ...] = Field(default=(), description="Nodes next_plan uses.")
    stop_step: int = Field(default=-1, ge=-1, description="Agreed step to stop and save at.")
    load_step: int = Field(default=-1, ge=-1, description="Checkpoint the launch loads; -1 none.")
    master: str = Field(default="", description="Rendezvous host:port of the current launch.")
    training: TrainingConfig | None = Field(
        default=None,
        description="Training config of the generation launched (set at each launch, its "
        "paths absolute); None: the workers' own defaults.",
    )
    cause: str = Field(
        default="",
        max_length=CAUSE_MAX,
        description="Why the last change began (shortened to its head past "
        f"{CAUSE_MAX} characters: :func:`shorten`).",
    )
    aborted: bool = Field(default=False, description="This reconfiguration was aborted.")
    path: LaunchPath = Field(
        default="restart", description="How the current generation's workers were launched."
    )
    path_reason: str = Field(
        default="",
        max_length=CAUSE_MAX,
        description="Why that path (a fallback names its cause; shortened as ``cause``).",
    )
    in_place_failed: bool = Field(
        default=False,
        description="The in-place launch of the current generation failed: the next launch "
        "takes the restart path.",
    )
    rendezvous_retries: int = Field(
        default=0,
        ge=0,
        description="Aborts in a row, since the job last ran, of launches that failed only "
        "because rank 0's rendezvous port was taken on its node (another process listens on "
        "base_port + generation % 1000: EADDRINUSE): up to the controller's bound "
        "(controller/rendezvous_ports.py) they are nobody's fault, and the next generation "
        "(the next port) launches on the same path; past it, such a failure is the node's. "
        "Reset by any other abort and once a generation runs. 0: none (wire version 9).",
    )
    bad_checkpoints: tuple[int, ...] = Field(
        default=(),
        description="Committed steps a launch could not load (corrupt or missing files: "
        "every placed node, or launches from two different nodes, failed to read them): never "
        "loaded again; launches fall back to the newest other recorded commit. A step saved "
        "again loses its mark.",
    )
    suspect_checkpoint: SuspectCheckpoint = Field(
        default_factory=SuspectCheckpoint,
        description="A checkpoint a minority of the placed nodes failed to read: loaded "
        "again without them before it is marked bad (two strikes from different nodes). "
        "Empty: none.",
    )
    node_health: dict[str, NodeHealth] = Field(
        default_factory=dict,
        description="node id -> its failure record, for nodes whose workers failed: a node "
        "excluded until a time is in no layout before then. Kept while the node is away (a "
        "lease flap or an agent restart forgets nothing) until its exclusion is long over.",
    )
    job_health: NodeHealth = Field(
        default_factory=NodeHealth,
        description="The job's own failure record: failures that most placed nodes reported "
        "alike (a training config every rank refuses, a bug every rank hits) count here, not "
        "against the nodes; while it is excluded no layout is launched.",
    )
    agreed_health: dict[str, NodeHealth] = Field(
        default_factory=dict,
        max_length=MAX_AGREED_KINDS,
        description="Error type -> the job's record of that error every rank raises alike "
        "(NonFiniteGradientsError, LabelOutOfRangeError, NonFiniteCheckpointError), counted "
        "apart from job_health's hangs and stalls: reset once a generation trains past its "
        "step; while one is excluded no layout is launched. Empty: none (wire version 5).",
    )
    forgiven_through: int = Field(
        default=-1,
        ge=-1,
        description="Newest generation whose failure records were forgiven for every node "
        "and the job (an operator's readmit --all, a changed training config's errors): "
        "failures of generations up to it are never counted (again). -1: none.",
    )
    forgiven_nodes: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict,
        max_length=MAX_NODE_LIST,
        description="Node id -> the generation whose failures of that node an operator "
        "forgave (sailor node readmit, the record forgotten): that node's failures of it are "
        "never counted (again), nor is it charged for holding up its teardown; the other "
        "nodes' are. Kept for the current generation only, emptied at the next launch. "
        "Empty: none (wire version 6).",
    )
    reads_spent_through: int = Field(
        default=-1,
        ge=-1,
        description="Newest generation whose checkpoint read failures an operator's clear "
        "of bad or suspect marks (``sailor checkpoint clear-bad``) answered, in its aborted "
        "TEARDOWN: its reports, still in the statuses, mark no step bad or suspect and "
        "charge no node again; a later generation's still do. -1: none (wire version 6).",
    )
    deadline_stretch: dict[StretchedPhase, Annotated[int, Field(ge=1, le=MAX_STRETCH)]] = Field(
        default_factory=dict,
        description="Phase (load, verify) -> factor its deadline (``deadlines.<phase>``) is "
        "multiplied by, for the restart path: doubled at each generation that phase stalled "
        "(no placed node got through, none to blame more than the others) up to "
        "``deadlines.stretch_cap``; once the phase completes, the least power of two its "
        "time needed (none when within the configured deadline). Empty: none.",
    )
    phase_epoch: int = Field(
        default=-1,
        ge=-1,
        description="Epoch of the leader that began the phase and set its deadline; a leader "
        "that adopts a TEARDOWN begun under another epoch restarts its deadline. -1: not "
        "recorded (taken as the current epoch).",
    )
    lost_nodes: tuple[str, ...] = Field(
        default=(),
        max_length=MAX_NODE_LIST,
        description="Placed nodes (sorted) the current generation lost when it was aborted "
        "(registration gone, or a preemption notice), or later in its TEARDOWN (recorded "
        "when first seen), kept through that TEARDOWN: their peers' "
        "SIGABRTs are NCCL's watchdog giving up on their ranks, not a hang, also once they are "
        "back. Empty: none, or a state of a leader before wire version 4, whose abort cause "
        "named them (``controller/failing_nodes.py``: ``lost_nodes``).",
    )
    sigabrt_reports: SigabrtReports = Field(
        default_factory=SigabrtReports,
        description="The SIGABRTs the current generation's nodes reported since its abort, "
        "whichever pass saw them; emptied at the next launch. Empty: none.",
    )
    accusations: Accusations = Field(
        default_factory=Accusations,
        description="The current generation's accusations (a peer's failure naming a "
        "culprit rank), whichever pass saw them, kept to weigh the later ones with "
        "(``controller/culprits.py``); emptied at the next launch. Empty: none (wire "
        "version 11).",
    )
    job_precision: Precision | None = Field(
        default=None,
        description="The job's compute precision, fixed once for its life: the training "
        "config's when it forces one, else the first launched plan's. Every later plan is "
        "made in it (GPU types that cannot run it are left out) and a plan in another is "
        "never launched (docs/training.md, 'One precision per job'). None: no plan launched "
        "yet (wire version 5).",
    )
    plan_failed: str = Field(
        default="",
        max_length=CAUSE_MAX,
        description="Why the last replan for the usable nodes in the job's precision failed "
        "(the planner's error: a search that timed out, a model or profile it cannot price) "
        "and when it is tried again: the leader backs off such a replan for an unchanged "
        "(membership, precision) (controller/executor.py). Emptied when a plan is adopted "
        "and at a launch. Empty: none (wire version 5).",
    )
    in_place_reads: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict,
        description="At an in-place launch: node id -> checkpoint bytes its ranks read, the "
        "layers no complete surviving replica group of the previous plan holds (sized at the "
        "LAUNCH from the previous layout, controller/plan_deadlines.py); what its LOAD "
        "deadline is derived from. Empty: a restart launch, or nothing to read (wire "
        "version 6).",
    )
    launch_waited: tuple[str, ...] = Field(
        default=(),
        max_length=MAX_NODE_LIST,
        description="Placed nodes (sorted) the current LAUNCH waited for past its deadline "
        "because their agent refused the Launch while it killed the previous workers "
        "(AgentStatus.killing): waited for, their Launch re-sent, up to deadlines.teardown "
        "past the deadline also once the kill has ended (the pass its end wakes comes before "
        "the re-sent Launch's ack), unless they report a failure. Emptied at the next launch "
        "and once every node acked. Empty: none (wire version 5).",
    )

    periodic: PeriodicCheckpoint = Field(
        default_factory=PeriodicCheckpoint,
        description="RUNNING: the controller's periodic checkpoint in flight, and when the "
        "last was asked for (``ControllerConfig.checkpoint_every_s``); reset when the phase "
        "leaves RUNNING. Empty: none asked in this phase (wire version 7).",
    )
    drop_steps: tuple[int, ...] = Field(
        default=(),
        max_length=MAX_DROP_STEPS,
        description="Steps of the saves given up on since the last commit (an aborted or "
        "failed reconfiguration CHECKPOINT, a periodic save abandoned or superseded), oldest "
        "first, never a recorded step: every Checkpoint names them (``Checkpoint.drop_steps``) "
        "so its committer deletes those that committed anyway. Emptied by the next commit "
        "(its save carried them all); past MAX_DROP_STEPS the oldest are forgotten (left on "
        "disk, never deleted wrongly) (``controller/drop_steps.py``, wire version 8).",
    )

    @field_validator("drop_steps")
    @classmethod
    def _drop_steps_valid(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        bad = [s for s in v if s < 0]
        if bad:
            raise field_error("drop_steps", v, f"steps are >= 0, not {bad[0]}")
        if len(set(v)) != len(v):
            raise field_error("drop_steps", v, "a step is named once")
        return v

    @field_validator("agreed_health")
    @classmethod
    def _agreed_named(cls, v: dict[str, NodeHealth]) -> dict[str, NodeHealth]:
        for kind in v:
            if not kind.isidentifier():
                raise field_error("agreed_health", kind, "keys are error types (identifiers)")
        return v

    @field_validator("lost_nodes")
    @classmethod
    def _lost_sorted(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        sorted_node_ids("lost_nodes", v)
        return v

    @field_validator("launch_waited")
    @classmethod
    def _waited_sorted(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        sorted_node_ids("launch_waited", v)
        return v

    @field_validator("cause", "path_reason", mode="before")
    @classmethod
    def _shortened(cls, v: object) -> object:
        """A state whose cause grew past the limit (written whole before it was shortened
        on write) still reads: a leader refused to lead from it, agents to launch."""
        return shorten(v) if isinstance(v, str) else v


class AgentStatus(WireMessage):
    """An agent's report of its node, written under its lease."""

    node_id: str = Field(min_length=1, description="Node.")
    epoch: int = Field(default=0, ge=0, description="Highest controller epoch seen.")
    generation: int = Field(default=-1, ge=-1, description="Generation of the workers it runs.")
    plan_id: str = Field(default="", description="Plan of the workers.")
    state: AgentState = Field(default="idle", description="Workers' state.")
    step: int = Field(default=-1, ge=-1, description="Last step completed by all its workers.")
    loss: float | None = Field(default=None, description="Loss of that step (rank 0 of node).")
    start_step: int = Field(default=-1, ge=-1, description="Step the workers started from.")
    saved_step: int = Field(default=-1, ge=-1, description="Last step its workers saved.")
    save_failed_step: int = Field(
        default=-1,
        ge=-1,
        description="Last step of this generation whose optional save (a periodic "
        "checkpoint's) failed, agreed by every rank, and was abandoned while training went on; "
        "-1: none (wire version 7).",
    )
    save_failure: str = Field(
        default="",
        max_length=1024,
        description="What failed in that save (the ranks and the first one's error).",
    )
    failure: str = Field(default="", max_length=4096, description="First failure cause.")
    culprit: int = Field(
        default=-1,
        ge=-1,
        description="Global rank ``failure`` names as guilty (a peer whose bytes did not "
        "decode, whose size was out of bounds or whose object had the wrong shape); -1: none. "
        "A failed worker's record carries it too (its key ``culprit``); for held workers whose "
        "world broke (their cause is no record) the controller reads it here.",
    )
    held_step: int = Field(
        default=-1,
        ge=-1,
        description="State ``held``: the step the workers hold the state of (for a world that "
        "broke, the last step they completed).",
    )
    killing: int = Field(
        default=0,
        ge=0,
        description="Worker process groups being killed now (an Abort is acked once their "
        "signals are sent): not yet gone, nor past the agent's teardown bound (then the "
        "failure is OutlivedKill). No worker starts on the node while it is above 0.",
    )
    spares: int = Field(default=0, ge=0, description="Warm spare worker processes ready now.")
    spares_wanted: int = Field(
        default=0, ge=0, description="Warm spares the agent keeps (AgentConfig.warm_spares)."
    )
    notice: PreemptionNotice | None = Field(
        default=None,
        description="The node's preemption notice, also published as an event: the second "
        "path to the controller while NATS is down (the leader validates it as an event).",
    )
    cpu_quota: float | Literal["unavailable"] | None = Field(
        default=None,
        description="The CPU quota its workers run under, cores' worth for all of them "
        "(AgentConfig.cpu_quota, as the kernel holds it now); 'unavailable': configured, but "
        "this host has no writable cpu controller, so they run unthrottled; None: no quota.",
    )
    time: float = Field(default=0.0, ge=0, description="Unix time of this report.")
    timings: tuple[RankTimings, ...] = Field(
        default=(),
        description="Per rank of this node, the medians of its last steps' timings (online "
        "calibration); empty when its workers report none.",
    )


class CommandAck(WireMessage):
    """An agent's reply to a command."""

    command_id: str = Field(description="Command acknowledged.")
    node_id: str = Field(default="", description="Replying node.")
    accepted: bool = Field(description="Applied now or earlier (idempotent replay).")
    duplicate: bool = Field(default=False, description="Command id already applied before.")
    reason: str = Field(
        default="",
        max_length=1024,
        description="Why refused; on an accepted Abort whose kill goes on, that it does.",
    )
    epoch_seen: int = Field(default=0, ge=0, description="Highest epoch the agent has seen.")


class NoticeRecord(WireMessage):
    """A preemption notice, kept in etcd so that any leader acts on it."""

    node_id: str = Field(min_length=1, description="Node to be reclaimed.")
    deadline: float = Field(ge=0, description="Unix time the node will be gone.")
    event_id: str = Field(default="", description="Event that reported it.")
    source: str = Field(default="", description="Watcher that saw it.")


class EventStreamState(WireMessage):
    """The leader's event stream as ``sailor status`` shows it (``event-stream``, bound to
    the leader's lease: it goes with the term). Written only once the stream could not be
    placed (too few NATS servers for ``event_stream_replicas``), again when that ends."""

    placed: bool = Field(description="The stream is placed: events reach the leader.")
    since: float = Field(
        ge=0, description="Unix time of the first failed placement, or of the placement."
    )
    reason: str = Field(
        default="", max_length=1024, description="JetStream's answer, while not placed."
    )
    replicas: int = Field(ge=1, description="Replicas asked (event_stream_replicas).")
    overdue: bool = Field(
        default=False,
        description="Not placed for longer than event_stream_deadline_s (an error logged).",
    )
    epoch: int = Field(ge=0, description="Leader epoch that wrote it.")


class CommitRecord(WireMessage):
    """A checkpoint whose every shard is durable and whose manifest is committed."""

    kind: Literal["commit"] = Field(default="commit", description="Record kind.")
    step: int = Field(ge=0, description="Step committed.")
    directory: str = Field(description="Checkpoint root.")
    plan_id: str = Field(default="", description="Layout it was saved from.")
    generation: int = Field(default=0, ge=0, description="Generation that saved it.")
    epoch: int = Field(default=0, ge=0, description="Leader epoch that committed it.")
    time: float = Field(default=0.0, ge=0, description="Unix time of the commit.")
    periodic: bool = Field(
        default=False,
        description="A periodic checkpoint of the RUNNING job (``controller/periodic.py``), "
        "not a reconfiguration's (wire version 7).",
    )


class ReadmitRequest(WireMessage):
    """An operator's request (``sailor node readmit``) that the leader forget failure
    records: the named nodes', or with ``all`` every node's and the job's. Written under
    ``readmit/<id>`` of the job's etcd root by an identity that may write there (a
    controller's or root: agents may not, RBAC); the leader applies it in a pass, as it
    writes every desired state, and deletes the key."""

    nodes: tuple[str, ...] = Field(default=(), description="Node ids whose records go.")
    all: bool = Field(default=False, description="Every node's record and the job's go.")
    who: str = Field(default="", max_length=256, description="Who asked (user@host).")
    time: float = Field(default=0.0, ge=0, description="Unix time of the request.")

    @model_validator(mode="after")
    def _names_something(self) -> ReadmitRequest:
        if not self.nodes and not self.all:
            raise field_error("nodes", self.nodes, "empty: name nodes, or set all")
        if any(not n for n in self.nodes):
            raise field_error("nodes", self.nodes, "an empty node id")
        return self


class ClearBadRequest(WireMessage):
    """An operator's request (``sailor checkpoint clear-bad``) that the leader clear the
    bad (and suspect) marks of committed steps once their storage is repaired: the named
    steps', or with ``all`` every one. Written under ``clear-bad/<id>`` of the job's etcd
    root by an identity that may write there (a controller's or root), applied by the
    leader in a pass and deleted, as a ``ReadmitRequest``."""

    steps: tuple[int, ...] = Field(
        default=(), max_length=1024, description="Steps whose marks go (sorted)."
    )
    all: bool = Field(default=False, description="Every bad and suspect mark goes.")
    repoint: bool = Field(
        default=False,
        description="The commit records of the steps named (``all``: every one) that name "
        "another directory than the leader's ``checkpoint_dir`` are re-pointed to it (their "
        "files were moved there), and their marks go too; wire version 7.",
    )
    who: str = Field(default="", max_length=256, description="Who asked (user@host).")
    time: float = Field(default=0.0, ge=0, description="Unix time of the request.")

    @model_validator(mode="after")
    def _names_something(self) -> ClearBadRequest:
        if not self.steps and not self.all:
            raise field_error("steps", self.steps, "empty: name steps, or set all")
        if any(s < 0 for s in self.steps):
            raise field_error("steps", self.steps, "a negative step")
        if list(self.steps) != sorted(set(self.steps)):
            raise field_error("steps", self.steps, "must be sorted, without repeats")
        return self
