"""The in-place steps of a worker's generation (``rank_main --in-place``): hold when the
world breaks, leave a held world, fill the new stage (kept, received from peers, read from
the checkpoint), pay lazy imports ahead of need, and end a process whose worlds were
abandoned. The exchange itself and the handshake: :mod:`in_place`; which layer comes from
where: :mod:`relayout`; docs/training.md, "In-place reconfiguration".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sailor.comm import abort as comm_abort
from sailor.comm import api as comm
from sailor.comm.codec import PeerObjectError
from sailor.megatron_patch.boundary import Progress, Status
from sailor.megatron_patch.checkpoint_io import CheckpointIO
from sailor.megatron_patch.engine import TrainConfig, Trainer, make_optimizer
from sailor.megatron_patch.errors import InjectedFailureError, classify, close_fault_file
from sailor.megatron_patch.in_place import (
    Held,
    Peers,
    exchange,
    exchange_layer_bytes,
    state_kinds,
)
from sailor.megatron_patch.relayout import Schedule, exchange_transients, schedule
from sailor.megatron_patch.relayout_memory import (
    VERDICT_CODES,
    RelayoutMemory,
    Verdict,
    decide,
    margin_bytes,
)
from sailor.megatron_patch.state import key_layer

__all__ = [
    "RelayoutMemoryError",
    "await_store",
    "comm_failure",
    "drop_old_grads",
    "fill_stage",
    "held_line",
    "hold_broken",
    "leave_process",
    "leave_world",
    "memory_figures",
    "memory_verdict",
    "offload_held",
    "relayout_memory",
    "release",
    "warm_up",
]


def comm_failure(exc: BaseException) -> bool:
    """A failure of the world (a peer died or the world was abandoned), not of this rank."""
    if isinstance(exc, comm_abort.CommAbortedError):
        return True
    return not isinstance(exc, InjectedFailureError) and classify(exc, True) == "peer"


def held_line(h: Held) -> dict[str, Any]:
    line: dict[str, Any] = {"event": "held", "rank": h.old_rank, "step": h.step}
    line["broken"] = h.broken
    if h.broken:
        line["cause"] = h.cause
        if h.culprit >= 0:
            line["culprit"] = h.culprit
    return line


def hold_broken(
    args: argparse.Namespace,
    status: Status,
    trainer: Trainer,
    progress: Progress,
    ckpt: CheckpointIO | None,
    generation: int,
    exc: BaseException,
) -> Held:
    """Leave a failed world at once (no waiting on dead peers) and hold, broken."""
    status.in_training, status.holding = False, True
    comm_abort.abandon_world()
    comm_abort.clear_abort()
    if ckpt is not None:
        ckpt.reset()
    comm.install_backend(comm.TorchBackend())  # a strict backend's log is of a dead world
    cause = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    # a peer's bytes that do not decode: its rank is to blame, not this world's others
    culprit = exc.rank if isinstance(exc, PeerObjectError) and exc.rank >= 0 else -1
    h = Held(
        None, args.rank, trainer.step, trainer.consumed_samples, True, generation, cause, culprit
    )
    progress.emit(held_line(h))
    return h


def leave_world(held: Held | None) -> float:
    """Leave the previous generation's world (held unbroken: still initialised, idle).

    Aborted, not destroyed: torch's ``destroy_process_group`` finalizes NCCL communicators
    (``ncclCommFinalize`` then ``ncclCommDestroy``, blocking until the other members do the
    same; torch 2.6 on), so a holder leaving while a peer of the old world is still being
    released, or was killed without leaving, would wait on it. The world is idle (the
    device's queued work is waited for first, up to ``QUIET_TIMEOUT_S``), so the abort
    cancels no transfer; work still queued then waits on a dead peer, and the abort ends it."""
    t = time.perf_counter()
    if held is not None and not held.broken and dist.is_initialized():
        # drained: nothing of the world blocks, its groups are freed; else kept alive
        comm_abort.abandon_world(idle=_quiet_device(held))
    return time.perf_counter() - t


QUIET_TIMEOUT_S = 5.0
"""How long leaving a held world waits for the device's queued work before aborting anyway.
An idle held world's queue drains in milliseconds (its last step was synchronized at the
boundary); what is still queued after seconds is an NCCL op whose peer died, which only
the abort (``ncclCommAbort`` cancels in-flight work) ends."""


def _quiet_device(held: Held, timeout_s: float | None = None) -> bool:
    """Wait, at most ``timeout_s``, for the held trainer's device to finish the work queued
    on its current stream (the trainer's kernels, and the NCCL ops it waited on: NCCL's
    ``Work.wait`` orders the current stream after them); True once drained (at once off
    CUDA). An event recorded and polled, not ``torch.cuda.synchronize``: that has no
    timeout, and a rank whose peer died with an unmatched NCCL op still queued hung there
    forever, the hang the abort after it is meant to avoid. ``timeout_s``: default
    ``QUIET_TIMEOUT_S``."""
    if held.trainer is None or held.trainer.device.type != "cuda":
        return True
    timeout_s = QUIET_TIMEOUT_S if timeout_s is None else timeout_s
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(held.trainer.device))
    if _drained(event.query, timeout_s):
        return True
    print(
        f"sailor: rank {held.old_rank}: the device's queued work did not finish within "
        f"{timeout_s:g} s of leaving the held world; aborting it anyway",
        file=sys.stderr,
        flush=True,
    )
    return False


def _drained(
    done: Callable[[], bool],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Poll ``done`` (an event's ``query``) until true (True) or ``timeout_s`` has passed
    (False), sleeping 0.1 ms doubling to 10 ms between polls."""
    end = clock() + timeout_s
    pause = 1e-4
    while not done():
        if clock() >= end:
            return False
        sleep(pause)
        pause = min(pause * 2, 0.01)
    return True


