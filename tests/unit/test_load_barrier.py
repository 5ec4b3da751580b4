"""``load_barrier`` on a real c10d TCP store (the one a world is initialised with).

Ranks are simulated by calls on one store: each check-in is what a rank does after its load.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from sailor.localnet import free_port
from sailor.megatron_patch.errors import PeerFailedError
from sailor.megatron_patch.load_barrier import (
    LoadBarrier,
    LoadTimeoutError,
    await_loads,
    loaded_together,
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
    for flag, value in (("--load-liveness-s", "0.0"), ("--load-timeout-s", "nan")):
        args = build_parser().parse_args([*base, flag, value])
        with pytest.raises(ValueError, match=f"{flag}={value}: must be > 0 seconds"):
            check_load_waits(args)
