"""Memory measurements: bytes saved for backward, peak allocation growth, process RSS.

Three quantities, each measured the way that isolates it:

* **Saved for backward** (:func:`saved_tensor_bytes`): every tensor autograd packs during a
  forward, seen through ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by
  storage, parameters excluded. Exact and device-independent; this is the activation
  memory a microbatch holds until its backward (the simulator's
  ``activation_bytes_per_sample`` times the microbatch size).
* **Peak allocation growth** (:func:`peak_growth_bytes`): the largest increase of
  tensor-allocated bytes over one forward + backward, temporaries included.

  - CUDA: ``torch.cuda.reset_peak_memory_stats`` then ``max_memory_allocated`` minus the
    allocated bytes before (the caching allocator's own counters).
  - CPU: torch's profiler with ``profile_memory=True``, which records every allocation and
    free of the c10 CPU allocator; the running sum of those events gives the peak. Not
    ``tracemalloc``: it only sees Python's allocator, and tensor storage is allocated in
    C++, so it reads ~0. Not RSS: glibc keeps freed chunks and RSS moves in pages, so a
    repeated fwd+bwd of a small layer shows no growth at all. The profiler costs time, so
    this pass is separate from (and never overlaps) the timed runs.
* **Process RSS** (:func:`rss_bytes`, :func:`peak_rss_bytes`, :func:`reset_peak_rss`): what
  the operating system charges a whole worker process; used for the framework overhead
  and the end-to-end check, where the question is the process's footprint. Linux only
  (``/proc/self/status``; the peak is reset by writing 5 to ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "peak_growth_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
    "rss_bytes",
    "saved_tensor_bytes",
]

_STATUS = Path("/proc/self/status")
_CPU = torch.autograd.DeviceType.CPU  # type: ignore[attr-defined]


def saved_tensor_bytes(fn: Callable[[], Any], params: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn`` runs (no parameters)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in skip and ptr != 0:
            seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        fn()
    return sum(seen.values())


def peak_growth_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Largest growth of tensor-allocated bytes on ``device`` while ``fn`` runs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, int(torch.cuda.max_memory_allocated(device)) - int(base))
    # kineto logs two lines per profiler start/stop to stderr unless told otherwise
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr,unused-ignore]
        if e.name() == "[memory]" and e.device_type() == _CPU
    )
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return int(peak)


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{_STATUS}: no {field} line (Linux /proc needed for RSS)")


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since start or the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter to the current RSS; False if not permitted."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
