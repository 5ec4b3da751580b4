"""``load_barrier`` on a real c10d TCP store (the one a world is initialised with).

Ranks are simulated by calls on one store: each check-in is what a rank does after its load.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist

from sailor.localnet import free_port
from sailor.megatron_patch.errors import PeerFailedError
from sailor.megatron_patch.load_barrier import (
    WATCHED,
    LoadBarrier,
    LoadTimeoutError,
    await_loads,
    loaded_together,
    watched,
)
from sailor.megatron_patch.rank_args import build_parser, check_load_waits


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timedelta(seconds=5))


def test_the_last_rank_to_load_releases_every_rank() -> None:
    store = _store()
    store.add("sailor/loaded/g/count", 2)  # ranks 0 and 1 checked in before
    store.set("sailor/loaded/g/done/0", "1")
    store.set("sailor/loaded/g/done/1", "1")
    assert await_loads(store, 2, 3, "g", timeout_s=5.0, poll_s=0.01) < 1.0


def test_a_rank_not_loaded_in_time_is_named() -> None:
    store = _store()
    with pytest.raises(LoadTimeoutError, match=r"ranks \[1, 2\] did not finish loading.*1 of 3"):
        await_loads(store, 0, 3, "g", timeout_s=0.2, poll_s=0.01)


def test_a_failed_load_is_raised_by_the_others_with_its_error() -> None:
    store = _store()
    with pytest.raises(OSError, match="disk gone"), loaded_together(store, 1, 2, "g", 5.0, 0.01):
        raise OSError("disk gone")
    with pytest.raises(
        PeerFailedError, match=r"rank 1 \(.*\) failed to load its stage: OSError: disk gone"
    ):
        await_loads(store, 0, 2, "g", timeout_s=5.0, poll_s=0.01)


def test_worlds_do_not_mix() -> None:
    store = _store()
    with pytest.raises(OSError), loaded_together(store, 1, 2, "generation-0", 5.0, 0.01):
        raise OSError("old world")
    store.add("sailor/loaded/generation-1/count", 1)
    assert await_loads(store, 0, 2, "generation-1", timeout_s=5.0, poll_s=0.01) < 1.0


def test_a_store_that_stops_answering_is_a_peer_failure() -> None:
    store = _store()
    client = dist.TCPStore(
        "127.0.0.1", store.port, 1, False, timedelta(seconds=2), wait_for_workers=False
    )
    del store  # the server (rank 0's) is gone
    with pytest.raises(PeerFailedError, match="rendezvous store stopped answering"):
        await_loads(client, 1, 2, "g", timeout_s=5.0, poll_s=0.01)


def test_bad_arguments_name_the_field() -> None:
    store = _store()
    with (
        pytest.raises(ValueError, match="rank=2 outside a world of world_size=2"),
        loaded_together(store, 2, 2, "g"),
    ):
        pass
    with (
        pytest.raises(ValueError, match="load timeout_s=0"),
        loaded_together(store, 0, 2, "g", timeout_s=0),
    ):
        pass
    with pytest.raises(ValueError, match="load liveness_s=-1"):
        LoadBarrier(store, 0, 2, "g", liveness_s=-1)


def test_a_rank_whose_heartbeat_stopped_is_named_for_every_waiter() -> None:
    store = _store()
    dead = LoadBarrier(store, 1, 3, "g", liveness_s=0.3).start()
    dead.close()  # killed: its counter stops, it writes nothing
    with pytest.raises(PeerFailedError, match=r"rank 1 \(.+\) failed to load.*no heartbeat for"):
        await_loads(store, 0, 3, "g", timeout_s=30.0, poll_s=0.01, liveness_s=0.3)
    # written for the others: rank 2 raises it at once, without watching rank 1 itself
    with pytest.raises(PeerFailedError, match=r"rank 1 .*no heartbeat.*seen by rank 0"):
        await_loads(store, 2, 3, "g", timeout_s=30.0, poll_s=0.01, liveness_s=60.0)


def test_a_rank_that_beats_is_waited_for_however_long_its_load() -> None:
    store = _store()
    loading = LoadBarrier(store, 1, 2, "g", liveness_s=0.2).start()
    try:
        with pytest.raises(LoadTimeoutError, match=r"ranks \[1\] did not finish"):
            await_loads(store, 0, 2, "g", timeout_s=1.5, poll_s=0.01, liveness_s=0.2)
    finally:
        loading.close()


def test_a_failure_before_the_load_reaches_the_waiters_while_pending() -> None:
    store = _store()
    building = LoadBarrier(store, 1, 2, "g").start()
    building.fail(MemoryError("building the stage"))  # rank_main.main's handler
    assert not building.pending
    with pytest.raises(PeerFailedError, match=r"rank 1 .*MemoryError: building the stage"):
        await_loads(store, 0, 2, "g", timeout_s=5.0, poll_s=0.01)
    # once over (released, or a world that loads nothing), a failure is nobody's news
    other = _store()
    done = LoadBarrier(other, 1, 2, "g").start()
    done.close()
    done.fail(RuntimeError("in training"))
    assert other.add("sailor/loaded/g/failures", 0) == 0


def test_without_a_load_timeout_a_dead_rank_still_ends_the_wait() -> None:
    store = _store()  # the agent's workers: --load-timeout-s inf (sailor.agent.worker_argv)
    LoadBarrier(store, 1, 2, "g", liveness_s=0.2).start().close()
    with pytest.raises(PeerFailedError, match=r"rank 1 .*no heartbeat"):
        await_loads(store, 0, 2, "g", timeout_s=float("inf"), poll_s=0.01, liveness_s=0.2)


def test_the_load_waits_are_checked_at_start_by_flag() -> None:
    base = ["--plan", "p", "--rank", "0", "--world-size", "1", "--master", "m"]
    check_load_waits(build_parser().parse_args([*base, "--load-timeout-s", "inf"]))
    for flag, value in (
        ("--load-liveness-s", "0.0"),
        ("--load-timeout-s", "nan"),
        ("--periodic-save-timeout-s", "-1.0"),
    ):
        args = build_parser().parse_args([*base, flag, value])
        with pytest.raises(ValueError, match=f"{flag}={value}: must be > 0 seconds"):
            check_load_waits(args)


def _silent_for(store: dist.TCPStore, world: str, dead: int, world_size: int, waiter: int) -> float:
    """Seconds (on a simulated clock, 1 s polls) until ``waiter`` names ``dead``, silent since
    its one beat, in a world whose other ranks beat between the waiter's polls."""
    now = [0.0]
    live = [r for r in range(world_size) if r not in (dead, waiter)]
    store.add(f"sailor/loaded/{world}/beat/{dead}", 1)

    def sleep(s: float) -> None:  # the live ranks' heartbeats, then the clock moves on
        for r in live:
            store.add(f"sailor/loaded/{world}/beat/{r}", 1)
        now[0] += s
        if now[0] > 100.0:
            raise AssertionError(f"rank {dead} of {world_size} not found dead within 100 s")

    with pytest.raises(PeerFailedError, match=rf"rank {dead} \(.*no heartbeat"):
        await_loads(
            store, waiter, world_size, world, float("inf"), 1.0, lambda: now[0], sleep, 10.0
        )
    return now[0]


