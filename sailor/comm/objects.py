"""Object collectives built from tensor collectives, so that their waits can be aborted.

``torch.distributed``'s own ``broadcast_object_list`` and ``all_gather_object`` wait inside
torch: on gloo in a blocking ``Work.wait``, on NCCL in the copy of the result to the host,
where no Python signal handler runs. A rank whose peer is alive but will never answer
(it failed elsewhere) then leaves only at the group's timeout, not on the worker's
``SIGUSR1``. With polling on (:func:`sailor.comm.abort.set_polling`: in-place workers) the
backend runs them here instead: the encoded objects' sizes, then their bytes, each moved by
the backend's own tensor collective (abortable waits) and read back after
:func:`~sailor.comm.abort.host_sync` (an abortable poll on CUDA).

The backend runs them here with polling off too, never torch's own: those unpickle what a
peer sends, and a hostile node's crafted pickle would run its code on every receiver. The
bytes are :mod:`sailor.comm.codec`'s tagged JSON (plain data only); a peer's that do not
decode, a size out of bounds (negative, or over :data:`MAX_OBJECT_BYTES`) or a peer that
could not encode its object (it sends size -1 and raises its own ``TypeError``) raise
:class:`~sailor.comm.codec.PeerObjectError` naming that rank, on every receiver at the same
point (after the collectives: nobody is left waiting). The tensors live where the group's
backend communicates: the current CUDA device for NCCL, host memory otherwise.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from sailor.comm import abort
from sailor.comm.codec import PeerObjectError, decode, encode
from sailor.comm.device_copy import to_device

__all__ = ["MAX_OBJECT_BYTES", "all_gather_objects", "broadcast_objects", "object_device"]

MAX_OBJECT_BYTES = 1 << 28
"""The largest encoded object a rank sends or accepts (256 MiB; the largest that travels,
a plan's JSON, is a few hundred KiB), and the largest buffer an all-gather allocates (the
members times the longest object: a gather's objects are small tuples): a larger
announced size is refused, naming its rank, before any buffer of that size is allocated."""

_UNENCODABLE = -1


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
    blobs, failure = _encoded(objs) if me else ([], None)
    own = [len(b) for b in blobs] if failure is None else [_UNENCODABLE] * len(objs)
    sizes = torch.tensor(own if me else [0] * len(objs), dtype=torch.int64)
    sizes = to_device(sizes, device)  # no host wait before the first abortable one
    ops.broadcast(sizes, src, group)
    abort.host_sync(device)
    lengths = [int(n) for n in sizes.tolist()]
    _check_sizes(lengths, src, failure, me)
    data = _bytes_tensor(b"".join(blobs), sum(lengths), device)
    ops.broadcast(data, src, group)
    abort.host_sync(device)
    if me:
        return
    raw, off = _host_bytes(data), 0
    for i, n in enumerate(lengths):
        objs[i] = decode(raw[off : off + n], src)
        off += n


def all_gather_objects(ops: _Tensors, outs: list[Any], obj: Any, group: Any) -> None:
    """``outs[i]`` = the ``obj`` (:mod:`sailor.comm.codec`'s types) of the group's ``i``-th
    rank."""
    device = object_device(group)
    members = dist.get_world_size(group)
    if len(outs) != members:
        raise ValueError(f"outs has {len(outs)} entries for a group of {members} ranks")
    (blob, *_), failure = _encoded([obj])
    own = len(blob) if failure is None else _UNENCODABLE
    size = to_device(torch.tensor([own], dtype=torch.int64), device)
    sizes = [torch.zeros_like(size) for _ in range(members)]
    ops.all_gather(sizes, size, group)
    abort.host_sync(device)
    lengths = [int(s.item()) for s in sizes]
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if failure is not None:
        raise failure
    for rank, n in zip(ranks, lengths, strict=True):
        _check_sizes([n], rank, None, rank == dist.get_rank())
    longest = max(lengths)
    if longest * members > MAX_OBJECT_BYTES:  # every member receives ``longest`` from each
        rank = ranks[lengths.index(longest)]
        why = f"{longest} bytes, times {members} members, over {MAX_OBJECT_BYTES}"
        if rank == dist.get_rank():
            raise ValueError(f"an object collective's object is {why}")
        raise PeerObjectError(f"rank {rank} announced an object of {why}", rank=rank)
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(members)]
    ops.all_gather(bufs, _bytes_tensor(blob, longest, device), group)
    abort.host_sync(device)
    for i, (b, n) in enumerate(zip(bufs, lengths, strict=True)):
        outs[i] = decode(_host_bytes(b[:n]), ranks[i])


def _encoded(objs: list[Any]) -> tuple[list[bytes], TypeError | None]:
    """Every object's bytes, or (empty blobs and) the error of the first that cannot be sent:
    the sender still takes part in the size exchange, announcing that it failed."""
    try:
        return [encode(o) for o in objs], None
    except TypeError as exc:
        return [b"" for _ in objs], exc


def _check_sizes(lengths: list[int], rank: int, failure: TypeError | None, mine: bool) -> None:
    """Raise, on every member alike, if global rank ``rank``'s announced sizes say it could
    not encode (its own ``failure`` re-raised on it) or are out of bounds (``mine``: this
    rank's own object, too large: its own error)."""
    if failure is not None:
        raise failure
    for n in lengths:
        if mine and n > MAX_OBJECT_BYTES:
            raise ValueError(f"an object collective's object is {n} bytes, over {MAX_OBJECT_BYTES}")
        if n == _UNENCODABLE:
            raise PeerObjectError(
                f"rank {rank} could not encode its object for an object collective "
                "(its own error names the type)",
                rank=rank,
            )
        if not 0 <= n <= MAX_OBJECT_BYTES:
            raise PeerObjectError(
                f"rank {rank} announced an object of {n} bytes (0..{MAX_OBJECT_BYTES} allowed)",
                rank=rank,
            )
