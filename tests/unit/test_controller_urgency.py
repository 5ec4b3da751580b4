"""Which wake-ups of the controller skip the debounce (``event_intake.urgent_wake``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sailor.controller.config import ControllerConfig
from sailor.controller.daemon import Controller
from sailor.controller.event_intake import urgent_wake
from sailor.schemas.runtime import DesiredState, Phase

RUNNING = DesiredState(
    epoch=3,
    generation=2,
    phase=Phase.RUNNING,
    placement={"a": (0,), "b": (1,)},
    membership=("a", "b", "idle"),
)
QUIESCE = RUNNING.model_copy(
    update={"phase": Phase.QUIESCE, "next_placement": {"a": (0,), "b": (1,), "new": (2,)}}
)


@pytest.mark.parametrize(
    ("kind", "node", "desired", "urgent"),
    [
        # the job is broken already: abort now
        ("node_left", "a", RUNNING, True),
        ("node_left", "b", QUIESCE, True),
        # the plan being prepared uses it: replan now
        ("node_left", "new", QUIESCE, True),
        # a notice's deadline runs, whoever it is for
        ("preemption_notice", "a", RUNNING, True),
        ("preemption_notice", "idle", RUNNING, True),
        ("preemption_notice", "a", None, True),
        # nothing runs there: coalesce with whatever follows
        ("node_left", "idle", RUNNING, False),
        ("node_left", "a", None, False),
        ("node_joined", "new", RUNNING, False),
        ("node_joined", "a", RUNNING, False),
        ("worker_failed", "idle", RUNNING, False),
        ("heartbeat", "a", RUNNING, False),
    ],
)
def test_urgent_wake(kind: str, node: str, desired: DesiredState | None, urgent: bool) -> None:
    assert urgent_wake(kind, node, desired) is urgent


def test_lost_registration_of_a_placed_node_ends_the_debounce(tmp_path: Path) -> None:
    """The nodes mirror reports a deleted key: urgent only for a node of the layout."""
    cfg = ControllerConfig(
        job="u", audit_log=tmp_path / "audit.jsonl", planner="data_parallel", debounce_s=5.0
    )
    ctl = Controller(cfg)
    try:
        ctl.desired = RUNNING
        ctl._node_gone("idle")
        assert not ctl._urgent and not ctl._urgent_wake.is_set()
        ctl._node_gone("a")
        assert ctl._urgent and ctl._urgent_wake.is_set() and ctl._wake.is_set()
    finally:
        ctl.audit.close()