def test_a_dead_rank_is_found_in_about_liveness_s_whatever_the_world_size() -> None:
    store = _store()
    # each waiter reads its next ranks on the ring every poll: 10 s of silence and a poll or
    # two, at 8 ranks as at 512 (one rank read per poll in turn took 511 s at 512 ranks)
    found = {w: _silent_for(store, f"w{w}", 1, w, 0) for w in (8, 64, 512)}
    assert all(10.0 <= t <= 12.0 for t in found.values()), found
    # a rank none of whose watchers waits yet is still found by the others' turns, later
    assert _silent_for(store, "behind", 5, 6, 0) <= 10.0 + 2 * 2


def test_every_rank_is_watched_by_watched_ranks_each_poll() -> None:
    for world_size in (1, 2, 3, 4, 5, 64):
        watchers = dict.fromkeys(range(world_size), 0)
        for rank in range(world_size):
            near = watched(rank, world_size)
            assert rank not in near and len(near) == min(WATCHED, world_size - 1)
            for r in near:
                watchers[r] += 1
        assert set(watchers.values()) == {min(WATCHED, world_size - 1)}, (world_size, watchers)


def test_the_heartbeat_is_not_held_up_by_the_main_threads_blocking_store_call() -> None:
    server = _store()
    client = dist.TCPStore(
        "127.0.0.1", server.port, 1, False, timedelta(seconds=3), wait_for_workers=False
    )
    loading = LoadBarrier(client, 1, 2, "g", liveness_s=0.5).start()
    blocked = threading.Thread(  # rank 1's main thread, in a store wait longer than liveness
        target=lambda: _suppress_store_error(client.wait, ["never-set"]), daemon=True
    )
    blocked.start()
    try:  # rank 1 beats on: rank 0 waits out its load timeout, and does not call it dead
        with pytest.raises(LoadTimeoutError, match=r"ranks \[1\] did not finish"):
            await_loads(server, 0, 2, "g", timeout_s=2.0, poll_s=0.02, liveness_s=0.5)
    finally:
        blocked.join()
        loading.close()


def _suppress_store_error(call: Callable[[list[str]], object], keys: list[str]) -> None:
    with contextlib.suppress(dist.DistStoreError):
        call(keys)


def test_the_heartbeat_beats_on_after_the_store_failed() -> None:
    port = free_port()
    first = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=10))
    beating = LoadBarrier(client, 1, 2, "g", liveness_s=0.5).start()
    try:
        time.sleep(0.3)
        del first  # the store's server goes; one comes back on its address
        time.sleep(0.3)
        second = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10))
        deadline = time.monotonic() + 10.0
        while not second.check(["sailor/loaded/g/beat/1"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert second.add("sailor/loaded/g/beat/1", 0) >= 1
    finally:
        beating.close()
