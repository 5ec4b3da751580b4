"""Async, distributed save and layout-aware load for one rank of a running plan.

``Checkpointer.save`` is called by every rank at the same iteration boundary. It
1. agrees on a save id (rank 0 broadcasts one, unless the caller passes the controller's id);
2. **snapshots** (what training waits for): for each layer its replica group writes, gathers
   the TP shards to the writing TP rank and copies the full tensors to CPU memory;
3. **persists** on a background thread: writes this rank's layer files and its part file; the
   committer rank then waits for every writer's part and writes manifest and commit marker.

A failure on this rank in steps 1-2 (the previous save's error, a param outside the rank's
layers, a host buffer or device allocation failing, a device-to-host copy) does not raise out
of ``save``: every rank must enter each of the save's collectives, and a rank that left
would leave its peers in one it never enters (NCCL: until the watchdog or the controller's
abort). The failure becomes the save's own (``done()`` is True, ``wait()`` raises it), and
the caller agrees it with the other ranks where it agrees the save's outcome (the worker's
save poll). The collectives make that safe:

- step 1 is an object all-gather of (rank 0's save id, whether this rank already failed)
  over the world (:func:`agree_save_start`): if some rank did, no rank snapshots;
- in step 2 each TP gather is preceded by a 1-element all-reduce MAX over the TP group of
  "this rank failed" (after the rank's device allocations for that gather, before the
  gather): once one is set, every rank of the group stops there, at the same collective.
  A rank that stopped for a peer has nothing in flight; the one that failed holds its error.

Training may run the next iterations while step 3 runs. Snapshot and persist time are measured
and reported separately (``SaveResult``). One save is in flight at a time: a second ``save``
first waits for the previous persist (that wait is counted in its snapshot time). The CPU
copies of one save are kept and overwritten by the next (``reuse_buffers``): one snapshot's
worth of host memory stays allocated between saves, and steady-state snapshots skip the
first-touch page faults of fresh memory.

The TP gather runs on the tensors' own device (NCCL communicates GPU tensors only) through
``sailor.comm``; the gathered pieces go to host memory after the collective.

Background threads never call torch.distributed: all collectives happen in ``save`` on the
caller's thread, in the same order on every rank of a TP group, so they cannot interleave with
the framework's own collectives. Which layers a rank writes and loads is decided by the pure
functions of ``assignment.py``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from sailor.checkpoint import readback
from sailor.checkpoint.assignment import (
    layout_summary,
    place_of,
    writer_assignment,
    writer_ranks,
)
from sailor.checkpoint.buffers import ScratchPool
from sailor.checkpoint.errors import CheckpointError, SaveCancelledError
from sailor.checkpoint.gc import apply_retention
from sailor.checkpoint.prune import SeenStep, apply_seen_prune, seen_below
from sailor.checkpoint.readback import read_back
from sailor.checkpoint.reader import Loaded, load
from sailor.checkpoint.state import ParamState, TrainingGlobals, split_key
from sailor.checkpoint.storage import Storage
from sailor.checkpoint.unrecorded import apply_unrecorded, committed_markers
from sailor.checkpoint.writer import commit, discard_save, persist_layers
from sailor.comm import abort as comm_abort
from sailor.comm import api as comm
from sailor.comm.codec import expect
from sailor.schemas.checkpoint import TENSOR_KINDS, CheckpointManifest, TensorKind
from sailor.schemas.plan import Plan

__all__ = ["Checkpointer", "SaveResult", "agree_save_start", "load_for_rank"]


@dataclass(frozen=True)
class SaveResult:
    """Timings and outcome of one rank's part of a save."""

    step: int
    save_id: str
    rank: int
    layers_written: tuple[int, ...]
    bytes_written: int
    snapshot_s: float
    """Training stall: waiting for the previous save, TP gather, copy to CPU."""
    persist_s: float
    """Background: writing this rank's shards and part file."""
    commit_s: float
    """Committer only: waiting for every part, manifest, marker (the save is durable)."""
    retention_s: float
    """Committer only: deleting checkpoints beyond ``keep`` and debris, after the commit."""
    manifest: CheckpointManifest | None
    """The committed manifest (committer rank only)."""
    retention_error: str = ""
    """Committer only: why deleting older checkpoints failed ('' if it did not). The save
    is committed all the same: a failed deletion leaves files, never loses a checkpoint."""
    readback_error: str = ""
    """Committer only: the new commit did not read back (``readback.read_back``: its
    manifest, a shard's size or a sampled block's checksum), so nothing older was deleted
    ('' if it read back, or retention had nothing to delete for)."""
    readback_s: float = 0.0
    """Committer only: reading the commit back before retention (0 if not read)."""
    readback_unchecked: int = 0
    """Committer only: shards of the commit read back whose data had no block checked
    (``ReadBack.unchecked``: none fit in the read-back's budget; their sizes were). The
    commit still counts as read back: reported, not blocking retention."""
    unrecorded_deleted: tuple[int, ...] = ()
    """Committer only: committed steps of saves the controller gave up on (the save's
    ``drop_steps``) that retention deleted (``unrecorded.apply_unrecorded``)."""


