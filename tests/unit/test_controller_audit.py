"""The audit log's group commit: records readable at once, durable after ``durable()``."""

from __future__ import annotations

import asyncio
import gzip
from pathlib import Path

from sailor.controller.audit import AuditLog, check, read_records


async def test_concurrent_durable_calls_share_fsyncs(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "a.jsonl")
    for i in range(100):
        log.write("event", float(i), event_id=f"e{i}")
    assert log.pending == 100
    assert [r["event_id"] for r in read_records([log.path])][:3] == ["e0", "e1", "e2"]

    async def ack(i: int) -> None:
        log.write("ack", 100.0 + i, command_id=f"c{i}")
        await log.durable()

    await asyncio.gather(*(ack(i) for i in range(50)))
    assert log.pending == 0
    assert log.fsyncs <= 3  # 150 records, one fsync for most of them
    await log.durable()  # nothing pending: no fsync
    assert log.fsyncs <= 3
    log.close()
    assert len(read_records([log.path])) == 150


async def test_durable_covers_records_written_while_an_fsync_runs(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "a.jsonl")
    log.write("event", 1.0)
    first = asyncio.ensure_future(log.durable())
    await asyncio.sleep(0)  # the first fsync is under way
    log.write("event", 2.0)
    await log.durable()  # must wait for a second fsync, not return on the first
    assert log.pending == 0
    await first
    log.close()


def test_sync_write_and_rotation_leave_nothing_pending(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "a.jsonl", max_bytes=200)
    log.write("leader", 1.0, sync=True, epoch=7)
    assert log.pending == 0
    for i in range(10):
        log.write("event", 2.0 + i, event_id=f"e{i}")
    log.close()
    recs = read_records([log.path])
    assert len(recs) == 11 and (tmp_path / "a.jsonl.1").exists()


def test_compressed_parts_are_read_and_other_files_beside_the_log_ignored(
    tmp_path: Path,
) -> None:
    """logrotate's ``compress`` leaves ``a.jsonl.2.gz``; a ``.bak`` copy is not a part; a
    line that is not UTF-8 is a corrupt record, not a crash of the whole audit."""
    log = AuditLog(tmp_path / "a.jsonl", max_bytes=200)
    for i in range(12):
        log.write("event", float(i), event_id=f"e{i}")
    log.close()
    parts = sorted(q.name for q in tmp_path.iterdir())
    assert "a.jsonl.2" in parts, parts
    two = tmp_path / "a.jsonl.2"
    (tmp_path / "a.jsonl.2.gz").write_bytes(gzip.compress(two.read_bytes()))
    two.unlink()
    (tmp_path / "a.jsonl.bak").write_text("not a part\n")
    recs = read_records([log.path])
    assert [r["event_id"] for r in recs] == [f"e{i}" for i in range(12)]
    with (tmp_path / "a.jsonl").open("ab") as f:
        f.write(b"\xff\xfe{not utf-8}\n")
    recs = read_records([log.path])
    assert len(recs) == 13 and sum(r["kind"] == "corrupt" for r in recs) == 1


def test_check_requires_each_event_to_come_on_its_own_nodes_subject() -> None:
    def event(eid: str, node: str, subject: str | None) -> dict[str, object]:
        rec: dict[str, object] = {"kind": "event", "time": 1.0, "event_id": eid, "node_id": node}
        if subject is not None:
            rec["subject"] = subject
        return {**rec, "event_kind": "node_joined"}

    ok = check([event("a", "n1", "sailor.j.events.n1.node_joined")])
    assert ok.ok, ok.violations
    rep = check(
        [
            event("b", "n2", "sailor.j.events.n1.node_joined"),
            event("c", "n2", None),
            event("d", "n2", "sailor.j.cmd.n2"),
        ]
    )
    assert len(rep.violations) == 3
    assert "accepted from n1's subject" in rep.violations[0]
    assert all("kept no event subject" in v for v in rep.violations[1:])


def test_check_requires_generations_to_grow_across_leaders() -> None:
    def phase(t: float, epoch: int, gen: int) -> dict[str, object]:
        return {"kind": "phase", "time": t, "epoch": epoch, "generation": gen, "phase": "idle"}

    recs = [
        {"kind": "leader", "time": 0.0, "epoch": 5},
        phase(1.0, 5, 3),
        phase(2.0, 5, 4),
        {"kind": "leader", "time": 3.0, "epoch": 9},
        phase(4.0, 9, 4),
    ]
    assert check(recs).ok
    reset = [*recs, {"kind": "leader", "time": 5.0, "epoch": 12}, phase(6.0, 12, 0)]
    rep = check(reset)
    assert rep.violations == ["t=6.000: generation 0 after 4: generations went back"]


