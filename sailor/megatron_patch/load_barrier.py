"""Every rank of a world waits for the others' loads on the rendezvous store, not in NCCL.

A rank fills its stage after the world formed (its first all-reduce is done): a checkpoint
restore, an in-place relayout's reads, or Hugging Face weights. Loads differ in length (one
rank reads more layers, or from a slower object store), and the next collective — the first
boundary's ``control.agree`` or the first 1F1B exchange — is where a rank that loaded early
would wait for the slowest under the process groups' timeout (600 s by default). A resume of
a large model longer than that trips NCCL's watchdog on every rank, and every relaunch
trips it again.

So after its load each rank checks in on the c10d store the world was initialised with (a
TCP store outside NCCL, served by rank 0) and waits there, in short polls, until every rank
has loaded, under a timeout of its own (``--load-timeout-s``, :data:`LOAD_TIMEOUT_S`). No
NCCL collective waits on a load, as no collective waits on a save (``boundary._durable``).

A rank whose load fails writes its error to the store before raising it; every other rank
raises :class:`~sailor.megatron_patch.errors.PeerFailedError` naming that rank and its error
as soon as its own load is over (``origin="peer"``: not charged to its node), instead of
waiting out the process group's timeout in a collective the failed rank never reaches. A
rank still loading cannot be interrupted: it learns of the failure when its own read ends.
If the store is gone (rank 0 failed and exited), the waiting ranks raise ``PeerFailedError``
saying so.

This module never touches a device or a collective; it takes any object with the c10d
store's ``add``/``set``/``get``/``check`` (``torch.distributed.Store``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Protocol

from sailor.megatron_patch.errors import PeerFailedError

__all__ = ["LOAD_TIMEOUT_S", "LoadTimeoutError", "Store", "await_loads", "loaded_together"]

LOAD_TIMEOUT_S = 7200.0
"""Default wait for every rank's load: a flat 2 h, not the checkpoint's size over a bandwidth
(the size of another rank's read is not known here, and a guessed bandwidth would be the
figure to distrust). 2 h covers a rank reading 720 GB at 100 MB/s — a conservative
sustained rate from an object store — which is more than one rank of a 70B-parameter model
reads with its AdamW moments (~1.1 TB in fp32 for the whole model, split over its stages).
A load longer than that is a stuck read, and the job fails naming the ranks not loaded."""

_PREFIX = "sailor/loaded"


class Store(Protocol):
    """The part of ``torch.distributed.Store`` used here."""

    def add(self, key: str, value: int) -> int: ...

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


class LoadTimeoutError(PeerFailedError):
    """Some ranks did not finish their load within ``--load-timeout-s`` (raised by the ranks
    that did: the slow ones' node is to blame, not theirs)."""


def _keys(world: str) -> tuple[str, str]:
    return f"{_PREFIX}/{world}/count", f"{_PREFIX}/{world}/failures"


@contextmanager
def loaded_together(
    store: Store,
    rank: int,
    world_size: int,
    world: str,
    timeout_s: float = LOAD_TIMEOUT_S,
    poll_s: float = 0.05,
) -> Iterator[None]:
    """Run this rank's load in the ``with`` block, then wait until every rank's is done.

    ``world`` names this world's loads on the store, the same on every rank of it (the
    worker's plan id and master address: a fresh rank and held in-place ranks number their
    generations differently). A failure in the block is written to the store for the
    others (best effort: the store may be gone too) and raised; after a good load this rank
    checks in and waits (:func:`await_loads`)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} outside a world of world_size={world_size}")
    if timeout_s <= 0:
        raise ValueError(f"load timeout_s={timeout_s}: must be > 0")
    try:
        yield
    except BaseException as exc:
        _publish_failure(store, rank, world, exc)
        raise
    await_loads(store, rank, world_size, world, timeout_s, poll_s)


def _publish_failure(store: Store, rank: int, world: str, exc: BaseException) -> None:
    text = f"{type(exc).__name__}: {exc}"[:2000]
    with suppress(Exception):  # the load's own error is the one to raise
        store.set(f"{_PREFIX}/{world}/failed/{rank}", f"{socket.gethostname()}\n{text}")
        store.add(_keys(world)[1], 1)


def await_loads(
    store: Store,
    rank: int,
    world_size: int,
    world: str,
    timeout_s: float = LOAD_TIMEOUT_S,
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Check this rank in as loaded and wait until every rank has; returns the seconds waited.

    Raises ``PeerFailedError`` once some rank's load failed (naming it, its host and its
    error), ``LoadTimeoutError`` after ``timeout_s`` naming the ranks not loaded, and
    ``PeerFailedError`` if the store stops answering (its host, rank 0, is gone)."""
    count, failures = _keys(world)
    t0 = clock()
    try:
        store.set(f"{_PREFIX}/{world}/done/{rank}", "1")
        n = store.add(count, 1)
        while True:
            if store.add(failures, 0) > 0:
                raise _peer_failure(store, world, world_size)
            if n >= world_size:
                return clock() - t0
            if clock() - t0 > timeout_s:
                late = [
                    r for r in range(world_size) if not store.check([f"{_PREFIX}/{world}/done/{r}"])
                ]
                raise LoadTimeoutError(
                    f"rank {rank}: ranks {late} did not finish loading their stage within "
                    f"--load-timeout-s={timeout_s:g} ({n} of {world_size} loaded)"
                )
            sleep(poll_s)
            n = store.add(count, 0)
    except PeerFailedError:
        raise
    except Exception as exc:  # the c10d store's errors: its server (rank 0) is gone
        raise PeerFailedError(
            f"rank {rank}: the rendezvous store stopped answering while waiting for every "
            f"rank's load ({type(exc).__name__}: {exc}); rank 0, its host, failed or was "
            "killed"
        ) from exc


def _peer_failure(store: Store, world: str, world_size: int) -> PeerFailedError:
    """The failure of the first rank (in rank order) whose load failed."""
    for r in range(world_size):
        key = f"{_PREFIX}/{world}/failed/{r}"
        if store.check([key]):
            host, _, text = store.get(key).decode(errors="replace").partition("\n")
            return PeerFailedError(f"rank {r} ({host}) failed to load its stage: {text}")
    return PeerFailedError("a rank failed to load its stage")
