"""The operator's side of a job's etcd state: read it for ``sailor status``, and write the
requests the leader acts on (``sailor node readmit``, ``sailor checkpoint clear-bad``). No
leadership needed.

A request is never applied here: the operator's write only asks, and the leader applies it
in a pass, as it writes every desired state (``decide``), then deletes the key. The desired
state itself has one writer, the leader, under its epoch guard (``DesiredState``); a write
from here would race its next pass and be overwritten.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from sailor.controller.bad_marks import marked
from sailor.controller.decide import not_admitted
from sailor.controller.decision_types import Observed
from sailor.controller.job_precision import job_precision
from sailor.coordination import Keys, TemporaryError, connect_etcd
from sailor.coordination.security import SecurityConfig
from sailor.planner.reach import PlannerReach
from sailor.schemas.hardware import NodeSpec
from sailor.schemas.online_calibration import CalibrationPointer
from sailor.schemas.precision import Precision
from sailor.schemas.runtime import (
    AgentStatus,
    ClearBadRequest,
    CommitRecord,
    DesiredState,
    EventStreamState,
    NodeHealth,
    NoticeRecord,
    ReadmitRequest,
)
from sailor.schemas.training import TrainingConfig

__all__ = [
    "Answer",
    "NotWrittenError",
    "periodic_status",
    "read_status",
    "request_clear_bad",
    "request_readmit",
]

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)


async def read_status(
    endpoint: str | Sequence[str],
    job: str,
    security: SecurityConfig | None = None,
    now: float | None = None,
    training: TrainingConfig | None = None,
    reach: PlannerReach | None = None,
) -> dict[str, Any]:
    """A JSON-able snapshot: leader, phase, plan, nodes with health, last checkpoint, and
    the event stream once the leader could not place it (``event_stream``: None while it
    never failed this term). A node
    the controller excludes (its workers kept failing: ``DesiredState.node_health``) shows
    until when, as of ``now`` (default: this host's clock). ``training``: the controller's
    training config, whose forced precision the leader admits nodes by (as
    ``job_precision.job_precision`` reads it); without it, the recorded one. ``reach``: what
    the controller's planner can use (``in_process.planner_reach_of`` of its config), which
    the leader admits nodes by too; without it, nodes are not judged by it."""
    keys = Keys(job=job)
    store = await connect_etcd(endpoint, security=security)
    try:
        leader = await store.get(keys.leader)
        desired_kv = await store.get(keys.desired)
        nodes = await store.get_prefix(keys.nodes)
        statuses = await store.get_prefix(keys.statuses)
        notices = await store.get_prefix(keys.notices)
        ckpts = await store.get_prefix(keys.checkpoints)
        calib = await store.get(keys.calibration)
        stream_kv = await store.get(keys.event_stream)
    finally:
        await store.close()
    d = None
    if desired_kv is not None:
        with contextlib.suppress(ValidationError):
            d = DesiredState.model_validate_json(desired_kv.value)
    # A record is believed only under its own key (as ObservedCache's ``key_of``): an agent
    # may write only its own keys, so a record there that names another node is not taken
    # as that node's (it would show its GPUs, zone or state in the other's row).
    st = {
        s.node_id: s
        for kv in statuses
        if (s := _parsed(AgentStatus, kv.value)) is not None and kv.key == keys.status(s.node_id)
    }
    nt = {
        r.node_id: r
        for kv in notices
        if (r := _parsed(NoticeRecord, kv.value)) is not None and kv.key == keys.notice(r.node_id)
    }
    now = time.time() if now is None else now
    health = d.node_health if d else {}
    out = {
        n: {"until": r.excluded_until, "failures": r.failures, "cause": r.cause}
        for n, r in sorted(health.items())
        if r.excluded_until > now
    }
    # the job's records (most nodes failed alike, a hang; an agreed error's): no launch
    job_recs = [d.job_health, *(r for _, r in sorted(d.agreed_health.items()))] if d else []
    held = max(job_recs, key=lambda r: r.excluded_until, default=None)
    job_out = None
    if held is not None and held.excluded_until > now:
        job_out = {"until": held.excluded_until, "failures": held.failures, "cause": held.cause}
    specs = {
        n.node_id: n
        for kv in nodes
        if (n := _parsed(NodeSpec, kv.value)) is not None and kv.key == keys.node(n.node_id)
    }
    precision = job_precision(d, training) if d is not None else None
    refused = _not_admitted(d, specs, st, nt, now, precision, reach)
    rows = []
    for n in specs.values():
        s2 = st.get(n.node_id)
        rows.append(
            {
                "node": n.node_id,
                "gpu": n.gpu_type,
                "gpus": n.gpus,
                "zone": n.zone,
                "spot": n.spot,
                "state": s2.state if s2 else "?",
                "step": s2.step if s2 else "",
                "loss": f"{s2.loss:.4f}" if s2 and s2.loss is not None else "",
                "notice": f"{nt[n.node_id].deadline:.0f}" if n.node_id in nt else "",
                "excluded": f"{out[n.node_id]['until']:.0f}" if n.node_id in out else "",
                "nccl": n.runtime.nccl_version if n.runtime is not None else "",
                "admitted": "no" if n.node_id in refused else "",
            }
        )
    commits: list[CommitRecord] = []
    for kv in ckpts:
        with contextlib.suppress(ValidationError):
            commits.append(CommitRecord.model_validate_json(kv.value))
    last = None
    if ckpts:
        with contextlib.suppress(ValidationError):
            last = CommitRecord.model_validate_json(ckpts[-1].value).step
    return {
        "leader": leader.value.decode() if leader else None,
        "epoch": leader.create_revision if leader else None,
        "phase": d.phase.value if d else None,
        "generation": d.generation if d else None,
        "plan_id": d.plan.plan_id if d and d.plan else None,
        "gpus_by_type_zone": d.plan.gpus_by_type_zone() if d and d.plan else {},
        "cause": d.cause if d else "",
        "excluded": out,
        "job_excluded": job_out,
        "not_admitted": refused,
        "plan_failed": d.plan_failed if d else "",
        "job_precision": d.job_precision if d else None,
        "admission_precision": precision,
        "last_checkpoint": last,
        "bad_checkpoints": list(d.bad_checkpoints) if d else [],
        "given_up_checkpoints": list(d.drop_steps) if d else [],
        "suspect_checkpoint": d.suspect_checkpoint.step if d else -1,
        "calibration_version": _calibration_version(calib.value) if calib else None,
        "event_stream": _event_stream(stream_kv.value, now) if stream_kv else None,
        "periodic": periodic_status(d, commits, now),
        "nodes": rows,
    }


def periodic_status(
    d: DesiredState | None, commits: Sequence[CommitRecord], now: float
) -> dict[str, Any]:
    """The controller's periodic checkpoint as of ``now``: the save in flight
    (``DesiredState.periodic``: its step, when it was asked for, its deadline; None if none)
    and the newest periodic commit (``CommitRecord.periodic``: its step and age; None if
    none)."""
    p = d.periodic if d is not None else None
    flying = None
    if p is not None and p.step >= 0:
        flying = {
            "step": p.step,
            "requested": p.requested,
            "asked_s_ago": round(max(0.0, now - p.requested), 1),
            "deadline": p.deadline,
            "deadline_in_s": round(p.deadline - now, 1),
        }
    newest = max((c for c in commits if c.periodic), key=lambda c: c.step, default=None)
    last = None
    if newest is not None:
        last = {"step": newest.step, "time": newest.time, "age_s": round(now - newest.time, 1)}
    return {"in_flight": flying, "last_commit": last}


def _parsed(model: type[_M], raw: bytes) -> _M | None:
    """``raw`` as ``model``; None when it is not one (never shown)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError:
        return None


def _not_admitted(
    d: DesiredState | None,
    nodes: dict[str, NodeSpec],
    status: dict[str, AgentStatus],
    notices: dict[str, NoticeRecord],
    now: float,
    precision: Precision | None = None,
    reach: PlannerReach | None = None,
) -> dict[str, str]:
    """The nodes the leader leaves out (the planner cannot use them, or for their runtime or
    the job's precision), and why, by the leader's own rule (``decide.not_admitted``) over
    the same records."""
    o = Observed(now=now, nodes=nodes, status=status, notices=notices)
    return not_admitted(d or DesiredState(epoch=0), o, precision=precision, reach=reach)


def _event_stream(raw: bytes, now: float) -> dict[str, Any] | None:
    """The leader's ``EventStreamState`` (``event-stream``: only after a failed placement,
    gone with its term), with how long it has held as of ``now``; None if unreadable."""
    try:
        st = EventStreamState.model_validate_json(raw)
    except ValidationError:
        return None
    return {
        "placed": st.placed,
        "since": st.since,
        "for_s": round(max(0.0, now - st.since), 1),
        "reason": st.reason,
        "replicas": st.replicas,
        "overdue": st.overdue,
        "epoch": st.epoch,
    }


def _calibration_version(raw: bytes) -> int | None:
    """The current online-calibration version (``calibration/current``), None if unreadable."""
    try:
        return CalibrationPointer.model_validate_json(raw).version
    except ValidationError:
        return None


async def _desired(store: Any, keys: Keys) -> DesiredState | None:
    """The job's desired state as etcd holds it; None if there is none, or it is unreadable."""
    kv = await store.get(keys.desired)
    if kv is None:
        return None
    with contextlib.suppress(ValidationError):
        return DesiredState.model_validate_json(kv.value)
    return None


WITHDRAW_RETRY_S = 30.0
"""How long a request no leader took is withdrawn for through an etcd outage (a restart
takes seconds); past it the command says the outcome is unknown and what to check."""

_CLOSED = b"closed"
"""A request's witness written by its command when no write of the request answered (a
written request's witness is empty): no write of that request commits after it."""

Outcome = Literal["applied", "withdrawn", "unwritten", "unconfirmed", "unknown"]
"""What became of a request written (``Answer.outcome``, less "nothing")."""


async def _ask(store: Any, key: str, witness: str, body: bytes, wait_s: float) -> Outcome:
    """Write a request at ``key`` and wait up to ``wait_s`` for a leader to take it: what
    became of it. A leader applies a request and deletes its key in one transaction, only
    while the key is as it read it (``Executor.write_desired``); not taken in time, the
    request is withdrawn by a delete that holds only while the key is as written. Exactly
    one of the two succeeds: a leader that read the request before the withdrawal can no
    longer apply it, and one that took it first is reported (before, the desired state was
    read again after the withdrawal, and a leader's write just after that read applied a
    request reported not applied). Through an etcd outage (``TemporaryError``) the wait goes
    on and the withdrawal is tried again for up to ``WITHDRAW_RETRY_S`` (before, the command
    ended with a traceback and left the request in etcd, to be applied whenever). A
    withdrawal whose answer was lost and whose retry finds the key gone cannot tell its own
    delete from a leader's take: "unknown", as when etcd never answers it.

    The request is written with its ``witness`` (``Keys.asked_witness``), which no leader
    deletes, and tried again through an etcd outage until the wait ends (``_written``): a
    write whose answer was lost (etcd restarted after its commit) is found committed by the
    retry, even when a leader took the request meanwhile, and the wait goes on as after a
    write that answered (before, the command ended with a traceback while the request sat
    in etcd, applied by a leader later). No write answered within the wait: the witness is
    closed (created with ``_CLOSED`` if absent, ``create_if_absent``): created, no write
    can commit after it (each needs the witness absent): "unwritten", nothing was written
    nor will be; there already, a write committed and the wait goes on from its revision.
    (Before, the witness was read: absent, "unwritten", though a write whose call timed
    out could still commit after the read.) The close not answered until
    ``WITHDRAW_RETRY_S`` past the wait: "unconfirmed" (the request may be in etcd)."""
    end = time.monotonic() + wait_s
    # the witness outlives the command's longest run; the lease's keepalive extends it
    ttl = int(wait_s + 2 * WITHDRAW_RETRY_S) + 10
    lease = await _retried(lambda: store.lease(ttl), end)
    if lease is None:
        return "unwritten"  # nothing written: etcd did not answer within the wait
    revoke = True
    try:
        revision = await _written(store, key, witness, body, lease, end)
        if revision is None:
            # no write answered within the wait, and one may have committed or may still
            # be on its way to etcd: closing the witness decides
            closed = await _retried(
                lambda: store.create_if_absent(witness, _CLOSED, lease),
                time.monotonic() + WITHDRAW_RETRY_S,
            )
            if closed is None:
                return "unconfirmed"  # etcd did not answer: the request may be there
            if closed.value == _CLOSED:
                # closed by this command: no write of the request commits from now on.
                # The lease is left to expire (its keepalive stops with the store), not
                # revoked: revoking would delete the closed witness with it
                revoke = False
                return "unwritten"
            revision = closed.mod_revision  # a write's witness: it committed
        while time.monotonic() < end:
            with contextlib.suppress(TemporaryError):
                if await store.get(key) is None:
                    return "applied"
            await asyncio.sleep(0.2)
        return await _withdrawn(store, key, revision)
    finally:
        if revoke:
            with contextlib.suppress(TemporaryError):
                await lease.revoke()  # the witness goes with it


async def _written(
    store: Any, key: str, witness: str, body: bytes, lease: Any, end: float
) -> int | None:
    """Write the request and its witness (``put_witnessed``), tried again through an etcd
    outage until ``end``: the write's revision, or None if none answered by then. A retry
    that finds the witness there learns that an earlier write committed (its answer lost),
    and its revision from the witness."""
    while True:
        with contextlib.suppress(TemporaryError):
            revision = await store.put_witnessed(key, body, witness, lease)
            if revision is not None:
                return int(revision)
            kv = await store.get(witness)
            if kv is not None:
                return int(kv.mod_revision)
        if time.monotonic() > end:
            return None
        await asyncio.sleep(0.5)


async def _withdrawn(store: Any, key: str, revision: int) -> Outcome:
    """Withdraw the request written at ``revision`` (a delete that holds only while the key
    is as written), tried again through an etcd outage for up to ``WITHDRAW_RETRY_S``."""
    end = time.monotonic() + WITHDRAW_RETRY_S
    lost = False  # a delete was sent whose answer etcd may have lost
    while True:
        try:
            deleted = await store.delete_unchanged(key, revision)
        except TemporaryError:
            lost = True
            if time.monotonic() > end:
                return "unknown"
            await asyncio.sleep(0.5)
            continue
        if deleted:
            return "withdrawn"
        return "unknown" if lost else "applied"


async def _retried(call: Callable[[], Awaitable[_T]], end: float) -> _T | None:
    """``call()`` tried again through ``TemporaryError`` until ``end``: its result, or None
    if etcd never answered by then."""
    while True:
        try:
            return await call()
        except TemporaryError:
            if time.monotonic() > end:
                return None
            await asyncio.sleep(0.5)


async def _commits(store: Any, keys: Keys) -> dict[int, str]:
    """step -> directory of the job's commit records (``ckpt/``), those readable."""
    out: dict[int, str] = {}
    for kv in await store.get_prefix(keys.checkpoints):
        with contextlib.suppress(ValidationError):
            c = CommitRecord.model_validate_json(kv.value)
            out[c.step] = c.directory
    return out


async def _desired_after(store: Any, keys: Keys) -> DesiredState | None:
    """``_desired`` once a request was taken, read through an etcd outage (up to
    ``WITHDRAW_RETRY_S``): what the leader's write left."""
    end = time.monotonic() + WITHDRAW_RETRY_S
    while True:
        try:
            return await _desired(store, keys)
        except TemporaryError:
            if time.monotonic() > end:
                raise
            await asyncio.sleep(0.5)


async def _commits_after(store: Any, keys: Keys) -> dict[int, str]:
    """``_commits`` once a request was taken, read through an etcd outage (up to
    ``WITHDRAW_RETRY_S``)."""
    end = time.monotonic() + WITHDRAW_RETRY_S
    while True:
        try:
            return await _commits(store, keys)
        except TemporaryError:
            if time.monotonic() > end:
                raise
            await asyncio.sleep(0.5)


class NotWrittenError(Exception):
    """An operator request that etcd failed before it was written: the reads it is decided
    from (the desired state, the commit records) did not answer. Nothing was written, so
    running the command again is safe. Names the endpoints and etcd's error (before, the
    command said only "etcd unavailable (...): temporary: retry": not which etcd, nor that
    the request was not written)."""

    def __init__(self, endpoint: str | Sequence[str], step: str, error: TemporaryError) -> None:
        eps = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        self.endpoints = tuple(eps)
        self.error = error
        super().__init__(
            f"etcd at {', '.join(eps)} failed while {step}, before the request was written "
            f"({error}): nothing was written; run the command again once etcd answers"
        )


@contextlib.asynccontextmanager
async def _unwritten(endpoint: str | Sequence[str], step: str) -> AsyncIterator[None]:
    """An etcd failure inside (before the request is written) as ``NotWrittenError``."""
    try:
        yield
    except TemporaryError as exc:
        raise NotWrittenError(endpoint, step, exc) from exc


def _request_id() -> str:
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"  # ids sort by time


@dataclass(frozen=True)
class Answer:
    """What became of an operator's request (``sailor node readmit``, ``sailor checkpoint
    clear-bad``)."""

    request_id: str
    """'' when none was written: there was nothing to do (``outcome`` "nothing")."""
    outcome: Literal["applied", "withdrawn", "unwritten", "unconfirmed", "unknown", "nothing"]
    """applied: a leader took it; withdrawn: none did within the wait, and none will;
    unwritten: etcd took no write of it within the wait (nothing applied, none will);
    unconfirmed: etcd lost the answer to its write and did not answer again (it may be in
    etcd, and may be applied); unknown: etcd failed while the request was withdrawn (it may
    have been applied, or may still wait in etcd); nothing: nothing named is held (no
    request written)."""
    done: tuple[str, ...] = ()
    """Applied: what the request ended, as the desired state showed it before and after
    (nodes readmitted, "the job" for the job's holds; steps cleared)."""
    again: tuple[str, ...] = ()
    """Applied: what it named that the desired state holds again after (charged or marked
    again since)."""
    unknown: tuple[str, ...] = ()
    """Named, but not held when asked: nothing to end for them."""
    moved: tuple[str, ...] = ()
    """Applied, ``clear-bad --repoint``: the steps whose commit records name the directory
    asked for after, and another before."""
    unmoved: tuple[str, ...] = ()
    """Applied, ``--repoint``: the steps recorded under another directory before whose
    records do not name the one asked for after (a leader of another ``checkpoint_dir``, or
    of a release without re-pointing)."""
    moved_from: tuple[str, ...] = ()
    """``--repoint``: the directories the records of ``moved`` named before (sorted)."""
    elsewhere: tuple[str, ...] = ()
    """``--repoint --from``: named steps recorded under a directory neither ``--from`` nor
    the one asked for ("STEP (DIRECTORY)"): the request was not written (``nothing``)."""
    directories: tuple[str, ...] = ()
    """``--repoint``, nothing written: the directories the records name other than the one
    asked for (sorted), for a ``--from`` that named none of them."""
    unread: str = ""
    """Applied, and etcd failed while its result was read back (through
    ``WITHDRAW_RETRY_S``): which endpoints and etcd's error. ``done``, ``again`` and the
    re-pointed steps are then not known; the request was applied all the same."""


def _unread(endpoint: str | Sequence[str], error: TemporaryError) -> str:
    """``Answer.unread``: the endpoints and etcd's error."""
    eps = [endpoint] if isinstance(endpoint, str) else list(endpoint)
    return f"etcd at {', '.join(eps)} failed while its result was read back ({error})"


def _held_records(d: DesiredState | None) -> set[str]:
    """The failure records ``d`` holds: nodes', and "the job" for its own or agreed holds."""
    if d is None:
        return set()
    held = set(d.node_health)
    if d.job_health != NodeHealth() or d.agreed_health:
        held.add(_JOB)
    return held


_JOB = "the job"


async def request_readmit(
    endpoint: str | Sequence[str],
    job: str,
    nodes: Sequence[str],
    everything: bool,
    who: str,
    security: SecurityConfig | None = None,
    wait_s: float = 10.0,
) -> Answer:
    """Ask the leader to forget the failure records of ``nodes`` (``everything``: every
    node's and the job's). No request is written when the desired state holds no record of
    any of them (``nothing``). Otherwise the answer says whether a leader took it
    (``applied``, with the records it ended and any held again after) or none did within
    ``wait_s`` (``withdrawn``: none will)."""
    keys = Keys(job=job)
    async with _unwritten(endpoint, "connecting"):
        store = await connect_etcd(endpoint, security=security)
    try:
        async with _unwritten(endpoint, "reading the job's desired state"):
            held = _held_records(await _desired(store, keys))
        asked = held if everything else {*nodes}
        unknown = () if everything else tuple(n for n in nodes if n not in held)
        if not asked & held:
            return Answer("", "nothing", unknown=unknown)
        rid = _request_id()
        names = tuple(n for n in nodes if n not in unknown)
        req = ReadmitRequest(nodes=names, all=everything, who=who, time=time.time())
        body = req.model_dump_json().encode()
        key = keys.readmit(rid)
        got = await _ask(store, key, keys.asked_witness(key), body, wait_s)
        if got != "applied":
            return Answer(rid, got, unknown=unknown)
        try:
            after = _held_records(await _desired_after(store, keys))
        except TemporaryError as exc:  # applied all the same: never "temporary: retry"
            return Answer(rid, "applied", unknown=unknown, unread=_unread(endpoint, exc))
        ended = asked & held
        return Answer(
            rid,
            "applied",
            done=_sorted_names(ended - after),
            again=_sorted_names(ended & after),
            unknown=unknown,
        )
    finally:
        await store.close()


def _sorted_names(names: set[str]) -> tuple[str, ...]:
    """Node ids sorted, "the job" last."""
    return (*sorted(names - {_JOB}), *([_JOB] if _JOB in names else []))


async def request_clear_bad(
    endpoint: str | Sequence[str],
    job: str,
    steps: Sequence[int],
    everything: bool,
    who: str,
    security: SecurityConfig | None = None,
    wait_s: float = 10.0,
    repoint: str = "",
    sources: Sequence[str] = (),
) -> Answer:
    """Ask the leader to clear the bad (and suspect) marks of committed ``steps``
    (``everything``: every mark). As :func:`request_readmit`: no request when the desired
    state marks none of them (``nothing``; ``unknown``: the named steps it does not mark),
    else ``applied`` (``done``: the steps whose marks went; ``again``: marked again after)
    or ``withdrawn``. ``repoint``: the controller config's ``checkpoint_dir``; the request
    also re-points the records of ``steps`` (``everything``: every record) that name
    another directory to the leader's (``ClearBadRequest.repoint``), and is written when
    there is one such record even with no mark (``moved``: the steps whose records name
    ``repoint`` after, another directory before).

    ``sources`` (``--from``, with ``repoint``): only records under these directories are
    re-pointed. The request then names the steps (no wire field: a leader of any release
    with re-pointing applies it): ``everything``, every step recorded under them (their
    marks go; marks of steps recorded elsewhere stay); else the steps given, refused
    (``elsewhere``, nothing written) when one is recorded under a third directory, which the
    leader would re-point too."""
    keys = Keys(job=job)
    async with _unwritten(endpoint, "connecting"):
        store = await connect_etcd(endpoint, security=security)
    try:
        async with _unwritten(endpoint, "reading the job's desired state and commit records"):
            d = await _desired(store, keys)
            before = await _commits(store, keys) if repoint else {}
        held = set(marked(d)) if d is not None else set()
        away = {s for s, where in before.items() if where != repoint}
        if sources:
            stray = sorted(s for s in set(steps) & away if before[s] not in sources)
            if stray:
                elsewhere = tuple(f"{s} ({before[s]})" for s in stray)
                return Answer("", "nothing", elsewhere=elsewhere)
            away = {s for s in away if before[s] in sources}
            if everything:  # every record under sources, and only those
                steps, everything, held = tuple(sorted(away)), False, held & away
        movable = away if everything else away & set(steps)
        asked = held if everything else set(steps)
        unknown = () if everything else tuple(sorted(set(steps) - held - movable))
        if not asked & held and not movable:
            others = tuple(sorted({w for w in before.values() if w != repoint}))
            return Answer("", "nothing", unknown=tuple(map(str, unknown)), directories=others)
        rid = _request_id()
        named = tuple(sorted((asked & held) | movable)) if not everything else ()
        req = ClearBadRequest(
            steps=named, all=everything, repoint=bool(repoint), who=who, time=time.time()
        )
        body = req.model_dump_json().encode()
        key = keys.clear_bad(rid)
        got = await _ask(store, key, keys.asked_witness(key), body, wait_s)
        if got != "applied":
            return Answer(rid, got, unknown=tuple(map(str, unknown)))
        try:
            after_d = await _desired_after(store, keys)
            now = await _commits_after(store, keys) if movable else {}
        except TemporaryError as exc:  # applied all the same: never "temporary: retry"
            unread = _unread(endpoint, exc)
            return Answer(rid, "applied", unknown=tuple(map(str, unknown)), unread=unread)
        after = set(marked(after_d)) if after_d is not None else set()
        ended = asked & held
        moved: list[str] = []
        unmoved: list[str] = []
        if movable:
            for s in sorted(movable):
                if s in now:  # a record dropped meanwhile is neither
                    (moved if now[s] == repoint else unmoved).append(str(s))
        return Answer(
            rid,
            "applied",
            done=tuple(map(str, sorted(ended - after))),
            again=tuple(map(str, sorted(ended & after))),
            unknown=tuple(map(str, unknown)),
            moved=tuple(moved),
            unmoved=tuple(unmoved),
            moved_from=tuple(sorted({before[int(s)] for s in moved})),
        )
    finally:
        await store.close()
