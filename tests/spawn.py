"""Test scaffolding: start torch.distributed ranks from a warm fork server.

``torch.multiprocessing.spawn`` starts each rank as a fresh interpreter that imports torch
and the engine again: ~7 s for four ranks on this 2-core machine, most of a short test. A
fork server that has imported them once (per test process) forks ready ranks in ~0.04 s.
Each rank still starts clean: the server forks before any process group, thread pool or
CUDA context exists, and the rank's function is looked up by module and name as under
spawn. Only tests use this; workers of the product start as their own processes.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["spawn"]

_PRELOAD = ["torch", "torch.distributed", "sailor.megatron_patch.engine", "sailor.checkpoint"]
multiprocessing.set_forkserver_preload(_PRELOAD)


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined; a rank's exception is raised
    here, as ``torch.multiprocessing.spawn`` does."""
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
