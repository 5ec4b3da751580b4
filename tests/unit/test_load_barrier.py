"""``load_barrier`` on a real c10d TCP store (the one a world is initialised with).

Ranks are simulated by calls on one store: each check-in is what a rank does after its load.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from sailor.localnet import free_port
from sailor.megatron_patch.errors import PeerFailedError, failure_record, write_error_file
from sailor.megatron_patch.load_barrier import (
    WATCHED,
    LoadBarrier,
    LoadTimeoutError,
    await_loads,
    loaded_together,
    rank0_error_file,
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
        PeerFailedError,
        match=r"rank 1 \(.*\) failed before its world's first step: OSError: disk gone",
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


def test_a_store_gone_names_rank_0_its_host_and_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _short_store_wait(monkeypatch)  # its failure, told to the gone store, waited for twice
    server = _store()  # rank 0's process serves it
    rank0 = LoadBarrier(server, 0, 2, "g").start()
    client = dist.TCPStore(
        "127.0.0.1", server.port, 1, False, timedelta(seconds=2), wait_for_workers=False
    )
    errors = tmp_path / "error-{rank}.json"
    waiting = LoadBarrier(
        client, 1, 2, "g", master=f"127.0.0.1:{server.port}",
        rank0_error_file=rank0_error_file(str(errors), 1), liveness_s=0.5,
    ).start()  # fmt: skip
    time.sleep(0.3)  # a beat: rank 1 learned rank 0's host
    rank0.close()
    # rank 0 failed where the store could not carry its error (a hung store host: the
    # error file is written first), then its process exited
    write_error_file(
        str(errors).replace("{rank}", "0"),
        failure_record(MemoryError("rank 0 out of host memory"), 0, -1, False),
    )
    del server, rank0
    with pytest.raises(PeerFailedError) as got, waiting.loading():
        pass
    text = str(got.value)
    assert "rendezvous store stopped answering while waiting for every rank's load" in text
    assert f"rank 0 (host {socket.gethostname()}, store 127.0.0.1:" in text
    assert "likely failed or been killed" in text
    assert "rank 0's error" in text and "MemoryError: rank 0 out of host memory" in text


_RANK0 = """
import os, sys
from datetime import timedelta
import torch.distributed as dist
from sailor.megatron_patch.load_barrier import LoadBarrier
store = dist.TCPStore(
    "127.0.0.1", int(sys.argv[1]), 2, True, timedelta(seconds=10), wait_for_workers=False
)
barrier = LoadBarrier(store, 0, 2, "g", poll_s=0.5).start()
print("up", flush=True)
sys.stdin.readline()
barrier.fail(OSError("rank 0's checkpoint unreadable"))  # the worker's handler, then:
os._exit(1)
"""


def test_rank_0s_failure_reaches_the_waiters_before_its_store_goes() -> None:
    port = free_port()
    rank0 = subprocess.Popen(
        [sys.executable, "-c", _RANK0, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        # connect once its store is up: a client that tried earlier retried with a backoff
        # of seconds, and under load past the server's wait for it (both timed out)
        assert rank0.stdout is not None and rank0.stdout.readline() == b"up\n"
        client = dist.TCPStore(
            "127.0.0.1", port, 2, False, timedelta(seconds=30), wait_for_workers=False
        )
        got: list[BaseException] = []
        waiting = LoadBarrier(client, 1, 2, "g", 60.0, 60.0, 0.5)
        waiter = threading.Thread(target=_catch, args=(got, lambda: _load(waiting)))
        waiter.start()
        time.sleep(0.2)
        assert rank0.stdin is not None
        rank0.stdin.write(b"fail\n")  # rank 0 fails; its process (the store) exits after
        rank0.stdin.flush()
        waiter.join(timeout=20.0)
        # out as soon as rank 1 read the failure: rank 0 does not wait its 24 s bound
        assert rank0.wait(timeout=10.0) == 1
        assert got and "rank 0 (" in str(got[0]), got
        assert "OSError: rank 0's checkpoint unreadable" in str(got[0])
    finally:
        rank0.kill()
        rank0.wait()


def test_the_store_gone_names_rank_0s_error_file_as_the_worker_would_find_it() -> None:
    assert rank0_error_file("/run/error-{rank}.json", 3) == "/run/error-0.json"
    assert rank0_error_file("/agent/gen-2/error-3.json", 3) == "/agent/gen-2/error-0.json"
    assert rank0_error_file("/x/my-errors.json", 3) is None
    assert rank0_error_file(None, 3) is None


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
    with pytest.raises(ValueError, match="load poll_s=0"):
        LoadBarrier(store, 0, 2, "g", poll_s=0)
    with pytest.raises(ValueError, match="--timeout-s=0: must be > 0 seconds"):
        LoadBarrier(store, 0, 2, "g").formed(0)


def test_a_rank_whose_heartbeat_stopped_is_named_for_every_waiter() -> None:
    store = _store()
    dead = LoadBarrier(store, 1, 3, "g", liveness_s=0.3).start()
    _kill(dead)
    waiting = LoadBarrier(store, 0, 3, "g", timeout_s=30.0, liveness_s=0.3, poll_s=0.01)
    with (
        pytest.raises(PeerFailedError, match=r"rank 1 \(.+\) failed before.*no heartbeat for"),
        waiting.loading(),
    ):
        pass
    # written for the others: rank 2 raises it at once, without watching rank 1 itself
    with pytest.raises(PeerFailedError, match=r"rank 1 .*no heartbeat.*seen by rank 0"):
        await_loads(store, 2, 3, "g", timeout_s=30.0, poll_s=0.01)


def test_a_rank_that_beats_is_waited_for_however_long_its_load() -> None:
    store = _store()
    # a liveness of seconds, not tenths: a beat thread starved that long on a loaded host
    # read as a death (it failed so under a load average of 20)
    loading = LoadBarrier(store, 1, 2, "g", liveness_s=2.0).start()
    # (waited out past the liveness and two of its watcher's beats)
    waiting = LoadBarrier(store, 0, 2, "g", timeout_s=3.0, liveness_s=2.0, poll_s=0.01)
    try:
        with (
            pytest.raises(LoadTimeoutError, match=r"ranks \[1\] did not finish"),
            waiting.loading(),
        ):
            pass
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
    _kill(LoadBarrier(store, 1, 2, "g", liveness_s=0.2).start())
    with (
        pytest.raises(PeerFailedError, match=r"rank 1 .*no heartbeat"),
        LoadBarrier(store, 0, 2, "g", float("inf"), 0.2, 0.01).loading(),
    ):
        pass


def test_the_load_waits_are_checked_at_start_by_flag() -> None:
    base = ["--plan", "p", "--rank", "0", "--world-size", "1", "--master", "m"]
    check_load_waits(build_parser().parse_args([*base, "--load-timeout-s", "inf"]))
    for flag, value in (
        ("--load-liveness-s", "0.0"),
        ("--load-timeout-s", "nan"),
        ("--load-poll-s", "0.0"),
        ("--periodic-save-timeout-s", "-1.0"),
    ):
        args = build_parser().parse_args([*base, flag, value])
        with pytest.raises(ValueError, match=f"{flag}={value}: must be > 0 seconds"):
            check_load_waits(args)


def test_a_dead_rank_whose_watchers_are_still_loading_is_found_in_about_liveness_s() -> None:
    store = _store()
    # 12 ranks: rank 6 dies while its watchers (3, 4, 5) are still loading, only rank 11
    # waits. Their heartbeat threads watch it from the world's start: found liveness_s
    # and a beat after it died (when the waiters watched, rank 11 found it only by its one
    # extra read a poll in turn: two reads 8 polls, 8 s, apart)
    ranks = [LoadBarrier(store, r, 12, "g", liveness_s=1.0, poll_s=1.0).start() for r in range(11)]
    try:
        t0 = time.monotonic()
        _kill(ranks[6])  # rank 6
        with (
            pytest.raises(PeerFailedError, match=r"rank 6 \(.*no heartbeat.*seen by rank [345]"),
            LoadBarrier(store, 11, 12, "g", float("inf"), 1.0, 1.0).loading(),
        ):
            pass
        assert time.monotonic() - t0 < 1.0 + 0.2 + 1.0 + 1.5  # liveness, a beat, a poll, slack
    finally:
        for b in ranks:
            b.close()


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
    waiting = LoadBarrier(server, 0, 2, "g", timeout_s=2.0, liveness_s=0.5, poll_s=0.02)
    try:  # rank 1 beats on: rank 0 waits out its load timeout, and does not call it dead
        with (
            pytest.raises(LoadTimeoutError, match=r"ranks \[1\] did not finish"),
            waiting.loading(),
        ):
            pass
    finally:
        server.set("never-set", "1")  # the wait ends now, not at its client's timeout
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


def test_a_rank_failing_before_the_first_collective_ends_the_others_there() -> None:
    store = _store()
    building = LoadBarrier(store, 1, 3, "g").start()
    early = LoadBarrier(store, 2, 3, "g", poll_s=0.01).start()
    # rank 2 arrived before the failure: it waits on the store, not in the collective
    got: list[BaseException] = []
    waiter = threading.Thread(target=lambda: _catch(got, lambda: early.formed(30.0)))
    waiter.start()
    time.sleep(0.1)
    building.fail(MemoryError("building the optimizer"))  # rank_main.main's handler
    waiter.join(timeout=5.0)
    assert (
        got and "rank 1 (" in str(got[0]) and "MemoryError: building the optimizer" in str(got[0])
    )
    arriving = LoadBarrier(store, 0, 3, "g", poll_s=0.01).start()
    with pytest.raises(PeerFailedError, match=r"rank 1 .*MemoryError: building the optimizer"):
        arriving.formed(30.0)
    assert not arriving.pending  # raised here: not written again by its handler


def test_a_rank_late_to_the_first_collective_is_named_with_the_groups_timeout() -> None:
    store = _store()
    # (rank 0 then keeps its store up two beats for rank 1: 0.2 s)
    arriving = LoadBarrier(store, 0, 2, "g", liveness_s=0.5, poll_s=0.01).start()
    with pytest.raises(
        LoadTimeoutError,
        match=r"ranks \[1\] did not reach the world's first collective within "
        r"--timeout-s=0.2 \(1 of 2 arrived\)",
    ):
        arriving.formed(0.2)


def test_arrivals_and_loads_are_counted_apart() -> None:
    store = _store()
    formed = [LoadBarrier(store, r, 2, "g", poll_s=0.01).start() for r in range(2)]
    t = threading.Thread(target=formed[1].formed, args=(10.0,))
    t.start()
    assert formed[0].formed(10.0) < 5.0
    t.join()
    with pytest.raises(LoadTimeoutError, match=r"ranks \[1\] did not finish loading"):
        await_loads(store, 0, 2, "g", timeout_s=0.2, poll_s=0.01)
    for b in formed:
        b.close()


def test_a_peer_failure_reaches_a_rank_held_elsewhere_through_its_heartbeat() -> None:
    store = _store()
    told: list[PeerFailedError] = []
    # rank 0's main thread is in a collective (NCCL waits there for its timeout) or in
    # deepspeed.initialize: its heartbeat thread reads the failure and ends it
    held = LoadBarrier(store, 0, 2, "g", liveness_s=0.5, on_peer_failure=told.append).start()
    t0 = time.monotonic()
    LoadBarrier(store, 1, 2, "g").start().fail(OSError("no space left on device"))
    while not told and time.monotonic() - t0 < 5.0:
        time.sleep(0.01)
    assert told and "rank 1 (" in str(told[0]) and "OSError: no space left" in str(told[0])
    assert time.monotonic() - t0 < 0.1 + 1.0  # a beat period (liveness_s / 5), and slack
    assert not held.pending
    held.close()


def test_a_closed_socket_after_a_peers_failure_is_that_peers_failure() -> None:
    store = _store()
    rank0 = LoadBarrier(store, 0, 2, "g").start()
    gloo = RuntimeError("[pair.cc:537] Read error: Connection reset by peer")
    assert rank0.peer_cause(gloo) is gloo  # nothing on the store: its own
    LoadBarrier(store, 1, 2, "g").start().fail(ValueError("bad deepspeed config"))
    cause = rank0.peer_cause(gloo)
    assert isinstance(cause, PeerFailedError) and cause.__cause__ is gloo
    assert "rank 1 (" in str(cause) and "ValueError: bad deepspeed config" in str(cause)
    own = MemoryError("out of memory")  # not a peer's: its own, whatever is on the store
    assert rank0.peer_cause(own) is own
    rank0.close()


def _kill(barrier: LoadBarrier) -> None:
    """Its heartbeat stops as a SIGKILL stops it: its counter stands, it writes nothing (no
    failure, no closed mark: ``close`` would write one)."""
    barrier._stop.set()
    if barrier._thread is not None:
        barrier._thread.join()


def _load(barrier: LoadBarrier) -> None:
    with barrier.loading():
        pass


def _catch(got: list[BaseException], call: Callable[[], object]) -> None:
    try:
        call()
    except BaseException as exc:
        got.append(exc)


def test_a_peer_failure_ends_a_rank_whose_main_thread_is_in_a_blocking_store_wait() -> None:
    server = _store()
    client = dist.TCPStore(
        "127.0.0.1", server.port, 1, False, timedelta(seconds=10), wait_for_workers=False
    )
    told: list[PeerFailedError] = []
    # (a liveness of seconds: rank 0, never started here, is not found dead first)
    held = LoadBarrier(client, 1, 3, "g", liveness_s=5.0, on_peer_failure=told.append).start()
    # rank 1's main thread waits on its client (gloo's new_group, NCCL's unique-id
    # exchange): the c10d client serves one request at a time, for the wait's whole timeout
    blocked = threading.Thread(
        target=lambda: _suppress_store_error(client.wait, ["never-set"]), daemon=True
    )
    blocked.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    LoadBarrier(server, 2, 3, "g").start().fail(RuntimeError("injected before its groups"))
    try:  # its heartbeat ends it (records, counts out) on its own connection: a beat (1 s),
        # not the store wait's 10 s
        while server.add("sailor/loaded/g/ended", 0) < 2 and time.monotonic() - t0 < 4.0:
            time.sleep(0.02)
        assert told and "RuntimeError: injected before its groups" in str(told[0])
        assert server.add("sailor/loaded/g/ended", 0) == 2
        assert time.monotonic() - t0 < 4.0
    finally:
        server.set("never-set", "1")  # the wait ends now, not at its 10 s timeout
        blocked.join()
        held.close()


def test_a_socket_error_met_after_the_heartbeat_took_up_a_peers_failure_is_that_failure() -> None:
    store = _store()
    told: list[PeerFailedError] = []
    rank0 = LoadBarrier(store, 0, 3, "g", liveness_s=2.0, on_peer_failure=told.append).start()
    LoadBarrier(store, 1, 3, "g").start().fail(ValueError("bad deepspeed config"))
    t0 = time.monotonic()
    while not told and time.monotonic() - t0 < 5.0:
        time.sleep(0.01)
    assert told and not rank0.pending
    # the main thread meanwhile meets rank 1's closed gloo socket: its handler records rank
    # 1's failure, not the socket's (that one won the first-writer error file)
    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:26318")
    cause = rank0.peer_cause(gloo)
    assert isinstance(cause, PeerFailedError) and cause.__cause__ is gloo
    assert "rank 1 (" in str(cause) and "ValueError: bad deepspeed config" in str(cause)
    rank0.close()


def test_rank_0_records_a_peers_failure_before_it_keeps_its_store_up_and_its_handler_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sailor.megatron_patch import load_barrier

    # a handler that did not wait would return once close() stopped waiting for the
    # heartbeat thread (STORE_WAIT_S): well inside the linger below
    monkeypatch.setattr(load_barrier, "STORE_WAIT_S", 0.5)
    store = _store()
    told: list[float] = []
    # rank 0 keeps its store up two polls (3 s) for rank 2, which never counts itself out
    rank0 = LoadBarrier(
        store, 0, 3, "g", liveness_s=2.0, poll_s=1.5,
        on_peer_failure=lambda _: told.append(time.monotonic()),
    ).start()  # fmt: skip
    t0 = time.monotonic()
    LoadBarrier(store, 1, 3, "g").start().fail(ValueError("bad deepspeed config"))
    while not told and time.monotonic() - t0 < 5.0:
        time.sleep(0.01)
    assert told and told[0] - t0 < 2.0  # its error file is written before it lingers
    # its main thread's handler (a closed socket) waits for the heartbeat's end: it does not
    # cut rank 0's linger short (a worker's heartbeat exits the process there) ...
    rank0.fail(RuntimeError("Connection closed by peer"))
    assert time.monotonic() - t0 >= 3.0 - 0.5
    # ... nor write a failure of its own: the rank was ending of rank 1's
    assert store.add("sailor/loaded/g/failures", 0) == 1


def test_a_rank_that_closed_its_barrier_is_not_taken_for_dead_by_those_still_pending() -> None:
    store = _store()
    told: list[PeerFailedError] = []
    ranks = [
        LoadBarrier(store, r, 4, "g", liveness_s=2.0, on_peer_failure=told.append).start()
        for r in range(4)
    ]
    time.sleep(0.5)
    ranks[0].close()  # its load (or its stage's build) done first: its heartbeat stops
    time.sleep(2.0 + 1.0)  # its three watchers stay pending past the liveness and two beats
    try:
        assert not told, told
        assert store.add("sailor/loaded/g/failures", 0) == 0
    finally:
        for b in ranks[1:]:
            b.close()


def test_two_writers_of_one_error_file_leave_the_first_record_whole(tmp_path: Path) -> None:
    # the worker's handler and its heartbeat's end, at once: neither raises, and the file
    # holds one writer's record, whole
    for i in range(200):
        path = tmp_path / f"error-{i}.json"
        start = threading.Barrier(2)
        errors: list[BaseException] = []

        def write(
            who: str,
            path: Path = path,
            start: threading.Barrier = start,
            errors: list[BaseException] = errors,
        ) -> None:
            start.wait()
            try:
                write_error_file(path, failure_record(RuntimeError(who), 0, -1, False))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(w,)) for w in ("main", "heartbeat")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, (i, errors)
        record = json.loads(path.read_text())
        assert record["message"] in ("main", "heartbeat")
        assert not list(tmp_path.glob(f"error-{i}.json.tmp*"))


def test_without_hard_links_the_first_claim_writes_the_record_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a file system without hard links (some FUSE and CIFS mounts: EPERM). The first writer
    # claims and renames its record into place; a second one gives way (a rename let the
    # last writer win); a writer cut off after its claim leaves no record, which the
    # agent's own record of the dead worker then takes (writer_gone); a record cut off
    # mid-write (it does not parse) counts as none
    def no_links(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)

    def rec(message: str) -> dict[str, object]:
        return dict(failure_record(RuntimeError(message), 0, -1, False))

    first = tmp_path / "error-0.json"
    write_error_file(first, rec("first"))  # type: ignore[arg-type]
    write_error_file(first, rec("second"))  # type: ignore[arg-type]
    assert json.loads(first.read_text())["message"] == "first"
    claimed = tmp_path / "error-1.json"
    (tmp_path / "error-1.json.claim").touch()  # a writer claimed, then was killed
    write_error_file(claimed, rec("late"))  # type: ignore[arg-type]
    assert not claimed.exists()  # the claim's writer may still rename: given way
    write_error_file(claimed, rec("agent"), writer_gone=True)  # type: ignore[arg-type]
    assert json.loads(claimed.read_text())["message"] == "agent"
    cut = tmp_path / "error-2.json"
    cut.write_text('{"rank": 0, "mess')
    write_error_file(cut, rec("whole"), writer_gone=True)  # type: ignore[arg-type]
    assert json.loads(cut.read_text())["message"] == "whole"
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_record_write_that_hangs_does_not_keep_a_rank_from_ending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the error file on a hard-mounted NFS whose server is gone: the heartbeat's end waits
    # for the record a bounded time, then counts the rank out (rank 0 may stop lingering)
    # and lets the main thread's handler go on; before, it held the lock for good
    from sailor.megatron_patch import load_barrier

    monkeypatch.setattr(load_barrier, "RECORD_WAIT_S", 0.5)
    store = _store()
    hung, entered = threading.Event(), threading.Event()

    def record(err: PeerFailedError) -> None:
        entered.set()
        hung.wait()

    b = LoadBarrier(
        store, 1, 3, "w", liveness_s=2.0, poll_s=0.05, on_peer_failure=record, exit_status=None
    ).start()
    try:
        load_barrier._publish(store, "w", 2, "h2", "RuntimeError: boom")
        assert entered.wait(10)
        handled = threading.Event()
        main = threading.Thread(
            target=lambda: (b.peer_cause(RuntimeError("Connection reset by peer")), handled.set()),
            daemon=True,
        )
        main.start()
        assert handled.wait(10), "the main thread's handler still waits for the hung record"
        assert store.add("sailor/loaded/w/ended", 0) == 1  # counted out
    finally:
        hung.set()
        b.close()


def test_rank_0_does_not_keep_its_store_up_for_ranks_that_closed_their_barriers() -> None:
    store = _store()
    # rank 0's linger is capped at two of its polls (6 s); ranks 1 and 2 closed their
    # barriers (their heartbeats stopped: they read no failure on the store): nobody to keep
    # the store up for. Before, rank 0 waited its whole cap for them.
    rank0 = LoadBarrier(store, 0, 3, "g", liveness_s=5.0, poll_s=3.0).start()
    for r in (1, 2):
        LoadBarrier(store, r, 3, "g", liveness_s=5.0).start().close()
    t0 = time.monotonic()
    rank0.fail(OSError("rank 0's checkpoint unreadable"))
    assert time.monotonic() - t0 < 2.0
    assert store.add("sailor/loaded/g/ended", 0) == 3


def test_rank_0_does_not_keep_its_store_up_for_a_rank_its_watchers_found_dead() -> None:
    store = _store()
    # rank 0's linger is capped at two of its polls (6 s); rank 2 is killed without a word
    # (it never counts itself out) and its watchers find it dead: that verdict counts it
    # out. Before, rank 0 waited its whole cap for it.
    rank0 = LoadBarrier(store, 0, 3, "g", liveness_s=2.0, poll_s=3.0).start()
    rank1 = LoadBarrier(store, 1, 3, "g", liveness_s=2.0, poll_s=0.01).start()
    _kill(LoadBarrier(store, 2, 3, "g", liveness_s=2.0).start())
    try:
        with pytest.raises(PeerFailedError, match=r"rank 2 .*no heartbeat") as got, rank1.loading():
            pass  # rank 1 waits, reads rank 2's death, counts itself out
        t0 = time.monotonic()
        rank0.fail(got.value)  # rank 0's handler, with the same failure
        assert time.monotonic() - t0 < 2.0
        assert store.add("sailor/loaded/g/ended", 0) == 3  # rank 2 counted once
    finally:
        rank0.close()


_STORE_HOST = """
import sys
from datetime import timedelta
import torch.distributed as dist
stores = []
for line in sys.stdin:  # a port per store asked for; EOF (the tests' process gone): exit
    stores.append(dist.TCPStore(
        "127.0.0.1", int(line), 1, True, timedelta(seconds=60), wait_for_workers=False
    ))
    print("up", flush=True)
