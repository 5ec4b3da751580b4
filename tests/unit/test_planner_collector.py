"""The planner's entry points run with the cyclic garbage collector paused, and leave it as
they found it."""

from __future__ import annotations

import gc

import pytest

from sailor.planner.collector import collector_paused
from sailor.planner.replan import replan
from sailor.planner.robust import robust_replan, robust_search
from sailor.planner.search import search


def test_paused_inside_and_resumed_after() -> None:
    seen: list[bool] = []

    @collector_paused
    def work() -> int:
        seen.append(gc.isenabled())
        return 7

    assert gc.isenabled()
    assert work() == 7
    assert seen == [False]
    assert gc.isenabled()


def test_resumed_after_an_exception() -> None:
    @collector_paused
    def fail() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail()
    assert gc.isenabled()


def test_a_caller_that_paused_it_keeps_it_paused() -> None:
    @collector_paused
    def inner() -> bool:
        return gc.isenabled()

    @collector_paused
    def outer() -> tuple[bool, bool]:
        return inner(), gc.isenabled()

    assert outer() == (False, False)
    assert gc.isenabled()
    gc.disable()
    try:
        assert inner() is False
        assert not gc.isenabled()  # not resumed behind the caller's back
    finally:
        gc.enable()


def test_searches_and_replans_run_with_it_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen from the template DP and the packing loop, inside real calls."""
    from sailor.planner import allocate, templates
    from tests.unit.test_planner_robust import CAL, ENV, POOL, ZONE
    from tests.unit.test_planner_search import make_pool

    seen: list[bool] = []
    for mod, name in ((templates, "_dp"), (allocate._Packer, "fill_for_time")):
        real = getattr(mod, name)

        def spy(*a: object, _real: object = real, **k: object) -> object:
            seen.append(gc.isenabled())
            return _real(*a, **k)  # type: ignore[operator]

        monkeypatch.setattr(mod, name, spy)
    kw = {**ENV.kw(), "gpu_specs": ENV.specs, "calibration": CAL}
    point = search(**kw, pool=POOL, top_k=1)  # type: ignore[arg-type]
    rob = robust_search(**kw, pool=POOL, top_k=1)  # type: ignore[arg-type]
    smaller = make_pool({("fast", ZONE): 2, ("slow", ZONE): 2})
    calls = []
    for run in (lambda: replan(point, smaller), lambda: robust_replan(rob, smaller)):
        before = len(seen)
        run()
        calls.append(len(seen) - before)
    assert seen and not any(seen)
    assert all(calls), calls  # each replan reached the packing loop
    assert gc.isenabled()


def test_two_threads_share_one_pause() -> None:
    """The first of two overlapping calls on two threads to finish does not resume the
    collector under the other (it did: the second search then ran with it on)."""
    import threading

    first_in, first_may_leave, second_done = threading.Event(), threading.Event(), []

    @collector_paused
    def first() -> None:
        first_in.set()
        first_may_leave.wait(5)

    @collector_paused
    def second() -> None:
        first_may_leave.set()
        t.join(5)  # the first call has returned
        second_done.append(gc.isenabled())

    t = threading.Thread(target=first)
    t.start()
    first_in.wait(5)
    second()
    assert second_done == [False]
    assert gc.isenabled()
