"""The audit log: one JSON object per line, fsynced, rotated by size; and its checker.

Every event received (or rejected), decision, plan, command, ack, phase change and checkpoint
commit is one record with ``time``, ``kind``, ``epoch``, ``plan_id``, ``command_id`` and
``cause`` where they apply. Records are rendered by structlog's JSON renderer.

Durability is a group commit: ``write`` appends a record to the log's buffer, with no
system call (under a burst a flush and a seek per record cost ~1 ms each, waiting for the
GIL), and ``await durable()`` hands everything written so far to the OS and returns once it
is fsynced. The controller calls it before it acts on what the records say: before it acks
the events of a fetched batch, before it sends a fan-out of commands, before it counts an
ack and at the end of every reconcile pass. So nothing it acknowledged or did is missing
after a crash, while one fsync covers a whole batch. The fsync runs in the log's own worker
thread: a per-record fsync on the event loop was 7.6 s of a 20 s run at 512 nodes and
capped event handling at ~580/s; in asyncio's shared default executor an fsync queued for
6 s behind the in-process agents' blocking calls (``benchmarks/runtime_reconfig.py``).
``write(..., sync=True)`` keeps the old fsync-before-return for the rare records written
outside a pass (leadership changes).

``check`` replays one or more logs (several controllers, merged by time) and reports
violated invariants:

- epochs of successive leaders only grow;
- generations never go back, within a term or across leaders (a leader that could not read
  the desired state refuses to lead rather than start again from generation 0);
- every accepted event kept the subject it arrived on, and that subject is its own node's
  (one node's agent may not speak for another: ``controller/daemon.py`` refuses it);
- no command was accepted by an agent from an epoch lower than one it had accepted before;
- every accepted preemption notice is followed by a phase change to RUNNING;
- no committed step is lost: every launch loads the newest commit recorded before it (but one
  a launch could not read: ``bad_checkpoints`` of the phase records; and one whose mark an
  operator cleared, ``clear_bad``, which a launch may load and need not: a planned
  reconfiguration reloads its own save; a step committed again is readable again; a new
  leader's first phase record, ``ADOPTION_CAUSES``, holds every mark there is: one it lacks
  was cleared by a write whose records its leader never wrote; a ``clear_bad`` a later
  leader audited again from the take's mark, ``taken_epoch``, counts once);
- every calibration-driven replan (a phase change whose cause starts with
  ``recalibration``) follows a ``replan_decision`` of its generation that reconfigured, whose
  numbers satisfy the rule by themselves (``recalibrate.rule_violations``: the gain exceeds the
  downtime with the margin, the fit was stable, the improvement is large enough and holds at
  both ends of the fitted range, the derived figures match their inputs), and that names a
  calibration version recorded before it (``calibration``, or ``calibration_restored`` by a
  new leader); at most one such replan per generation (no flapping).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from sailor.controller.recalibrate import rule_violations
from sailor.controller.rendezvous_ports import RENDEZVOUS_RETRIES
from sailor.coordination.keys import event_subject_source, safe_token
from sailor.schemas.json_text import JsonTooDeepError, load_json

__all__ = ["ADOPTION_CAUSES", "AuditLog", "AuditReport", "check", "read_records", "timeline"]

ADOPTION_CAUSES = ("took over", "first leader")
"""The cause of a leader's first phase record of its term (``Controller._adopt``): the
desired state as it took it over, with every bad mark etcd holds (``bad_checkpoints``,
absent when none)."""


class AuditLog:
    """Append-only JSON-lines writer with group-committed fsync and size rotation (``LOG.1``…)."""

    def __init__(self, path: Path, max_bytes: int = 64 << 20, backups: int = 5) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        path.parent.mkdir(parents=True, exist_ok=True)
        self._render = structlog.processors.JSONRenderer(sort_keys=True)
        self._fh = path.open("ab")
        self._size = self._fh.tell()  # bytes in the current part, tracked without a syscall
        self._written = 0  # records written so far
        self._synced = 0  # of them, known fsynced
        self._syncing: asyncio.Task[None] | None = None
        self.fsyncs = 0  # measurement: how many fsyncs the records took
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="audit-fsync")

    def write(self, kind: str, time: float, sync: bool = False, **fields: Any) -> None:
        """Append one record; with ``sync``, fsync it (and all before it) before returning."""
        record = {"kind": kind, "time": round(time, 6), **fields}
        line = self._render(None, "", record)
        data = (line if isinstance(line, str) else line.decode()).encode() + b"\n"
        if self._size + len(data) > self.max_bytes:
            self._rotate()
        self._fh.write(data)  # buffered: durable() (or sync) flushes and fsyncs
        self._size += len(data)
        self._written += 1
        if sync:
            self.sync()

    @property
    def pending(self) -> int:
        """Records written and not yet known to be fsynced."""
        return self._written - self._synced

    def sync(self) -> None:
        """fsync now, on the calling thread."""
        if self._synced == self._written:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.fsyncs += 1
        self._synced = self._written

    async def durable(self) -> None:
        """Return once every record written before this call is fsynced (group commit).

        Concurrent callers share fsyncs: a caller that finds one in flight waits for it and,
        if its own records came after that fsync began, for the next one.
        """
        target = self._written
        while self._synced < target:
            if self._syncing is None or self._syncing.done():
                self._syncing = asyncio.create_task(self._fsync(), name="audit:fsync")
            await asyncio.shield(self._syncing)

    async def _fsync(self) -> None:
        upto = self._written
        self._fh.flush()
        # a duplicate of the descriptor: a rotation on the loop thread may close the original
        fd = os.dup(self._fh.fileno())
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, os.fsync, fd)
        finally:
            os.close(fd)
        self.fsyncs += 1
        self._synced = max(self._synced, upto)

    def _rotate(self) -> None:
        self.sync()  # the old part is complete and durable before it is renamed
        self._fh.close()
        for i in range(self.backups - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self._fh = self.path.open("ab")
        self._size = 0

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with contextlib.suppress(OSError, ValueError):
            self.sync()
        with contextlib.suppress(OSError):
            self._fh.close()


def _rotated_parts(p: Path) -> list[Path]:
    """``p``'s rotated parts, oldest first: ``p.N`` (ours) and ``p.N.gz`` (logrotate's
    ``compress``), by ``N`` descending; any other file beside it (``p.bak``) is not a part."""
    parts: list[tuple[int, Path]] = []
    for q in p.parent.glob(p.name + ".*"):
        rest = q.name[len(p.name) + 1 :]
        n = rest.removesuffix(".gz")
        if n.isdigit():
            parts.append((int(n), q))
    return [q for _, q in sorted(parts, key=lambda x: -x[0])]


def _read_part(part: Path) -> str:
    if part.suffix == ".gz":
        import gzip

        return gzip.decompress(part.read_bytes()).decode("utf-8", errors="replace")
    return part.read_text(errors="replace")


def read_records(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """All records of the given logs (and their rotated parts), merged by time."""
    out: list[dict[str, Any]] = []
    for p in paths:
        for part in [*_rotated_parts(p), p]:
            if not part.exists():
                continue
            for n, line in enumerate(_read_part(part).splitlines(), 1):
                if not line.strip():
                    continue
                where = f"{part}:{n}"
                try:
                    rec = load_json(line, where)
                except JsonTooDeepError:  # a bare RecursionError ended `sailor audit`
                    why = "JSON nested too deep to read (past the parser's depth limit)"
                    rec = {"kind": "corrupt", "time": 0.0, "where": where, "why": why}
                except json.JSONDecodeError:
                    rec = {"kind": "corrupt", "time": 0.0, "where": where}
                else:
                    why = malformed(rec)
                    if why:
                        rec = {"kind": "corrupt", "time": 0.0, "where": where, "why": why}
                rec["_source"] = p.name
                out.append(rec)
    out.sort(key=lambda r: float(r.get("time", 0.0)))
    return out


_REQUIRED_INTS: dict[str, tuple[str, ...]] = {
    "leader": ("epoch",),
    "ack": ("epoch",),
    "commit": ("step",),
    "phase": ("generation",),
    "calibration": ("version",),
}
"""Fields a record of a kind must carry as integers for the checks to mean anything."""


def malformed(rec: object) -> str:
    """Why a parsed line is not a record the checks can read ('' if it is): not an object,
    no string ``kind``, no numeric ``time``, or a field its kind needs missing or not an
    integer."""
    if not isinstance(rec, dict):
        return f"not a JSON object ({type(rec).__name__})"
    kind, t = rec.get("kind"), rec.get("time")
    if not isinstance(kind, str):
        return f"kind={kind!r}: not a string"
    if isinstance(t, bool) or not isinstance(t, int | float):
        return f"time={t!r}: not a number"
    for name in _REQUIRED_INTS.get(kind, ()):
        v = rec.get(name)
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{kind} record: {name}={v!r}: an integer is required"
    return ""


@dataclass
class AuditReport:
    """The outcome of ``check``."""

    records: int = 0
    violations: list[str] = field(default_factory=list)
    preemptions: int = 0
    commits: list[int] = field(default_factory=list)
    reconfigurations: int = 0
    calibrations: int = 0
    """Calibration versions recorded (``calibration`` records)."""
    recalibrations: int = 0
    """Calibration-driven replans (phase changes with cause ``recalibration``)."""
    in_place: int = 0
    """Launches that took the in-place path."""
    fallbacks: int = 0
    """Restart launches that fell back after an in-place launch failed."""
    marked_bad: list[int] = field(default_factory=list)
    """Committed steps a launch could not read, as the log leaves them (marked bad, not
    cleared nor committed again)."""

    @property
    def ok(self) -> bool:
        return not self.violations


def check(records: list[dict[str, Any]]) -> AuditReport:
    """Check the invariants over merged records."""
    rep = AuditReport(records=len(records))
    last_epoch = -1
    acked_epoch: dict[str, int] = {}
    pending_notices: list[tuple[float, str]] = []
    deleted: set[int] = set()  # steps whose checkpoints a commit deleted (``dropped``)
    recorded: set[int] = set()  # steps recorded (committed, not dropped since), as logged
    unreadable: set[int] = set()  # commits a launch could not read (``bad_checkpoints``)
    cleared: set[int] = set()  # their marks cleared by an operator (``clear_bad``)
    clears: set[str] = set()  # the requests those ``clear_bad`` records name
    last_gen = -1
    versions: set[int] = set()
    decided: dict[int, dict[str, Any]] = {}  # generation -> its decision to reconfigure
    recalibrated: set[int] = set()  # generations a calibration-driven replan began in
    in_place_gen = -1  # the generation last launched in place
    failed_in_place = -1  # an in-place generation aborted before it ran
    for r in records:
        kind = r.get("kind")
        t = float(r.get("time", 0.0))
        if kind == "corrupt":
            why = f": {r['why']}" if r.get("why") else ""
            rep.violations.append(f"unreadable line at {r.get('where')}{why}")
        elif kind == "leader":
            epoch = int(r.get("epoch", -1))
            if epoch <= last_epoch:
                rep.violations.append(f"t={t:.3f}: epoch {epoch} after {last_epoch}")
            last_epoch = max(last_epoch, epoch)
        elif kind == "ack" and r.get("accepted"):
            node, epoch = str(r.get("node_id")), int(r.get("epoch", -1))
            if epoch < acked_epoch.get(node, -1):
                rep.violations.append(
                    f"t={t:.3f}: {node} accepted {r.get('command_id')} from stale epoch {epoch}"
                )
            acked_epoch[node] = max(acked_epoch.get(node, -1), epoch)
        elif kind == "event":
            _check_subject(r, t, rep)
            if r.get("event_kind") == "preemption_notice":
                rep.preemptions += 1
                pending_notices.append((t, str(r.get("node_id"))))
        elif kind in ("calibration", "calibration_restored"):
            versions.add(int(r.get("version", -1)))
            rep.calibrations += kind == "calibration"
        elif kind == "replan_decision" and r.get("reconfigure"):
            _check_decision(r, t, versions, rep)
            decided[int(r.get("generation", -1))] = r
        elif kind == "commit":
            step = int(r.get("step", -1))
            rep.commits.append(step)
            dropped = {int(s) for s in r.get("dropped", ())}
            if any(s >= step for s in dropped):
                rep.violations.append(
                    f"t={t:.3f}: the commit of step {step} deleted steps {sorted(dropped)}: "
                    "only older checkpoints may go"
                )
            # the save's drop_steps (absent or null: an older controller's, or none asked)
            asked = r.get("drop_steps")
            steps = {s for s in asked if isinstance(s, int)} if isinstance(asked, list) else set()
            if bad := steps & (recorded | {step}):
                rep.violations.append(
                    f"t={t:.3f}: the save of step {step} was sent drop_steps {sorted(steps)} "
                    f"naming recorded step(s) {sorted(bad)}: its committer could delete a "
                    "commit a launch loads"
                )
            deleted |= dropped
            recorded = (recorded | {step}) - dropped
            unreadable.discard(step)  # saved again: new files, its mark went with the old
            cleared.discard(step)
        elif kind == "clear_bad":
            rid = str(r.get("request_id", ""))
            if "taken_epoch" in r and rid in clears:
                # a take audited again from its mark by a later leader (the first one's
                # delete of the mark failed): the clear happened once, at the first
                # record; counted again, a step marked since would read as cleared
                continue
            clears.add(rid)
            gone = {int(s) for s in r.get("cleared", ())} & unreadable
            unreadable -= gone
            cleared |= gone
        elif kind == "phase":
            phase = r.get("phase")
            gen = int(r.get("generation", -1))
            marked = {int(s) for s in r.get("bad_checkpoints", ())}
            if r.get("cause") in ADOPTION_CAUSES:
                # a new leader's first write holds every mark etcd holds (absent: none):
                # one its view lacks went with a write whose audit record no one wrote (the
                # old leader's answer lost, its term ended before it read the state back)
                cleared |= unreadable - marked
                unreadable = set(marked)
            else:
                unreadable |= marked
            cleared -= marked
            if gen < last_gen:
                rep.violations.append(
                    f"t={t:.3f}: generation {gen} after {last_gen}: generations went back"
                )
            last_gen = max(last_gen, gen)
            if str(r.get("cause", "")).startswith("recalibration"):
                rep.recalibrations += 1
                if gen not in decided:
                    rep.violations.append(
                        f"t={t:.3f}: calibration-driven replan of generation {gen} without a "
                        "replan_decision that reconfigured"
                    )
                if gen in recalibrated:
                    rep.violations.append(
                        f"t={t:.3f}: second calibration-driven replan in generation {gen}"
                    )
                recalibrated.add(gen)
            if phase == "running":
                pending_notices = [(nt, n) for nt, n in pending_notices if nt > t]
            if phase == "teardown" and gen == in_place_gen and in_place_failed_abort(r):
                failed_in_place = gen
            if phase == "launch":
                failed_in_place = _check_path(r, t, gen, failed_in_place, rep)
                in_place_gen = gen if r.get("path") == "in_place" else -1
            if phase == "launch":
                rep.reconfigurations += 1
                load = int(r.get("load_step", -1))
                if load in deleted:
                    rep.violations.append(
                        f"t={t:.3f}: launch loads step {load}, whose checkpoint was deleted"
                    )
                # the newest commit a launch could read: not one a launch failed to load
                readable = max(
                    (c for c in rep.commits if c not in unreadable and c not in cleared),
                    default=-1,
                )
                if load < readable:
                    rep.violations.append(
                        f"t={t:.3f}: launch loads step {load} but step {readable} "
                        "was committed: committed steps lost"
                    )
    for nt, n in pending_notices:
        rep.violations.append(f"t={nt:.3f}: preemption notice for {n} never led to a resumed run")
    rep.marked_bad = sorted(unreadable)
    return rep


_LAUNCHING_PHASES = ("launch", "load", "verify")


def in_place_failed_abort(r: dict[str, Any]) -> bool:
    """A teardown record that aborts a generation while it came up (its in-place path failed):
    not one whose only failure was a taken rendezvous port, within the bound of such aborts
    in a row (``rendezvous_retries``: the path is kept, ``controller/rendezvous_ports.py``)."""
    tries = r.get("rendezvous_retries", 0)
    if isinstance(tries, int) and 0 < tries <= RENDEZVOUS_RETRIES:
        return False
    cause = str(r.get("cause", ""))
    return cause.startswith("abort: during ") and cause[len("abort: during ") :].startswith(
        _LAUNCHING_PHASES
    )


def _check_path(
    r: dict[str, Any], t: float, gen: int, failed_in_place: int, rep: AuditReport
) -> int:
    """A launch after a failed in-place launch must take the restart path and say why; every
    launch of a log that records paths names one. Returns the failure still pending."""
    path = r.get("path")
    if path == "in_place":
        rep.in_place += 1
    if failed_in_place < 0:
        return -1
    if path == "in_place":
        rep.violations.append(
            f"t={t:.3f}: generation {gen} launched in place again after the in-place launch "
            f"of generation {failed_in_place} failed (no fallback to the restart path)"
        )
    elif path == "restart":
        rep.fallbacks += 1
        if "fallback" not in str(r.get("path_reason", "")):
            rep.violations.append(
                f"t={t:.3f}: generation {gen} fell back to the restart path without saying why"
            )
    return -1


def _check_decision(r: dict[str, Any], t: float, versions: set[int], rep: AuditReport) -> None:
    """A decision to reconfigure must satisfy the rule by its own numbers and name a
    calibration version recorded before it."""
    what = f"t={t:.3f}: replan_decision of generation {r.get('generation')}"
    for why in rule_violations(r):
        rep.violations.append(f"{what}: {why}")
    version = r.get("calibration_version")
    if not isinstance(version, int) or version not in versions:
        rep.violations.append(f"{what} names calibration v{version}, never recorded before it")


def _check_subject(r: dict[str, Any], t: float, rep: AuditReport) -> None:
    """An accepted event must name its subject, and the subject must be its node's."""
    what = f"t={t:.3f}: event {r.get('event_id')} about {r.get('node_id')}"
    source = event_subject_source(str(r.get("subject", "")))
    if source is None:
        rep.violations.append(f"{what} kept no event subject")
    elif source != safe_token(str(r.get("node_id", ""))):
        rep.violations.append(f"{what} was accepted from {source}'s subject")


def timeline(records: list[dict[str, Any]]) -> list[str]:
    """Human-readable lines: relative time, kind, the fields that matter."""
    if not records:
        return []
    t0 = float(records[0].get("time", 0.0))
    keep = {
        "leader",
        "event",
        "event_rejected",
        "phase",
        "commit",
        "periodic_checkpoint",
        "plan",
        "fenced",
        "calibration",
        "calibration_restored",
        "replan_decision",
        "not_admitted",
        "event_stream_unplaced",
        "event_stream_overdue",
        "event_stream_placed",
        "audit_budget_exceeded",
        "events_unaudited",
        "credentials_revoked",
    }
    lines: list[str] = []
    for r in records:
        kind = r.get("kind")
        if kind not in keep:
            continue
        t = float(r.get("time", 0.0)) - t0
        extra = {
            k: v
            for k, v in r.items()
            if k not in {"kind", "time", "_source"} and v not in ("", None)
        }
        desc = " ".join(
            f"{k}={v}" for k, v in sorted(extra.items()) if k not in ("plan", "constants")
        )
        lines.append(f"{t:9.3f}s  {kind:<15} {desc[:160]}")
    return lines