"""
# the process serving the hung-store tests' stores, started by the first of them: one torch
# import (over a CPU-second) for all of them, not one each
_store_host: list[subprocess.Popen[bytes]] = []


@atexit.register
def _end_store_host() -> None:
    for server in _store_host:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()


@contextlib.contextmanager
def _store_process() -> Iterator[tuple[subprocess.Popen[bytes], dist.TCPStore]]:
    """A new store served by a process other than this one (rank 0's), which the test can
    stop (SIGSTOP: a hung store, neither answering nor closing its sockets; the test sends
    SIGCONT before it ends), and a client of it whose calls wait 10 s for an answer. The
    process serves this process's earlier tests' stores too, idle by then."""
    if not _store_host or _store_host[0].poll() is not None:
        _store_host[:] = [
            subprocess.Popen(
                [sys.executable, "-c", _STORE_HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE
            )
        ]
    server = _store_host[0]
    server.send_signal(signal.SIGCONT)  # running, whatever an earlier test left
    assert server.stdin is not None and server.stdout is not None
    port = free_port()
    server.stdin.write(f"{port}\n".encode())
    server.stdin.flush()
    assert server.stdout.readline() == b"up\n"
    client = dist.TCPStore(
        "127.0.0.1", port, 1, False, timedelta(seconds=10), wait_for_workers=False
    )
    try:
        yield server, client
    finally:
        server.send_signal(signal.SIGCONT)


def test_the_handlers_lookup_of_a_peers_failure_is_bounded_on_a_hung_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store_wait_s = _short_store_wait(monkeypatch)
    with _store_process() as (server, client):
        rank1 = LoadBarrier(client, 1, 2, "g", liveness_s=30.0).start()
        time.sleep(0.2)
        server.send_signal(signal.SIGSTOP)  # rank 0's process stopped: its store hangs
        try:
            gloo = RuntimeError("[pair.cc:537] Read error: Connection reset by peer")
            # the worker's handler looks for a peer's failure before it writes its record:
            # the record waits STORE_WAIT_S at most (before, the c10d client's add waited on
            # a stopped server for good, its timeout notwithstanding)
            assert _returns_within(store_wait_s + 1.0, lambda: rank1.peer_cause(gloo)) == [gloo]
        finally:
            server.send_signal(signal.SIGCONT)
        rank1.close()


def _short_store_wait(monkeypatch: pytest.MonkeyPatch) -> float:
    """``load_barrier.STORE_WAIT_S`` shortened for this test (a hung store is waited for that
    long, in this process only: these tests' ranks are in it) and returned: the bound a call
    on the hung store is checked against, whatever its length."""
    from sailor.megatron_patch import load_barrier

    monkeypatch.setattr(load_barrier, "STORE_WAIT_S", 0.5)
    return load_barrier.STORE_WAIT_S


def _returns_within(bound_s: float, call: Callable[[], object]) -> list[object]:
    """``[call()]`` if it returned within ``bound_s`` (run on a daemon thread: a call that
    hangs fails the test rather than holding it), else ``[]``."""
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(call()), daemon=True)
    t.start()
    t.join(bound_s)
    return got


def test_closing_the_barrier_on_a_hung_store_is_bounded_and_its_mark_lands_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store_wait_s = _short_store_wait(monkeypatch)
    with _store_process() as (server, client):
        # (a world of one: nobody to watch; it beats every 0.2 s)
        rank = LoadBarrier(client, 0, 1, "g", liveness_s=1.0).start()
        deadline = time.monotonic() + 5.0
        while not client.check(["sailor/loaded/g/beat/0"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        server.send_signal(signal.SIGSTOP)  # the store's process stopped: its store hangs
        try:
            time.sleep(0.5)  # a beat waits for the store's answer on the heartbeat's connection
            # its load done, training begins: the closed mark does not hold it (before, the
            # mark went on that connection behind the beat, which waited for good whatever
            # the client's timeout, and close then waited for the heartbeat thread 5 s)
            assert _returns_within(store_wait_s + 1.0, rank.close) == [None]
            heartbeat = rank._thread
            assert heartbeat is not None and heartbeat.daemon  # never holds the exit
        finally:
            server.send_signal(signal.SIGCONT)
        # the store answers again: the closed mark and the count-out land, the thread ends
        heartbeat.join(timeout=10.0)
        assert not heartbeat.is_alive()
        assert client.check(["sailor/loaded/g/closed/0"])
        assert client.add("sailor/loaded/g/ended", 0) == 1


@pytest.mark.parametrize(
    ("poll_s", "want"),
    [(1.0, [0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0, 1.0]), (0.05, [0.02, 0.04] + [0.05] * 6)],
    ids=["default", "fast"],
)
def test_polls_start_short_and_double_up_to_poll_s(poll_s: float, want: list[float]) -> None:
    """Ranks that arrive moments apart (an in-place relayout's loads) are released within
    tens of milliseconds, not at the next whole poll (1 s by default: two such waits were
    ~2 s of the demo's ~2.7 s in-place no-step gap); a long wait polls every ``poll_s``."""
    store, slept = _store(), []

    def sleep(s: float) -> None:
        slept.append(s)
        if len(slept) == len(want):  # the last rank checks in
            store.add("sailor/loaded/g/count", 1)

    assert await_loads(store, 0, 2, "g", timeout_s=60.0, poll_s=poll_s, sleep=sleep) < 5.0
    assert slept == pytest.approx(want)
