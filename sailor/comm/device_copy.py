"""Host tensors onto the device without a host wait.

A plain host-to-device copy of pageable memory (``t.to("cuda")``, ``torch.tensor(...,
device="cuda")``) waits on the host, in C, until the copy has run on the current stream:
after every kernel queued before it, NCCL's included. A rank whose peer died mid-collective
sits in that wait, where the in-place abort's signal handler (``sailor.comm.abort``) never
runs, until NCCL's watchdog ends the process. Staged through pinned memory and issued
non-blocking, the copy is queued like a kernel and the host goes on; the caching host
allocator keeps the pinned buffer until the copy has run.

For small tensors (flags, sizes, a microbatch's inputs): torch's pinned-host allocator rounds
each block up to a power of two and keeps freed blocks for the life of the process, so a
large tensor copied this way stays locked in host memory. A large host tensor is copied
after an abortable wait (``comm.abort.host_sync``) has drained the stream instead.
"""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without a host wait: a host tensor goes pinned and non-blocking to
    a GPU; anything else is a plain move (nothing to do on the same device; a copy between
    GPUs is queued on the stream, not waited for)."""
    if device.type == "cuda" and t.device.type == "cpu":
        src = t if t.is_pinned() else t.pin_memory()
        return src.to(device, non_blocking=True)
    return t.to(device)
