"""Pieces of the in-place worker without processes: the directive parser and the
abortable waits of ``sailor.comm.abort``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

from sailor.comm import abort
from sailor.megatron_patch.in_place import parse_directive


def _d(gen: object, argv: object) -> str:
    return json.dumps({"relayout": {"generation": gen, "argv": argv}})


def test_parse_directive() -> None:
    assert parse_directive(_d(3, ["--rank", "1"]), 2) == (3, ["--rank", "1"])
    assert parse_directive(_d(2, ["--rank", "1"]), 2) is None  # not newer
    assert parse_directive(_d(0, []), -1) == (0, [])
    for bad in ("", "{", "[]", '{"stop_at_step": 3}', _d(True, []), _d(3, "x"), _d(3, [1])):
        assert parse_directive(bad, -1) is None, bad


class _Never:
    """A work that never completes (a peer that is alive but will never answer)."""

    def __init__(self) -> None:
        self.waited = threading.Event()

    def is_completed(self) -> bool:
        return False

    def wait(self) -> bool:
        self.waited.wait()
        return True


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


@pytest.fixture
def polling() -> Iterator[None]:
    abort.set_polling(True)
    yield
    abort.set_polling(False)
    abort.clear_abort()


@pytest.mark.parametrize("waiter", [abort.wait, abort.wait_threaded])
def test_abort_leaves_a_blocked_wait_promptly(polling: None, waiter: object) -> None:
    work = _Never()
    threading.Timer(0.1, abort.request_abort).start()
    t = time.monotonic()
    with pytest.raises(abort.CommAbortedError):
        waiter(work)  # type: ignore[operator]
    assert time.monotonic() - t < 0.5
    assert abort.abandoned()  # the blocked work stays referenced
    work.waited.set()  # let the helper thread go


def test_completed_works_pass_and_no_polling_blocks_plainly(polling: None) -> None:
    assert abort.wait(_Done()) is True and abort.wait_threaded(_Done()) is True
    assert abort.wait(None) is None
    abort.request_abort()
    with pytest.raises(abort.CommAbortedError):
        abort.wait(_Done())
    abort.set_polling(False)
    assert abort.wait(_Done()) is True  # without polling: a plain wait, as before
