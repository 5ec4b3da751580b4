"""The controller's searches: one replan at a time, keyed, cancellable, backed off on failure.

Planning runs as a named task — in the planner's worker process when it has one (``aplan``),
else in a thread — so it overlaps the checkpoint. A replan and its result are keyed by
(membership, precision): a replan for the same nodes in another precision (the job's was
fixed meanwhile) is a new one, not swallowed by the one under way. A replan that times out,
or that a replan for a newer key replaces, is cancelled; cancelling ``aplan`` kills the worker
process's search (``ProcessPlanner``), so a later replan never queues behind an abandoned one.
(A search in a thread cannot be stopped: it runs to its end, its result dropped.) A replan
that failed is not started again for the same key before its backoff is over
(``REPLAN_RETRY_S``, doubling per failure up to ``REPLAN_RETRY_MAX_S``; a new membership or
precision, or a new leader, tries at once); why, and when it is retried, goes into the
desired state (``plan_failed``) for ``sailor status`` while that replan is the one the job
waits for (``decide.wanted_replan``), and goes once it is not (another membership or
precision, no replan at all: the job IDLE without nodes, or launched).

One instance per leadership term (the executor's): a new leader starts without backoffs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sailor.controller.audit import AuditLog
from sailor.controller.decision_types import Replan
from sailor.controller.job_precision import plan_precision
from sailor.controller.planning import Planner, PlanResult
from sailor.coordination import Clock, TaskSet
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.model import ModelSpec
from sailor.schemas.precision import Precision
from sailor.schemas.runtime import DesiredState, shorten

__all__ = [
    "REPLAN_RETRY_MAX_S",
    "REPLAN_RETRY_S",
    "REPLAN_TIMEOUT_S",
    "ReplanKey",
    "Replans",
]

REPLAN_TIMEOUT_S = 60.0
"""A search still running after this long is cancelled and the replan fails (``plan_failed``);
decide asks again on a later pass."""

REPLAN_RETRY_S = 15.0
"""After a replan failed, the same (membership, precision) is not planned again for this
long, doubled at each further failure up to ``REPLAN_RETRY_MAX_S``. A pool where no GPU can
run a forced precision failed the same search on every decide pass, each an audit record;
a transient failure (a timeout under load) is still retried soon."""

REPLAN_RETRY_MAX_S = 300.0
"""The longest backoff between two failed replans of the same (membership, precision)."""

ReplanKey = tuple[tuple[str, ...], Precision | None]
"""What a replan is for: the node ids (the membership) and the precision it plans in."""


class Replans:
    """The replan under way, the result waiting to be adopted, and the failed ones' backoff."""

    def __init__(
        self,
        planner: Planner,
        audit: AuditLog,
        clock: Clock,
        tasks: TaskSet,
        wake: Callable[[bool], None],
        epoch: Callable[[], int],
        timeout_s: float = REPLAN_TIMEOUT_S,
        model: ModelSpec | None = None,
    ) -> None:
        self.planner = planner
        self.audit = audit
        self.clock = clock
        self.tasks = tasks
        self.wake = wake
        self.epoch = epoch
        self.timeout_s = timeout_s
        self.model = model  # for the precision a plan trains in (``plan_precision``)
        self.running: ReplanKey | None = None
        self._task: asyncio.Task[None] | None = None
        self.ready: tuple[ReplanKey, PlanResult] | None = None
        # the backoff of failed replans, per key: failures in a row, retry time, error, the
        # node records asked with (a node that re-registers under its id with other GPUs is
        # a new question: no backoff), and the note for the desired state (``plan_failed``)
        self.failed: dict[ReplanKey, tuple[int, float, str, tuple[NodeSpec, ...], str]] = {}

    def start(self, action: Replan) -> bool:
        """Start planning for the action's nodes in its precision; False if that is under
        way already, its result waits to be adopted, or it failed and its backoff is on."""
        membership = tuple(n.node_id for n in action.nodes)
        key: ReplanKey = (membership, action.precision)
        if self.running == key:
            return False
        if self.ready is not None and self.ready[0] == key:
            return False
        failed = self.failed.get(key)
        if failed is not None and self.clock.now() < failed[1] and failed[3] == action.nodes:
            return False  # backed off: the same nodes (ids and records) in the same precision
        old = self._task
        if old is not None and not old.done():
            # Replaced by a newer key: stop its search (the worker process's would
            # otherwise run on, and this one queue behind it).
            old.cancel()
        self.running = key

        async def run() -> None:
            t0 = self.clock.now()
            try:
                aplan = getattr(self.planner, "aplan", None)
                if aplan is not None:
                    work = aplan(action.nodes, action.previous, action.precision)
                else:
                    work = asyncio.to_thread(
                        self.planner.plan, action.nodes, action.previous, action.precision
                    )
                # on timeout wait_for cancels ``work``: aplan's search is killed with it
                result = await asyncio.wait_for(work, self.timeout_s)
            except Exception as exc:
                error = repr(exc) if str(exc) else type(exc).__name__
                if self.running == key:  # not one that a newer replan replaced
                    self.running = None
                    self._note_failure(key, error, action.nodes)
                self.audit.write(
                    "plan_failed",
                    self.clock.now(),
                    epoch=self.epoch(),
                    nodes=len(membership),
                    job_precision=action.precision,
                    error=error,
                    retry_in_s=round(self.failed[key][1] - self.clock.now(), 3)
                    if key in self.failed
                    else None,
                )
                self.wake(True)  # the reason goes into the desired state now
                return
            if self.running != key:
                return
            self.ready = (key, result)
            self.running = None
            self.failed.pop(key, None)
            pred = result.plan.predicted
            self.audit.write(
                "plan",
                self.clock.now(),
                epoch=self.epoch(),
                plan_id=result.plan.plan_id,
                nodes=len(membership),
                gpus=result.plan.num_gpus,
                reason=result.reason,
                cause=action.cause,
                planning_s=round(self.clock.now() - t0, 4),
                predicted=None if pred is None else pred.model_dump(),
                precision=result.plan.precision,
                job_precision=action.precision,
            )
            self.wake(True)  # adopt it now: no debounce between a finished plan and etcd

        self._task = self.tasks.spawn(f"replan-{len(membership)}", run())
        return True

    def _note_failure(
        self, key: ReplanKey, error: str, nodes_asked: tuple[NodeSpec, ...] = ()
    ) -> None:
        """Back off ``key``'s replan: ``REPLAN_RETRY_S`` doubled per failure in a row, up to
        ``REPLAN_RETRY_MAX_S``; the reason is noted for the desired state
        (:meth:`failure_shown`). The other keys' records go: only the latest membership and
        precision are ever asked for."""
        count = self.failed[key][0] + 1 if key in self.failed else 1
        wait = min(REPLAN_RETRY_S * 2 ** (count - 1), REPLAN_RETRY_MAX_S)
        nodes, precision = key
        note = shorten(
            f"replan for {len(nodes)} nodes in precision={precision or 'not fixed'} failed "
            f"{count}x: {error}; tried again in {wait:.0f} s, or at once for other nodes or "
            f"another precision"
        )
        self.failed = {key: (count, self.clock.now() + wait, error, nodes_asked, note)}

    def failure_shown(
        self, desired: DesiredState, wanted: Replan | None
    ) -> tuple[DesiredState, str] | None:
        """``desired`` with the failed search's reason (``plan_failed``) as the present has
        it, and why, given the replan the job waits for (``decide.wanted_replan``); None
        when it holds that already (a write only when it changes). The reason of this
        leader's last failed replan while ``wanted`` is that very replan (the same node ids
        and records, the same precision: backed off, or retried), else none. A reason this
        leader did not note (a previous leader's) stays while some replan is wanted: its
        result replaces or clears it."""
        if wanted is None:
            note = ""
        elif not self.failed:
            return None
        else:
            key: ReplanKey = (tuple(n.node_id for n in wanted.nodes), wanted.precision)
            failed = self.failed.get(key)
            note = failed[4] if failed is not None and failed[3] == wanted.nodes else ""
        if note == desired.plan_failed:
            return None
        if note:
            return desired.model_copy(update={"plan_failed": note}), "plan failed"
        now = "no replan" if wanted is None else f"a replan for {len(wanted.nodes)} nodes"
        why = f"the failed search is no longer wanted ({now} is)"
        return desired.model_copy(update={"plan_failed": ""}), why

    def adopt(self, desired: DesiredState) -> tuple[DesiredState, str] | None:
        """A desired state carrying the finished plan (no failed search's reason left), if
        one is ready and still wanted, with why it is written; None when none is news. A
        result is adopted unless the next plan is for its membership in its precision
        already."""
        ready, self.ready = self.ready, None
        if ready is not None:
            (membership, _), result = ready
            same = (
                desired.next_plan is not None
                and desired.next_membership == membership
                and plan_precision(desired.next_plan, self.model)
                == plan_precision(result.plan, self.model)
            )
            if not same:
                state = desired.model_copy(
                    update={
                        "next_plan": result.plan,
                        "next_placement": result.placement,
                        "next_membership": membership,
                        "plan_failed": "",
                    }
                )
                return state, "plan ready"
            if desired.plan_failed:
                return desired.model_copy(update={"plan_failed": ""}), "plan ready"
        return None
