"""The audit budget per event source (``controller/audit_budget.py``): a burst recorded,
then counted until the source is quiet; earned back at the rate; sources independent."""

from __future__ import annotations

import pytest

from sailor.controller.audit_budget import QUIET_S, AuditBudget, Take, budget_source


def test_a_flood_is_recorded_up_to_the_burst_then_counted_until_quiet() -> None:
    b = AuditBudget(burst=3, rate=1.0)
    takes = [b.take("n1", 0.0) for _ in range(10)]
    assert [t.record for t in takes] == [True] * 3 + [False] * 7
    assert [t.began for t in takes] == [False] * 3 + [True] + [False] * 6
    assert b.owed(0.5) == []  # still flooding (sent less than QUIET_S ago)
    # within the episode, what was earned is not spent: every event is counted
    assert b.take("n1", 2.0) == Take(record=False)
    assert b.owed(2.0 + QUIET_S) == [("n1", 8)]
    assert b.owed(10.0) == []  # reported once
    # the budget earned meanwhile (capped at the burst) is the next burst's
    assert [b.take("n1", 10.0).record for _ in range(4)] == [True, True, True, False]


def test_sources_are_independent_and_refill_at_the_rate() -> None:
    b = AuditBudget(burst=2, rate=2.0)
    assert [b.take("n1", 0.0).record for _ in range(3)] == [True, True, False]
    assert b.take("n2", 0.0).record  # another node: its own budget
    assert b.owed(5.0) == [("n1", 1)]
    assert [b.take("n1", 5.0).record for _ in range(3)] == [True, True, False]


def test_budget_source_is_the_subjects_source_token() -> None:
    assert budget_source("sailor.j.events.n1.node_joined") == "n1"
    assert budget_source("sailor.j.events.n1.a.b") == "n1"
    assert budget_source("odd") == "odd"


@pytest.mark.parametrize(("burst", "rate"), [(0, 1.0), (1, 0.0)], ids=["no-burst", "no-rate"])
def test_a_budget_needs_a_burst_and_a_rate(burst: int, rate: float) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        AuditBudget(burst=burst, rate=rate)
