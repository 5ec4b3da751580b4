"""JSON nested past the parser's depth limit (``[[[…``, 100k brackets) in a file or a peer's
text: each reader names where it came from instead of raising a bare ``RecursionError``
(``schemas.json_text.load_json``), and a daemon's reader goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sailor.schemas.json_text import JsonTooDeepError, load_json

DEEP = "[" * 100_000


def test_load_json_names_where_the_text_came_from() -> None:
    with pytest.raises(JsonTooDeepError, match=r"^f\.json:3: JSON nested too deep"):
        load_json(DEEP, "f.json:3")
    assert isinstance(JsonTooDeepError("x"), ValueError)  # every `except ValueError` covers it
    with pytest.raises(json.JSONDecodeError):
        load_json("{", "f.json")
    assert load_json(b'{"a": [1]}', "f.json") == {"a": [1]}


def test_sailor_audit_reports_a_too_deep_line_as_corrupt(tmp_path: Path) -> None:
    """``sailor audit`` ended in a RecursionError traceback; now the line is a corrupt
    record naming the file and line, the other records are read and checked."""
    from sailor.cli.main import app
    from sailor.controller.audit import read_records

    log = tmp_path / "audit.jsonl"
    good = {"kind": "leader", "time": 1.0, "epoch": 7, "identity": "c1"}
    log.write_text(json.dumps(good) + "\n" + DEEP + "\n")
    recs = read_records([log])
    bad = [r for r in recs if r["kind"] == "corrupt"]
    assert len(recs) == 2 and len(bad) == 1, recs
    assert bad[0]["where"] == f"{log}:2" and "nested too deep" in bad[0]["why"], bad
    res = CliRunner().invoke(app, ["audit", str(log)])
    assert not isinstance(res.exception, RecursionError), res.exception
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert f"unreadable line at {log}:2: JSON nested too deep" in res.output, res.output


def test_a_too_deep_membership_trace_is_a_trace_file_error(tmp_path: Path) -> None:
    from sailor.controller.online_calibration import TraceFileError, load_trace

    trace = tmp_path / "trace.json"
    trace.write_text(DEEP)
    with pytest.raises(TraceFileError, match=f"{trace}: JSON nested too deep"):
        load_trace(trace)


def test_a_check_child_printing_too_deep_json_is_a_cuda_error_fact() -> None:
    """The agent's node check parses its child's output: a RecursionError (or any output
    that is not its facts) ended the check with a traceback; now it is the check's finding."""
    from sailor.agent.check_gather import child_facts

    for out in (DEEP.encode(), b"not json", b"[1, 2]", b'{"devices": 5}'):
        got = child_facts(out)
        assert got["gathered"] is True, got
        assert got["cuda_error"].startswith("the check process printed no facts"), got
    assert "nested too deep" in child_facts(DEEP.encode())["cuda_error"]
    fine = child_facts(b'{"gathered": true}')  # the child's facts pass through
    assert fine["gathered"] is True and not fine.get("cuda_error"), fine


def test_a_too_deep_nats_login_file_is_named(tmp_path: Path) -> None:
    from sailor.coordination.security.settings import read_nats_login

    path = tmp_path / "n1.nats.json"
    path.write_text(DEEP)
    with pytest.raises(ValueError, match=f"{path}: not a NATS login file"):
        read_nats_login(path)


def test_a_worker_reads_too_deep_control_files_as_none(tmp_path: Path) -> None:
    """The worker's control file and relayout directive (written by the agent) nested too
    deep: read as no request, as a half-written file is, not a RecursionError ending it."""
    from sailor.megatron_patch.control import ControlRequest, read_control
    from sailor.megatron_patch.in_place import parse_directive

    path = tmp_path / "control-0.json"
    path.write_text(DEEP)
    assert read_control(path) == ControlRequest()
    assert parse_directive(DEEP, 0) is None
