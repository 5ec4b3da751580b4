"""The mark of a leader's take of an operator's request (``controller/take_marks.py``): it
holds the epoch that took it and the request's own audit record, read back whole by a later
term; an empty or foreign mark reads as a take whose record is not known, never an error."""

from __future__ import annotations

import json

from sailor.controller.decision_types import ClearBadDone, ClearReadmit
from sailor.controller.take_marks import (
    RESERVED_FIELDS,
    TakeMark,
    mark_value,
    read_mark,
    request_record,
)
from sailor.schemas.runtime import CommitRecord


def test_a_clear_bad_mark_reads_back_as_its_audit_record() -> None:
    a = ClearBadDone(
        "r1",
        who="op@h",
        steps=(300,),
        cleared=(),
        reason="no bad or suspect mark on step 300",
        repointed=(CommitRecord(step=300, directory="/ck"),),
        repointed_from=("/old",),
    )
    kind, fields = request_record(a)
    mark = read_mark(mark_value(a, epoch=4))
    assert mark == TakeMark(4, kind, fields) and kind == "clear_bad"
    assert fields["repointed"] == [300] and fields["repointed_from"] == ["/old"]
    assert fields["directory"] == "/ck" and fields["who"] == "op@h"


def test_a_readmit_mark_reads_back_as_its_audit_record() -> None:
    mark = read_mark(mark_value(ClearReadmit("r2", "forgot n2"), epoch=7))
    assert mark == TakeMark(7, "readmit", {"request_id": "r2", "reason": "forgot n2"})


def test_an_empty_or_foreign_mark_is_a_take_of_unknown_record() -> None:
    unknown = TakeMark(None, "", {})
    for raw in (
        b"",
        b"not json",
        b"[]",
        b'{"epoch": "4", "kind": "readmit", "record": {}}',
        b'{"epoch": 4, "kind": "phase", "record": {}}',
        b'{"epoch": 4}',
        b'{"epoch": true, "kind": "readmit", "record": {}}',
        b"[" * 5000,  # nested past json's limit: RecursionError, which crashed the pass
    ):
        assert read_mark(raw) == unknown, raw


def test_a_mark_whose_record_names_a_field_the_settle_sets_is_bad() -> None:
    """A record naming ``kind``, ``time``, ``sync``, ``epoch``, ``answer_lost`` or
    ``taken_epoch`` (no release writes one): no record to audit, why, and the record as
    found. Before, it was passed on beside those fields, and ``AuditLog.write`` raised."""
    for name in sorted(RESERVED_FIELDS):
        record = {"request_id": "r1", "reason": "x", name: 1}
        raw = json.dumps({"epoch": 4, "kind": "readmit", "record": record}).encode()
        mark = read_mark(raw)
        assert (mark.epoch, mark.kind, mark.record, mark.raw) == (4, "", {}, record), name
        assert name in mark.bad, mark.bad
    assert read_mark(mark_value(ClearReadmit("r2", "forgot n2"), epoch=7)).bad == ""
