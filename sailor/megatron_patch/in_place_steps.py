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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sailor.comm import abort as comm_abort
from sailor.comm import api as comm
from sailor.megatron_patch.boundary import Progress, Status
from sailor.megatron_patch.checkpoint_io import CheckpointIO
from sailor.megatron_patch.engine import TrainConfig, Trainer, make_optimizer
from sailor.megatron_patch.errors import InjectedFailureError, classify
from sailor.megatron_patch.in_place import Held, Peers, exchange
from sailor.megatron_patch.relayout import schedule

__all__ = [
    "await_store",
    "comm_failure",
    "drop_old_grads",
    "fill_stage",
    "held_line",
    "hold_broken",
    "leave_process",
    "leave_world",
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
    h = Held(None, args.rank, trainer.step, trainer.consumed_samples, True, generation, cause)
    progress.emit(held_line(h))
    return h


def leave_world(held: Held | None) -> float:
    """Leave the previous generation's world (held unbroken: still initialised, idle)."""
    t = time.perf_counter()
    if held is not None and not held.broken and dist.is_initialized():
        dist.destroy_process_group()
    return time.perf_counter() - t


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
    exchange), then the layers no live rank holds from checkpoint ``--load-step``."""
    if args.fail_relayout and held is not None:
        mark = Path(args.fail_relayout)
        with contextlib.suppress(FileExistsError):
            mark.open("x").close()
            raise InjectedFailureError(f"injected relayout failure on rank {args.rank}")
    sched = schedule(peers.old_plan, peers.holders, trainer.plan)
    source = held.trainer if held is not None and args.rank in peers.holders else None
    t = time.time()
    bucket = max(1, int(args.exchange_bucket_mb * 2**20))
    st = exchange(trainer, source, sched, trainer.adam_step, device, bucket_bytes=bucket)
    t_transfer = time.time()
    layers = st.checkpoint_layers
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
    n_ckpt = sum(1 for k, _p in trainer.stage.keyed_parameters() if int(k.split(".")[0]) in layers)
    return {
        "path": "in_place",
        "kept_keys": st.kept_keys,
        "received_keys": st.received_keys,
        "checkpoint_keys": n_ckpt,
        "bytes_received": st.bytes_received,
        "batches": st.batches,
        "largest_batch_bytes": st.largest_batch_bytes,
        "transfer_s": t_transfer - t,
        "load_s": time.time() - t_transfer,
    }


def warm_up() -> None:
    """Pay torch's lazy imports ahead of need: the first AdamW built in a process imports
    ``torch._dynamo`` (1.53 s of a fresh rank's 1.72 s stage build, measured on this
    2-core machine), which a warm spare should not pay after its directive."""
    make_optimizer([torch.nn.Parameter(torch.zeros(1))], TrainConfig())


def leave_process(code: int) -> int:
    """The end of an in-place process: with abandoned worlds, no destructors (they could
    join threads blocked on dead peers: ``sailor.comm.abort``)."""
    if comm_abort.abandoned():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if dist.is_initialized():  # held unbroken, told to exit: the idle world goes
        dist.destroy_process_group()
    return code


def await_store(master: str, timeout_s: float, poll_s: float = 0.005) -> float:
    """Wait until rank 0's rendezvous store at ``master`` (``host:port``) accepts connections;
    returns the seconds waited. A ``TCPStore`` client that finds no server yet backs off for
    0.3–0.7 s (measured, torch 2.13) even when the server starts a few ms later: in place,
    every rank gets its directive at about the same moment, so without this the new world's
    rendezvous often cost that backoff. A plain connect-and-close, polled; after
    ``timeout_s`` it gives up and lets ``init_process_group`` report its own timeout."""
    host, port = master.rsplit(":", 1)
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
