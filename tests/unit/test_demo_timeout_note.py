"""A demo wait that runs out says what the cluster was doing, not only what it waited for.

Seen under load: ``RUNNING after generation 3: not within 60 s`` and nothing more, while the
controller's audit said why the joining node never got a layout (another Sailor release:
its agent started from a checkout edited after the others had started). The error now
carries the desired state, each node's state and the newest ``not_admitted`` record."""

from __future__ import annotations

from sailor.cli.demo.observe import ClusterView, NodeRow
from sailor.cli.demo.scenario import stuck_note

_WHY = (
    "Sailor 0.1.0+570daa65ac09, the job's nodes run Sailor 0.1.0+2ed0b1c050a9 (n3): the "
    "workers of one job must run one release"
)


def _row(node: str, state: str) -> NodeRow:
    return NodeRow(node=node, gpu="cpu", zone="local-a", state=state, step=-1, loss=None, ranks=())


_VIEW = ClusterView(
    phase="running",
    generation=3,
    cause="first step after 17 done",
    nodes=(_row("n3", "running"), _row("n4", "idle")),
)


def test_the_note_names_the_phase_the_nodes_and_why_a_node_is_left_out() -> None:
    records = [
        {"kind": "phase", "phase": "running", "generation": 3},
        {"kind": "event", "event_kind": "node_joined", "node_id": "n4"},
        {"kind": "not_admitted", "nodes": {"n4": _WHY}},
    ]
    note = stuck_note(_VIEW, records)
    assert note == (
        "desired: running, generation 3 (first step after 17 done); nodes: n3 running, "
        f"n4 idle; not admitted: n4: {_WHY}"
    )


def test_a_later_admission_clears_the_refusal_and_no_records_are_no_error() -> None:
    records = [{"kind": "not_admitted", "nodes": {"n4": _WHY}}, {"kind": "not_admitted"}]
    assert "not admitted" not in stuck_note(_VIEW, records)
    assert stuck_note(ClusterView(), []) == "desired: —, generation -1; nodes: none registered"


def test_the_note_says_when_the_view_is_old_and_which_processes_had_exited() -> None:
    """A joining node the note lists as missing was either never registered or not seen: a
    view of etcd that reads kept failing says so, and an agent that died is named with its
    exit code (a fresh-clone CI's run said only "nodes: n3 running" for a missing n4)."""
    note = stuck_note(
        _VIEW,
        [],
        view_age_s=41.6,
        read_error="UnavailableError: etcd at 127.0.0.1:2379: deadline",
        exited=[("agent-n1", 0), ("agent-n2", -9), ("agent-n4", 1)],
    )
    assert note.endswith(
        "; view of etcd 42 s old; last read failed: UnavailableError: etcd at "
        "127.0.0.1:2379: deadline; exited: agent-n1 (0), agent-n2 (-9), agent-n4 (1)"
    ), note
    # a fresh view (one poll old) is not called old
    assert "old" not in stuck_note(_VIEW, [], view_age_s=0.3)
