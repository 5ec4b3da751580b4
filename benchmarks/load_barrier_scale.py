"""The load barrier's store traffic and dead-rank detection at 64 to 1024 ranks.

Every rank of a world waits for the others' loads on rank 0's c10d TCP store
(:mod:`sailor.megatron_patch.load_barrier`): each rank beats on it from the world's start,
each rank that has loaded polls it. This runs that traffic for real, at the worker's periods
(1 s polls, ``--load-liveness-s`` 60 s, beats every ``liveness_s / 5``), on this machine:

* a real ``torch.distributed.TCPStore`` server (libuv, torch's default) in this process;
* ``--procs`` client processes, each holding its share of the N ranks, one thread and one
  store connection per rank for its wait and another for its heartbeat (as a worker: the
  heartbeat has a connection of its own); each rank runs the protocol's own code;
* a probe in this process: a heartbeat write (``add(key, 1)``) and a counter read
  (``add(key, 0)``) every 20 ms on a connection of its own, timed.

Ranks ``d - 3 .. d`` (``d = N // 2``) are still loading (they beat, they do not wait): ``d``'s
ring predecessors, its watchers, are not waiting. Every other rank waits. After a warm-up
and ``--measure-s`` of steady traffic, rank ``d`` dies (its heartbeat stops, it writes
nothing); printed: the time until the first waiter raises ``PeerFailedError`` naming it
(or ``>cap``).

Two protocols, measured in the same run:

* ``legacy``: the barrier before the heartbeat thread watched (reproduced here): each waiter
  read its 3 ring successors' counters and one other rank's in turn every poll, besides the
  barrier's two counters (6 requests per poll); a dead rank whose watchers were all still
  loading was found only by the turns: one waiter's two reads of it ``N - 4`` polls apart.
* ``current``: :class:`~sailor.megatron_patch.load_barrier.LoadBarrier` as it is.

Prints the setup, requests/s offered and served, server CPU, the probe's latency
percentiles, and the detection time. Never asserts a timing.

    python benchmarks/load_barrier_scale.py [--ranks 64,256,1024] [--procs 2] [--measure-s 20]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from sailor.localnet import free_port
from sailor.megatron_patch.errors import PeerFailedError
from sailor.megatron_patch.load_barrier import LoadBarrier

_CHILD = "--child"
_WORLD = "bench"
_PREFIX = f"sailor/loaded/{_WORLD}"


class _Counted:
    """A store connection that counts the requests it made (``clone`` counts into the same)."""

    def __init__(self, store: Any, counter: list[int]) -> None:
        self._store, self._n = store, counter

    def clone(self) -> _Counted:
        return _Counted(self._store.clone(), self._n)

    def add(self, key: str, value: int) -> int:
        self._n[0] += 1
        return int(self._store.add(key, value))

    def set(self, key: str, value: str) -> None:
        self._n[0] += 1
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        self._n[0] += 1
        return bytes(self._store.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._n[0] += 1
        return [bytes(v) for v in self._store.multi_get(keys)]

    def check(self, keys: list[str]) -> bool:
        self._n[0] += 1
        return bool(self._store.check(keys))

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        self._n[0] += 1  # a failure's claim (load_barrier._publish); without it, lost
        return bytes(self._store.compare_set(key, expected_value, desired_value))


class _Legacy:
    """The barrier before the heartbeat thread watched: a beat every ``liveness_s / 5`` on a
    connection of its own; a waiter's poll reads the failures and loaded counters, its 3 ring
    successors' beats and one other rank's in turn, and keeps what it saw for itself."""

    def __init__(self, store: Any, rank: int, n: int, liveness_s: float, poll_s: float) -> None:
        self.store, self.rank, self.n, self.liveness_s, self.poll_s = (
            store,
            rank,
            n,
            liveness_s,
            poll_s,
        )
        self._stop = threading.Event()

    def start(self) -> _Legacy:
        self.store.set(f"{_PREFIX}/host/{self.rank}", socket.gethostname())
        threading.Thread(target=self._beat, daemon=True).start()
        return self

    def _beat(self) -> None:
        conn = self.store.clone()
        while not self._stop.is_set():
            conn.add(f"{_PREFIX}/beat/{self.rank}", 1)
            self._stop.wait(self.liveness_s / 5)

    def close(self) -> None:
        self._stop.set()

    def wait(self) -> None:
        store, rank, n = self.store, self.rank, self.n
        near = [(rank + i) % n for i in range(1, 4)]
        rest = [(rank + i) % n for i in range(1, n) if (rank + i) % n not in near]
        seen: dict[int, tuple[int, float]] = {}
        turn = 0
        store.set(f"{_PREFIX}/done/{rank}", "1")
        store.add(f"{_PREFIX}/count", 1)
        while True:
            if store.add(f"{_PREFIX}/failures", 0) > 0:
                raise PeerFailedError("a rank failed")
            peers = [*near, rest[turn % len(rest)]]
            turn += 1
            for peer in peers:
                beats, now = store.add(f"{_PREFIX}/beat/{peer}", 0), time.monotonic()
                last = seen.get(peer)
                if last is None or last[0] != beats:
                    seen[peer] = (beats, now)
                elif now - last[1] >= self.liveness_s:
                    store.set(f"{_PREFIX}/failed/{peer}", "no heartbeat")
                    store.add(f"{_PREFIX}/failures", 1)
                    raise PeerFailedError(f"rank {peer}: no heartbeat")
            time.sleep(self.poll_s)
            store.add(f"{_PREFIX}/count", 0)


def _ignore(err: PeerFailedError) -> None:
    """A worker exits here (``record_peer_failure``, then ``exit_status``); the benchmark's
    waiters say it."""


def _child(cfg: dict[str, Any]) -> None:
    threading.stack_size(512 * 1024)
    n, protocol, liveness, poll = cfg["n"], cfg["protocol"], cfg["liveness_s"], cfg["poll_s"]
    dead = n // 2
    loading = {(dead - i) % n for i in range(4)}
    counter = [0]
    ranks: dict[int, Any] = {}
    for r in range(cfg["lo"], cfg["hi"]):
        conn = _Counted(
            dist.TCPStore(
                "127.0.0.1", cfg["port"], n, False, timedelta(seconds=300), wait_for_workers=False
            ),
            counter,
        )
        if protocol == "legacy":
            ranks[r] = _Legacy(conn, r, n, liveness, poll).start()
        else:
            # as a worker's (worker_barrier): its heartbeat also reads the failures counter
            ranks[r] = LoadBarrier(
                conn, r, n, _WORLD, float("inf"), liveness, poll, on_peer_failure=_ignore
            ).start()
    print("ready", flush=True)
    t_go, t_kill = (float(x) for x in sys.stdin.readline().split())
    found: list[float] = []

    def wait(r: int) -> None:
        time.sleep(max(0.0, t_go - time.time()) + random.uniform(0.0, poll))
        try:
            if protocol == "legacy":
                ranks[r].wait()
            else:
                with ranks[r].loading():
                    pass
        except PeerFailedError:
            found.append(time.time())

    for r in ranks:
        if r not in loading:
            threading.Thread(target=wait, args=(r,), daemon=True).start()
    t_a = t_go + cfg["warm_s"]
    time.sleep(max(0.0, t_a - time.time()))
    a = counter[0]
    time.sleep(max(0.0, t_kill - time.time()))
    b = counter[0]
    print(json.dumps({"requests": b - a, "window_s": t_kill - t_a}), flush=True)
    if dead in ranks:
        ranks[dead]._stop.set()  # killed: its heartbeat stops, it writes nothing (no close mark)
    while not found:
        time.sleep(0.05)
    print(json.dumps({"found": min(found)}), flush=True)
    time.sleep(3600)


def _probe(port: int, until: float, out: dict[str, list[float]]) -> None:
    conn = dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=60), wait_for_workers=False)
    while time.time() < until:
        t = time.perf_counter()
        conn.add("probe/beat", 1)
        t1 = time.perf_counter()
        conn.add(f"{_PREFIX}/beat/0", 0)
        t2 = time.perf_counter()
        out["write"].append(t1 - t)
        out["read"].append(t2 - t1)
        time.sleep(0.02)


def _pct(xs: list[float]) -> str:
    if not xs:
        return "-"
    q = statistics.quantiles(xs, n=100, method="inclusive")
    return f"p50 {q[49] * 1e3:.2f} / p99 {q[98] * 1e3:.2f} / max {max(xs) * 1e3:.2f} ms"


def _offered(protocol: str, n: int, poll: float, liveness: float) -> float:
    waiting, beat_s = n - 4, liveness / 5
    if protocol == "legacy":
        return waiting * 6 / poll + n / beat_s
    # a poll reads both counters at once; a beat is the beat and 3 reads, and the failures
    # counter where no wait of the rank's own reads it (the loading ranks)
    return waiting * (1 / poll + 4 / beat_s) + (n - waiting) * 5 / beat_s


def _run(protocol: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, 1, True, timedelta(seconds=300), wait_for_workers=False
    )
    server.add(f"{_PREFIX}/failures", 0)
    per = -(-n // args.procs)
    procs = []
    for i in range(args.procs):
        cfg = {
            "n": n, "protocol": protocol, "port": port, "lo": i * per, "hi": min(n, (i + 1) * per),
            "liveness_s": args.liveness_s, "poll_s": args.poll_s, "warm_s": args.warm_s,
        }  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, _CHILD, json.dumps(cfg)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a client process did not start: {line!r}")
        t_go = time.time() + 0.5
        t_kill = t_go + args.warm_s + args.measure_s
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{t_go} {t_kill}\n")
            p.stdin.flush()
        lat: dict[str, list[float]] = {"write": [], "read": []}
        time.sleep(max(0.0, t_go + args.warm_s - time.time()))
        cpu0 = time.process_time()
        _probe(port, t_kill, lat)
        cpu = time.process_time() - cpu0
        served = 0.0
        for p in procs:
            assert p.stdout is not None
            got = json.loads(p.stdout.readline())
            served += got["requests"] / got["window_s"]
        found = _first_found(procs, t_kill + args.detect_cap_s)
        return {
            "offered": _offered(protocol, n, args.poll_s, args.liveness_s),
            "served": served,
            "server_cpu": cpu / args.measure_s,
            "write": _pct(lat["write"]),
            "read": _pct(lat["read"]),
            "detect": f"{found - t_kill:.1f} s" if found else f">{args.detect_cap_s:g} s",
        }
    finally:
        for p in procs:
            p.kill()
            p.wait()
        del server


def _first_found(procs: list[subprocess.Popen[str]], deadline: float) -> float | None:
    found: list[float] = []

    def read(p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            found.append(json.loads(line)["found"])
            return

    for p in procs:
        threading.Thread(target=read, args=(p,), daemon=True).start()
    while not found and time.time() < deadline:
        time.sleep(0.05)
    return min(found) if found else None


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == _CHILD:
        _child(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="64,256,1024")
    ap.add_argument("--protocols", default="legacy,current")
    ap.add_argument("--procs", type=int, default=2, help="client processes sharing the ranks")
    ap.add_argument("--poll-s", type=float, default=1.0, help="the worker's poll (worker_barrier)")
    ap.add_argument("--liveness-s", type=float, default=60.0, help="--load-liveness-s")
    ap.add_argument("--warm-s", type=float, default=3.0)
    ap.add_argument("--measure-s", type=float, default=20.0)
    ap.add_argument("--detect-cap-s", type=float, default=150.0)
    args = ap.parse_args()
    print(
        f"setup: TCPStore server (libuv) in this process; {args.procs} client processes, "
        f"2 connections and 2 threads per rank; poll {args.poll_s:g} s, liveness "
        f"{args.liveness_s:g} s, beat every {args.liveness_s / 5:g} s; {args.measure_s:g} s "
        f"measured after {args.warm_s:g} s; {os.cpu_count()} cores; load average "
        f"{os.getloadavg()[0]:.2f}",
        flush=True,
    )
    print(
        f"{'protocol':9} {'ranks':>5} {'offered/s':>10} {'served/s':>9} {'srv cpu':>7}  "
        "heartbeat write | counter read | dead rank found (watchers loading)",
        flush=True,
    )
    for n in (int(x) for x in args.ranks.split(",")):
        for protocol in args.protocols.split(","):
            r = _run(protocol, n, args)
            print(
                f"{protocol:9} {n:5d} {r['offered']:10.0f} {r['served']:9.0f} "
                f"{r['server_cpu']:7.0%}  {r['write']} | {r['read']} | {r['detect']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
