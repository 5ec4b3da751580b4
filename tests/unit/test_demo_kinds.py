"""The demo's node kinds: their prior, what the planner makes of it, and the layout table.

The planner is pure, so the layouts the demo's first generation runs (planned from the prior
alone) and those of its later memberships are checked here exactly; the end-to-end run
(tests/integration/test_demo.py) checks that they appear in the summary with their measured
steps.
"""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from sailor import catalog
from sailor.cli.demo.kinds import (
    CORE_SCALE,
    DEMO_GLOBAL_BATCH,
    FULL_CORES,
    SLOW_CORES,
    demo_kinds,
    prior_calibration,
    write_prior,
)
from sailor.cli.demo.layouts import describe_kinds, layout_shape, layouts, print_layouts
from sailor.cli.demo.model import demo_model
from sailor.cli.demo.observe import StepPoint
from sailor.controller.layout import layout_of
from sailor.controller.planning.in_process import SailorPlanner
from sailor.schemas import NodeSpec
from sailor.schemas.calibration import Calibration


def test_odd_nodes_full_even_nodes_slow() -> None:
    kinds = demo_kinds(["n1", "n2", "n3", "n4"])
    assert kinds == {
        "n1": ("cpu-full", FULL_CORES),
        "n2": ("cpu-slow", SLOW_CORES),
        "n3": ("cpu-full", FULL_CORES),
        "n4": ("cpu-slow", SLOW_CORES),
    }
    assert pytest.approx(0.4 * FULL_CORES) == SLOW_CORES


def test_the_prior_scales_compute_by_the_quota_and_keeps_the_rest() -> None:
    base = catalog.calibration()
    cal = prior_calibration({"cpu-full": 0.5, "cpu-slow": 0.2}, base, core_scale=8.0)
    cpu = cal.for_gpu("cpu")
    full, slow = cal.for_gpu("cpu-full"), cal.for_gpu("cpu-slow")
    assert full.compute_scale == pytest.approx(16.0)
    assert slow.compute_scale == pytest.approx(40.0)
    assert slow.compute_scale / full.compute_scale == pytest.approx(2.5)
    for g in (full, slow):  # only compute moves: the cpu entry's other constants stay
        assert g.model_dump(exclude={"gpu_type", "compute_scale", "source"}) == cpu.model_dump(
            exclude={"gpu_type", "compute_scale", "source"}
        )
        assert "quota" in g.source and "not profiled" in g.source
    assert {g.gpu_type for g in base.gpus} <= {g.gpu_type for g in cal.gpus}
    with pytest.raises(ValueError, match="cpu-slow"):
        prior_calibration({"cpu-slow": 0.0})


def test_the_prior_file_is_a_calibration_file(tmp_path: Any) -> None:
    path = write_prior(tmp_path / "prior.json", demo_kinds(["n1", "n2"]))
    cal = Calibration.model_validate_json(path.read_text())
    assert cal.for_gpu("cpu-slow").compute_scale == pytest.approx(CORE_SCALE / SLOW_CORES)


def _plan(planner: SailorPlanner, members: list[str]) -> list[dict[str, Any]]:
    kinds = demo_kinds(["n1", "n2", "n3", "n4"])
    nodes = tuple(
        NodeSpec(node_id=n, gpu_type=kinds[n][0], gpus=1, zone="local-a", spot=True, address="x")
        for n in members
    )
    res = planner.plan(nodes, None)
    return layout_of(res.plan, res.placement)


def test_the_planner_gives_the_slow_kind_less_work_in_every_mixed_membership() -> None:
    """The demo's script, {n1 n2 n3} → {n2 n3} → {n3} → {n3 n4}, planned from the prior: a
    pipeline with fewer layers on its slow node than on its full one beside a full replica
    (5 + 1 or 4 + 2: the replica of all 6 layers sets the pace, so these tie, and which one
    the search meets first is not the point); then replicas of 8 (full) and 4 (slow)
    samples; one full node; 8 and 4 again."""
    spec, _ = demo_model(DEMO_GLOBAL_BATCH)
    quotas = {"cpu-full": FULL_CORES, "cpu-slow": SLOW_CORES}
    planner = SailorPlanner(spec, calibration=prior_calibration(quotas))
    first = layout_shape(_plan(planner, ["n1", "n2", "n3"]))
    (slow,) = first["kinds"]["cpu-slow"]["layers"]
    full = sorted(first["kinds"]["cpu-full"]["layers"])
    assert full[-1] == 6 and 0 < slow < full[0] and slow + full[0] == 6, first
    assert first["uneven"]
    for members in (["n2", "n3"], ["n3", "n4"]):
        shape = layout_shape(_plan(planner, members))
        samples = {p["kinds"][0]: p["samples"] for p in shape["pipelines"]}
        assert samples == {"cpu-full": 8, "cpu-slow": 4}, shape
        assert shape["uneven"]
    alone = layout_shape(_plan(planner, ["n3"]))
    assert list(alone["kinds"]) == ["cpu-full"] and not alone["uneven"]


