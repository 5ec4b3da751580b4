"""The NCCL replay on hand-written logs: each rule of its model, one table row each."""

from __future__ import annotations

import pytest

from sailor.comm.nccl_replay import CommOp, replay


def _send(peer: int, batch: int, numel: int = 4, dtype: str = "torch.float32") -> CommOp:
    return CommOp("send", batch=batch, peer=peer, dtype=dtype, numel=numel)


def _recv(peer: int, batch: int, numel: int = 4, dtype: str = "torch.float32") -> CommOp:
    return CommOp("recv", batch=batch, peer=peer, dtype=dtype, numel=numel)


def _wait(batch: int) -> CommOp:
    return CommOp("wait", batch=batch)


def _ar(group: tuple[int, ...], numel: int = 1, dtype: str = "torch.float32") -> CommOp:
    return CommOp("all_reduce", group=group, dtype=dtype, numel=numel, detail="sum")


def test_paired_exchange_in_one_batch_completes() -> None:
    """Both ranks post send+recv to each other in one batch: NCCL runs them together."""
    logs = {0: [_send(1, 0), _recv(1, 0), _wait(0)], 1: [_send(0, 0), _recv(0, 0), _wait(0)]}
    assert replay(logs).ok


def test_lone_sends_before_receives_deadlock() -> None:
    """Each rank's lone send blocks the shared channel: neither receive ever starts."""
    logs = {0: [_send(1, 0), _recv(1, 1), _wait(1)], 1: [_send(0, 0), _recv(0, 1), _wait(1)]}
    res = replay(logs)
    assert res.status == "deadlock"
    assert {s.rank for s in res.stuck} == {0, 1}
    assert "channel to 1 busy" in res.message


def test_send_is_a_rendezvous_not_buffered() -> None:
    """A waited send with no receive posted never completes (no eager buffering)."""
    logs = {0: [_send(1, 0), _wait(0), _ar((0, 1))], 1: [_ar((0, 1)), _recv(0, 1), _wait(1)]}
    res = replay(logs)
    assert res.status == "deadlock"
    assert "waiting for 1 to start the matching recv" in res.message


def test_posted_but_never_waited_ops_must_still_complete() -> None:
    logs = {0: [_send(1, 0)], 1: []}
    res = replay(logs)
    assert res.status == "deadlock"
    assert res.stuck[0].rank == 0 and "never completes" in res.stuck[0].reason


@pytest.mark.parametrize(
    ("recv", "what"),
    [(_recv(0, 0, numel=8), "x8"), (_recv(0, 0, dtype="torch.bfloat16"), "bfloat16")],
)
def test_send_and_receive_must_agree_on_dtype_and_numel(recv: CommOp, what: str) -> None:
    logs = {0: [_send(1, 0), _wait(0)], 1: [recv, _wait(0)]}
    res = replay(logs)
    assert res.status == "mismatch" and what in res.message


def test_collectives_match_in_order_per_group() -> None:
    ok = {0: [_ar((0, 1)), _ar((0, 1), 2)], 1: [_ar((0, 1)), _ar((0, 1), 2)]}
    assert replay(ok).ok
    swapped = {0: [_ar((0, 1)), _ar((0, 1), 2)], 1: [_ar((0, 1), 2), _ar((0, 1))]}
    assert replay(swapped).status == "mismatch"


def test_collectives_on_two_groups_in_opposite_orders_deadlock() -> None:
    logs = {
        0: [_ar((0, 1)), _ar((0, 2))],
        1: [_ar((0, 1)), _ar((1, 2))],
        2: [_ar((1, 2)), _ar((0, 2))],
    }
    assert replay(logs).ok
    crossed = {0: [_ar((0, 2)), _ar((0, 1))], 1: [_ar((0, 1))], 2: [_ar((0, 2))]}
    assert replay(crossed).ok
    cycle = {
        0: [_ar((0, 1)), _ar((0, 2))],
        1: [_ar((1, 2)), _ar((0, 1))],
        2: [_ar((0, 2)), _ar((1, 2))],
    }
    res = replay(cycle)
    assert res.status == "deadlock" and {s.rank for s in res.stuck} == {0, 1, 2}


def test_channel_order_is_issue_order_across_batches() -> None:
    """Rank 1 receives twice from 0 while 0 first waits on a send to 2: fine with a buffer."""
    logs = {
        0: [_send(2, 0), _send(1, 1), _wait(0), _wait(1)],
        1: [_recv(0, 0), _wait(0)],
        2: [_recv(0, 0), _wait(0)],
    }
    assert replay(logs).ok


def test_log_lines_round_trip() -> None:
    op = CommOp("all_reduce", group=(0, 3), dtype="torch.float32", shape=(2, 3), numel=6)
    assert CommOp.from_json(op.to_json()) == op


def test_peer_outside_the_logs_is_reported() -> None:
    assert replay({0: [_send(5, 0)]}).status == "mismatch"
