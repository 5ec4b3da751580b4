"""How ranks started on one host share its cores: the slowdown curve and the wake-up delay.

A GPU rank owns its device. CPU ranks that ``launch_local`` starts on one host share its
cores, and two effects decide their speed; both are measured here with the profiled model's
own layers (one stage holding all of them, forward + backward + the engine's AdamW step at
one microbatch size), never on the plans the simulator will predict:

* **slowdown(n)**: ``n`` ranks run that training step at once, as many steps as one rank
  alone does in ``window_s``; with others, each step also sends one activation (one
  microbatch's hidden states) to the next rank of the round and receives one from the
  previous, posted before the step and waited for after it, as a pipeline stage's
  asynchronous sends are: the communication threads of the backend take their share of the
  cores, as they do in training. ``slowdown[n-1]`` is their mean step time over the mean step
  time of one rank alone (which sends nothing). The rounds go ``1..K`` then ``K..1`` and each
  factor is the mean of its two rounds, so a drift of the host's load hits every factor
  alike. With ``pin`` (rank ``r`` bound to core ``r % cores``, as
  ``launch_local(pin_cores=True)`` binds a plan's ranks) the factor is each rank's own work,
  the waits left out: the simulator shares each core among the ranks bound to it and takes
  only the rest of the factor as the cost of sharing the host.
* **wake_s**: one rank sends a timestamp to another, blocked on the receive, and keeps
  computing; the receiver notes when it runs again. Measured once with ``cores - 1`` other
  ranks computing (so that ``cores`` ranks compute when the message lands: the receiver must
  wait for the scheduler to give it a core) and once with none (a core is free);
  ``wake_s`` is the difference of the mean delays (the transfer itself cancels out).
* **collective_wake_s**: ranks 0 and 1 compute a step, all-reduce 8 bytes, then all-reduce
  them again at once: the mean time from the later entry to the later exit of the first
  minus that of the second. The backend's threads sleep while the ranks compute and must be
  woken (several hand-overs between threads and processes) by a collective entered after
  computing, as the first gradient all-reduce and the loss all-reduce of an iteration are.
* **rendezvous_s / rendezvous_busy_s**: gloo hands a send over only once the receiver has
  posted its receive (the receiver notifies, then the sender's communication thread writes),
  so a receive posted after its send waits for that exchange even though the data was "sent"
  long before. One rank sends an activation and blocks until it is taken (a stage that has
  sent waits for its next message: in 1F1B the sender is rarely still computing when the
  receive comes); the other computes a step, then posts the receive and times it: the mean
  wait with no other rank computing (``rendezvous_s``) and with ``cores`` others computing
  (``rendezvous_busy_s``: the sender's threads wait for a core).

The ranks are real processes joined by a gloo group (:mod:`procs`), with the worker's one
intra-op thread each. The simulator uses the result only for plans it is told run on one
host (``simulate(..., shared_host=True)``): see ``sailor.simulator.shared_host``.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sailor.schemas import ModelSpec
from sailor.schemas.profile import HostSharing

__all__ = ["HOST_SOURCE", "HostRun", "host_sharing_from", "measure_host_sharing"]

HOST_SOURCE = "sailor.profiler.host_sharing"
_WAKE_WARMUP = 10


@dataclass(frozen=True)
class HostRun:
    """What to measure: up to ``max_ranks`` ranks at once, each window ``window_s``."""

    spec: ModelSpec
    gpu_type: str = "cpu"
    mbs: int = 1
    max_ranks: int = 4
    window_s: float = 1.0
    wake_messages: int = 150
    threads: int = 1
    cores: int = 0
    """Cores the ranks may run on (0: this process's CPU affinity)."""
    pin: bool = False
    """Bind rank ``r`` to core ``r % cores``, as ``launch_local(pin_cores=True)`` does."""

    def __post_init__(self) -> None:
        if self.max_ranks < 1:
            raise ValueError(f"max_ranks={self.max_ranks}: need at least 1")
        if self.window_s <= 0:
            raise ValueError(f"window_s={self.window_s}: must be > 0")
        if self.mbs < 1:
            raise ValueError(f"mbs={self.mbs}: must be >= 1")
        if self.wake_messages < 1:
            raise ValueError(f"wake_messages={self.wake_messages}: must be >= 1")

    @property
    def host_cores(self) -> int:
        return self.cores or len(os.sched_getaffinity(0))


def measure_host_sharing(run: HostRun, deadline_s: float = 600.0) -> HostSharing:
    """Run the measurement ranks and reduce their times to a :class:`HostSharing`."""
    from sailor.profiler.procs import run_ranks

    cores = run.host_cores
    world = max(run.max_ranks, cores + 2)
    config = {
        "spec": run.spec.model_dump(mode="json"),
        "mbs": run.mbs,
        "max_ranks": run.max_ranks,
        "window_s": run.window_s,
        "wake_messages": run.wake_messages,
        "threads": run.threads,
        "cores": cores,
        "pin": run.pin,
    }
    results = run_ranks(__name__, world, config, deadline_s=deadline_s)
    return host_sharing_from(results, run.gpu_type, cores, run.max_ranks, pinned=run.pin)


def host_sharing_from(
    results: list[dict[str, Any]], gpu_type: str, cores: int, max_ranks: int, pinned: bool = False
) -> HostSharing:
    """Reduce the ranks' raw times (``_rank_main``'s output) to the factors.

    Unbound ranks: whole steps, waits included (the ring runs in lockstep, so a rank that
    waits for a slower one is slowed by it, as unbound ranks moved between cores are).
    Bound ranks: each rank's own work only; the simulator shares each core among the ranks
    bound to it and keeps the rest of the factor as the cost of sharing the host."""
    steps: dict[int, list[float]] = {}  # n -> every rank's mean step time over its rounds
    for r in results:
        for n_text, means in r["compute" if pinned else "steps"].items():
            steps.setdefault(int(n_text), []).extend(means)
    alone = statistics.fmean(steps[1])
    slowdown = tuple(statistics.fmean(steps[n]) / alone for n in range(1, max_ranks + 1))
    spread = tuple(
        statistics.pstdev(steps[n]) / alone if len(steps[n]) > 1 else 0.0
        for n in range(1, max_ranks + 1)
    )
    wake = results[1]["wake"]
    wake_s = max(0.0, statistics.fmean(wake["loaded"]) - statistics.fmean(wake["idle"]))
    hand = results[1].get("rendezvous", {})
    collective_wake_s = _collective_wake(results[0].get("collective"), results[1].get("collective"))
    return HostSharing(
        gpu_type=gpu_type,
        cores=cores,
        slowdown=(1.0, *slowdown[1:]),
        slowdown_spread=spread,
        wake_s=wake_s,
        rendezvous_s=statistics.fmean(hand["idle"]) if hand.get("idle") else 0.0,
        rendezvous_busy_s=statistics.fmean(hand["loaded"]) if hand.get("loaded") else 0.0,
        pinned=pinned,
        collective_wake_s=collective_wake_s,
        source=(
            f"{HOST_SOURCE}: 1..{max_ranks} ranks of the model's training step at once; "
            f"wake-up with {cores - 1} busy ranks vs none; receives posted after their "
            f"send, with {cores} busy ranks and none; {cores} cores"
            + ("; rank r bound to core r % cores" if pinned else "")
        ),
    )


def _collective_wake(a: dict[str, list[float]] | None, b: dict[str, list[float]] | None) -> float:
    """Mean extra time of an all-reduce entered after computing over one entered right after
    another: each from the later entry to the later exit of the two ranks."""
    if not a or not b or not a["cold_in"]:
        return 0.0

    def spans(kind: str) -> list[float]:
        ins = zip(a[f"{kind}_in"], b[f"{kind}_in"], strict=True)
        outs = zip(a[f"{kind}_out"], b[f"{kind}_out"], strict=True)
        return [max(o) - max(i) for i, o in zip(ins, outs, strict=True)]

    return max(0.0, statistics.fmean(spans("cold")) - statistics.fmean(spans("hot")))


# --- the rank side ---------------------------------------------------------------------------


def _rank_main(argv: list[str] | None = None) -> int:
    import time

    import torch
    import torch.distributed as dist

    from sailor.megatron_patch.engine import TrainConfig, make_optimizer
    from sailor.megatron_patch.model import GPTStage
    from sailor.profiler.procs import init_gloo, rank_args, write_result

    args, cfg = rank_args(argv)
    if cfg.get("pin"):
        from sailor.megatron_patch.affinity import available_cores, bind, round_robin

        bind(round_robin(args.world_size, available_cores())[args.rank])
    torch.set_num_threads(int(cfg["threads"]))
    init_gloo(args, timeout_s=300.0)
    rank, world = args.rank, args.world_size
    spec = ModelSpec.model_validate(cfg["spec"])
    mbs, window = int(cfg["mbs"]), float(cfg["window_s"])
    n_layers = spec.num_all_layers
    stage = GPTStage(spec, 0, n_layers - 1, seed=rank)
    opt = make_optimizer(stage.parameters(), TrainConfig())
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, spec.vocab_size, (mbs, spec.seq_length), generator=gen)
    labels = torch.randint(0, spec.vocab_size, (mbs, spec.seq_length), generator=gen)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        x: torch.Tensor = tokens
        for i, mod in enumerate(stage.layers.values()):
            x = mod(x, labels) if i == n_layers - 1 else mod(x)
        x.backward()  # type: ignore[no-untyped-call]
        opt.step()

    def loop(seconds: float) -> list[float]:
        times: list[float] = []
        end = time.perf_counter() + seconds
        while True:
            t0 = time.perf_counter()
            if t0 >= end:
                return times
            step()
            times.append(time.perf_counter() - t0)

    loop(0.3)  # warm-up: allocator, autograd, optimizer state
    # every round runs the same number of steps on each of its ranks (they exchange
    # messages in lockstep): as many as one rank alone does in a window
    alone = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        alone[0] = statistics.fmean(loop(min(window, 0.5)))
    dist.broadcast(alone, src=0)
    count = max(10, round(window / float(alone[0])))
    out_act = torch.zeros(mbs * spec.seq_length * spec.hidden_size)
    in_act = torch.zeros_like(out_act)

    def ring(n: int) -> tuple[list[float], list[float]]:
        """``count`` steps; with others, each step also sends one activation to the next
        rank of the round and receives one from the previous, as a pipeline stage does.
        The times of whole steps (waits included) and of the step's own work."""
        times: list[float] = []
        work: list[float] = []
        for _ in range(count):
            t0 = time.perf_counter()
            reqs = []
            if n > 1:
                reqs = [
                    dist.irecv(in_act, src=(rank - 1) % n),
                    dist.isend(out_act, dst=(rank + 1) % n),
                ]
            t1 = time.perf_counter()
            step()
            work.append(time.perf_counter() - t1)
            for r in reqs:
                if r is not None:
                    r.wait()
            times.append(time.perf_counter() - t0)
        return times, work

    k_max = int(cfg["max_ranks"])
    steps: dict[str, list[float]] = {}
    compute: dict[str, list[float]] = {}
    for n in [*range(1, k_max + 1), *range(k_max, 0, -1)]:
        dist.barrier()
        if rank < n:
            whole, own = ring(n)
            steps.setdefault(str(n), []).append(statistics.fmean(whole))
            compute.setdefault(str(n), []).append(statistics.fmean(own))
    out: dict[str, Any] = {"rank": rank, "steps": steps, "compute": compute}

    cores = int(cfg["cores"])
    messages = int(cfg["wake_messages"]) + _WAKE_WARMUP

    def duel(
        label: str, busy: int, send: Callable[[], None], receive: Callable[[], list[float]]
    ) -> list[float] | None:
        """Rank 0 runs ``send`` and rank 1 ``receive`` (its result) while ``busy`` of the
        other ranks compute, until rank 0 is done."""
        dist.barrier()
        burners = range(2, 2 + min(busy, world - 2))
        stop = Path(args.out).with_name(f"stop-{label}")  # gloo's irecv never completes
        if rank in burners:
            while not stop.exists():
                step()
        elif rank == 0:
            send()
            stop.touch()
        elif rank == 1:
            return receive()
        return None

    # wake-up: rank 0 sends timestamps and keeps computing; rank 1 waits for them
    stamp = torch.zeros(1, dtype=torch.float64)

    def send_stamps() -> None:
        for _ in range(messages):
            step()
            stamp[0] = time.monotonic()
            req = dist.isend(stamp, dst=1)
            step()  # still computing when the message lands
            if req is not None:
                req.wait()

    def note_delays() -> list[float]:
        delays: list[float] = []
        for i in range(messages):
            dist.recv(stamp, src=0)
            if i >= _WAKE_WARMUP:
                delays.append(time.monotonic() - float(stamp[0]))
        return delays

    # rendezvous: rank 0 sends an activation and blocks until it is taken, as a pipeline
    # stage that has sent waits for its next message; rank 1 computes a step of its own
    # before it posts the receive, so the send is always first
    def send_first() -> None:
        for _ in range(messages):
            req = dist.isend(out_act, dst=1)
            if req is not None:
                req.wait()

    def receive_late() -> list[float]:
        waits: list[float] = []
        for i in range(messages):
            step()
            t0 = time.perf_counter()
            dist.recv(in_act, src=0)
            if i >= _WAKE_WARMUP:
                waits.append(time.perf_counter() - t0)
        return waits

    wake: dict[str, list[float]] = {}
    hand: dict[str, list[float]] = {}
    for label, busy in (("idle", 0), ("loaded", cores - 1)):
        got = duel(f"wake-{label}", busy, send_stamps, note_delays)
        if got is not None:
            wake[label] = got
    for label, busy in (("idle", 0), ("loaded", cores)):
        got = duel(f"rdv-{label}", busy, send_first, receive_late)
        if got is not None:
            hand[label] = got
    out["wake"] = wake
    out["rendezvous"] = hand

    # a collective entered after computing: ranks 0 and 1 compute a step, then all-reduce 8
    # bytes (the loss); then once more at once (the backend's threads awake). Clock stamps of
    # entry and exit; the host's monotonic clock is shared by the ranks
    pair = dist.new_group([0, 1])
    word = torch.zeros(1, dtype=torch.float64)
    cold: dict[str, list[float]] = {"cold_in": [], "cold_out": [], "hot_in": [], "hot_out": []}
    dist.barrier()
    if rank < 2:
        for i in range(messages):
            step()
            marks = [time.perf_counter()]
            dist.all_reduce(word, group=pair)
            marks.append(time.perf_counter())
            dist.all_reduce(word, group=pair)
            marks.append(time.perf_counter())
            if i >= _WAKE_WARMUP:
                cold["cold_in"].append(marks[0])
                cold["cold_out"].append(marks[1])
                cold["hot_in"].append(marks[1])
                cold["hot_out"].append(marks[2])
    out["collective"] = cold
    dist.barrier()
    write_result(args, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