def drop_old_grads(held: Held | None) -> None:
    """Free the held trainer's gradients before the next generation's stage is built: the
    exchange sends weights and moments only (4 B per parameter less at the peak)."""
    if held is not None and held.trainer is not None:
        for p in held.trainer.stage.parameters():
            p.grad = None


def release(held: Held | None) -> None:
    """Drop the held trainer once the new stage is filled: its weights, moments and the
    allocator's cached blocks would otherwise stay on the GPU for the whole generation."""
    if held is None or held.trainer is None:
        return
    device = held.trainer.device
    held.trainer = None  # the last reference: freed now (no gc.collect: ~0.2 s of downtime)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _state_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of distinct storages (a tied parameter is one tensor under two keys)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.is_meta or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def _held_tensors(tr: Trainer) -> list[torch.Tensor]:
    """The held trainer's weights and moments (its gradients are dropped by now)."""
    out: list[torch.Tensor] = []
    for p in tr.stage.parameters():
        out.append(p.data)
        st = tr.optimizer.state.get(p, {})
        out.extend(v for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor))
    return out


def _new_bytes(trainer: Trainer, layers: set[int] | None) -> int:
    """The new stage's state (weights, and both moments once AdamW has stepped) in
    ``layers`` (None: all), from its parameters' shapes (it may be on ``meta``)."""
    kinds = len(state_kinds(trainer.adam_step))
    seen: set[int] = set()
    total = 0
    for key, p in trainer.stage.keyed_parameters():
        if id(p) in seen or (layers is not None and key_layer(key) not in layers):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size() * kinds
    return total


def offload_held(tr: Trainer, host: torch.device) -> int:
    """Move the held trainer's weights and moments to ``host`` memory; returns the bytes
    moved off the device. The parameters stay the same objects. Pageable memory, not
    page-locked: torch's pinned-host allocator rounds each block up to a power of two and
    keeps freed blocks cached for the life of the process (``CachingHostAllocator``), so a
    stage offloaded once would hold up to twice its size of locked RAM on every rank of the
    node from then on; the exchange's copies back to the device are slower for it."""
    moved = _state_bytes([t for t in _held_tensors(tr) if t.device != host])

    def off(t: torch.Tensor) -> torch.Tensor:
        return t if t.device == host else t.to(host)

    for p in tr.stage.parameters():
        p.data = off(p.data)
        st = tr.optimizer.state.get(p, {})
        for k, v in list(st.items()):
            if k != "step" and isinstance(v, torch.Tensor):
                st[k] = off(v)
    if moved and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the allocator's blocks go back to the driver
    return moved


def _elsewhere(tr: Trainer, device: torch.device) -> bool:
    """Some of the held trainer's state is on another GPU than ``device``."""
    return any(t.device != device and t.device.type == "cuda" for t in _held_tensors(tr))


def _device_free(device: torch.device) -> tuple[int, int]:
    """(bytes the device can still allocate, its total): free memory plus what the caching
    allocator holds unused."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached, total


def _host_share(gpus_per_node: int) -> int | None:
    """One GPU's share of the host's available memory (``MemAvailable``; None where
    ``/proc/meminfo`` is not there): every rank of a node may offload at once."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // max(1, gpus_per_node)
    except (OSError, ValueError, IndexError):
        return None
    return None