def _recalibration_log() -> list[dict[str, object]]:
    """A run whose fit said to reconfigure once, with the numbers to back it."""
    from sailor.controller.recalibrate import (
        RecalibrationPolicy,
        ReplanInputs,
        decide_recalibration,
    )

    d = decide_recalibration(
        ReplanInputs(
            generation=1,
            calibration_version=1,
            running_plan="p-a",
            best_plan="p-b",
            running_s=4.4,
            best_s=2.5,
            worst_improvement=0.42,
            downtime_s=5.0,
            time_to_change_s=475.0,
            stable_reports=2,
        ),
        RecalibrationPolicy(stable_reports=2),
    )
    assert d.reconfigure
    return [
        {"kind": "leader", "time": 0.0, "epoch": 5},
        {"kind": "phase", "time": 1.0, "phase": "running", "generation": 1, "cause": "x"},
        {"kind": "calibration", "time": 2.0, "version": 1, "generation": 1},
        {"kind": "replan_decision", "time": 3.0, "epoch": 5, **d.model_dump()},
        {
            "kind": "phase",
            "time": 3.1,
            "phase": "quiesce",
            "generation": 1,
            "cause": "recalibration: v1 says p-b",
        },
        {"kind": "phase", "time": 5.0, "phase": "running", "generation": 2, "cause": "y"},
    ]


def test_check_accepts_a_recalibration_that_the_rule_backs() -> None:
    rep = check(_recalibration_log())
    assert rep.ok, rep.violations
    assert rep.recalibrations == 1 and rep.calibrations == 1


def test_check_reports_a_tampered_or_unbacked_recalibration() -> None:
    log = _recalibration_log()
    # the gain written bigger than its inputs give
    tampered = [dict(r) for r in log]
    tampered[3]["gain_s"] = 1e6
    rep = check(tampered)
    assert any("gain_s" in v for v in rep.violations), rep.violations
    # the inputs changed so that the rule no longer holds (the downtime was longer)
    tampered = [dict(r) for r in log]
    tampered[3]["downtime_s"] = 500.0
    assert any("the rule says no" in v for v in check(tampered).violations)
    # a calibration version that was never recorded
    assert any(
        "never recorded" in v
        for v in check([r for r in log if r["kind"] != "calibration"]).violations
    )
    # a replan with cause recalibration and no decision behind it
    assert any(
        "without a replan_decision" in v
        for v in check([r for r in log if r["kind"] != "replan_decision"]).violations
    )
    # a second one in the same generation: flapping
    again = {**log[4], "time": 3.5}
    assert any(
        "second calibration-driven" in v for v in check([*log[:5], again, log[5]]).violations
    )


def test_check_accepts_a_version_a_new_leader_restored() -> None:
    log = _recalibration_log()
    log[2] = {"kind": "calibration_restored", "time": 2.0, "version": 1, "epoch": 6}
    assert check(log).ok


def test_check_requires_a_fallback_after_a_failed_in_place_launch() -> None:
    def launch(t: float, gen: int, path: str, why: str) -> dict[str, object]:
        return {
            "kind": "phase",
            "time": t,
            "generation": gen,
            "phase": "launch",
            "load_step": -1,
            "path": path,
            "path_reason": why,
        }

    aborted = {
        "kind": "phase",
        "time": 2.0,
        "generation": 1,
        "phase": "teardown",
        "cause": "abort: during load: worker failed on n1: boom",
    }
    fallback = launch(3.0, 2, "restart", "fallback: the in-place launch of generation 1 failed")
    good = [launch(1.0, 1, "in_place", "in place (configured)"), aborted, fallback]
    rep = check(good)
    assert rep.ok and rep.in_place == 1 and rep.fallbacks == 1
    again = [*good[:2], launch(3.0, 2, "in_place", "in place (configured)")]
    assert "launched in place again" in check(again).violations[0]
    silent = [*good[:2], launch(3.0, 2, "restart", "")]
    assert "without saying why" in check(silent).violations[0]
    # an abort while running is no failure of the in-place path: in place again is fine
    running_abort = {**aborted, "cause": "abort: node lost without notice: n2"}
    ok = [good[0], running_abort, launch(3.0, 2, "in_place", "in place (configured)")]
    assert check(ok).ok


