"""The reconfiguration state machine: phases, legal transitions and per-phase deadlines.

::

    IDLE ──> LAUNCH ──> LOAD ──> VERIFY ──> RUNNING
               ^                               │ plan change / preemption notice
               │                               v
            TEARDOWN <── COMMIT <── CHECKPOINT <── QUIESCE

    any of QUIESCE..VERIFY, and RUNNING on a failure or a node lost without notice
        ──(abort)──> TEARDOWN, which relaunches from the last committed checkpoint
    TEARDOWN ──> IDLE when no usable node is left, or the config contradicts the job's precision

Legal transitions (``LEGAL``): RUNNING→QUIESCE, QUIESCE→CHECKPOINT, CHECKPOINT→COMMIT,
COMMIT→TEARDOWN, TEARDOWN→LAUNCH, LAUNCH→LOAD, LOAD→VERIFY, VERIFY→RUNNING, IDLE→LAUNCH,
TEARDOWN→IDLE, and X→TEARDOWN (abort) from every phase but IDLE. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import Field

from sailor.controller.plan_deadlines import DeadlineModel
from sailor.schemas._base import Frozen
from sailor.schemas.runtime import Phase, StretchedPhase

__all__ = ["LEGAL", "PhaseDeadlines", "check_transition", "is_legal", "stretch_key"]

_STRETCH_MAX_S = 6 * 3600.0
"""The default ceiling of a stretched LOAD or VERIFY deadline (``stretch_max_s``), s: twice
``DeadlineModel.max_s``'s default (3 h)."""

_FORWARD: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.LAUNCH}),
    Phase.RUNNING: frozenset({Phase.QUIESCE}),
    Phase.QUIESCE: frozenset({Phase.CHECKPOINT}),
    Phase.CHECKPOINT: frozenset({Phase.COMMIT}),
    Phase.COMMIT: frozenset({Phase.TEARDOWN}),
    Phase.TEARDOWN: frozenset({Phase.LAUNCH, Phase.IDLE}),
    Phase.LAUNCH: frozenset({Phase.LOAD}),
    Phase.LOAD: frozenset({Phase.VERIFY}),
    Phase.VERIFY: frozenset({Phase.RUNNING}),
}

LEGAL: dict[Phase, frozenset[Phase]] = {
    p: nxt | ({Phase.TEARDOWN} if p is not Phase.IDLE else frozenset())
    for p, nxt in _FORWARD.items()
}
"""phase -> phases it may move to (forward step or abort to TEARDOWN)."""


def is_legal(src: Phase, dst: Phase) -> bool:
    return src == dst or dst in LEGAL[src]


def check_transition(src: Phase, dst: Phase) -> None:
    """Raise ValueError naming both phases if the move is not legal."""
    if not is_legal(src, dst):
        raise ValueError(f"phase transition {src.value} -> {dst.value} is not legal")


def stretch_key(phase: Phase) -> StretchedPhase:
    """``phase`` (LOAD or VERIFY) as a key of ``DesiredState.deadline_stretch``."""
    if phase is Phase.LOAD:
        return "load"
    if phase is Phase.VERIFY:
        return "verify"
    raise ValueError(f"phase={phase.value!r}: only load and verify deadlines stretch")


