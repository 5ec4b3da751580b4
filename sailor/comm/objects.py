"""Object collectives built from tensor collectives, so that their waits can be aborted.

``torch.distributed``'s own ``broadcast_object_list`` and ``all_gather_object`` wait inside
torch: on gloo in a blocking ``Work.wait``, on NCCL in the copy of the result to the host,
where no Python signal handler runs. A rank whose peer is alive but will never answer
(it failed elsewhere) then leaves only at the group's timeout, not on the worker's
``SIGUSR1``. With polling on (:func:`sailor.comm.abort.set_polling`: in-place workers) the
backend runs them here instead: the pickled objects' sizes, then their bytes, each moved by
the backend's own tensor collective (abortable waits) and read back after
:func:`~sailor.comm.abort.host_sync` (an abortable poll on CUDA).

The bytes are pickles, as in torch's own object collectives: the peers are the ranks of one
job. The tensors live where the group's backend communicates: the current CUDA device for
NCCL, host memory otherwise.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch
import torch.distributed as dist

from sailor.comm import abort
from sailor.comm.device_copy import to_device

__all__ = ["all_gather_objects", "broadcast_objects", "object_device"]


class _Tensors(Protocol):
    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> None: ...

    def all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor, group: Any) -> None: ...


def object_device(group: Any) -> torch.device:
    """Where a group's object collective keeps its tensors (NCCL moves GPU tensors only)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes_tensor(blob: bytes, size: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    if blob:
        out[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return out.to(device)  # after an abortable wait: the stream holds nothing to wait for


def _host_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.cpu().numpy().tobytes())


def broadcast_objects(ops: _Tensors, objs: list[Any], src: int, group: Any) -> None:
    """Global rank ``src``'s ``objs`` into every member's list (same length everywhere)."""
    device = object_device(group)
    me = dist.get_rank() == src
    blobs = [pickle.dumps(o) for o in objs] if me else []
    sizes = torch.tensor([len(b) for b in blobs] if me else [0] * len(objs), dtype=torch.int64)
    sizes = to_device(sizes, device)  # no host wait before the first abortable one
    ops.broadcast(sizes, src, group)
    abort.host_sync(device)
    lengths = [int(n) for n in sizes.tolist()]
    data = _bytes_tensor(b"".join(blobs), sum(lengths), device)
    ops.broadcast(data, src, group)
    abort.host_sync(device)
    if me:
        return
    raw, off = _host_bytes(data), 0
    for i, n in enumerate(lengths):
        objs[i] = pickle.loads(raw[off : off + n])
        off += n


def all_gather_objects(ops: _Tensors, outs: list[Any], obj: Any, group: Any) -> None:
    """``outs[i]`` = the picklable ``obj`` of the group's ``i``-th rank."""
    device = object_device(group)
    members = dist.get_world_size(group)
    if len(outs) != members:
        raise ValueError(f"outs has {len(outs)} entries for a group of {members} ranks")
    blob = pickle.dumps(obj)
    size = to_device(torch.tensor([len(blob)], dtype=torch.int64), device)
    sizes = [torch.zeros_like(size) for _ in range(members)]
    ops.all_gather(sizes, size, group)
    abort.host_sync(device)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(members)]
    ops.all_gather(bufs, _bytes_tensor(blob, longest, device), group)
    abort.host_sync(device)
    for i, (b, n) in enumerate(zip(bufs, lengths, strict=True)):
        outs[i] = pickle.loads(_host_bytes(b[:n]))