def test_check_refuses_a_launch_from_a_deleted_checkpoint() -> None:
    def commit(t: float, step: int, dropped: list[int]) -> dict[str, object]:
        return {"kind": "commit", "time": t, "step": step, "dropped": dropped}

    def launch(t: float, gen: int, load: int) -> dict[str, object]:
        return {"kind": "phase", "time": t, "phase": "launch", "generation": gen, "load_step": load}

    ok = [commit(1, 4, []), launch(2, 1, 4), commit(3, 9, []), commit(4, 14, [4]), launch(5, 2, 14)]
    assert check(ok).ok
    rep = check([*ok, launch(6, 3, 4)])  # a restart that reads a pruned step
    assert any("loads step 4, whose checkpoint was deleted" in v for v in rep.violations)
    rep = check([commit(1, 9, [9, 4])])  # a commit may only delete older steps
    assert any("commit of step 9 deleted steps [4, 9]" in v for v in rep.violations)
    # a launch that falls back below an unreadable commit: allowed once the phase records
    # name it (bad_checkpoints), a lost commit otherwise
    torn = {"kind": "phase", "time": 6, "phase": "teardown", "generation": 2, "load_step": 9}
    fallback = [*ok, {**torn, "bad_checkpoints": [14]}, launch(7, 3, 9)]
    assert check(fallback).ok, check(fallback).violations
    rep = check([*ok, torn, launch(7, 3, 9)])
    assert any("loads step 9 but step 14 was committed" in v for v in rep.violations)


def test_check_refuses_a_save_told_to_delete_a_recorded_step() -> None:
    """A commit's ``drop_steps`` (its save's ``Checkpoint.drop_steps``: the saves the
    controller gave up on, which its committer deletes if committed) must name no step
    recorded before it, nor its own. A record dropped before (``dropped``) may be named; an
    older controller's commit (no ``drop_steps``) is not checked."""

    def commit(
        t: float, step: int, dropped: list[int], asked: list[int] | None
    ) -> dict[str, object]:
        rec: dict[str, object] = {"kind": "commit", "time": t, "step": step, "dropped": dropped}
        return rec if asked is None else rec | {"drop_steps": asked}

    ok = [commit(1, 4, [], []), commit(2, 9, [], [12]), commit(3, 14, [4], [30])]
    assert check([*ok, commit(4, 20, [9], [4, 22])]).ok
    assert check([*ok, commit(4, 20, [9], None)]).ok
    rep = check([*ok, commit(4, 20, [9], [9, 14, 22])])
    assert any(
        "save of step 20 was sent drop_steps [9, 14, 22] naming recorded step(s) [9, 14]" in v
        for v in rep.violations
    ), rep.violations
    rep = check([*ok, commit(4, 20, [9], [20])])
    assert any("naming recorded step(s) [20]" in v for v in rep.violations), rep.violations


def test_malformed_records_are_violations_naming_the_line_and_field(tmp_path: Path) -> None:
    """A record that parses as JSON but is not one the checks can read (a list, a time that
    is not a number, a leader without an epoch) is reported at its file and line with the
    field, not a Python error, nor a made-up violation ('epoch -1 after -1')."""
    log = tmp_path / "a.jsonl"
    log.write_text(
        "\n".join(
            [
                '{"kind": "leader", "time": 1.0, "epoch": 1}',
                '{"kind": "leader", "time": "yesterday", "epoch": "x"}',
                "[1, 2]",
                '{"kind": "leader", "time": 2.0}',
                '{"kind": "commit", "time": 3.0, "step": "7"}',
            ]
        )
        + "\n"
    )
    rep = check(read_records([log]))
    assert sorted(rep.violations) == sorted(
        [
            f"unreadable line at {log}:2: time='yesterday': not a number",
            f"unreadable line at {log}:3: not a JSON object (list)",
            f"unreadable line at {log}:4: leader record: epoch=None: an integer is required",
            f"unreadable line at {log}:5: commit record: step='7': an integer is required",
        ]
    )


def test_check_takes_a_cleared_mark_as_readable_again() -> None:
    """An operator cleared step 14's mark (``clear_bad``): a launch may load it, and need
    not (a planned reconfiguration reloads its own save); once 14 is committed again, a
    launch below it loses a commit. Before, a step once marked stayed unreadable for the
    checker for good: a launch that lost it after it was saved again passed."""

    def commit(t: float, step: int) -> dict[str, object]:
        return {"kind": "commit", "time": t, "step": step, "dropped": []}

    def launch(t: float, gen: int, load: int) -> dict[str, object]:
        return {"kind": "phase", "time": t, "phase": "launch", "generation": gen, "load_step": load}

    torn = {"kind": "phase", "time": 3, "phase": "teardown", "generation": 1, "load_step": 9}
    marked = [commit(1, 9), commit(2, 14), {**torn, "bad_checkpoints": [14]}, launch(4, 2, 9)]
    clear = {"kind": "clear_bad", "time": 5, "request_id": "r1", "who": "ops@h", "cleared": [14]}
    ok = [*marked, clear, launch(6, 3, 14), launch(7, 4, 9)]
    assert check(ok).ok, check(ok).violations
    rep = check([*marked, clear, commit(8, 14), launch(9, 3, 9)])
    assert any("loads step 9 but step 14 was committed" in v for v in rep.violations)