def relayout_memory(
    trainer: Trainer, source: Trainer | None, sched: Schedule, batch_bytes: int
) -> RelayoutMemory | None:
    """This rank's figures on a GPU (None elsewhere: the host is the device). ``source``:
    the held trainer the exchange reads from; ``sched``: the relayout's schedule;
    ``batch_bytes``: the exchange's receive budget per batch."""
    device = trainer.device
    if device.type != "cuda":
        return None
    replica = trainer.plan.pipelines[trainer.role.pipeline].stages[trainer.role.stage].replica
    free, total = _device_free(device)
    return memory_figures(
        trainer, source, sched, batch_bytes, free, total, _host_share(replica.gpus_per_node)
    )


def memory_figures(
    trainer: Trainer,
    source: Trainer | None,
    sched: Schedule,
    batch_bytes: int,
    free_bytes: int,
    total_bytes: int,
    host_free_bytes: int | None,
) -> RelayoutMemory:
    """:func:`relayout_memory`'s figures from the device's free and total bytes."""
    device = trainer.device
    rank = trainer.role.rank
    on_device = [t for t in _held_tensors(source) if t.device == device] if source else []
    keep_x, off_x = exchange_transients(
        sched, exchange_layer_bytes(trainer.spec, trainer.adam_step), batch_bytes, rank
    )
    return RelayoutMemory(
        new_bytes=_new_bytes(trainer, None),
        kept_bytes=_new_bytes(trainer, set(sched.of(rank).kept)) if source is not None else 0,
        held_bytes=_state_bytes(on_device),
        keep_exchange_bytes=keep_x,
        offload_exchange_bytes=off_x,
        free_bytes=free_bytes,
        margin_bytes=margin_bytes(total_bytes),
        host_free_bytes=host_free_bytes,
    )


def memory_verdict(
    mode: str, rank: int, mem: RelayoutMemory | None, device: torch.device
) -> tuple[Verdict, bool]:
    """This rank's verdict (``mode``, ``--relayout-offload``: ``auto`` decides from
    ``mem``, ``keep`` without it) and whether any rank of the world stages its sends (one
    MAX all-reduce, every rank). Raises on every rank if some rank's new stage does not fit
    even with its old one on the host."""
    if mode == "always":
        mine: Verdict = "offload"
    elif mode == "never" or mem is None:
        mine = "keep"
    else:
        mine = decide(mem)
    # the world's worst verdict, and the highest rank that gave it (every rank's message
    # names it; that rank's own also has its figures)
    too_large = mine == "too_large"
    world = torch.tensor(
        [VERDICT_CODES[mine], rank if too_large else -1], dtype=torch.int64, device=device
    )
    comm.all_reduce(world, "max")
    comm_abort.host_sync(device)
    worst, culprit = (int(v) for v in world.tolist())
    if worst == VERDICT_CODES["too_large"]:
        detail = f": {mem.describe()}" if too_large and mem is not None else ""
        raise RelayoutMemoryError(
            f"in-place relayout: the new stage of rank {culprit} does not fit on its device "
            f"even with its old stage on the host{detail}; this is rank {rank} ({mine}). "
            "Restart instead"
        )
    return mine, worst >= VERDICT_CODES["offload"]


class RelayoutMemoryError(RuntimeError):
    """A rank of the new world cannot hold its new stage during the relayout."""


