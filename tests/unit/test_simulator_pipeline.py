"""1F1B closed form vs event-driven replay: where they agree and how they bound each other."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sailor.simulator.pipeline import closed_form_1f1b, one_f_one_b_order, replay_1f1b

times = st.floats(min_value=0.01, max_value=1.0, allow_nan=False)


@st.composite
def pipelines(
    draw: st.DrawFn, delays: bool = False
) -> tuple[list[float], list[float], int, list[float]]:
    n = draw(st.integers(1, 6))
    f = draw(st.lists(times, min_size=n, max_size=n))
    b = draw(st.lists(times, min_size=n, max_size=n))
    m = draw(st.integers(1, 16))
    d = draw(st.lists(st.floats(0.0, 0.2), min_size=n, max_size=n)) if delays else []
    return f, b, m, d


def test_order_is_1f1b() -> None:
    assert one_f_one_b_order(3, 0, 4) == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("F", 3),
        ("B", 1),
        ("B", 2),
        ("B", 3),
    ]
    assert one_f_one_b_order(3, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


@given(st.integers(1, 8), st.integers(1, 32), times, times)
def test_uniform_stages_agree_exactly(n: int, m: int, f: float, b: float) -> None:
    expected = (m + n - 1) * (f + b)
    assert replay_1f1b([f] * n, [b] * n, m).end_s == pytest.approx(expected)
    assert closed_form_1f1b([f] * n, [b] * n, m) == pytest.approx(expected)


@given(pipelines())
def test_replay_lower_bound_proven(p: tuple[list[float], list[float], int, list[float]]) -> None:
    f, b, m, _ = p
    r = replay_1f1b(f, b, m).end_s
    busiest = m * max(x + y for x, y in zip(f, b, strict=True))
    one_trip = sum(f) + sum(b)
    assert r >= max(busiest, one_trip) - 1e-9


@settings(max_examples=300, derandomize=True)
@given(pipelines())
def test_closed_form_bounds_replay_without_delays(
    p: tuple[list[float], list[float], int, list[float]],
) -> None:
    f, b, m, _ = p
    r = replay_1f1b(f, b, m).end_s
    c = closed_form_1f1b(f, b, m)
    # Proven: every term of the closed form is at most fill + (m-1)·C* (a cycle's mean never
    # exceeds the busiest stage without delays), and replay >= fill and replay >= m·C*.
    assert c <= 2.0 * r + 1e-9
    # Checked, not proven (random search: 1.254); derandomized so CI is reproducible.
    assert r <= 1.3 * c


@settings(max_examples=300, derandomize=True)
@given(pipelines(delays=True))
def test_closed_form_bounds_replay_with_delays(
    p: tuple[list[float], list[float], int, list[float]],
) -> None:
    f, b, m, d = p
    r = replay_1f1b(f, b, m, d).end_s
    c = closed_form_1f1b(f, b, m, d)
    assert r >= sum(f) + sum(b) + 2 * sum(d[:-1]) - 1e-9
    # Proven: a cycle's mean exceeds the busiest stage by at most its share of 2·Σdelay.
    assert c <= 2.0 * r + 2.0 * (m - 1) * sum(d[:-1]) + 1e-9
    # Checked, not proven (random search: 1.249 and 1.519); derandomized for CI.
    assert r <= 1.3 * c
    assert c <= 1.6 * r


@given(pipelines(), st.integers(1, 8))
def test_more_microbatches_never_faster(
    p: tuple[list[float], list[float], int, list[float]], extra: int
) -> None:
    f, b, m, _ = p
    assert replay_1f1b(f, b, m + extra).end_s >= replay_1f1b(f, b, m).end_s - 1e-12
    assert closed_form_1f1b(f, b, m + extra) >= closed_form_1f1b(f, b, m) - 1e-12


@given(pipelines(delays=True), st.integers(0, 5), st.floats(0.0, 0.5))
def test_slower_link_never_faster(
    p: tuple[list[float], list[float], int, list[float]], i: int, more: float
) -> None:
    f, b, m, d = p
    slow = list(d)
    slow[i % len(d)] += more
    assert replay_1f1b(f, b, m, slow).end_s >= replay_1f1b(f, b, m, d).end_s - 1e-12
    assert closed_form_1f1b(f, b, m, slow) >= closed_form_1f1b(f, b, m, d) - 1e-12


def test_timeline_records_every_op() -> None:
    run = replay_1f1b([1.0, 2.0], [2.0, 4.0], 3, record=True)
    assert len(run.ops) == 2 * 2 * 3
    for op in run.ops:
        assert op.end_s > op.start_s
    per_stage = {
        s: sorted((o for o in run.ops if o.stage == s), key=lambda o: o.start_s) for s in (0, 1)
    }
    for ops in per_stage.values():
        for a, c in itertools.pairwise(ops):
            assert c.start_s >= a.end_s - 1e-12


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        replay_1f1b([], [], 1)
    with pytest.raises(ValueError):
        closed_form_1f1b([1.0], [1.0], 0)
