"""The iteration's one world collective: what every rank learns before its optimizer step.

One fp64 vector, summed over the world once per iteration, in the same order on every rank:

- slot 0: the loss (the last stage's TP rank 0 adds its pipeline's, every other rank 0);
- slot 1: the local sum of squared gradients that clipping counts (``clipping``; 0 without
  clipping, inf where an uncounted gradient holds an inf or NaN);
- slot ``2 + r``: rank ``r``'s flags (:data:`NONFINITE`: a local gradient holds an inf or
  NaN; :data:`BAD_LABELS`: a microbatch it read holds a label outside the vocabulary), which
  only rank ``r`` writes, so the sum is each rank's own flags: every rank learns which ranks
  saw what, not only whether some did (a MAX would tell the latter alone).

The host reads the vector once (``tolist``), and that read is the loss's: before, a run
without clipping all-reduced a flag, synchronized and read it, then all-reduced the loss and
read it too (two collectives, two host round-trips per iteration); now one of each, as the
loss alone was before the non-finite check. At 1,024 ranks the vector is 8 KB, a latency-bound
all-reduce like the 8-byte one it replaces. Under NCCL it is a device tensor; every rank calls
:func:`agree_step` (or :func:`start_step`, then :func:`read_step` once other collectives of
the iteration are issued: the engine's control agreement rides on the same host wait) at the
same point of every iteration.

:func:`local_nonfinite` is the fused local test: one ``torch._foreach_norm`` (max-abs, so a
large finite gradient never overflows it; inf for an inf, NaN for a NaN) over every gradient,
one ``stack().max()``: on a GPU a few multi-tensor kernels instead of an ``isfinite``
kernel, a bool allocation the size of the gradient and an ``any`` per parameter.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sailor.comm import api as comm
from sailor.comm.codec import PeerObjectError, expect
from sailor.megatron_patch.clock import synchronize

__all__ = [
    "BAD_LABELS",
    "HOST_NAME_MAX",
    "NONFINITE",
    "Agreed",
    "agree_step",
    "gathered_hosts",
    "local_nonfinite",
    "rank_hosts",
    "read_step",
    "start_step",
    "world_objects",
]

NONFINITE = 1
"""A rank's flag: one of its gradients holds an inf or NaN."""
BAD_LABELS = 2
"""A rank's flag: a microbatch it read holds a label outside the vocabulary."""


@torch.no_grad()
def local_nonfinite(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 0-dim bool on ``device``: some tensor of ``grads`` holds an inf or NaN (no sync).
    Empty tensors are left out (a max-abs of nothing has no identity)."""
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.bool, device=device)
    peaks = torch._foreach_norm(grads, math.inf)
    return ~torch.isfinite(torch.stack(peaks).max())


@dataclass(frozen=True)
class Agreed:
    """One iteration's agreed values (the same on every rank)."""

    loss: float
    squares: float
    """The global sum of squared gradients clipping counts (0.0 without clipping)."""
    flags: tuple[int, ...]
    """Each rank's flags, by rank."""

    def ranks(self, flag: int) -> tuple[int, ...]:
        """The ranks whose flags hold ``flag``."""
        return tuple(r for r, f in enumerate(self.flags) if f & flag)

    @property
    def nonfinite(self) -> bool:
        """Some rank's gradient holds an inf or NaN (its flag, or a non-finite norm)."""
        return bool(self.ranks(NONFINITE)) or not math.isfinite(self.squares)


def start_step(
    loss: torch.Tensor,
    squares: torch.Tensor | None,
    nonfinite: torch.Tensor,
    bad_labels: bool,
    rank: int,
    world_size: int,
    group: Any = None,
) -> torch.Tensor:
    """Build the vector and sum it over ``group`` (the world): the collective, issued, not
    read (no host wait; :func:`read_step` reads it).

    ``loss``, ``squares`` (None: no clipping) and ``nonfinite`` are this rank's one-element
    or 0-dim device tensors; ``bad_labels`` is known on the host."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} outside a world of {world_size}")
    vec = torch.zeros(2 + world_size, dtype=torch.float64, device=loss.device)
    vec[0] = loss.reshape(())
    if squares is not None:
        vec[1] = squares.reshape(())
    flag = nonfinite.reshape(()).to(torch.float64) * NONFINITE
    vec[2 + rank] = flag + (BAD_LABELS if bad_labels else 0)
    comm.all_reduce(vec, group=group)
    return vec


def read_step(vec: torch.Tensor) -> Agreed:
    """The host's one read of a :func:`start_step` vector: the iteration's device wait."""
    synchronize(vec.device)  # abortable where the host waits (in-place workers)
    got = vec.tolist()
    # a flag slot is an exact small integer (one writer); NaN never reaches it
    return Agreed(got[0], got[1], tuple(int(f) for f in got[2:]))


def agree_step(
    loss: torch.Tensor,
    squares: torch.Tensor | None,
    nonfinite: torch.Tensor,
    bad_labels: bool,
    rank: int,
    world_size: int,
    group: Any = None,
) -> Agreed:
    """Sum the vector over ``group`` (the world) and read it on the host once
    (:func:`start_step` then :func:`read_step`)."""
    return read_step(start_step(loss, squares, nonfinite, bad_labels, rank, world_size, group))


def rank_hosts(ranks: Sequence[int], group: Any = None) -> str:
    """``rank 1 (host-a), rank 3 (host-b)``: ``ranks`` with their hosts. Collective (one
    object all-gather over ``group``): every rank calls it at the same point, at the start
    of every streak of non-finite steps (``nonfinite.SkipStreak.observe``: the streak's
    first ranks are named then, whether or not it grows into an agreed error), not only
    when one is raised."""
    hosts = gathered_hosts(world_objects(socket.gethostname(), group))
    return ", ".join(f"rank {r} ({hosts[min(r, len(hosts) - 1)]})" for r in sorted(ranks))


HOST_NAME_MAX = 255
"""The longest host name a peer may send (POSIX ``HOST_NAME_MAX`` is 255 at most; Linux's
``gethostname`` gives 64): the name goes into an error's text that is kept with the run."""


def gathered_hosts(got: list[object]) -> list[str]:
    """Each rank's host name of :func:`rank_hosts`'s gather (rank ``r``'s at index ``r``),
    checked: :class:`PeerObjectError` naming the first rank whose object is not a non-empty
    ``str`` of at most :data:`HOST_NAME_MAX` characters. What a peer sends goes into the
    text of a non-finite streak's error as it is; a malformed one is its sender's fault
    (``culprit`` in the failure record), not the receiver's. Pure."""
    out: list[str] = []
    for r, g in enumerate(got):
        host = expect(g, str, r, "its host name")
        if not 0 < len(host) <= HOST_NAME_MAX:
            raise PeerObjectError(
                f"rank {r} sent a host name of {len(host)} characters "
                f"({host[:40]!r}): 1 to {HOST_NAME_MAX} expected",
                rank=r,
            )
        out.append(host)
    return out


def world_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, by rank (``[obj]`` without a process group). Collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    comm.all_gather_object(out, obj, group=group)
    return out
