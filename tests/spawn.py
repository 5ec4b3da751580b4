"""Test scaffolding: start torch.distributed ranks from a warm fork server.

``torch.multiprocessing.spawn`` starts each rank as a fresh interpreter that imports torch
and the engine again: ~7 s for four ranks on this 2-core machine, most of a short test. A
fork server that has imported them once (per test process) forks ready ranks in ~0.04 s.
Each rank still starts clean: the server forks before any process group, thread pool or
CUDA context exists, and the rank's function is looked up by module and name as under
spawn. :func:`start_process` forks one process the same way and leaves it running (a
test that kills it). Only tests use this; workers of the product start as their own
processes.
"""

from __future__ import annotations

import multiprocessing
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


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined; a rank's exception is raised
    here, as ``torch.multiprocessing.spawn`` does."""
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def start_process(fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> BaseProcess:
    """``fn(*args)`` in one process forked by the same server, started and not joined: for
    a test that kills it, or waits for its exit code itself."""
    proc = multiprocessing.get_context("forkserver").Process(target=fn, args=args)
    proc.start()
    return proc