class Checkpointer:
    """Saves this rank's share of a checkpoint of ``plan`` asynchronously."""

    def __init__(
        self,
        storage: Storage,
        plan: Plan,
        rank: int,
        *,
        keep: int | None = 3,
        committer_rank: int = 0,
        tp_group: Any = None,
        layer_bytes: Mapping[int, int] | None = None,
        commit_timeout_s: float = 600.0,
        reuse_buffers: bool = True,
        scratch: ScratchPool | None = None,
    ) -> None:
        self.storage = storage
        self.plan = plan
        self.rank = rank
        self.place = place_of(plan, rank)
        self.keep = keep
        self.committer_rank = committer_rank
        self.tp_group = tp_group
        self.assignment = writer_assignment(plan, layer_bytes)
        self.writers = writer_ranks(plan, layer_bytes)
        self.commit_timeout_s = commit_timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-persist-r{rank}")
        self._pending: Future[SaveResult] | None = None
        # Set by ``cancel()``: the world this checkpointer saved for was abandoned, and a
        # later generation may commit the same step; a persist still running must not.
        self._cancelled = threading.Event()
        # The previous save's CPU copies, reused once it is persisted: copying into memory
        # already touched runs at ~9 GB/s here vs ~2 GB/s into fresh memory, whose first-touch
        # page faults dominate the stall on this VM (torch copy of 48 MB fp32, 1 thread).
        self.reuse_buffers = reuse_buffers
        self._spare: dict[int, dict[str, ParamState]] = {}
        # Buffers of the transposing copies into the stored layout, kept between saves (and
        # shared with the process's other checkpointers when ``scratch`` is given).
        self._scratch = scratch if scratch is not None else ScratchPool()
        if self.place.tp_size > 1 and tp_group is None:
            raise CheckpointError(f"rank {rank}: tp={self.place.tp_size} needs a tp_group")

    def save(
        self,
        params: Mapping[str, ParamState],
        globals_: TrainingGlobals,
        *,
        save_id: str | None = None,
        prune_below: int = -1,
        owned: bool = False,
        drop_steps: Sequence[int] | None = None,
    ) -> float:
        """Snapshot now, persist in the background; returns the snapshot (stall) seconds.
        ``prune_below`` >= 0: after the commit, the committer also deletes every step
        directory below that step, as it was when this save began (``prune``: what a
        save there made since stays; the caller knows which older checkpoints are still
        needed). ``drop_steps`` (the steps of saves the controller
        gave up on; None: no such rule): after the commit, the committer also deletes those
        of them at or above ``prune_below`` that were committed when this save began
        (``unrecorded``: a commit nobody recorded). ``owned``: ``params``
        are host copies made for this save and handed over (the caller neither reads nor
        writes them after; e.g. the copies :meth:`lend_copies` lent, filled): the snapshot
        keeps them as they are instead of copying them again (at TP 1; a tensor on a device
        is copied to the host all the same).

        Collective over the world (the start, unless ``save_id`` is given: then the caller
        agreed it) and each TP group (the gathers). A failure here or on a peer ends the
        snapshot on every rank at the same collective and raises nothing: this rank's own
        is raised by ``wait()``, a peer's leaves nothing in flight (module docstring)."""
        t0 = time.perf_counter()
        failure: Exception | None = None
        by_layer: dict[int, dict[str, ParamState]] = {}
        try:
            self.wait()
            by_layer = self._by_layer(params)
        except Exception as exc:  # agreed below, raised by wait()
            failure = exc
        sid = save_id or ""
        if save_id is None:
            sid, failed = agree_save_start(failure)
            if failed:
                return self._abandon(failure, t0)
        mine, failure = self._snapshot(by_layer, self._spare, failure, owned)
        if mine is None:
            return self._abandon(failure, t0)
        self._spare = mine if self.reuse_buffers else {}
        snapshot_s = time.perf_counter() - t0
        drop = None if drop_steps is None else tuple(sorted(set(drop_steps)))
        self._pending = self._pool.submit(
            self._persist, mine, globals_, sid, snapshot_s, prune_below, drop
        )
        return snapshot_s

    def _abandon(self, failure: Exception | None, t0: float) -> float:
        """End a save that failed here or on a peer: this rank's failure becomes the save's
        (``done()``, ``wait()`` raises it); a peer's leaves nothing in flight. The spare
        copies may be half overwritten: not reused."""
        self._spare = {}
        self._pending = None if failure is None else _failed(failure)
        return time.perf_counter() - t0

    def take_buffers(self, other: Checkpointer) -> None:
        """Take the host copies ``other`` keeps for reuse (another root's checkpointer of
        this plan and rank, as for periodic checkpoints beside the controller's): a process
        then keeps one snapshot's worth, not one per root (12 bytes per parameter it writes:
        hundreds of GB per node for a 70B model). Nothing moves while ``other`` persists a
        save (its copies are being written) or for another plan or rank."""
        if (
            other is self
            or not other.done()
            or (other.plan, other.rank)
            != (
                self.plan,
                self.rank,
            )
        ):
            return
        if other._spare:
            self._spare, other._spare = other._spare, {}

    def lend_copies(self) -> dict[str, ParamState]:
        """The host copies kept for the next save, by key (``"{layer}.{param}"``), handed to
        a caller that fills them itself and gives them back to :meth:`save` (``owned``):
        the checkpointer keeps none meanwhile. None while a save is in flight (its copies
        are being written): the caller makes its own then."""
        if not self.done():
            return {}
        spare, self._spare = self._spare, {}
        return {f"{layer}.{n}": ps for layer, lp in spare.items() for n, ps in lp.items()}

    @property
    def kept_bytes(self) -> int:
        """Bytes of the host copies kept for the next save."""
        return sum(
            t.numel() * t.element_size()
            for layer in self._spare.values()
            for ps in layer.values()
            for t in (ps.weight, ps.exp_avg, ps.exp_avg_sq)
        )

    def done(self) -> bool:
        """Whether nothing is in flight (the last save is persisted, and committed on the
        committer), without blocking."""
        return self._pending is None or self._pending.done()

    def settle(self, timeout_s: float) -> bool:
        """Whether nothing is in flight, waiting up to ``timeout_s`` for the save in flight
        to end; never raises its error (``wait`` does)."""
        fut = self._pending
        if fut is None:
            return True
        futures_wait([fut], timeout=max(0.0, timeout_s))
        return fut.done()

    def wait(self) -> SaveResult | None:
        """Block until the save in flight is persisted (and committed, on the committer)."""
        if self._pending is None:
            return None
        fut, self._pending = self._pending, None
        return fut.result()

    def cancel(self) -> None:
        """Fence a save still in flight for a world that was abandoned (its peers may be
        dead; nothing waits for it): its committer writes no manifest or marker from now on
        (checked before each write that could undo another commit), so a later generation's
        commit of the same step is not interleaved with it, and it deletes the save's files
        written so far (``discard_save``: never a committed save's). A writer that is not
        the committer writes nothing more once its persist ends (or skips it if not begun)
        and deletes nothing: ranks cancel when each sees the world fail, and a committer
        not cancelled yet may be committing that save. A write already begun is not
        interrupted: a committer stalled inside its manifest write is the one window left.
        Does not block."""
        self._cancelled.set()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    # -- steps -------------------------------------------------------------------------------

    def _by_layer(self, params: Mapping[str, ParamState]) -> dict[int, dict[str, ParamState]]:
        """``params`` by layer; raises for one outside this rank's layers."""
        place = self.place
        by_layer: dict[int, dict[str, ParamState]] = {}
        for key, p in params.items():
            layer, name = split_key(key)
            if layer not in place.layers:
                raise CheckpointError(
                    f"rank {self.rank}: param {key!r} is not in its stage's layers "
                    f"{place.layers[0]}..{place.layers[-1]}"
                )
            by_layer.setdefault(layer, {})[name] = p
        return by_layer

    def _snapshot(
        self,
        by_layer: Mapping[int, Mapping[str, ParamState]],
        spare: Mapping[int, Mapping[str, ParamState]],
        failure: Exception | None = None,
        owned: bool = False,
    ) -> tuple[dict[int, dict[str, ParamState]] | None, Exception | None]:
        """Full CPU copies of the layers this rank writes (gathering TP shards as needed),
        into the previous save's copies (``spare``, persisted already) where shapes match;
        ``owned`` host tensors (``save``) are kept as they are.

        Returns ``(copies, None)``, or ``(None, failure)`` once this rank failed (``failure``
        given: before the snapshot) or, at TP > 1, a rank of its TP group did (then
        ``failure`` is None here): every rank of the group stops at the same gather."""
        place = self.place
        device = _device_of(by_layer)
        if device is not None and failure is None:
            # The copies to the host below wait for the device: wait for the training work
            # queued before them here, where an abort (SIGUSR1) is still seen.
            comm_abort.host_sync(device)
        group = self.tp_group if place.tp_size > 1 else None
        gate = _TPGate(group, device or _flag_device(group), failure)
        mine: dict[int, dict[str, ParamState]] = {}
        for layer in place.layers:
            writer = self.assignment[layer]
            if writer not in place.group_ranks:
                continue
            layer_params = by_layer.get(layer, {})
            old = spare.get(layer, {})
            if place.tp_size > 1:
                full = self._gather_layer(layer_params, writer, old, gate)
                if full is None:
                    return None, gate.failure
            elif gate.failure is not None:
                return None, gate.failure
            else:
                try:
                    full = {
                        n: p if owned and _on_host(p) else _copy_param(p, old.get(n))
                        for n, p in layer_params.items()
                    }
                except Exception as exc:  # the save's failure (module docstring)
                    return None, exc
            if writer == self.rank:
                mine[layer] = full
        if not gate.close():
            return None, gate.failure
        return mine, None

    def _gather_layer(
        self,
        lp: Mapping[str, ParamState],
        writer: int,
        old: Mapping[str, ParamState],
        gate: _TPGate,
    ) -> dict[str, ParamState] | None:
        """Gather one layer's TP-sharded tensors to ``writer``: flat messages of at most
        ``GATHER_BUCKET_BYTES`` per rank (one tensor alone if larger), each moved to the
        host before the next, so that the writer's GPU holds the TP copies of one bucket at
        a time, not of the whole layer's weights and both moments (~12 B per parameter of
        the full layer: ~10 GB for a 70B-class block).

        None once a rank of the TP group failed (``gate``): every rank of the group leaves
        at the same bucket, before its gather."""
        names = sorted(lp)
        sharded = [(n, k) for n in names for k in TENSOR_KINDS if lp[n].tp_dim is not None]
        me = self.rank == writer
        out: dict[str, dict[str, torch.Tensor]] = {}
        # Every TP rank of the group holds the same layers, hence the same ``sharded`` list
        # and the same buckets: all of them take part in each gather, or none does.
        for bucket in _buckets(sharded, lambda nk: lp[nk[0]].tensor(nk[1]).numel() * 4):
            flat: torch.Tensor | None = None
            dev_bufs: list[torch.Tensor] | None = None
            if gate.failure is None:
                try:  # the device memory of this gather, before the group agrees to run it
                    flat = _flat(lp, bucket)
                    dev_bufs = (
                        [torch.empty_like(flat) for _ in self.place.group_ranks] if me else None
                    )
                except Exception as exc:
                    gate.failure = exc
            if not gate.open() or flat is None:
                return None
            comm.gather(flat, dev_bufs, dst=writer, group=self.tp_group)
            del flat
            if dev_bufs is None:
                continue
            comm_abort.host_sync(dev_bufs[0].device)  # the gather, abortably (SIGUSR1)
            try:
                self._land(lp, bucket, dev_bufs, old, out)
            except Exception as exc:  # told to the group before its next gather
                gate.failure = exc
            del dev_bufs
        if not me or gate.failure is not None:
            return {}
        try:
            result = {}
            for n in names:
                p = lp[n]
                if p.tp_dim is None:
                    result[n] = _copy_param(p, old.get(n))
                else:
                    o = out[n]
                    result[n] = ParamState(o["weight"], o["exp_avg"], o["exp_avg_sq"], p.tp_dim)
        except Exception as exc:  # no collective follows in this layer: the save's failure
            gate.failure = exc
            return {}
        return result

    @staticmethod
    def _land(
        lp: Mapping[str, ParamState],
        bucket: Sequence[tuple[str, TensorKind]],
        dev_bufs: Sequence[torch.Tensor],
        old: Mapping[str, ParamState],
        out: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        """The gathered pieces of one bucket in host memory, joined into full tensors."""
        bufs = [_to_host(b) for b in dev_bufs]
        off = 0
        for n, k in bucket:
            t = lp[n].tensor(k)
            pieces = [b[off : off + t.numel()].view(t.shape) for b in bufs]
            dim = lp[n].tp_dim
            if dim is None:  # filtered above; this narrows the type
                raise CheckpointError(f"{n}: lost its tp_dim")
            dst = _reusable(old.get(n), k, pieces, dim)
            out.setdefault(n, {})[k] = (
                torch.cat(pieces, dim=dim, out=dst) if dst is not None else torch.cat(pieces, dim)
            )
            off += t.numel()

    def _commit(self, globals_: TrainingGlobals, save_id: str) -> CheckpointManifest:
        return commit(
            self.storage,
            step=globals_.step,
            save_id=save_id,
            writer_ranks=self.writers,
            globals_=globals_,
            model=self.plan.model,
            num_layers=self.plan.num_layers,
            plan_id=self.plan.plan_id,
            layout=layout_summary(self.plan),
            timeout_s=self.commit_timeout_s,
            cancelled=self._cancelled.is_set,
        )

    def _discard(self, step: int, save_id: str) -> None:
        """The cancelled committer's: delete its save's files (every rank's written so far:
        fenced, it commits nothing, so the save is dead; ``discard_save`` never touches a
        committed save's). A failure to delete leaves them to ``sailor ckpt gc``."""
        with contextlib.suppress(OSError, CheckpointError):
            discard_save(self.storage, step, save_id)

    def _persist(
        self,
        mine: dict[int, dict[str, ParamState]],
        globals_: TrainingGlobals,
        save_id: str,
        snapshot_s: float,
        prune_below: int = -1,
        drop_steps: tuple[int, ...] | None = None,
    ) -> SaveResult:
        t0 = time.perf_counter()
        nbytes = 0
        # The commits on disk as this save begins (before it writes anything): the only
        # ones its retention may delete as unrecorded (``unrecorded``'s docstring: one a
        # later generation commits is never among them, however late this committer runs).
        # So are the files below ``prune_below`` (``prune``'s docstring: a run that fell
        # back below it saves there, under a committer that may be this late).
        seen: dict[int, bytes] | None = None
        below: dict[int, SeenStep] | None = None
        seen_error = ""
        if self.rank == self.committer_rank and (drop_steps or prune_below >= 0):
            try:
                if drop_steps:
                    seen = committed_markers(self.storage, but=globals_.step, only=drop_steps)
                if prune_below >= 0:
                    below = seen_below(self.storage, min(prune_below, globals_.step))
            except (OSError, CheckpointError) as exc:
                seen_error = f"listing the commits before the save: {type(exc).__name__}: {exc}"
        if mine and not self._cancelled.is_set():
            part = persist_layers(
                self.storage, globals_.step, save_id, mine, rank=self.rank, scratch=self._scratch
            )
            nbytes = sum(s.size for s in part.shards)
        if self._cancelled.is_set() and self.rank != self.committer_rank:
            # Nobody here waits for it; its files stay: ranks cancel when each sees the
            # failure, and a committer not cancelled yet may be committing this very save
            # (its files are the committer's to discard, or gc's).
            raise SaveCancelledError(f"step {globals_.step} save {save_id}: cancelled")
        t1 = time.perf_counter()
        manifest = None
        t2 = t1
        retention_error = readback_error = ""
        readback_s, unchecked = 0.0, 0
        unrecorded: list[int] = []
        if self.rank == self.committer_rank:
            try:
                manifest = self._commit(globals_, save_id)
            except SaveCancelledError:
                self._discard(globals_.step, save_id)
                raise
            t2 = time.perf_counter()
            # Nothing older goes while the new commit does not read back: after in-place
            # reconfigurations no step left on disk may ever have been read.
            readback_error, readback_s, unchecked = self._read_back(
                globals_.step, prune_below, bool(seen)
            )
            # Retention, the controller's prune and the deletion of unrecorded commits each
            # run whatever the others meet: one older step that cannot be judged or deleted
            # must not stop every later deletion and fill the disk. The step is committed
            # whatever they meet: a failed deletion (StorageError, OSError), a step spared
            # (CorruptCheckpointError, not debris) or a bug in judging one is reported, never
            # a failed save.
            errors = [seen_error]
            if not readback_error:
                below_step = min(prune_below, globals_.step)
                if self.keep is not None:
                    keep = self.keep
                    errors.append(
                        _reported(
                            lambda: apply_retention(
                                self.storage, keep=keep, committed_step=globals_.step
                            ),
                            globals_.step,
                        )
                    )
                if below is not None:
                    seen_below_it = below
                    errors.append(
                        _reported(
                            lambda: apply_seen_prune(
                                self.storage,
                                seen_below_it,
                                below_step=below_step,
                                committed_step=globals_.step,
                                cancelled=self._cancelled.is_set,
                            ),
                            globals_.step,
                        )
                    )
                if seen and drop_steps:
                    try:
                        unrecorded = apply_unrecorded(
                            self.storage,
                            seen,
                            drop_steps=drop_steps,
                            committed_step=globals_.step,
                            below_step=below_step,
                            cancelled=self._cancelled.is_set,
                        )
                    except (OSError, ValueError, CheckpointError) as exc:
                        errors.append(_deleting(globals_.step, exc))
            retention_error = "; ".join(e for e in errors if e)
        return SaveResult(
            step=globals_.step,
            save_id=save_id,
            rank=self.rank,
            layers_written=tuple(sorted(mine)),
            bytes_written=nbytes,
            snapshot_s=snapshot_s,
            persist_s=t1 - t0,
            commit_s=t2 - t1,
            retention_s=time.perf_counter() - t2 if manifest is not None else 0.0,
            manifest=manifest,
            retention_error=retention_error,
            readback_error=readback_error,
            readback_s=readback_s,
            readback_unchecked=unchecked,
            unrecorded_deleted=tuple(unrecorded),
        )

    def _read_back(
        self, step: int, prune_below: int, unrecorded: bool = False
    ) -> tuple[str, float, int]:
        """Before retention deletes anything: ``(why the commit of step did not read back
        or '', seconds, shards with no block checked)`` (``readback.read_back``; not read
        when nothing would be deleted). Whatever the read-back raises (a backend's error
        that ``read_back`` did not turn into a problem, a bug) is its failure too, never
        the save's: the step is committed already."""
        if self.keep is None and prune_below < 0 and not unrecorded:
            return "", 0.0, 0
        t0 = time.perf_counter()
        try:
            # the module's budget read at each call (a test may lower it)
            rb = read_back(self.storage, step, budget_bytes=readback.READBACK_BYTES)
        except Exception as exc:
            return (
                f"step {step} was committed but reading it back raised, so no older "
                f"checkpoint was deleted: {type(exc).__name__}: {exc}",
                time.perf_counter() - t0,
                0,
            )
        if rb.ok:
            return "", rb.seconds, rb.unchecked
        why = "; ".join(rb.problems[:3]) + (
            f" (and {len(rb.problems) - 3} more)" if len(rb.problems) > 3 else ""
        )
        return (
            f"step {step} was committed but does not read back, so no older checkpoint "
            f"was deleted: {why}",
            rb.seconds,
            rb.unchecked,
        )


def agree_save_start(failure: BaseException | None) -> tuple[str, bool]:
    """``(save id, some rank failed)`` at the start of a save: rank 0's new id and whether
    any rank's save failed before it began. The save's first collective (one object
    all-gather over the world): every rank enters it, failed or not, and then all of them
    snapshot or none does. Without a process group: a new id and this rank's own."""
    mine = uuid.uuid4().hex[:12]
    if not (dist.is_available() and dist.is_initialized()):
        return mine, failure is not None
    got: list[Any] = [None] * dist.get_world_size()
    comm.all_gather_object(got, (mine if dist.get_rank() == 0 else "", failure is not None))
    got = [expect(g, (str, bool), r, "its save id and failure flag") for r, g in enumerate(got)]
    return str(got[0][0]), any(bool(g[1]) for g in got)


class _TPGate:
    """Whether a save's TP group goes on to its next gather: one 1-element all-reduce MAX of
    "this rank failed" over the group before each gather (after the rank's own device
    allocations for it), so that a failure on one rank stops every rank of the group at the
    same collective. At TP = 1 (no group) there is no gather and no agreement.

    The flag is a device tensor (NCCL); reading it is a host sync per gather, on the save's
    path only (the writer syncs there anyway to copy the pieces to the host). :meth:`close`
    agrees once more at the end of the snapshot: a rank that failed before its first gather
    still meets its group at one collective whatever the others' bucket count, and a
    writer's failure after the last gather (landing its pieces on the host) stops every
    rank of the group too. Before, no agreement followed the last gather: such a failure
    ended the writer's save alone, and its peers went on to persist theirs. One more small
    all-reduce per save."""

    def __init__(self, group: Any, device: torch.device | None, failure: Exception | None) -> None:
        self.group, self.failure = group, failure
        self.device = device or torch.device("cpu")
        self.agreed = 0

    def open(self) -> bool:
        """Agree the group's failures (collective over the group); True: gather."""
        if self.group is None:
            return self.failure is None
        self.agreed += 1
        # filled on the device, not copied from the host: a pageable copy waits in C for the
        # stream (the previous gather's NCCL work), where a dead writer holds it and the
        # in-place abort's signal cannot reach the host (``sailor.comm.device_copy``)
        flag = torch.full(
            (1,), int(self.failure is not None), dtype=torch.int64, device=self.device
        )
        comm.all_reduce(flag, op="max", group=self.group)
        if flag.is_meta:  # a shape-only dry run: nothing failed that it could tell
            return self.failure is None
        comm_abort.host_sync(flag.device)
        return not int(flag.item())

    def close(self) -> bool:
        """At the end of the snapshot: agree once more (see the class); True: go on."""
        if self.group is None:
            return self.failure is None
        return self.open()


def _failed(exc: Exception) -> Future[SaveResult]:
    """A save that failed before its persist: done, its result the error."""
    fut: Future[SaveResult] = Future()
    fut.set_exception(exc)
    return fut


def _device_of(by_layer: Mapping[int, Mapping[str, ParamState]]) -> torch.device | None:
    for params in by_layer.values():
        for p in params.values():
            return p.tensor("weight").device
    return None


def _flag_device(group: Any) -> torch.device | None:
    """Where the TP gate's flag goes when the rank holds no parameter to take the device
    from (its save failed before it had them: ``by_layer`` empty): the current CUDA device
    under NCCL, whose collectives take CUDA tensors only (a flag on the host raised on that
    rank and left its peers waiting in the all-reduce), else the host (None)."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if str(dist.get_backend(group)) != "nccl":
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _flat(lp: Mapping[str, ParamState], bucket: Sequence[tuple[str, TensorKind]]) -> torch.Tensor:
    """One rank's message of a TP gather: the bucket's shards, flat, on their device."""
    return torch.cat([lp[n].tensor(k).detach().reshape(-1) for n, k in bucket])


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory (the tensor itself if it is there already).

    A meta tensor (shape-only dry runs of the save under ``sailor.comm.strict``) has no data
    to copy: its host copy is an uninitialised buffer of its shape.
    """
    if t.is_meta:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return t.to("cpu")


def _cpu_copy(t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    # A real copy even on CPU: training mutates its tensors in place after the snapshot.
    if t.is_meta:
        return into if into is not None and into.shape == t.shape else _to_host(t)
    if into is not None and into.shape == t.shape and into.dtype == t.dtype:
        return into.copy_(t.detach())
    return t.detach().to("cpu", copy=True)


def _on_host(p: ParamState) -> bool:
    """Whether every tensor of ``p`` holds its data in host memory (not a meta tensor)."""
    return all(p.tensor(k).device.type == "cpu" for k in TENSOR_KINDS)


def _copy_param(p: ParamState, old: ParamState | None) -> ParamState:
    if old is None:
        return p.map(_cpu_copy)
    w, a, b = (_cpu_copy(p.tensor(k), old.tensor(k)) for k in TENSOR_KINDS)
    return ParamState(w, a, b, p.tp_dim)


def _reusable(
    old: ParamState | None, kind: str, pieces: list[torch.Tensor], dim: int
) -> torch.Tensor | None:
    """The previous save's full tensor if it has the shape the gathered pieces make."""
    if old is None:
        return None
    t: torch.Tensor = getattr(old, kind)
    shape = list(pieces[0].shape)
    shape[dim] = sum(x.shape[dim] for x in pieces)
    return t if list(t.shape) == shape and t.dtype == pieces[0].dtype else None


def load_for_rank(
    storage: Storage,
    plan: Plan,
    rank: int,
    *,
    step: int | None = None,
    tp_dims: Mapping[str, int | None] | None = None,
    into: Mapping[str, ParamState] | None = None,
) -> Loaded:
    """Load exactly the layers ``rank`` owns under ``plan``, sliced for its TP rank
    (into the caller's tensors where ``into`` has them; see ``reader.load``)."""
    place = place_of(plan, rank)
    return load(
        storage,
        place.layers,
        tp_rank=place.tp_rank,
        tp_size=place.tp_size,
        step=step,
        tp_dims=tp_dims,
        into=into,
    )


GATHER_BUCKET_BYTES = 256 << 20
"""Bytes of one rank's flat message in a checkpoint's TP gather (the writer's GPU holds the
TP degree times this at once)."""


_T = TypeVar("_T")


def _buckets(items: Sequence[_T], size: Callable[[_T], int]) -> list[list[_T]]:
    """``items`` in order, cut into runs of at most ``GATHER_BUCKET_BYTES`` (an item larger
    than that alone)."""
    out: list[list[_T]] = []
    used = 0
    for it in items:
        b = size(it)
        if not out or (used and used + b > GATHER_BUCKET_BYTES):
            out.append([])
            used = 0
        out[-1].append(it)
        used += b
    return out


def _deleting(step: int, exc: Exception) -> str:
    """A retention's failure as the save reports it."""
    return f"deleting checkpoints older than step {step}: {type(exc).__name__}: {exc}"


def _reported(delete: Callable[[], object], step: int) -> str:
    """Run one of a committer's deletions; why it failed ('' when it did not)."""
    try:
        delete()
    except (OSError, ValueError, CheckpointError) as exc:
        return _deleting(step, exc)
    return ""
