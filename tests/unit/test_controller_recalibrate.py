"""The online-calibration replan rule, its inputs, and the audit's re-check of its records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor.controller.config import (
    DEFAULT_TIME_BETWEEN_CHANGES_S,
    ControllerConfig,
    OnlineCalibrationSettings,
)
from sailor.controller.online_calibration import TraceFileError, load_trace
from sailor.controller.recalibrate import (
    RecalibrationPolicy,
    ReplanInputs,
    decide_recalibration,
    expected_downtime,
    mean_time_between_changes,
    past_downtimes,
    rule_violations,
)

POLICY = RecalibrationPolicy(margin=0.5, min_improvement=0.05, stable_reports=3)
REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "sailor"


def inputs(**kw: object) -> ReplanInputs:
    base: dict[str, object] = {
        "generation": 4,
        "calibration_version": 2,
        "running_plan": "p-run",
        "best_plan": "p-best",
        "running_s": 1.0,
        "best_s": 0.8,
        "worst_improvement": 0.15,
        "downtime_s": 10.0,
        "time_to_change_s": 475.0,
        "stable_reports": 3,
    }
    return ReplanInputs.model_validate({**base, **kw})


@pytest.mark.parametrize(
    ("kw", "reconfigure", "why"),
    [
        ({}, True, "gain"),
        # 475 s x 2 % = 9.5 s: under the minimum improvement (and under the threshold)
        ({"best_s": 0.98}, False, "improvement 2.0% below"),
        # 60 s x 20 % = 12 s < 10 s x 1.5: does not pay its downtime with the margin
        ({"time_to_change_s": 60.0}, False, "does not pay"),
        # 12 s > 7 s x 1.5; with 10 s of downtime it would pay the bare downtime only:
        # the margin is the hysteresis
        ({"time_to_change_s": 60.0, "downtime_s": 7.0}, True, "gain"),
        # 30 steps left at 1 s: 30 s x 20 % = 6 s < 15 s
        ({"remaining_steps": 30}, False, "does not pay"),
        ({"stable_reports": 2}, False, "stable over 2"),
        ({"worst_improvement": -0.01}, False, "no gain at a corner"),
        ({"best_plan": "p-run"}, False, "running layout"),
        ({"same_layout": True}, False, "running layout"),
        ({"decided_generation": 4}, False, "decided in generation 4"),
        ({"decided_generation": 3}, True, "gain"),
    ],
)
def test_rule_table(kw: dict[str, object], reconfigure: bool, why: str) -> None:
    d = decide_recalibration(inputs(**kw), POLICY)
    assert d.reconfigure is reconfigure and why in d.reason, d.reason
    assert d.improvement == pytest.approx(1 - d.best_s / d.running_s)
    assert d.gain_s == pytest.approx(d.horizon_s * d.improvement)
    assert d.threshold_s == pytest.approx(d.downtime_s * 1.5)


def test_horizon_is_the_sooner_of_the_next_change_and_the_end_of_training() -> None:
    assert decide_recalibration(inputs(remaining_steps=100), POLICY).horizon_s == 100.0
    assert decide_recalibration(inputs(remaining_steps=10**6), POLICY).horizon_s == 475.0


def test_no_flapping_over_a_sequence_of_reports() -> None:
    """A run of fits: the rule reconfigures once per generation at most, only after the fit
    has been stable, and a new layout whose fits find nothing much better keeps running."""
    decided = -1
    replans: list[int] = []
    stable = 0
    # (generation, best_s relative to running_s, fit agrees with the previous one)
    reports = [
        (1, 0.60, True),
        (1, 0.62, True),
        (1, 0.55, False),  # the fit moved: stability starts over
        (1, 0.58, True),
        (1, 0.58, True),  # stable 3: reconfigure
        (1, 0.58, True),  # same generation: no second replan while the first is under way
        (2, 1.00, True),  # the new layout is the best one
        (2, 0.97, True),
        (2, 0.96, True),  # 4 % better: below the minimum improvement, noise
        (2, 1.03, True),
        (2, 0.96, True),
    ]
    last_gen = -1
    for gen, ratio, agrees in reports:
        stable = 1 if gen != last_gen or not agrees else stable + 1
        last_gen = gen
        d = decide_recalibration(
            inputs(
                generation=gen,
                best_s=ratio,
                worst_improvement=1 - ratio - 0.01,
                stable_reports=stable,
                decided_generation=decided,
                same_layout=ratio == 1.0,
            ),
            POLICY,
        )
        if d.reconfigure:
            decided = gen
            replans.append(gen)
    assert replans == [1]


def test_rule_violations_accepts_a_true_record_and_catches_tampering() -> None:
    d = decide_recalibration(inputs(), POLICY)
    record = {"kind": "replan_decision", "time": 5.0, "epoch": 3, **json.loads(d.model_dump_json())}
    assert rule_violations(record) == []
    # a gain made up to look bigger than its inputs give
    assert any("gain_s" in v for v in rule_violations({**record, "gain_s": 500.0}))
    # inputs that the rule rejects, whatever the verdict says
    low = rule_violations({**record, "time_to_change_s": 10.0})
    assert any("the rule says no" in v for v in low)
    assert rule_violations({**record, "margin": 100.0})  # a policy edited after the fact
    assert rule_violations({**record, "running_s": -1})[0].startswith("unreadable")


def test_downtimes_from_phase_records() -> None:
    phases = [
        ("idle", 0.0),
        ("launch", 1.0),
        ("running", 5.0),  # a first launch: not a reconfiguration
        ("quiesce", 10.0),
        ("checkpoint", 11.0),
        ("commit", 11.2),
        ("teardown", 11.3),
        ("launch", 11.4),
        ("running", 14.0),  # 3 s from the stop
        ("teardown", 20.0),  # an abort
        ("launch", 21.0),
        ("running", 27.0),  # 7 s
    ]
    assert past_downtimes(phases) == pytest.approx([3.0, 7.0])
    t, source = expected_downtime(phases, 30.0)
    assert t == pytest.approx(5.0) and source == "median of 2 measured reconfiguration(s)"
    assert expected_downtime(phases[:3], 30.0) == (30.0, "configured default")


def test_mean_time_between_changes() -> None:
    assert mean_time_between_changes([(0, 4), (100, 4), (200, 3), (400, 4)]) == pytest.approx(200)
    assert mean_time_between_changes([(0, 4), (50, 4)]) == 50.0
    with pytest.raises(ValueError):
        mean_time_between_changes([(0, 4)])


def test_default_time_between_changes_is_the_reference_traces_shortest() -> None:
    traces = sorted((REFERENCE / "traces").glob("a100_trace*.json"))
    if not traces:
        pytest.skip(f"reference traces not present under {REFERENCE}")
    means = {}
    for f in traces:
        rows = json.loads(f.read_text())
        means[f.name] = mean_time_between_changes(
            [(float(r["Time"]), int(r["GPUs"])) for r in rows]
        )
    assert min(means.values()) == pytest.approx(DEFAULT_TIME_BETWEEN_CHANGES_S, rel=0.01), means


def test_settings_are_validated_and_a_trace_path_is_anchored(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="margin"):
        OnlineCalibrationSettings(margin=-1)
    with pytest.raises(ValueError, match="min_improvement"):
        OnlineCalibrationSettings(min_improvement=1.5)
    with pytest.raises(ValueError, match="interval_s"):
        OnlineCalibrationSettings(interval_s=0)
    cfg_file = tmp_path / "conf" / "controller.yaml"
    cfg_file.parent.mkdir()
    cfg_file.write_text("online_calibration:\n  membership_trace: trace.json\n  margin: 1.0\n")
    cfg = ControllerConfig.load(cfg_file)
    assert cfg.online_calibration.membership_trace == cfg_file.parent / "trace.json"
    assert cfg.online_calibration.margin == 1.0 and cfg.online_calibration.enabled


def test_a_decision_records_the_measured_step_beside_the_predicted_one() -> None:
    d = decide_recalibration(inputs(measured_s=1.25, corners=8), POLICY)
    record = {"kind": "replan_decision", "time": 5.0, "epoch": 3, **json.loads(d.model_dump_json())}
    assert record["measured_s"] == 1.25 and record["running_s"] == 1.0 and record["corners"] == 8
    assert rule_violations(record) == []
    older = {k: v for k, v in record.items() if k not in ("measured_s", "corners")}
    assert rule_violations(older) == []  # records written before the field still check
    with pytest.raises(ValueError, match="measured_s"):
        inputs(measured_s=0.0)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ('[{"Time": 0, "GPUs": 4}, {"Time": NaN, "GPUs": 3}]', r"\[1\]\.Time=nan"),
        ('[{"Time": 0, "GPUs": 4}, {"Time": Infinity, "GPUs": 3}]', r"\[1\]\.Time=inf"),
        ('[{"time": 0, "gpus": 4}, {"time": 9, "gpus": 3}]', r"\[0\]\.Time=None"),
        ('[{"Time": "x", "GPUs": 4}, {"Time": 1, "GPUs": 3}]', r"\[0\]\.Time='x'"),
        ('[{"Time": 0, "GPUs": 4.7}, {"Time": 10, "GPUs": 4.2}]', r"\[0\]\.GPUs=4\.7"),
        ('[{"Time": 0, "GPUs": -1}, {"Time": 10, "GPUs": 4}]', r"\[0\]\.GPUs=-1"),
        ('{"Time": 0}', "a trace is a list"),
        ('[{"Time": 0, "GPUs": 4}]', "at least two"),
        ("[{", "not JSON"),
    ],
    ids=["nan", "inf", "keys", "text", "fraction", "negative", "object", "one", "json"],
)
def test_a_bad_membership_trace_is_refused_naming_the_row_and_value(
    tmp_path: Path, text: str, want: str
) -> None:
    """A NaN time made the horizon NaN (every replan judgement of the job then failed its
    validation), a missing key stopped the controller with a bare KeyError, a count of 4.7
    was read as 4. Fails on the old code."""
    path = tmp_path / "trace.json"
    path.write_text(text)
    with pytest.raises(TraceFileError, match=want) as info:
        load_trace(path)
    assert str(path) in str(info.value)
    ok = tmp_path / "ok.json"
    ok.write_text('[{"Time": 0, "GPUs": 4}, {"Time": 60, "GPUs": 3}, {"Time": 90.5, "GPUs": 3}]')
    assert load_trace(ok) == 90.5