_MIXED = [
    {
        "stages": [
            {"layers": [0, 4], "kind": "cpu-full", "tp": 1, "nodes": ["n1"]},
            {"layers": [5, 5], "kind": "cpu-slow", "tp": 1, "nodes": ["n2"]},
        ],
        "mbs": 2,
        "mb": 3,
    },
    {
        "stages": [{"layers": [0, 5], "kind": "cpu-full", "tp": 1, "nodes": ["n3"]}],
        "mbs": 2,
        "mb": 3,
    },
]


def test_layout_shape_per_kind_and_per_pipeline() -> None:
    shape = layout_shape(_MIXED)
    assert shape["kinds"] == {
        "cpu-full": {"layers": [5, 6], "tp": [1], "nodes": ["n1", "n3"]},
        "cpu-slow": {"layers": [1], "tp": [1], "nodes": ["n2"]},
    }
    assert [p["samples"] for p in shape["pipelines"]] == [6, 6]
    assert shape["pipelines"][0]["kinds"] == ["cpu-full", "cpu-slow"]
    assert shape["uneven"]  # 5 and 1 layers in one pipeline
    assert describe_kinds(shape) == "cpu-full 5+6 tp1 (n1,n3) · cpu-slow 1 tp1 (n2)"
    even = [{**_MIXED[1], "mb": 2}, {**_MIXED[1], "mb": 2}]
    assert not layout_shape(even)["uneven"]
    unequal = [{**_MIXED[1], "mb": 4}, {**_MIXED[1], "mbs": 4, "mb": 1}]
    assert layout_shape(unequal)["uneven"]  # 8 and 4 samples


def test_layouts_pair_each_launch_with_its_mean_step() -> None:
    records = [
        {"kind": "phase", "phase": "launch", "generation": 1, "layout": _MIXED},
        {"kind": "phase", "phase": "running", "generation": 1},
        {
            "kind": "phase",
            "phase": "launch",
            "generation": 2,
            "layout": _MIXED[1:],
            "predicted_step_s": 0.02,
        },
    ]
    # generation 2: three fast steps (10 ms) and one that waited out a quota period: the
    # mean, 32.5 ms, is the rate; the median gap (10 ms) would hide the quota
    times = [0.0, 1.0, 2.0, 3.0, 3.01, 3.02, 3.03, 3.13]
    points = [StepPoint(2, s, 5.0, 0.0, t) for s, t in enumerate(times)]
    points += [StepPoint(1, s, 5.0, 0.0, 0.5 * s) for s in range(3)]
    rows = layouts(records, points)
    assert [r["generation"] for r in rows] == [1, 2]
    one, two = rows
    assert one["predicted_step_s"] is None and one["prediction_error"] is None
    assert one["measured_step_s"] is None  # three steps, all skipped
    assert two["measured_step_s"] == pytest.approx(0.13 / 4)
    assert two["prediction_error"] == pytest.approx(0.02 / (0.13 / 4) - 1.0)
    assert two["shape"] == layout_shape(_MIXED[1:])
    assert two["steps"] == 8
    con = Console(width=200, record=True)
    print_layouts(con, rows)
    text = con.export_text()
    assert "cpu-full 0-4 | cpu-slow 5-5 (2×3)" in text and "[tp]" in text
    assert "0.020" in text and "0.032" in text and "-38%" in text


def test_without_cgroups_the_demo_says_so_and_paces(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sailor.agent import cpu_quota
    from sailor.cli.demo import run

    why = "no writable cpu controller (cgroup v1: no hierarchy mounted with the cpu controller)"
    monkeypatch.setattr(cpu_quota, "detect", lambda proc=None: why)
    quota = run.quota_support()
    assert quota == {"available": False, "why": why}
    con = Console(quiet=True)  # --json: the console is quiet, stderr still says it
    run._say_kinds(con, demo_kinds(["n1", "n2"]), quota)
    err = capsys.readouterr().err
    assert "CPU quotas unavailable" in err and why in err and "UNTHROTTLED" in err
    assert "cpu-slow at 0.2 cores: n2" in err
    assert run.demo_pace(quota) == run.UNTHROTTLED_PACE_S > 0
    assert run.demo_pace({"available": True, "where": "cgroup v1"}) == 0.0