def test_a_new_leaders_first_record_holds_every_mark_there_is() -> None:
    """Leader 1 applies ``clear-bad 14``, etcd commits it and loses the answer, and
    leader 1's term ends before it reads its state back: neither ``request_applied`` nor
    ``clear_bad`` is written by anyone. Leader 2's takeover record holds the marks etcd
    holds (7, not 14): the checker takes 14 as cleared from there, as after a
    ``clear_bad``, and a mark the takeover holds that the log never showed counts too.
    Before, 14 stayed unreadable for the checker for good."""

    def phase(t: float, gen: int, cause: str, bad: list[int] | None) -> dict[str, object]:
        r: dict[str, object] = {
            "kind": "phase",
            "time": t,
            "phase": "running",
            "generation": gen,
            "load_step": 9,
            "cause": cause,
        }
        if bad is not None:  # absent when none, as the executor writes it
            r["bad_checkpoints"] = bad
        return r

    commits = [
        {"kind": "commit", "time": t, "step": s, "dropped": []}
        for t, s in ((1, 7), (2, 9), (3, 14))
    ]
    term1 = [{"kind": "leader", "time": 0.5, "epoch": 1}, *commits, phase(4, 2, "abort", [7, 14])]
    takeover = [{"kind": "leader", "time": 10, "epoch": 2}, phase(10.1, 2, "took over", [7])]
    rep = check([*term1, *takeover])
    assert rep.ok, rep.violations
    assert rep.marked_bad == [7]
    launch = {"kind": "phase", "time": 11, "phase": "launch", "generation": 3, "load_step": 14}
    assert check([*term1, *takeover, launch]).ok  # 14 cleared: it may be loaded
    more = phase(10.1, 2, "took over", [7, 8])  # a mark this log never showed
    assert check([*term1, takeover[0], more]).marked_bad == [7, 8]
    # the takeover holds no mark at all (the field absent): every one went
    none = phase(10.1, 2, "took over", None)
    assert check([*term1, takeover[0], none]).marked_bad == []
    # a later phase record of the same term adds marks, as ever; one that is no takeover
    # and lacks a mark does not clear it
    assert check([*term1, phase(5, 2, "teardown", [8])]).marked_bad == [7, 8, 14]


def test_a_clear_bad_audited_again_from_its_mark_counts_once() -> None:
    """Leader 1 clears step 14's mark (``clear_bad r1``) and cannot delete the take's mark
    before its term ends; 14 is marked bad again (a launch could not read it), and leader
    2 audits r1 again from the mark (``taken_epoch``). The checker keeps 14 marked: the
    second record is the same clear, not a new one. Before, it read 14 as cleared again."""
    commits = [
        {"kind": "commit", "time": t, "step": s, "dropped": []} for t, s in ((1, 9), (2, 14))
    ]

    def phase(t: float, gen: int, cause: str) -> dict[str, object]:
        return {
            "kind": "phase",
            "time": t,
            "phase": "running",
            "generation": gen,
            "load_step": 9,
            "cause": cause,
            "bad_checkpoints": [14],
        }

    clear = {"kind": "clear_bad", "time": 4, "request_id": "r1", "who": "ops@h", "cleared": [14]}
    term1 = [{"kind": "leader", "time": 0.5, "epoch": 1}, *commits, phase(3, 2, "abort"), clear]
    term1.append(phase(5, 3, "abort"))  # 14 marked again
    replay = {**clear, "time": 10.2, "epoch": 2, "answer_lost": True, "taken_epoch": 1}
    term2 = [{"kind": "leader", "time": 10, "epoch": 2}, phase(10.1, 3, "took over"), replay]
    rep = check([*term1, *term2])
    assert rep.ok, rep.violations
    assert rep.marked_bad == [14]
    # a replay whose first record no log holds (its leader wrote none) counts
    alone = check([*commits, phase(3, 2, "abort"), replay])
    assert alone.marked_bad == []