class PhaseDeadlines(Frozen):
    """Seconds each phase may take before the reconfiguration is aborted.

    The configured lengths are floors. QUIESCE, CHECKPOINT, LOAD and VERIFY get the longer
    of theirs and what the plan needs (``derive``, ``controller/plan_deadlines.py``): the
    bytes its busiest node writes or reads at the configured storage throughput, its
    predicted iteration time. The defaults here were made for the CPU demo (``make demo``:
    the tiny model on a 2-core machine, a step well under a second, a launch with torch's
    import about 5 s) and keep its tests quick to notice a hang; the demo's tiny model needs
    less than every one of them, so its deadlines are these. A 7B model on two 8-GPU nodes
    writes ~40 GB per node: at a default gp3 volume's 125 MiB/s its CHECKPOINT gets ~10
    minutes, not 60 s. Set ``derive``'s throughputs for your storage; a floor above the
    derived value (a start-up the model does not size: NCCL init at hundreds of nodes) is
    still yours to raise. A ``load`` or ``verify`` deadline that no placed node gets past
    stretches itself on top (``stretch_cap``), so a deadline too short costs relaunches,
    not a hold; a ``checkpoint`` one does not stretch.
    """

    quiesce: float = Field(
        default=30.0, gt=0, description="Reach the agreed step (the floor: see ``derive``)."
    )
    checkpoint: float = Field(
        default=60.0, gt=0, description="Every shard durable (the floor: see ``derive``)."
    )
    commit: float = Field(default=10.0, gt=0, description="Record the commit in etcd.")
    teardown: float = Field(
        default=150.0,
        gt=0,
        description="All workers gone. Above the agent's kill bound: it acks an Abort once "
        "the signals are sent, and TEARDOWN waits until its status reports no process group "
        "being killed (AgentStatus.killing), up to 3 s of SIGTERM grace plus 120 s of "
        "teardown_timeout_s (sailor/agent/killed_groups.py); a shorter deadline charged "
        "nodes still killing.",
    )
    launch: float = Field(default=20.0, gt=0, description="Every node acked its launch.")
    load: float = Field(
        default=120.0,
        gt=0,
        description="Workers started and loading: the floor; a checkpoint's read is sized "
        "by ``derive``.",
    )
    verify: float = Field(
        default=120.0,
        gt=0,
        description="First step in the new layout: the floor; the plan's predicted "
        "iteration time is counted by ``derive``.",
    )
    stretch_cap: int = Field(
        default=8,
        ge=1,
        description="Most a LOAD or VERIFY deadline is stretched: each generation that no "
        "placed node got through doubles that phase's next deadline up to this factor (and "
        "stretch_max_s) before anyone is charged (docs/runtime.md, Failing nodes). 1: charge "
        "at once.",
    )
    stretch_max_s: float = Field(
        default=_STRETCH_MAX_S,
        gt=0,
        description="Most a stretch lengthens a LOAD or VERIFY deadline to, s: it doubles "
        "only while the stretched deadline stays within this, and a deadline above it (a "
        "derived one at deadlines.derive.max_s under a lower setting, a floor set above it) "
        "is not stretched. Default 6 h: twice deadlines.derive.max_s's default, so a "
        "deadline the model capped still doubles once; before, 3 h x stretch_cap reached "
        "24 h, after 3 + 6 + 12 h of stalls.",
    )
    derive: DeadlineModel = Field(
        default_factory=DeadlineModel,
        description="What QUIESCE, CHECKPOINT, LOAD and VERIFY need by the plan's bytes and "
        "iteration time; each gets the longer of that and its configured length "
        "(``enabled: false``: the configured lengths alone).",
    )

    def factor(self, phase: Phase, stretch: Mapping[StretchedPhase, int] | None = None) -> int:
        """The factor ``stretch`` (``DesiredState.deadline_stretch``) multiplies ``phase``'s
        deadline by: 1 when none, at most ``stretch_cap`` (a state written under a larger cap
        uses this one's)."""
        factor = next((f for k, f in (stretch or {}).items() if k == phase.value), 1)
        return min(max(int(factor), 1), self.stretch_cap)

    def fitted(
        self, phase: Phase, stretch: Mapping[StretchedPhase, int] | None, base_s: float
    ) -> int:
        """:meth:`factor`, halved while it stretches ``base_s`` past ``stretch_max_s`` (1
        when ``base_s`` is past it already): the factor a phase of that base gets."""
        factor = self.factor(phase, stretch)
        while factor > 1 and base_s * factor > self.stretch_max_s:
            factor //= 2
        return factor

    def of(self, phase: Phase, stretch: Mapping[StretchedPhase, int] | None = None) -> float:
        """Configured deadline length of ``phase``; 0 for phases without one (IDLE, RUNNING).
        With ``stretch``, times the phase's :meth:`factor`. What a plan needs on top is
        ``decision_types.phase_deadline``'s."""
        return float(getattr(self, phase.value, 0.0)) * self.factor(phase, stretch)
