"""What the mark of a leader's take of an operator's request holds, and how a later term
reads it. Pure: bytes and values in, values out; no I/O, no clock.

A leader that applies a request (``readmit/<id>``, ``clear-bad/<id>``) deletes it in a
transaction that also writes the take's mark, ``taken/<kind>/<id>`` (``Keys.taken``): with
a desired state (``Executor.write_desired``) or without one (``Executor._take``). The mark
holds the request's own audit record (``readmit`` or ``clear_bad``: what it ended, or why
nothing) and the epoch of the leader that took it, and is bound to no lease. Answered, the
leader audits the take and deletes the mark. Its answer lost, the mark says the take
committed (``Executor.settle_lost_takes``). And should the term end before either, the
mark outlives it: the next leader audits the take from it at its start
(``Executor.settle_orphan_marks``) and deletes it. Bound to the lease, as it was, the mark
went with the term and no leader could write a record of the take.

Must never import the daemon or the executor (they import this one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sailor.controller.decision_types import ClearBadDone, ClearReadmit

__all__ = ["RESERVED_FIELDS", "TakeMark", "mark_value", "read_mark", "request_record"]

RESERVED_FIELDS = frozenset({"kind", "time", "sync", "epoch", "answer_lost", "taken_epoch"})
"""Names the audit record of a take settled from its mark sets itself (``AuditLog.write``'s
own arguments, and what ``Executor.settle_orphan_marks`` adds): a mark's record naming one
is no record :func:`request_record` wrote, and, passed on, it raised ``TypeError`` in every
leader in turn (the mark stays until audited)."""


def request_record(a: ClearReadmit | ClearBadDone) -> tuple[str, dict[str, Any]]:
    """The audit record of a request applied: its kind (``readmit``, ``clear_bad``) and its
    fields besides the time and the epoch (what it ended, or why nothing)."""
    if isinstance(a, ClearBadDone):
        fields: dict[str, Any] = {
            "request_id": a.request_id,
            "who": a.who,
            "steps": list(a.steps),
            "all": a.all,
            "cleared": list(a.cleared),
            "reason": a.reason,
        }
        if a.repointed:  # which records now name which directory, and named before
            fields |= {
                "repointed": [r.step for r in a.repointed],
                "repointed_from": list(a.repointed_from),
                "directory": a.repointed[0].directory,
            }
        return "clear_bad", fields
    return "readmit", {"request_id": a.request_id, "reason": a.reason}


def mark_value(a: ClearReadmit | ClearBadDone, epoch: int) -> bytes:
    """The mark of ``a``'s take by the leader of ``epoch``: that epoch, and the request's
    audit record (:func:`request_record`)."""
    kind, fields = request_record(a)
    return json.dumps({"epoch": epoch, "kind": kind, "record": fields}).encode()


@dataclass(frozen=True)
class TakeMark:
    """A mark as a later term reads it. ``epoch`` None and ``kind`` '': an empty mark (a
    release that bound it to the lease and wrote nothing in it) or one that does not parse:
    the take committed, what it did is not known. ``bad``: why a mark that parses holds no
    record to audit (``kind`` '' and ``record`` empty then; ``raw`` the record as found)."""

    epoch: int | None
    kind: str
    record: dict[str, Any]
    bad: str = ""
    raw: dict[str, Any] | None = None


def read_mark(raw: bytes) -> TakeMark:
    """The mark ``raw`` (:func:`mark_value`); never raises."""
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, RecursionError):  # RecursionError: nested past json's limit
        body = None
    if not isinstance(body, dict):
        return TakeMark(None, "", {})
    epoch, kind, record = body.get("epoch"), body.get("kind"), body.get("record")
    if (
        not isinstance(epoch, int)
        or isinstance(epoch, bool)
        or kind not in ("readmit", "clear_bad")
        or not isinstance(record, dict)
    ):
        return TakeMark(None, "", {})
    reserved = sorted(RESERVED_FIELDS & record.keys())
    if reserved:
        why = f"its record names fields the audit record sets itself: {', '.join(reserved)}"
        return TakeMark(epoch, "", {}, bad=why, raw=record)
    return TakeMark(epoch, str(kind), record)
