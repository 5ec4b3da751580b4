"""Test scaffolding: start torch.distributed ranks from a warm fork server.

``torch.multiprocessing.spawn`` starts each rank as a fresh interpreter that imports torch
and the engine again: ~7 s for four ranks on this 2-core machine, most of a short test. A
fork server that has imported them once (per test process) forks ready ranks in ~0.04 s.
Each rank still starts clean: the server forks before any process group, thread pool or
CUDA context exists, and the rank's function is looked up by module and name as under
spawn. :func:`start_process` forks one process the same way and leaves it running (a
test that kills it). Only tests use this; workers of the product start as their own
processes.

Every spawned rank runs with ``TORCH_DIST_INIT_BARRIER=1``: ``init_process_group`` (and
``new_group``) then returns on no rank before every rank has built its group (torch's
store-based barrier). Without it a rank that had nothing to send (a test whose ranks each
raise a local error, ``test_megatron_patch_vocab_parallel``) could finish and exit while
another rank was still in gloo's ``connectFullMesh``, which then failed with "Connection
closed by peer" (a fresh-clone CI; 4 of 150 runs of that test's ranks at load ~6 here, 0 of
400 with the barrier). The port gloo printed, 8373, was not one drawn by ``free_port``:
gloo prints a port in network byte order (8373 is port 46368, one the kernel chose).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import torch.multiprocessing as mp

__all__ = ["spawn", "start_process"]

_PRELOAD = [
    "torch",
    "torch.distributed",
    "sailor.megatron_patch.engine",
    "sailor.checkpoint",
    # torch.optim wraps its constructors in torch._compile._disable_dynamo, which imports
    # torch._dynamo (and sympy) on the first call: each rank's first optimizer cost ~1.0 s
    # of CPU (torch 2.13, measured 2026-11-29), a third of a forked rank's start
    "torch._dynamo",
]
multiprocessing.set_forkserver_preload(_PRELOAD)


INIT_BARRIER_ENV = "TORCH_DIST_INIT_BARRIER"
"""torch's switch for a store-based barrier at the end of ``init_process_group`` and
``new_group`` (module docstring)."""


def _rank(rank: int, fn: Callable[..., Any], *args: Any) -> None:
    os.environ[INIT_BARRIER_ENV] = "1"
    fn(rank, *args)


def _process(fn: Callable[..., Any], *args: Any) -> None:
    os.environ[INIT_BARRIER_ENV] = "1"
    fn(*args)


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined; a rank's exception is raised
    here, as ``torch.multiprocessing.spawn`` does."""
    mp.start_processes(_rank, args=(fn, *args), nprocs=nprocs, join=True, start_method="forkserver")


def start_process(fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> BaseProcess:
    """``fn(*args)`` in one process forked by the same server, started and not joined: for
    a test that kills it, or waits for its exit code itself."""
    proc = multiprocessing.get_context("forkserver").Process(target=_process, args=(fn, *args))
    proc.start()
    return proc
