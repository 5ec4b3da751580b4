"""One DeepSpeed adapter rank in bf16 on the CPU, with a fault or a probe on its checkpoints.

``python -m tests.integration.deepspeed_fault_rank ARGS`` runs ``deepspeed_glue``'s entry
point in bf16 (as ``deepspeed_bf16_rank``), its checkpoint IO wrapped by what the environment
asks, each through the adapter's real path (no branch for it in Sailor's code):

- ``SAVE_TRACE=path-with-{rank}``: during each save, every all-reduce and reduce is recorded
  (a weak reference to its buffer's storage, its bytes, its destination); the file gets, per
  save, the number of each, the bytes of the recorded buffers still alive at each (the full
  tensors the rank holds then: on the CPU accelerator the device is the host), their peak,
  the bytes of summed tensors the rank received (an all-reduce's on every rank, a reduce's
  on its destination only), the bytes the checkpointer's snapshot copied to its host copies
  (``checkpointer._cpu_copy``), and the bytes of the parameters of the layers the rank
  writes, of its whole stage and of its largest one;
- ``BREAK_FRAGMENT_RANK=r``: before its first save, rank ``r`` drops ``exp_avg_sq`` from the
  optimizer-state fragment DeepSpeed linked to its middle parameter (one in its own flat
  partition), so that reading that moment raises DeepSpeed's own error, partway through the
  stage's parameters, as an allocation failing there would;
- ``DUMP_AT_SAVE=path-with-{rank}-and-{step}``: after each save, every rank dumps its full
  weights (the fp32 masters in bf16) as ``--dump-state`` dumps them at the run's end: the
  state a run saving without stopping had at its save;
- ``SLOW_LOAD_RANK=r``, ``SLOW_LOAD_S``: rank ``r``'s checkpoint storage stalls its first read
  once the world has formed (``slow_load_worker``'s wrapper);
- ``FAIL_BEFORE_LOAD_RANK=r``: rank ``r`` fails after DeepSpeed's initialisation, before its
  restore (the adapter's run state cannot be built: a ``MemoryError``), while the others
  restore and wait for it;
- ``FAIL_INIT_RANK=r``: rank ``r``'s ``deepspeed.initialize`` raises, while the others run
  theirs (and its first collectives).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from sailor.checkpoint import checkpointer, layers_written_by
from sailor.megatron_patch import deepspeed_adapter
from sailor.megatron_patch.deepspeed_adapter import main
from sailor.megatron_patch.deepspeed_state import DeepSpeedRun
from sailor.megatron_patch.state import key_layer
from sailor.training_process import deepspeed_glue
from sailor.training_process.deepspeed_glue import DeepSpeedLayerIO
from tests.integration.rank_exit import exit_now
from tests.integration.slow_load_worker import _SlowStorage


class _Trace:
    """The collectives of one save, the bytes alive at each, the bytes received and copied."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.buffers: list[tuple[StorageWeakRef, int]] = []
        self.live: list[int] = []
        self.calls = {"all_reduce": 0, "reduce": 0}
        self.received = 0
        self.copied = 0

    def _record(self, tensor: torch.Tensor) -> None:
        self.buffers.append((StorageWeakRef(tensor.untyped_storage()), tensor.nbytes))
        self.live.append(sum(n for ref, n in self.buffers if not ref.expired()))

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kw: Any) -> Any:
        self._record(tensor)
        self.calls["all_reduce"] += 1
        self.received += tensor.nbytes
        return _REAL_ALL_REDUCE(tensor, *args, **kw)

    def reduce(self, tensor: torch.Tensor, dst: int | None = None, *args: Any, **kw: Any) -> Any:
        self._record(tensor)
        self.calls["reduce"] += 1
        if dst == self.rank:
            self.received += tensor.nbytes
        return _REAL_REDUCE(tensor, dst, *args, **kw)

    def cpu_copy(self, t: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        self.copied += t.nbytes
        out: torch.Tensor = _REAL_CPU_COPY(t, *args, **kw)
        return out


_REAL_ALL_REDUCE = dist.all_reduce
_REAL_REDUCE = dist.reduce
_REAL_CPU_COPY = checkpointer._cpu_copy


def _break_fragment(run: DeepSpeedRun) -> str:
    linked: list[tuple[str, Any]] = [
        (k, p) for k, p in run.keyed_parameters() if getattr(p, "_hp_mapping", None) is not None
    ]
    key, p = linked[len(linked) // 2]
    del p._hp_mapping.optim_fragment["exp_avg_sq"]
    return key


class _ProbedIO(DeepSpeedLayerIO):
    def __init__(self) -> None:
        super().__init__()
        self._saves_seen = 0

    def save(
        self,
        trainer: DeepSpeedRun,
        root: str,
        keep: int | None = None,
        prune_below: int = -1,
        optional: bool = False,
        drop_steps: tuple[int, ...] | None = None,
    ) -> float:
        trace_to = os.environ.get("SAVE_TRACE", "")
        if self._saves_seen == 0 and os.environ.get("BREAK_FRAGMENT_RANK") == str(trainer.rank):
            key = _break_fragment(trainer)
            print(f"broke the exp_avg_sq fragment of {key}", file=sys.stderr, flush=True)
        self._saves_seen += 1
        took = self._save(trainer, root, keep, prune_below, optional, drop_steps, trace_to)
        dump_to = os.environ.get("DUMP_AT_SAVE", "")
        if dump_to:  # after the save, as ``--dump-state`` after a stop's: a collective
            state = {k: (w.cpu(), None) for k, w in trainer.weights().items()}
            path = dump_to.replace("{rank}", str(trainer.rank)).replace("{step}", str(trainer.step))
            torch.save(state, path)
        return took

    def _save(
        self,
        trainer: DeepSpeedRun,
        root: str,
        keep: int | None,
        prune_below: int,
        optional: bool,
        drop_steps: tuple[int, ...] | None,
        trace_to: str,
    ) -> float:
        if not trace_to:
            return super().save(trainer, root, keep, prune_below, optional, drop_steps)
        trace = _Trace(trainer.rank)
        dist.all_reduce = trace.all_reduce  # type: ignore[assignment]
        dist.reduce = trace.reduce  # type: ignore[assignment]
        checkpointer._cpu_copy = trace.cpu_copy  # type: ignore[assignment]
        try:
            return super().save(trainer, root, keep, prune_below, optional, drop_steps)
        finally:
            dist.all_reduce = _REAL_ALL_REDUCE
            dist.reduce = _REAL_REDUCE
            checkpointer._cpu_copy = _REAL_CPU_COPY
            written = set(layers_written_by(trainer.plan, trainer.rank))
            sizes = {k: p.numel() * 4 for k, p in trainer.keyed_parameters()}
            record = {
                "params": len(sizes),
                "all_reduces": trace.calls["all_reduce"],
                "reduces": trace.calls["reduce"],
                "received_bytes": trace.received,
                "host_copy_bytes": trace.copied,
                "live_bytes": trace.live,
                "peak_live_bytes": max(trace.live, default=0),
                "written_bytes": 3 * sum(n for k, n in sizes.items() if key_layer(k) in written),
                "stage_bytes": 3 * sum(sizes.values()),
                "largest_bytes": max(sizes.values()),
            }
            path = Path(trace_to.replace("{rank}", str(trainer.rank)))
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def _rank(argv: list[str]) -> int:
    return int(argv[argv.index("--rank") + 1])


if __name__ == "__main__":
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # as deepspeed_bf16_rank: no inductor
    argv = sys.argv[1:]
    if _rank(argv) == int(os.environ.get("SLOW_LOAD_RANK", "-1")):
        real_open = deepspeed_glue.open_storage
        delay = float(os.environ.get("SLOW_LOAD_S", "0"))
        opened: dict[str, Any] = {}

        def slow_open(root: str, **kw: Any) -> Any:
            # one wrapper per process: the stall happens once, on the first read
            opened.setdefault("storage", _SlowStorage(real_open(root, **kw), delay, False))
            return opened["storage"]

        deepspeed_glue.open_storage = slow_open  # type: ignore[assignment]
    if _rank(argv) == int(os.environ.get("FAIL_BEFORE_LOAD_RANK", "-1")):

        def failing_run(*args: Any, **kw: Any) -> DeepSpeedRun:
            raise MemoryError("building the run state before the restore")

        deepspeed_adapter.DeepSpeedRun = failing_run  # type: ignore[assignment,misc]
    if _rank(argv) == int(os.environ.get("FAIL_INIT_RANK", "-1")):
        import deepspeed

        def failing_initialize(*args: Any, **kw: Any) -> Any:
            raise ValueError("injected: DeepSpeed refused this rank's engine")

        deepspeed.initialize = failing_initialize
    exit_now(main(argv, ckpt=_ProbedIO(), precision="bf16"))
