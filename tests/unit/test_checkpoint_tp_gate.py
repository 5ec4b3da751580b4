"""The TP group's agreement during a save's snapshot (``checkpointer._TPGate``), by its
logic on the CPU: where its flag lives, and that the end of the snapshot always agrees.

Under NCCL a flag on the host raises on the rank that put it there and leaves its peers in
the all-reduce; a failure after the last gather must reach the whole group
(docs/checkpoint.md: "every rank of the group stops there").
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from sailor.checkpoint import checkpointer
from sailor.checkpoint.checkpointer import Checkpointer


class _Recorded:
    """``_TPGate`` stand-in: records the device it was given; the save stops at once."""

    devices: ClassVar[list[torch.device | None]] = []

    def __init__(self, group: Any, device: torch.device | None, failure: Any) -> None:
        _Recorded.devices.append(device)
        self.failure = failure

    def close(self) -> bool:
        return False


class _Place:
    tp_size = 2
    layers: tuple[int, ...] = ()
    group_ranks = (0, 1)


def test_a_rank_without_parameters_puts_its_flag_on_its_cuda_device_under_nccl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A save given its id (``save_id``) whose rank failed before it had its parameters
    (``by_layer`` empty): the gate's flag goes to the current CUDA device under NCCL, not
    to the host; under gloo the host is right."""
    _Recorded.devices = []
    monkeypatch.setattr(checkpointer, "_TPGate", _Recorded)
    monkeypatch.setattr(checkpointer.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    me: Any = type("_Me", (), {"place": _Place(), "tp_group": object(), "assignment": {}})()
    for backend in ("nccl", "gloo"):
        monkeypatch.setattr(checkpointer.dist, "get_backend", lambda g, b=backend: b)
        mine, failure = Checkpointer._snapshot(me, {}, {}, RuntimeError("before the save"))
        assert mine is None and isinstance(failure, RuntimeError)
    assert _Recorded.devices == [torch.device("cuda", 1), None]
    assert checkpointer._flag_device(None) is None  # TP 1: no group, no flag


def test_the_end_of_a_snapshot_agrees_also_after_gathers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer fails landing its last gather's pieces on the host: ``close`` all-reduces
    the flag once more, so every rank of the group learns it (before: only when no gather
    had run, and the peers went on to persist their layers)."""
    flags: list[int] = []

    def all_reduce(t: torch.Tensor, op: str, group: Any) -> None:
        flags.append(int(t.item()))

    monkeypatch.setattr(checkpointer.comm, "all_reduce", all_reduce)
    gate = checkpointer._TPGate(object(), None, None)
    assert gate.open()  # the last gather's agreement
    gate.failure = RuntimeError("host copy failed")  # after it
    assert not gate.close()
    assert flags == [0, 1]
    # a peer, no failure of its own: the group's MAX is 0 at the gather, 1 at the end
    maxima = iter([0, 1])
    monkeypatch.setattr(checkpointer.comm, "all_reduce", lambda t, op, group: t.fill_(next(maxima)))
    peer = checkpointer._TPGate(object(), None, None)
    assert peer.open()
    assert not peer.close()  # told: it stops too
