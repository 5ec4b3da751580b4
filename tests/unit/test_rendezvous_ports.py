"""A generation's rendezvous port taken on rank 0's node (``EADDRINUSE``): how the worker
classifies it, how the controller reads it, and what ``decide`` does (the same path at the
next generation's port, nobody charged, bounded), and the audit's view of it.

Before, the worker called the failure a peer's ("socket" is a peer marker), the abort marked
the in-place path failed and the next launch fell back to the restart path.
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from sailor.controller.audit import in_place_failed_abort
from sailor.controller.decide import decide
from sailor.controller.decision_types import SetDesired
from sailor.controller.failure_text import parse_failure
from sailor.controller.rendezvous_ports import RENDEZVOUS_RETRIES
from sailor.megatron_patch.errors import classify, failure_record
from sailor.schemas.runtime import AgentStatus, DesiredState, Phase
from tests.unit.test_controller_decide import (
    IN_PLACE,
    NOW,
    _planned,
    fails,
    nodes,
    obs,
    running,
    st,
)

# torch's TCPStore server, word for word, when its port is taken (measured: torch 2.13, a
# socket listening on the port on 127.0.0.1)
TAKEN = (
    "The server socket has failed to listen on any local network address. port: 29501, "
    "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
)


@pytest.mark.parametrize(
    ("exc", "in_training", "origin"),
    [
        (dist.DistNetworkError(TAKEN), False, "rendezvous"),
        (OSError(98, "Address already in use"), False, "rendezvous"),
        # in training no rank binds a given port: a peer's socket error as before
        (dist.DistNetworkError(TAKEN), True, "peer"),
        (RuntimeError("Connection reset by peer: socket closed"), False, "peer"),
        (RuntimeError("The client socket has timed out"), False, "peer"),
    ],
    ids=["store-taken", "oserror-98", "in-training", "reset", "timeout"],
)
def test_a_taken_rendezvous_port_is_its_own_origin(
    exc: BaseException, in_training: bool, origin: str
) -> None:
    assert classify(exc, in_training) == origin
    rec = failure_record(exc, rank=0, step=12, in_training=in_training)
    assert rec["origin"] == origin and rec["retry"] is True


def _taken_status(i: int, gen: int = 1) -> AgentStatus:
    """Node ``i``'s status with rank 0's record of a taken port, as the worker writes it."""
    record = failure_record(dist.DistNetworkError(TAKEN), rank=0, step=12, in_training=False)
    return st(i, gen=gen, state="failed").model_copy(update={"failure": json.dumps(record)})


def test_the_controller_reads_the_origin() -> None:
    cause = parse_failure(_taken_status(1).failure)
    assert cause.origin == "rendezvous" and cause.port_taken and cause.own
    # cut off after its keys (the agent keeps 2000 characters), still read
    assert parse_failure(_taken_status(1).failure[:80]).port_taken
    assert not parse_failure(fails(1, "peer").failure).port_taken


def _loading(**kw: object) -> DesiredState:
    return running(
        (1, 2), phase=Phase.LOAD, phase_deadline=NOW + 60, path="in_place", master="h:29501", **kw
    )


def test_a_taken_port_keeps_the_in_place_path_and_charges_nobody() -> None:
    d = _loading()
    a = decide(d, obs(nodes(1, 2), [_taken_status(1), st(2)]), IN_PLACE)
    assert isinstance(a[0], SetDesired)
    torn = a[0].state
    assert torn.phase is Phase.TEARDOWN and torn.aborted
    assert not torn.in_place_failed and torn.rendezvous_retries == 1
    assert torn.node_health == {} and torn.job_health.failures == 0
    assert "rendezvous port 29501 taken on n1" in a[0].reason, a[0].reason
    assert "EADDRINUSE" in torn.cause
    # the next passes: n1's failure still reported (late), then the hold done: nobody is
    # charged, and the next generation launches in place on the next port, saying why
    torn = _planned(torn, (1, 2))
    late = decide(torn, obs(nodes(1, 2), [_taken_status(1), st(2, state="held")]), IN_PLACE)
    assert not [x for x in late if isinstance(x, SetDesired)], late
    a = decide(torn, obs(nodes(1, 2), [st(1, state="idle"), st(2, state="held")]), IN_PLACE)
    launch = a[-1]
    assert isinstance(launch, SetDesired) and launch.state.phase is Phase.LAUNCH
    nxt = launch.state
    assert nxt.generation == 2 and nxt.master == "h:29502"
    assert nxt.path == "in_place" and nxt.node_health == {}
    assert "generation 1's rendezvous port 29501 was taken" in nxt.path_reason
    # once it runs, the count is reset
    verify = nxt.model_copy(update={"phase": Phase.VERIFY, "phase_deadline": NOW + 10})
    a = decide(verify, obs(nodes(1, 2), [st(1, gen=2, step=13), st(2, gen=2, step=13)]), IN_PLACE)
    assert isinstance(a[0], SetDesired) and a[0].state.phase is Phase.RUNNING
    assert a[0].state.rendezvous_retries == 0


def test_past_the_bound_a_taken_port_is_the_nodes_failure() -> None:
    d = _loading(rendezvous_retries=RENDEZVOUS_RETRIES)
    a = decide(d, obs(nodes(1, 2), [_taken_status(1), st(2)]), IN_PLACE)
    assert isinstance(a[0], SetDesired)
    torn = a[0].state
    assert torn.in_place_failed and torn.rendezvous_retries == RENDEZVOUS_RETRIES + 1
    assert torn.node_health["n1"].failures == 1, torn.node_health
    assert f"{RENDEZVOUS_RETRIES + 1} launches in a row" in a[0].reason, a[0].reason
    torn = _planned(torn, (1, 2))
    a = decide(torn, obs(nodes(1, 2), [st(1, state="idle"), st(2, state="idle")]), IN_PLACE)
    nxt = a[-1].state  # type: ignore[union-attr]
    assert nxt.path == "restart" and "rendezvous" not in nxt.path_reason


def test_another_nodes_own_failure_is_an_ordinary_abort() -> None:
    """A taken port beside another node's own failure: the in-place path failed as for any
    failure, the other node is charged; the taken port still is not (nobody's fault)."""
    d = _loading(rendezvous_retries=1)
    a = decide(d, obs(nodes(1, 2), [_taken_status(1), fails(2)]), IN_PLACE)
    assert isinstance(a[0], SetDesired)
    torn = a[0].state
    assert torn.in_place_failed and torn.rendezvous_retries == 0
    assert sorted(torn.node_health) == ["n2"], torn.node_health
    torn = _planned(torn, (1, 2))
    a = decide(torn, obs(nodes(1, 2), [st(1, state="idle"), st(2, state="idle")]), IN_PLACE)
    assert "rendezvous" not in a[-1].state.path_reason  # type: ignore[union-attr]


def test_the_count_is_a_field_checked_on_read() -> None:
    with pytest.raises(ValueError, match="rendezvous_retries"):
        DesiredState.model_validate({"epoch": 1, "rendezvous_retries": -1})


def test_the_audit_accepts_the_same_path_after_a_taken_port() -> None:
    abort = {"kind": "phase", "phase": "teardown", "cause": f"abort: during load: {TAKEN}"}
    assert in_place_failed_abort(abort)  # an older log, or no taken port: a failed path
    assert not in_place_failed_abort(abort | {"rendezvous_retries": 1})
    assert in_place_failed_abort(abort | {"rendezvous_retries": RENDEZVOUS_RETRIES + 1})
