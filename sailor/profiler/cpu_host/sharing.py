"""CPU test scaffolding: how ranks started on one host share its cores (slowdown, wake-up).

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
* **all-reduces as the engine enters them**: for ``n = 2..K`` ranks, each iteration is the
  end of a training step as :mod:`~sailor.megatron_patch.engine` runs it: ranks 0 and 1
  compute the model's forward and backward, every rank all-reduces a gradient-sized buffer
  in a group of its own, then another in a second group, ranks 0 and 1 step the optimizer,
  and every rank all-reduces one scalar (the loss) in a third; no barrier in between (the
  loss all-reduce is the iteration's barrier, as in training). Ranks 2.. do not compute: they
  wait in each all-reduce, as the stages of a pipeline that finish before its first stage
  (had all ``n`` ranks computed the same work at once, ranks sharing a core would arrive by
  the scheduler's time slices, which no plan does). Each all-reduce's time runs from the later
  entry to the later exit. On a shared
  host these are not the all-reduce of the collective probe (a barrier, then one all-reduce):
  the backend's threads sleep while the ranks compute and are woken by several hand-overs
  between threads and processes, and a core that has gone idle waits for the scheduler; traced
  here, a 2-rank all-reduce of 8 KB took 2-3 ms on average right after the backward, 0.3-0.8
  ms right after the optimizer step, against 0.4-0.7 ms after a barrier.
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
host (``sailor.simulator.cpu_host.simulate_on_shared_host``).
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

HOST_SOURCE = "sailor.profiler.cpu_host.sharing"
_WAKE_WARMUP = 10
_ENTRY_WARMUP = 5
_ALLREDUCE_BYTES = 8192
"""Gradient all-reduces of the entry measurement: 8 KB, the size of a small model's tied
embedding gradient; larger ones add their bandwidth time (the collective probe's bus
bandwidth) in the simulator."""


@dataclass(frozen=True)
class HostRun:
    """What to measure: up to ``max_ranks`` ranks at once, each window ``window_s``."""

    spec: ModelSpec
    gpu_type: str = "cpu"
    mbs: int = 1
    max_ranks: int = 4
    window_s: float = 1.0
    wake_messages: int = 150
    entry_iterations: int = 150
    """Iterations of the engine's end of step per rank count (the all-reduce entry times)."""
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
        if self.entry_iterations < 1:
            raise ValueError(f"entry_iterations={self.entry_iterations}: must be >= 1")

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
        "entry_iterations": run.entry_iterations,
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
    after_compute, after_allreduce, after_update = _entry_spans(results, max_ranks)
    return HostSharing(
        gpu_type=gpu_type,
        cores=cores,
        slowdown=(1.0, *slowdown[1:]),
        slowdown_spread=spread,
        wake_s=wake_s,
        rendezvous_s=statistics.fmean(hand["idle"]) if hand.get("idle") else 0.0,
        rendezvous_busy_s=statistics.fmean(hand["loaded"]) if hand.get("loaded") else 0.0,
        pinned=pinned,
        allreduce_after_compute_s=after_compute,
        allreduce_after_allreduce_s=after_allreduce,
        allreduce_after_update_s=after_update,
        allreduce_probe_bytes=int(results[0].get("entry_bytes", 0)) if after_compute else 0,
        source=(
            f"{HOST_SOURCE}: 1..{max_ranks} ranks of the model's training step at once; "
            f"wake-up with {cores - 1} busy ranks vs none; receives posted after their "
            f"send, with {cores} busy ranks and none; the engine's all-reduces after "
            f"compute, after an all-reduce and after the update, 2..{max_ranks} ranks; "
            f"{cores} cores" + ("; rank r bound to core r % cores" if pinned else "")
        ),
    )


def _entry_spans(
    results: list[dict[str, Any]], max_ranks: int
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Mean time of each of the engine's three all-reduces per rank count (n = 2..max_ranks),
    from the later entry to the later exit: (after compute, after an all-reduce, after the
    optimizer step). Empty when the probe did not time them (older output)."""
    out: tuple[list[float], list[float], list[float]] = ([], [], [])
    for n in range(2, max_ranks + 1):
        per_rank = [r["entries"][str(n)] for r in results if str(n) in r.get("entries", {})]
        if len(per_rank) < n:
            return (), (), ()
        spans: tuple[list[float], list[float], list[float]] = ([], [], [])
        for marks in zip(*per_rank, strict=True):
            for kind, (enter, leave) in enumerate(((0, 1), (1, 2), (3, 4))):
                spans[kind].append(max(m[leave] for m in marks) - max(m[enter] for m in marks))
        for kind in range(3):
            out[kind].append(statistics.fmean(spans[kind]))
    return tuple(out[0]), tuple(out[1]), tuple(out[2])


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

    def forward_backward() -> None:
        stage(tokens, labels).backward()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        forward_backward()
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

    # the end of a training step as the engine runs it, for n = 2..K ranks: forward and
    # backward, a gradient all-reduce, a second one in another group, the optimizer step,
    # the loss all-reduce (the barrier of the iteration). Stamps on the host's monotonic
    # clock, shared by the ranks; reduced across ranks in host_sharing_from
    grad = torch.zeros(_ALLREDUCE_BYTES // 4)
    follow = torch.zeros_like(grad)
    loss = torch.zeros(1, dtype=torch.float64)
    entries: dict[str, list[list[float]]] = {}
    for n in range(2, k_max + 1):
        members = list(range(n))
        groups = [dist.new_group(members) for _ in range(3)]  # every rank of the world calls
        dist.barrier()
        if rank >= n:
            continue
        # ranks 0 and 1 (on different cores when bound) compute; the others have finished
        # their share before and wait in each all-reduce, as the stages of a pipeline that
        # drains before its first stage does
        computes = rank < 2
        marks: list[list[float]] = []
        for i in range(int(cfg["entry_iterations"]) + _ENTRY_WARMUP):
            if computes:
                opt.zero_grad(set_to_none=False)
                forward_backward()
            t = [time.perf_counter()]
            dist.all_reduce(grad, group=groups[0])
            t.append(time.perf_counter())
            dist.all_reduce(follow, group=groups[1])
            t.append(time.perf_counter())
            if computes:
                opt.step()
            t.append(time.perf_counter())
            dist.all_reduce(loss, group=groups[2])
            t.append(time.perf_counter())
            if i >= _ENTRY_WARMUP:
                marks.append(t)
        entries[str(n)] = marks
    out["entries"] = entries
    out["entry_bytes"] = _ALLREDUCE_BYTES
    dist.barrier()
    write_result(args, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
