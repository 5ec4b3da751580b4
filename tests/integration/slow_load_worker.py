"""The shipped training process with a slow or failing checkpoint storage on one rank.

``python -m tests.integration.slow_load_worker ARGS`` runs ``sailor.training_process``
(``LayerCheckpointIO``) with the storage its restores open wrapped: once the world has
formed, the first read of rank ``SLOW_LOAD_RANK`` waits ``SLOW_LOAD_S`` seconds, or raises
``OSError`` when ``FAIL_LOAD`` is set, or the process SIGKILLs itself when ``KILL_LOAD`` is
set (the host's OOM killer: no Python exception, nothing written). The delay or the failure
goes through the worker's real load path (``rank_main`` → ``CheckpointIO.restore`` → the
storage), with no branch for it in the worker. Reads before the world forms (the
checkpoint's position) are not touched: they come before ``init_process_group``, whose own
timeout they would trip. ``FAIL_BUILD`` set: that rank's stage build raises (an OOM building
the ``Trainer``), before its load begins. ``FAIL_GROUPS`` set: that rank raises once its
process groups are built, before the world's first all-reduce.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch.distributed as dist

from sailor.megatron_patch import rank_main
from sailor.training_process import ckpt_glue
from sailor.training_process.entry import main


class _SlowStorage:
    """A checkpoint storage whose first read after the world formed stalls or fails."""

    def __init__(self, inner: Any, delay_s: float, fail: bool) -> None:
        self._inner, self._delay_s, self._fail, self._stalled = inner, delay_s, fail, False

    def _stall(self) -> None:
        if self._stalled or not dist.is_initialized():
            return
        self._stalled = True
        time.sleep(self._delay_s)
        if os.environ.get("KILL_LOAD"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fail:
            raise OSError(f"injected: checkpoint storage unreachable after {self._delay_s:g} s")

    def read(self, *args: Any, **kw: Any) -> Any:
        self._stall()
        return self._inner.read(*args, **kw)

    def read_into(self, *args: Any, **kw: Any) -> Any:
        self._stall()
        return self._inner.read_into(*args, **kw)

    def open_read(self, *args: Any, **kw: Any) -> Any:
        self._stall()
        return self._inner.open_read(*args, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _rank(argv: list[str]) -> int:
    return int(argv[argv.index("--rank") + 1])


if __name__ == "__main__":
    argv = sys.argv[1:]
    if _rank(argv) == int(os.environ.get("SLOW_LOAD_RANK", "-1")):
        real_open = ckpt_glue.open_storage
        delay = float(os.environ.get("SLOW_LOAD_S", "0"))
        fail = bool(os.environ.get("FAIL_LOAD"))
        state: dict[str, Any] = {}

        def slow_open(root: str, **kw: Any) -> Any:
            # one wrapper per process: the stall happens once, on the first read
            state.setdefault("storage", _SlowStorage(real_open(root, **kw), delay, fail))
            return state["storage"]

        ckpt_glue.open_storage = slow_open  # type: ignore[assignment]
        if os.environ.get("FAIL_BUILD"):

            def failed_build(*_args: Any, **_kw: Any) -> Any:
                raise MemoryError("injected: out of memory building the stage")

            rank_main.Trainer = failed_build  # type: ignore[assignment,misc]
        if os.environ.get("FAIL_GROUPS"):
            real_groups = rank_main.build_process_groups

            def failed_groups(*args: Any, **kw: Any) -> Any:
                real_groups(*args, **kw)
                raise RuntimeError("injected: the process groups' setup failed on this rank")

            rank_main.build_process_groups = failed_groups  # type: ignore[assignment]
    sys.exit(main(argv))