def fill_stage(
    args: argparse.Namespace,
    trainer: Trainer,
    held: Held | None,
    peers: Peers,
    ckpt: CheckpointIO | None,
    device: torch.device,
    resume: bool,
) -> dict[str, Any]:
    """Fill the new stage: kept and received layers (every rank takes part in the
    exchange), then the layers no live rank holds from checkpoint ``--load-step``. The
    stage may be built empty (on ``meta``): every parameter is placed on the device as it
    is filled. Before the exchange each rank checks that it fits, moving its held stage to
    the host if it does not fit otherwise (:mod:`relayout_memory`)."""
    if args.fail_relayout and held is not None:
        mark = Path(args.fail_relayout)
        with contextlib.suppress(FileExistsError):
            mark.open("x").close()
            raise InjectedFailureError(f"injected relayout failure on rank {args.rank}")
    sched = schedule(peers.old_plan, peers.holders, trainer.plan)
    source = held.trainer if held is not None and args.rank in peers.holders else None
    bucket = max(1, int(args.exchange_bucket_mb * 2**20))
    verdict: Verdict = "keep"
    staged = False
    host = torch.device("cpu")
    mode = args.relayout_offload
    t_off = time.time()
    offloaded = 0
    if peers.holders:  # every rank exchanges (the same peers on every rank): one verdict
        if device.type == "cuda":
            if source is not None and mode != "never" and _elsewhere(source, device):
                # a rank that moved GPUs: its held stage sits on another rank's GPU, and
                # every shard it sends is a copy on its own anyway
                offloaded = offload_held(source, host)
                mode = "always"
            # those GPUs' memory is free before any rank measures its own: the all-reduce
            # is queued on the stream, the host waits for it
            comm.all_reduce(torch.zeros(1, device=device))
            comm_abort.host_sync(device)
        mem = relayout_memory(trainer, source, sched, bucket)
        verdict, staged = memory_verdict(mode, args.rank, mem, device)
    if verdict == "offload" and source is not None:
        offloaded += offload_held(source, host)
    t = time.time()
    st = exchange(
        trainer, source, sched, trainer.adam_step, device, bucket_bytes=bucket, staged_sends=staged
    )
    t_transfer = time.time()
    layers = st.checkpoint_layers
    empty = trainer.materialize()
    stray = sorted({key_layer(k) for k in empty} - set(layers))
    if stray:
        raise RuntimeError(f"layers {stray} of rank {args.rank}: not filled by the exchange")
    if layers:
        if not resume or ckpt is None:
            raise RuntimeError(
                f"layers {layers} of rank {args.rank}: no live holder and no checkpoint "
                "(--ckpt-dir/--load-step)"
            )
        if layers == list(trainer.role.layers):
            ckpt.restore(trainer, args.ckpt_dir, args.load_step)
        else:
            ckpt.restore_layers(trainer, args.ckpt_dir, args.load_step, layers)
    n_ckpt = sum(1 for k, _p in trainer.stage.keyed_parameters() if key_layer(k) in layers)
    return {
        "path": "in_place",
        "kept_keys": st.kept_keys,
        "received_keys": st.received_keys,
        "checkpoint_keys": n_ckpt,
        "bytes_received": st.bytes_received,
        "batches": st.batches,
        "largest_batch_bytes": st.largest_batch_bytes,
        "memory": verdict,
        "offloaded_bytes": offloaded,
        "offload_s": t - t_off,
        "transfer_s": t_transfer - t,
        "load_s": time.time() - t_transfer,
    }


def warm_up() -> None:
    """Pay torch's lazy imports ahead of need: the first AdamW built in a process imports
    ``torch._dynamo`` (1.53 s of a fresh rank's 1.72 s stage build, measured on this
    2-core machine), which a warm spare should not pay after its directive."""
    make_optimizer([torch.nn.Parameter(torch.zeros(1))], TrainConfig())


def leave_process(code: int, error_file: str = "", at_once: bool = False) -> int:
    """The end of an in-place process: with abandoned worlds, no destructors (they could
    join threads blocked on dead peers: ``sailor.comm.abort``). A world still held (unbroken,
    told to exit) is aborted, not finalized, as :func:`leave_world` leaves one: the other
    holders of its node exit when their own agents tell them. ``at_once``: a process with
    nothing to finish (a warm spare told to go before it ever had a rank) skips the
    interpreter's teardown too, which takes 0.3 s after importing torch and 0.7 s after
    :func:`warm_up` (measured here, idle host; seconds with several spares on 2 cores): a
    spare told to go is gone within its agent's kill grace. Before ``os._exit``, what
    ``rank_main.main`` does at a clean end and ``os._exit`` skips: its ``faulthandler``
    file next to ``error_file`` goes if empty (left, it read as a crash that said nothing)."""
    if dist.is_initialized():
        comm_abort.abandon_world()
    if comm_abort.abandoned() or at_once:
        close_fault_file(error_file)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def await_store(master: str, timeout_s: float, poll_s: float = 0.005) -> float:
    """Wait until rank 0's rendezvous store at ``master`` (``host:port``) accepts connections;
    returns the seconds waited. A ``TCPStore`` client that finds no server yet backs off for
    0.3–0.7 s (measured, torch 2.13) even when the server starts a few ms later: in place,
    every rank gets its directive at about the same moment, so without this the new world's
    rendezvous often cost that backoff. A plain connect-and-close, polled; after
    ``timeout_s`` it gives up and lets ``init_process_group`` report its own timeout."""
    host, port = master.rsplit(":", 1)
    host = host.strip("[]")  # an IPv6 rendezvous: [fd00::17]:29507
    t = time.monotonic()
    end = t + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(poll_s, 0.05)):
                return time.monotonic() - t
        except OSError:
            if time.monotonic() >= end:
                return time.monotonic() - t
            time.sleep(poll_s)
