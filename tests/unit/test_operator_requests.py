"""``sailor node readmit`` and ``sailor checkpoint clear-bad`` when ``--wait`` runs out.

The command withdraws its request and used to report failure (exit status 1), but a leader
may have read the request just before and apply it all the same: the operator was told
nothing happened while it did. Now the desired state is read again after the withdrawal,
and the request counts as applied when what it asked for holds. A fake store stands in for
etcd: its "leader" applies the request as it is written and never deletes the key (a
leader whose delete came after the withdrawal). Each test fails on the code before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from sailor.controller import status
from sailor.coordination import Keys
from sailor.schemas.runtime import DesiredState, NodeHealth

KEYS = Keys(job="j")


@dataclass
class _KV:
    value: bytes


class _Store:
    """An etcd stand-in: ``apply`` turns the desired state into the leader's after it read
    a request (None: no leader)."""

    def __init__(self, desired: DesiredState, apply: Any = None) -> None:
        self.data = {KEYS.desired: desired.model_dump_json().encode()}
        self.apply = apply
        self.deleted: list[str] = []

    async def get(self, key: str) -> _KV | None:
        return _KV(self.data[key]) if key in self.data else None

    async def put(self, key: str, value: bytes) -> None:
        self.data[key] = value
        if key != KEYS.desired and self.apply is not None:
            after = self.apply(DesiredState.model_validate_json(self.data[KEYS.desired]))
            self.data[KEYS.desired] = after.model_dump_json().encode()

    async def delete(self, key: str) -> None:
        self.deleted.append(key)
        self.data.pop(key, None)

    async def close(self) -> None:
        pass


def _use(monkeypatch: pytest.MonkeyPatch, store: _Store) -> None:
    async def connect(*_: object, **__: object) -> _Store:
        return store

    monkeypatch.setattr(status, "connect_etcd", connect)


HELD = NodeHealth(failures=2, generation=3, exclusions=1, excluded_until=1e12, cause="x")
MARKED = DesiredState(epoch=1, generation=3, bad_checkpoints=(7, 14))


@pytest.mark.parametrize("leader", [True, False])
async def test_a_readmit_the_leader_applied_as_it_was_withdrawn_is_reported_applied(
    monkeypatch: pytest.MonkeyPatch, leader: bool
) -> None:
    d = DesiredState(epoch=1, generation=3, node_health={"n1": HELD, "n2": HELD})
    forget = (lambda s: s.model_copy(update={"node_health": {"n2": HELD}})) if leader else None
    store = _Store(d, forget)
    _use(monkeypatch, store)
    rid, done, unknown = await status.request_readmit("e", "j", ["n1"], False, "op", None, 0.3)
    assert rid and unknown == () and done is leader
    assert store.deleted == [KEYS.readmit(rid)]  # withdrawn either way


@pytest.mark.parametrize("leader", [True, False])
async def test_a_clear_bad_the_leader_applied_as_it_was_withdrawn_is_reported_applied(
    monkeypatch: pytest.MonkeyPatch, leader: bool
) -> None:
    clear = (lambda s: s.model_copy(update={"bad_checkpoints": (7,)})) if leader else None
    store = _Store(MARKED, clear)
    _use(monkeypatch, store)
    rid, done, unknown = await status.request_clear_bad("e", "j", [14], False, "op", None, 0.3)
    assert rid and unknown == () and done is leader
    assert store.deleted == [KEYS.clear_bad(rid)]


async def test_everything_counts_as_applied_only_when_nothing_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = DesiredState(epoch=1, generation=3, node_health={"n1": HELD}, job_health=HELD)
    store = _Store(d, lambda s: s.model_copy(update={"node_health": {}}))  # the job's is left
    _use(monkeypatch, store)
    assert (await status.request_readmit("e", "j", [], True, "op", None, 0.3))[1] is False
    store = _Store(MARKED, lambda s: s.model_copy(update={"bad_checkpoints": ()}))
    _use(monkeypatch, store)
    assert (await status.request_clear_bad("e", "j", [], True, "op", None, 0.3))[1] is True
