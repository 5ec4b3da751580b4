"""Applies the actions ``decide`` returns: guarded etcd writes, commands, replanning.

The executor is the I/O half of decide-then-apply. Every etcd write goes through the
leader's epoch guard; a ``FencedError`` means this controller was deposed and it must stop.
Commands go out through ``command_sends.CommandSends`` (in the background, each waiting a
bounded time for its ack; a fan-out's records durable before the first request; acks and
refusals kept for ``decide``, bounded by generations). Planning runs as a named task
(``replans.Replans``: one replan at a time, keyed by membership and precision, cancelled
when replaced or timed out, backed off when it fails), so it overlaps the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import structlog

from sailor.controller.audit import AuditLog
from sailor.controller.command_sends import CommandSends
from sailor.controller.decision_types import (
    Action,
    ClearBadDone,
    ClearNotice,
    ClearReadmit,
    Commit,
    DecideConfig,
    PeriodicOutcome,
    Replan,
    Send,
    SetDesired,
    phase_deadline,
)
from sailor.controller.layout import layout_of
from sailor.controller.planning import Planner
from sailor.controller.replans import REPLAN_TIMEOUT_S, Replans
from sailor.controller.take_marks import mark_value, read_mark, request_record
from sailor.coordination import (
    ChangedError,
    Clock,
    EtcdStore,
    FencedError,
    Keys,
    Leadership,
    NatsCommands,
    TaskSet,
    TemporaryError,
)
from sailor.schemas.commands import training_digest
from sailor.schemas.runtime import (
    CAUSE_MAX,
    Accusations,
    DesiredState,
    NodeHealth,
    PeriodicCheckpoint,
    Phase,
    SigabrtReports,
    SuspectCheckpoint,
    shorten,
)

__all__ = ["Executor"]

_log = structlog.get_logger("sailor.controller")


@dataclass(frozen=True)
class _LostWrite:
    """A desired state whose write met an etcd error (committed or not), with what its
    phase record needs and the requests it applies."""

    state: DesiredState
    reason: str
    take: tuple[ClearReadmit | ClearBadDone, ...]
    load_directory: str | None


class Executor:
    """I/O for one leadership term."""

    def __init__(
        self,
        store: EtcdStore,
        commands: NatsCommands,
        keys: Keys,
        audit: AuditLog,
        leadership: Leadership,
        planner: Planner,
        clock: Clock,
        tasks: TaskSet,
        wake: Callable[[bool], None],
        command_timeout_s: float = 1.0,
        resend_s: float = 0.5,
        replan_timeout_s: float = REPLAN_TIMEOUT_S,
        decide_cfg: DecideConfig | None = None,
    ) -> None:
        self.store = store
        self.commands = commands
        self.keys = keys
        self.audit = audit
        self.lead = leadership
        self.clock = clock
        self.tasks = tasks
        self.wake = wake
        # what the decision's deadlines were set with: each phase record says why its length
        self.decide_cfg = decide_cfg
        self.sends = CommandSends(commands, audit, clock, tasks, wake, command_timeout_s, resend_s)
        self.replans = Replans(
            planner,
            audit,
            clock,
            tasks,
            wake,
            lambda: self.epoch,
            replan_timeout_s,
            decide_cfg.model if decide_cfg is not None else None,
        )
        self.progressed = False
        # the operators' requests (readmit/, clear-bad/) as this pass observed them: key ->
        # mod revision, set by the daemon. A pass that applies one writes the desired state
        # and deletes the request in one transaction, only while the key is as observed: a
        # command that gave up withdraws it (compare-and-delete), and exactly one of the
        # two takes it, so the command's answer ("applied" or "withdrawn") is what happened
        self.request_revisions: dict[str, int] = {}
        # requests a write found changed (withdrawn) since observed: key -> the revision
        # observed. The daemon leaves them out of the passes whose mirror still shows that
        # revision (the watch delivers the delete a moment later): before, each such pass
        # decided the same refused write again, at once
        self.withdrawn: dict[str, int] = {}
        # the last desired state whose write met an etcd error (with the requests it
        # applies), until the leader reads its state back (settle_lost): etcd may have
        # committed it, and then its phase record (and its requests') is written there
        self.lost: _LostWrite | None = None
        # requests deleted without a desired state (``_take``) whose delete met an etcd
        # error: committed or not, ``settle_lost_takes`` tells once etcd answers
        self.lost_takes: dict[str, ClearReadmit | ClearBadDone] = {}
        # a desired state that took requests, whose write met an etcd error and that the
        # read-back did not find committed: each request it took is settled by
        # ``settle_lost_takes`` (withdrawn meanwhile, or there for the next pass)
        self.uncommitted: _LostWrite | None = None
        # marks of takes audited whose delete etcd did not answer: deleted at the next
        # pass or settle (else the next term would audit those takes once more)
        self.marks_left: set[str] = set()
        # the marks an earlier term left (its takes unsettled) are audited once a term
        self.orphans_settled = False

    @property
    def epoch(self) -> int:
        return self.lead.epoch

    async def write_desired(
        self,
        state: DesiredState,
        reason: str,
        take: tuple[ClearReadmit | ClearBadDone, ...] = (),
        load_directory: str | None = None,
    ) -> None:
        """Write ``state`` under the epoch guard, and the phase record. ``take``: the
        operators' requests it applies, their keys deleted in the same transaction while
        each is as observed (``request_revisions``); ``ChangedError`` if one was withdrawn
        (nothing written). ``load_directory``: a LAUNCH state's checkpoint root
        (``SetDesired.load_directory``), in its record."""
        # a field added since the last release is written only when in use: agents and a
        # standby controller on a release before wire versions read the state as long as
        # it is not (their schema refuses fields it does not know)
        fields = (
            "bad_checkpoints",
            "node_health",
            "agreed_health",
            "deadline_stretch",
            "lost_nodes",
            "job_precision",
            "plan_failed",
            "launch_waited",
            "in_place_reads",
            "forgiven_nodes",
            "drop_steps",
            "rendezvous_retries",
        )
        unused = {f for f in fields if not getattr(state, f)}
        if state.job_health == NodeHealth():
            unused.add("job_health")
        if state.suspect_checkpoint == SuspectCheckpoint():
            unused.add("suspect_checkpoint")
        if state.reads_spent_through < state.generation:
            # spends the current generation's read failures only: an older one's is moot
            unused.add("reads_spent_through")
        if state.sigabrt_reports == SigabrtReports():
            unused.add("sigabrt_reports")
        if state.accusations == Accusations():
            unused.add("accusations")
        if state.periodic == PeriodicCheckpoint():
            unused.add("periodic")
        # model_copy does not validate: a cause naming every node of a large layout would
        # be written whole, and no reader could parse the state back
        if len(state.cause) > CAUSE_MAX or len(state.path_reason) > CAUSE_MAX:
            state = state.model_copy(
                update={"cause": shorten(state.cause), "path_reason": shorten(state.path_reason)}
            )
        data = state.model_dump_json(exclude=unused or None).encode()
        if self.lost is not None and self.lost.state == state:
            self.lost = None  # written again (a retried takeover): this write's record stands
        try:
            if take:
                keys = tuple(self._request_key(a) for a in take)
                marks = [
                    (self.keys.taken(k), mark_value(a, self.epoch))
                    for k, a in zip(keys, take, strict=True)
                ]
                await self.store.put_all_guarded(
                    [(self.keys.desired, data), *self._repointed(take), *marks],
                    self.keys.leader,
                    self.epoch,
                    delete=keys,
                    expect=self._expected(keys),
                )
                for key in keys:
                    self.lost_takes.pop(key, None)
                self._answered(keys)
            else:
                await self.store.put_guarded(self.keys.desired, data, self.keys.leader, self.epoch)
        except TemporaryError:
            # committed or not: settle_lost tells, and writes the records then (before, a
            # write whose answer was lost and that etcd committed had no phase record)
            self.lost = _LostWrite(state, reason, take, load_directory)
            raise
        self._phase_record(state, reason, load_directory)

    def _phase_record(
        self, state: DesiredState, reason: str, load_directory: str | None, **more: Any
    ) -> None:
        """The audit record of a desired state written (``phase``)."""
        extra: dict[str, Any] = {}
        if state.bad_checkpoints:
            extra["bad_checkpoints"] = list(state.bad_checkpoints)
        if state.drop_steps:  # saves given up on: the next save's committer deletes them
            extra["drop_steps"] = list(state.drop_steps)
        if state.rendezvous_retries:  # aborts in a row of a taken rendezvous port
            extra["rendezvous_retries"] = state.rendezvous_retries
        if state.deadline_stretch:  # LOAD or VERIFY deadlines stretched after a stall
            extra["deadline_stretch"] = dict(state.deadline_stretch)
        if state.suspect_checkpoint.step >= 0:  # loaded again without the nodes that failed
            extra["suspect_checkpoint"] = state.suspect_checkpoint.model_dump(mode="json")
        now = self.clock.now()
        out = {n: r.excluded_until for n, r in state.node_health.items() if r.excluded_until > now}
        if out:  # which nodes no layout may use, and until when
            extra["excluded"] = out
        holds = [state.job_health, *state.agreed_health.values()]
        until = max(r.excluded_until for r in holds)
        if until > now:  # no layout is launched until then
            extra["job_excluded"] = until
        if state.phase is Phase.LAUNCH:  # which training config and layout this generation runs
            t = state.training
            extra["training_sha256"] = training_digest(t) if t is not None else ""
            extra["path"] = state.path
            extra["path_reason"] = state.path_reason
            extra["job_precision"] = state.job_precision
            if load_directory is not None:  # which directory this generation reads
                extra["load_directory"] = load_directory
            if state.plan is not None:
                extra["layout"] = layout_of(state.plan, state.placement)
                pred = state.plan.predicted
                extra["predicted_step_s"] = pred.iteration_time_s if pred is not None else None
        if state.phase_deadline > 0:
            extra["deadline_s"] = round(state.phase_deadline - state.phase_since, 3)
            if self.decide_cfg is not None:
                extra["deadline"] = _deadline_why(state, self.decide_cfg)
        self.audit.write(
            "phase",
            now,
            epoch=self.epoch,
            phase=state.phase.value,
            generation=state.generation,
            plan_id=state.plan.plan_id if state.plan else "",
            stop_step=state.stop_step,
            load_step=state.load_step,
            cause=reason,
            **extra,
            **more,
        )

    async def apply(self, actions: list[Action], desired: DesiredState) -> DesiredState:
        """Carry out ``actions``; sets ``progressed`` if anything but a send happened.

        ``progressed`` is what the loop's undebounced follow-up pass is for: a Replan the
        executor is already running, or commands already in flight, change nothing, and a
        pass that follows them would decide the same again (a spinning loop: 47,000 passes
        in 20 s while the first search ran at 64 nodes, once etcd reads no longer paced it).
        """
        self.progressed = False
        if self.marks_left:
            # marks of takes audited whose delete etcd did not answer: tried at each pass
            # (a settle runs only after a pass that raised, and a term left with marks has
            # the next leader audit those takes once more)
            await self._unmark(*sorted(self.marks_left))
        sends = [a for a in actions if isinstance(a, Send)]
        taken: set[str] = set()
        for i, a in enumerate(actions):
            if isinstance(a, Replan):
                self.progressed |= self.replans.start(a)
                continue
            if isinstance(a, Send):  # sent below when due; acks wake the loop themselves
                continue
            if isinstance(a, PeriodicOutcome):  # a record only: the state comes with it
                self.audit.write(
                    "periodic_checkpoint",
                    self.clock.now(),
                    epoch=self.epoch,
                    outcome=a.outcome,
                    step=a.step,
                    generation=a.generation,
                    cause=a.reason,
                )
                continue
            before, self.progressed = self.progressed, True
            if isinstance(a, SetDesired):
                take = self._requests_applied(actions, i)
                try:
                    await self.write_desired(a.state, a.reason, take, a.load_directory)
                except ChangedError:
                    # an operator withdrew a request this state applies: not applied, and
                    # nothing decided from it goes out; the next pass decides without it
                    # once the mirror shows the withdrawal (its watch wakes the loop): no
                    # follow-up pass of its own, which decided the same refused write again
                    await self._withdrawn(tuple(self._request_key(r) for r in take))
                    self.progressed = before
                    return desired
                taken.update(self._request_key(r) for r in take)
                desired = a.state
            elif isinstance(a, Commit):
                rec = a.record
                await self.store.put_guarded(
                    self.keys.checkpoint(rec.step),
                    rec.model_dump_json().encode(),
                    self.keys.leader,
                    self.epoch,
                )
                # the committer deleted these steps' files once the new one committed
                # (Checkpoint.prune_below): their records go too, after the new record
                for step in a.drop:
                    await self.store.delete_guarded(
                        self.keys.checkpoint(step), self.keys.leader, self.epoch
                    )
                self.audit.write(
                    "commit",
                    self.clock.now(),
                    epoch=self.epoch,
                    step=rec.step,
                    plan_id=rec.plan_id,
                    directory=rec.directory,
                    dropped=list(a.drop),
                    periodic=a.periodic,
                    drop_steps=None if a.drop_steps is None else list(a.drop_steps),
                )
            elif isinstance(a, ClearNotice):
                await self.store.delete_guarded(
                    self.keys.notice(a.node_id), self.keys.leader, self.epoch
                )
            elif isinstance(a, ClearBadDone | ClearReadmit):
                # applied: the desired state was written first
                key = self._request_key(a)
                if key not in taken and not await self._take(a):
                    continue
                self._audit_request(a)
                # audited: its mark is no longer needed (left, the next term audits it)
                await self._unmark(self.keys.taken(key))
        self.sends.prune(desired.generation)
        due = self.sends.due(sends)
        if due and not self.lead.fresh:
            # cut off from etcd past the lease's TTL: another leader may hold the key and
            # be sending its own; these go out (unchanged ids) once a refresh answers
            _log.warning("sends_held_lease_not_fresh", epoch=self.epoch, commands=len(due))
            due = []
        if due:
            await self.sends.send(due)
        return desired

    def _requests_applied(
        self, actions: list[Action], i: int
    ) -> tuple[ClearReadmit | ClearBadDone, ...]:
        """The requests the desired state of ``actions[i]`` applies: the deletions right
        after it (``decide`` puts them there, ``ClearReadmit`` and ``ClearBadDone``: the
        state written before them no longer holds what they named)."""
        taken: list[ClearReadmit | ClearBadDone] = []
        for a in actions[i + 1 :]:
            if not isinstance(a, ClearReadmit | ClearBadDone):
                break
            taken.append(a)
        return tuple(taken)

    def _repointed(self, take: tuple[ClearReadmit | ClearBadDone, ...]) -> list[tuple[str, bytes]]:
        """The commit records the requests of ``take`` re-point (``ClearBadDone.repointed``),
        as writes of the transaction that deletes them."""
        return [
            (self.keys.checkpoint(r.step), r.model_dump_json().encode())
            for a in take
            if isinstance(a, ClearBadDone)
            for r in a.repointed
        ]

    def _request_key(self, a: ClearReadmit | ClearBadDone) -> str:
        if isinstance(a, ClearReadmit):
            return self.keys.readmit(a.request_id)
        return self.keys.clear_bad(a.request_id)

    def _audit_request(self, a: ClearReadmit | ClearBadDone, **extra: Any) -> None:
        """The audit record of a request applied (``readmit``, ``clear_bad``): what it
        ended or why nothing (``take_marks.request_record``)."""
        kind, fields = request_record(a)
        self.audit.write(kind, self.clock.now(), epoch=self.epoch, **fields, **extra)

    def _expected(self, keys: tuple[str, ...]) -> dict[str, int]:
        """key -> mod revision observed, for the keys a pass takes. ``ChangedError`` if one
        has no observed revision: taken unguarded, a request its operator withdrew
        meanwhile was applied, and the command said "withdrawn"."""
        unseen = [k for k in keys if k not in self.request_revisions]
        if unseen:
            raise ChangedError("no observed revision for a request", key=",".join(unseen))
        return {k: self.request_revisions[k] for k in keys}

    async def _take(self, a: ClearReadmit | ClearBadDone) -> bool:
        """Delete a request that changed no desired state (it named no record or mark there
        is, or only re-pointed commit records: written in the same transaction) while it is
        as observed; False if its operator withdrew it first. The transaction also writes
        the take's mark (``Keys.taken``, ``take_marks``: the request's record, bound to no
        lease): should its answer be lost, the mark, not the key's absence, says it
        committed (``settle_lost_takes``; after the term, ``settle_orphan_marks``);
        answered, the mark goes once the take is audited (``apply``)."""
        key = self._request_key(a)
        mark = self.keys.taken(key)
        try:
            await self.store.put_all_guarded(
                [*self._repointed((a,)), (mark, mark_value(a, self.epoch))],
                self.keys.leader,
                self.epoch,
                delete=(key,),
                expect=self._expected((key,)),
            )
        except ChangedError:
            await self._withdrawn((key,))
            return False
        except TemporaryError:
            self.lost_takes[key] = a  # committed or not: its mark tells (settle_lost_takes)
            raise
        self.lost_takes.pop(key, None)
        self._answered((key,))
        return True

    def _answered(self, keys: tuple[str, ...]) -> None:
        """Requests a write or take just committed (answered): no longer the uncommitted
        write's to settle (its key is gone because this took it, not withdrawn)."""
        lost = self.uncommitted
        if lost is None:
            return
        left = tuple(a for a in lost.take if self._request_key(a) not in keys)
        self.uncommitted = replace(lost, take=left) if left else None

    async def _unmark(self, *marks: str) -> None:
        """Delete takes' marks (one transaction) once their outcome is audited. etcd
        failing: tried again at the start of the next pass (``apply``) and at the next
        settle (``marks_left``); should the term end first, the next leader audits the
        take again from the mark (its record says so). Deposed: the next leader's to
        settle."""
        if not marks:
            return
        try:
            await self.store.put_all_guarded([], self.keys.leader, self.epoch, delete=marks)
        except TemporaryError as exc:
            self.marks_left.update(marks)
            _log.debug("take_mark_left", keys=list(marks), error=str(exc))
        except FencedError as exc:
            _log.debug("take_mark_left", keys=list(marks), error=str(exc))
        else:
            self.marks_left.difference_update(marks)

    async def _withdrawn(self, keys: tuple[str, ...]) -> None:
        """After a write that took ``keys`` was refused: audit those an operator withdrew
        (gone, or at another revision than observed; one without an observed revision
        counts so), and keep them out of the passes until the mirror shows it
        (``withdrawn``). The others were refused only for being bundled with one: the next
        pass applies them (not audited as withdrawn). A key whose earlier take lost its
        answer (``lost_takes``) is settled by that take's mark instead: gone because that
        take committed, it was applied, not withdrawn (before, a stale mirror's next take,
        refused, audited it withdrawn and the settle then applied: both in the audit)."""
        lost = tuple(k for k in keys if k in self.lost_takes)
        if lost:
            await self.settle_lost_takes(lost)
        changed = []
        for key in keys:
            if key in lost:
                continue
            seen = self.request_revisions.get(key)
            kv = await self.store.get(key) if seen is not None else None
            if kv is None or kv.mod_revision != seen:
                changed.append(key)
                if seen is not None:
                    self.withdrawn[key] = seen
        if changed:
            self.audit.write("request_withdrawn", self.clock.now(), epoch=self.epoch, keys=changed)
            _log.info("request_withdrawn", keys=changed)

    def settle_lost(self, held: DesiredState) -> tuple[str, ...]:
        """After an etcd error, with ``held`` the desired state etcd holds: the request keys
        of a write whose answer was lost that etcd did commit (``held`` is that write's
        state), audited as applied (``request_applied``, ``answer_lost``, then each
        request's own record, ``readmit`` or ``clear_bad``, as a write that answered writes
        it) and kept out of the passes whose mirror still shows them (``withdrawn``), so
        that a stale mirror's next take, refused, is not audited as a withdrawal; () when
        there was none or it did not commit (its requests are still there: the next pass
        applies them, and audits them then). A committed write's phase record is written
        here first (``answer_lost``), whether or not it took requests. Once per lost
        write: settled, it is forgotten (before, the requests' own records were never
        written: the audit checker kept a cleared step unreadable)."""
        lost, self.lost = self.lost, None
        if lost is None:
            return ()
        if lost.state != held:
            # not committed: a request it took that its command withdrew meanwhile is in
            # no later pass (the mirror shows it gone), so none would audit it; the settle
            # of the takes does (before, no record at all)
            self.uncommitted = lost if lost.take else None
            return ()
        # the state etcd holds is that write's: its phase record, as a write that answered
        # writes it (before, none: the audit missed a phase, or a launch)
        self._phase_record(lost.state, lost.reason, lost.load_directory, answer_lost=True)
        if not lost.take:
            return ()
        # audited here: their marks go at the settle of the takes, which follows
        self.marks_left.update(self.keys.taken(self._request_key(a)) for a in lost.take)
        return self._applied_lost(lost.take, held.cause)

    def _applied_lost(
        self, take: tuple[ClearReadmit | ClearBadDone, ...], cause: str
    ) -> tuple[str, ...]:
        """Audit requests taken by a write whose answer was lost as applied
        (``request_applied``, ``answer_lost``, then each one's own record) and keep them
        out of the passes whose mirror still shows them (``withdrawn``); their keys. No
        longer the uncommitted write's to settle either (``_answered``): an earlier write
        that took them and did not commit would find them gone with this take's mark
        and audit them a second time."""
        keys = tuple(self._request_key(a) for a in take)
        self._answered(keys)
        for key in keys:
            if key in self.request_revisions:
                self.withdrawn[key] = self.request_revisions[key]
        self.audit.write(
            "request_applied",
            self.clock.now(),
            epoch=self.epoch,
            keys=list(keys),
            cause=cause,
            answer_lost=True,
        )
        for a in take:
            self._audit_request(a, answer_lost=True)
        return keys

    async def settle_lost_takes(self, only: tuple[str, ...] | None = None) -> tuple[str, ...]:
        """After an etcd error: the requests deleted without a desired state (``_take``:
        they named nothing there is, or only re-pointed records) whose transaction met it,
        settled by what that transaction left (``_took``), each audited once: committed
        (its mark is there), as applied, as :meth:`settle_lost` audits a write's
        (``request_applied``, ``answer_lost``, then its own record); not committed and the
        key gone (its command withdrew it in the meantime: the command said "withdrawn"),
        as withdrawn (``request_withdrawn``, ``answer_lost``); no mark and this term over
        (the next leader may have audited the take from its mark and deleted it), as
        unknown (``request_unknown``), never as applied. Before, a key gone counted as
        applied: a take that did not commit and the command's withdrawal were audited as a
        re-point the records never got. Still
        there, the request stays for the next pass, which takes it (an answered take
        forgets it) or finds it withdrawn (settled by the mark then). etcd not answering
        the reads: kept for the next settle (with ``only``, these keys alone: raised). The
        keys audited as applied."""
        applied: list[ClearReadmit | ClearBadDone] = []
        withdrawn: list[str] = []
        unknown: list[str] = []
        late: tuple[str, ...] = ()  # an uncommitted write's, committed after all
        if only is None and self.uncommitted is not None:
            late, gone, lost_unknown = await self._settle_uncommitted()
            withdrawn.extend(gone)
            unknown.extend(lost_unknown)
        if only is None and self.marks_left:
            await self._unmark(*sorted(self.marks_left))
        for key, a in list(self.lost_takes.items()):
            if only is not None and key not in only:
                continue
            try:
                took = await self._took(key)
            except TemporaryError:
                if only is not None:
                    raise  # a pass's refused take: the daemon's settle after the error
                continue
            if took is None:
                continue
            del self.lost_takes[key]
            if key in self.request_revisions:  # the mirror may show it a while yet
                self.withdrawn[key] = self.request_revisions[key]
            if took == "applied":
                applied.append(a)
                await self._unmark(self.keys.taken(key))
            elif took == "withdrawn":
                withdrawn.append(key)
            else:
                unknown.append(key)
        now = self.clock.now()
        if withdrawn:
            self.audit.write(
                "request_withdrawn",
                now,
                epoch=self.epoch,
                keys=withdrawn,
                answer_lost=True,
                cause="withdrawn by its command before the take committed",
            )
            _log.info("request_withdrawn", keys=withdrawn, answer_lost=True)
        if unknown:
            self.audit.write(
                "request_unknown",
                now,
                epoch=self.epoch,
                keys=unknown,
                cause="a take's answer lost, no mark, and this leader's term over (the "
                "next leader settles a mark it finds)",
            )
            _log.warning("request_unknown", keys=unknown)
        if not applied:
            return late
        return late + self._applied_lost(tuple(applied), "a request deleted, its answer lost")

    async def _settle_uncommitted(self) -> tuple[tuple[str, ...], list[str], list[str]]:
        """The request keys of the uncommitted write (``uncommitted``) settled by what its
        transaction left, as a lost take's (``_took``): the key gone and this term's mark
        there, it committed after all (after the read-back): audited as applied, with the
        write's phase record, as a lost answer's (:meth:`settle_lost`): returned first; the
        key gone and no mark, its command withdrew it (the write needs the key as observed:
        it can no longer commit): returned second; no mark and the term over, unknown:
        returned third. Those still there are the next pass's, which applies and audits them; a
        key a later take lost the answer of (``lost_takes``) is that take's to settle.
        Before, a gone key was called committed when the desired state etcd held equalled
        the write's: a later write of the same state (the operator asked again) had a
        withdrawn request audited as applied. etcd not answering: kept for the next
        settle."""
        lost = self.uncommitted
        if lost is None:
            return (), [], []
        take = tuple(a for a in lost.take if self._request_key(a) not in self.lost_takes)
        try:
            took = [(a, await self._took(self._request_key(a))) for a in take]
        except TemporaryError as exc:
            _log.debug("uncommitted_unsettled", error=str(exc))
            return (), [], []
        self.uncommitted = None
        applied = tuple(a for a, t in took if t == "applied")
        late: tuple[str, ...] = ()
        if applied:
            # its marks are there: it committed; its records, as a lost answer's
            self._phase_record(lost.state, lost.reason, lost.load_directory, answer_lost=True)
            self.marks_left.update(self.keys.taken(self._request_key(a)) for a in applied)
            late = self._applied_lost(applied, "a write committed after its read-back")
        withdrawn = [self._request_key(a) for a, t in took if t == "withdrawn"]
        unknown = [self._request_key(a) for a, t in took if t == "unknown"]
        for key in (*withdrawn, *unknown):
            if key in self.request_revisions:  # the mirror may show it a while yet
                self.withdrawn[key] = self.request_revisions[key]
        return late, withdrawn, unknown

    async def settle_orphan_marks(self) -> tuple[str, ...]:
        """At the start of the term: the takes an earlier leader's term ended without
        settling, known by the marks it left under ``taken/`` (bound to no lease: a take's
        transaction writes its mark, so a mark says the take committed), each audited as
        applied (``request_applied``, ``answer_lost``, ``taken_epoch``, then the request's
        own record the mark holds, ``take_marks``), once, and its mark deleted. An empty
        or unreadable mark (a release that wrote none in it) gets the ``request_applied``
        record alone. The keys audited; () when etcd does not answer (tried again at the
        next pass: ``orphans_settled``). Before, the mark went with the old term's lease
        and no leader wrote a record of the take. A mark whose leader audited its take and
        could not delete it before its term ended is audited once more: its record names
        the epoch that took it, whose log may hold the first."""
        try:
            found = await self.store.get_prefix(self.keys.takens)
        except TemporaryError as exc:
            _log.debug("orphan_marks_unread", error=str(exc))
            return ()
        done: list[str] = []
        marks: list[str] = []
        now = self.clock.now()
        for kv in sorted(found, key=lambda kv: kv.key):
            mark = read_mark(kv.value)
            if mark.epoch == self.epoch:  # this term's own: settled by this term
                continue
            key = self.keys.root + kv.key.removeprefix(self.keys.takens)
            taken = mark.epoch if mark.epoch is not None else -1
            self.audit.write(
                "request_applied",
                now,
                epoch=self.epoch,
                keys=[key],
                answer_lost=True,
                taken_epoch=taken,
                cause="taken by an earlier leader whose term ended before it settled the "
                "take (its mark outlived the term)",
            )
            if mark.bad:  # the take committed; what it did, the record cannot say
                self.audit.write(
                    "take_mark_bad",
                    now,
                    epoch=self.epoch,
                    keys=[key],
                    taken_epoch=taken,
                    cause=mark.bad,
                    record=mark.raw,
                )
                _log.warning("take_mark_bad", key=kv.key, cause=mark.bad)
            elif mark.kind:  # the record holds none of the names written here (read_mark)
                self.audit.write(
                    mark.kind,
                    now,
                    epoch=self.epoch,
                    answer_lost=True,
                    taken_epoch=taken,
                    **mark.record,
                )
            done.append(key)
            marks.append(kv.key)
        if done:
            _log.info("orphan_takes_settled", keys=done)
        await self._unmark(*marks)
        self.orphans_settled = True
        return tuple(done)

    async def _took(self, key: str) -> Literal["applied", "withdrawn", "unknown"] | None:
        """What became of a take of ``key`` whose answer was lost: None while the key is
        there (the take did not commit, yet); else "applied" if the take's mark is there,
        written by this term (one an earlier term left, under a key of the same name, is
        not this take's: ``settle_orphan_marks`` audits it).
        Read in this order: once the key is gone, a take that had not committed never
        will (its compare needs the key as observed), and a take that did left its mark,
        there until a leader audits the take and deletes it: this one, or after this term
        the next one (``settle_orphan_marks``). The leader key read after the mark, at this
        term's epoch, says no other term had begun when the mark was read: no mark is then
        "withdrawn" (its command deleted the key); otherwise "unknown". ``TemporaryError``
        if etcd does not answer."""
        if await self.store.get(key) is not None:
            return None
        mark = await self.store.get(self.keys.taken(key))
        if mark is not None and read_mark(mark.value).epoch == self.epoch:
            return "applied"
        leader = await self.store.get(self.keys.leader)
        if leader is not None and leader.create_revision == self.epoch:
            return "withdrawn"
        return "unknown"


def _deadline_why(state: DesiredState, cfg: DecideConfig) -> str:
    """Why ``state``'s phase has its deadline (``decision_types.phase_deadline`` of the
    state, as ``move_to`` set it), and when a preemption notice cut it shorter."""
    dl = phase_deadline(state, state.phase, cfg)
    why = dl.why()
    got = state.phase_deadline - state.phase_since
    if got < dl.seconds - 1e-6:
        why += f"; cut to {got:.0f} s by a preemption notice (its deadline - notice_margin_s)"
    return why
