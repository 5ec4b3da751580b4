"""A backend that records every call and enforces NCCL's local rules (for tests).

What it checks at the call, on this rank (raising :class:`CommRuleError`):

- every tensor is on the rank's declared device (NCCL refuses host tensors; gloo does not);
- every tensor is contiguous;
- every tensor's dtype is one NCCL has (:data:`NCCL_DTYPES`): gloo takes bool, complex and
  int16 as they are, NCCL has no such type;
- receive and gather buffers have the dtype and element count of what they receive, as
  far as one rank can tell (a gather's outputs match its input);
- tags cannot be passed at all (``sailor.comm.api`` has none; NCCL ignores them).

What needs every rank's log (``nccl_replay``): pairing, ordering, deadlocks, dtype and
element count agreement between ranks.

Two modes: forwarding (``inner`` given: the call then goes to the real backend, so a real
gloo run is checked), or **dry** (``inner=None``: nothing is communicated, receive buffers
keep what they hold). Dry mode lets one process run the real schedule of every rank of a
plan, one rank after another, on ``torch.device("meta")``: the model computes shapes only,
and any tensor moved to the host before a collective (a ``.cpu()``) is a device violation,
as it would be under NCCL.

``SAILOR_STRICT_COMM=<dir>`` makes a worker use a forwarding strict backend and write its
log to ``<dir>/rank-<r>.jsonl`` (:func:`from_env`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sailor.comm.api import Backend, P2POp, ReduceOp, Work
from sailor.comm.nccl_replay import CommOp

__all__ = [
    "ENV_VAR",
    "NCCL_DTYPES",
    "CommRuleError",
    "DryGroup",
    "StrictBackend",
    "from_env",
    "read_logs",
]

ENV_VAR = "SAILOR_STRICT_COMM"


NCCL_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
)
"""The torch dtypes NCCL itself communicates (``ncclDataType_t``: int8, uint8, int32,
uint32, int64, uint64, float16, bfloat16, float32, float64, and float8 on SM 90; NCCL's API
reference "Types"). Left out: what NCCL has no type for — bool, complex, int16 — and float8
and torch's unsigned 16-64-bit types, which the engine never sends. torch's NCCL process
group carries a bool as bytes and turns a bool ``SUM`` into a logical OR (gloo counts), and
its Python layer splits complex tensors into real pairs for some operations only: refused
here alike, so that code checked on gloo sends nothing whose meaning under NCCL differs."""


class CommRuleError(RuntimeError):
    """A call NCCL would refuse or mis-handle (a bug in the caller: never retried)."""


@dataclass(frozen=True)
class DryGroup:
    """A process group of a dry run: only its global ranks (in group order)."""

    ranks: tuple[int, ...]


class _Done:
    """The handle of a dry operation: waiting records the wait point."""

    def __init__(self, backend: StrictBackend, batch: int, inner: Work | None) -> None:
        self._backend, self._batch, self._inner = backend, batch, inner

    def wait(self) -> Any:
        self._backend.ops.append(CommOp("wait", batch=self._batch))
        return self._inner.wait() if self._inner is not None else True


def _same_device(t: torch.Tensor, device: torch.device) -> bool:
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index == device.index


class StrictBackend:
    """Records and checks every call of one rank (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        world_size: int,
        inner: Backend | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} outside world_size={world_size}")
        self.rank, self.device, self.world_size, self.inner = rank, device, world_size, inner
        self.ops: list[CommOp] = []
        self._batches = 0

    # -- checks and records ------------------------------------------------------------------

    def _ranks(self, group: Any) -> tuple[int, ...]:
        if group is None:
            return tuple(range(self.world_size))
        if isinstance(group, DryGroup):
            return group.ranks
        return tuple(dist.get_process_group_ranks(group))

    def _check(self, t: torch.Tensor, what: str) -> None:
        if not _same_device(t, self.device):
            raise CommRuleError(
                f"rank {self.rank}: {what} tensor on {t.device}, the rank's device is "
                f"{self.device} (NCCL only communicates tensors on the rank's own GPU)"
            )
        if not t.is_contiguous():
            raise CommRuleError(f"rank {self.rank}: {what} tensor is not contiguous")
        if t.dtype not in NCCL_DTYPES:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in NCCL_DTYPES))
            raise CommRuleError(
                f"rank {self.rank}: {what} tensor of dtype {t.dtype}: NCCL has no such type "
                f"(it communicates {names}); convert it explicitly before the call"
            )

    def _collective(
        self, kind: str, t: torch.Tensor | None, group: Any, detail: str = ""
    ) -> tuple[int, ...]:
        ranks = self._ranks(group)
        if self.rank not in ranks:
            raise CommRuleError(f"rank {self.rank}: {kind} on group {list(ranks)} without it")
        if t is not None:
            self._check(t, kind)
        self.ops.append(
            CommOp(
                kind,
                group=ranks,
                dtype=str(t.dtype) if t is not None else "object",
                shape=tuple(t.shape) if t is not None else (),
                numel=t.numel() if t is not None else 0,
                device=str(t.device) if t is not None else "",
                detail=detail,
            )
        )
        return ranks

    def _outputs(self, kind: str, outs: Sequence[torch.Tensor], t: torch.Tensor, n: int) -> None:
        if len(outs) != n:
            raise CommRuleError(f"rank {self.rank}: {kind} with {len(outs)} outputs for {n} ranks")
        for o in outs:
            self._check(o, f"{kind} output")
            if o.dtype != t.dtype or o.numel() != t.numel():
                raise CommRuleError(
                    f"rank {self.rank}: {kind} output {o.dtype}x{o.numel()} for input "
                    f"{t.dtype}x{t.numel()}"
                )

    # -- Backend -----------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, group: Any) -> None:
        self._collective("all_reduce", tensor, group, op)
        if self.inner is not None:
            self.inner.all_reduce(tensor, op, group)

    def all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor, group: Any) -> None:
        ranks = self._collective("all_gather", tensor, group)
        self._outputs("all_gather", outs, tensor, len(ranks))
        if self.inner is not None:
            self.inner.all_gather(outs, tensor, group)

    def all_gather_into_tensor(self, out: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
        ranks = self._collective("all_gather_into_tensor", tensor, group)
        self._check(out, "all_gather_into_tensor output")
        if out.dtype != tensor.dtype or out.numel() != tensor.numel() * len(ranks):
            raise CommRuleError(
                f"rank {self.rank}: all_gather_into_tensor output {out.dtype}x{out.numel()} "
                f"for {len(ranks)} x {tensor.dtype}x{tensor.numel()}"
            )
        if self.inner is not None:
            self.inner.all_gather_into_tensor(out, tensor, group)

    def gather(
        self, tensor: torch.Tensor, outs: list[torch.Tensor] | None, dst: int, group: Any
    ) -> None:
        ranks = self._collective("gather", tensor, group, f"dst={dst}")
        if dst not in ranks:
            raise CommRuleError(f"rank {self.rank}: gather to {dst} outside {list(ranks)}")
        if self.rank == dst:
            if outs is None:
                raise CommRuleError(f"rank {self.rank}: gather destination without outputs")
            self._outputs("gather", outs, tensor, len(ranks))
        if self.inner is not None:
            self.inner.gather(tensor, outs, dst, group)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> None:
        ranks = self._collective("broadcast", tensor, group, f"src={src}")
        if src not in ranks:
            raise CommRuleError(f"rank {self.rank}: broadcast from {src} outside {list(ranks)}")
        if self.inner is not None:
            self.inner.broadcast(tensor, src, group)

    def barrier(self, group: Any) -> None:
        self._collective("barrier", None, group)
        if self.inner is not None:
            self.inner.barrier(group)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Work]:
        if not ops:
            return []
        batch = self._batches
        self._batches += 1
        for o in ops:
            if o.kind not in ("send", "recv"):
                raise CommRuleError(f"rank {self.rank}: p2p kind {o.kind!r}")
            if o.peer == self.rank or not 0 <= o.peer < self.world_size:
                raise CommRuleError(f"rank {self.rank}: {o.kind} with peer {o.peer}")
            self._check(o.tensor, o.kind)
            self.ops.append(
                CommOp(
                    o.kind,
                    batch=batch,
                    peer=o.peer,
                    dtype=str(o.tensor.dtype),
                    shape=tuple(o.tensor.shape),
                    numel=o.tensor.numel(),
                    device=str(o.tensor.device),
                )
            )
        if self.inner is None:  # a handle per operation, as gloo returns (NCCL: one per batch)
            return [_Done(self, batch, None) for _ in ops]
        works = self.inner.batch_isend_irecv(ops)
        return [_Done(self, batch, w) for w in works]

    def all_gather_object(self, outs: list[Any], obj: Any, group: Any) -> None:
        ranks = self._collective("all_gather_object", None, group)
        if len(outs) != len(ranks):
            raise CommRuleError(f"rank {self.rank}: all_gather_object with {len(outs)} slots")
        if self.inner is not None:
            self.inner.all_gather_object(outs, obj, group)
        else:
            outs[ranks.index(self.rank)] = obj

    def broadcast_object_list(self, objs: list[Any], src: int, group: Any) -> None:
        self._collective("broadcast_object_list", None, group, f"src={src}")
        if self.inner is not None:
            self.inner.broadcast_object_list(objs, src, group)

    # -- logs --------------------------------------------------------------------------------

    def write(self, directory: str | Path) -> Path:
        """Write this rank's log as ``<directory>/rank-<rank>.jsonl``."""
        path = Path(directory) / f"rank-{self.rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(op.to_json() + "\n" for op in self.ops))
        tmp.replace(path)
        return path


def read_logs(directory: str | Path) -> dict[int, list[CommOp]]:
    """Every ``rank-<r>.jsonl`` of ``directory``, by rank."""
    out: dict[int, list[CommOp]] = {}
    for path in sorted(Path(directory).glob("rank-*.jsonl")):
        rank = int(path.stem.split("-", 1)[1])
        out[rank] = [CommOp.from_json(line) for line in path.read_text().splitlines() if line]
    return out


def from_env(
    rank: int, device: torch.device, world_size: int, inner: Backend
) -> tuple[StrictBackend, Path] | None:
    """A forwarding strict backend and its log directory if ``SAILOR_STRICT_COMM`` is set."""
    directory = os.environ.get(ENV_VAR, "")
    if not directory:
        return None
    return StrictBackend(rank, device, world_size, inner=inner), Path(directory)
