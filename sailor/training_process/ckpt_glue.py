"""Glue between a rank's trainer and the layer-keyed checkpoints of ``sailor.checkpoint``.

- :func:`trainer_params`: the rank's parameters with both AdamW moments as ``ParamState``,
  keyed ``"{global_layer}.{param_name}"`` (what ``Checkpointer.save`` takes);
- :func:`restore_trainer`: the layers this rank owns under *its* plan (or a subset of them:
  what an in-place relayout could not get from a live rank), read from a checkpoint saved
  under any layout and sliced for its TP rank, copied into the live parameters, with the
  AdamW moments and step count restored;
- :class:`LayerCheckpointIO`: the worker's ``CheckpointIO`` on top of those: an async save at
  the iteration boundary (snapshot on the caller's thread, persist on a background thread;
  each layer is written once across replicas, the manifest is committed by rank 0), and
  resume at the checkpoint's step and data position.

The AdamW step count is the global iteration minus the iterations skipped for an fp16
overflow (``Trainer.adam_step``); a save checks that every parameter's count is that one and
refuses otherwise. The globals carry it (``adam_step``), the skipped count and the loss
scale and the non-finite streak under way (``Trainer.scaling_state``), so a resumed fp16 run
continues its scale instead of starting over at 2**16 (and skipping steps again), and a run
saved inside a streak of non-finite skips continues it. Never imports NATS, etcd or the agent:
it is called inside a worker process.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from sailor.checkpoint import (
    Checkpointer,
    ParamState,
    TrainingGlobals,
    agree_save_start,
    load,
    load_for_rank,
    open_storage,
    read_manifest,
)
from sailor.checkpoint.buffers import ScratchPool
from sailor.checkpoint.data_fit import check_data_fit
from sailor.checkpoint.errors import AbandonedWriteError, SaveSkippedError
from sailor.checkpoint.fit import check_fit
from sailor.checkpoint.mounts import Mount, read_mounts, same_storage
from sailor.megatron_patch.data import identity_of
from sailor.megatron_patch.engine import Trainer
from sailor.megatron_patch.model import shard
from sailor.megatron_patch.state import key_layer, optimizer_state, stage_state
from sailor.megatron_patch.tp_layers import tp_dim_of
from sailor.megatron_patch.vocab_parallel import pad_rows, padded_vocab
from sailor.schemas.checkpoint import CheckpointManifest
from sailor.schemas.data_identity import DataIdentity, describe_differences
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan

T = TypeVar("T")

__all__ = [
    "CheckpointSaves",
    "LayerCheckpointIO",
    "check_model_fit",
    "check_resumed_data",
    "pad_vocab_rows",
    "restore_trainer",
    "trainer_params",
    "unpadded_vocab",
]


def trainer_params(tr: Trainer) -> dict[str, ParamState]:
    """This rank's weights and AdamW moments, layer-keyed, with their TP dims."""
    opt = optimizer_state(tr.stage, tr.optimizer)
    out: dict[str, ParamState] = {}
    for key, (t, dim) in stage_state(tr.stage).items():
        if key not in opt:
            zeros = torch.zeros_like(t)
            out[key] = ParamState(t, zeros, zeros.clone(), dim)
        else:
            out[key] = ParamState(t, opt[key]["exp_avg"], opt[key]["exp_avg_sq"], dim)
    return out


def restore_trainer(
    tr: Trainer, root: str, step: int, layers: Collection[int] | None = None
) -> None:
    """Load the layers ``tr`` owns (or only ``layers`` of them) from the committed
    checkpoint ``step`` under ``root``.

    On CPU with fp32 parameters the weights are read straight into the parameters and the
    Adam moments into new tensors that become the optimizer's state (no second copy); other
    parameters (CUDA, lower precision) are loaded first and copied over. ``layers`` (the
    layers no live rank holds at an in-place relayout) reads just those layers' blocks.
    """
    if layers is not None:
        unknown = set(layers) - set(tr.role.layers)
        if unknown:
            raise ValueError(f"layers {sorted(unknown)} are not on rank {tr.role.rank}")
    wanted = set(tr.role.layers if layers is None else layers)
    if not wanted:
        return
    params = [(k, p) for k, p in tr.stage.keyed_parameters() if key_layer(k) in wanted]
    dims = {k: d for k, (_t, d) in stage_state(tr.stage).items() if key_layer(k) in wanted}
    storage = open_storage(root)
    manifest = read_manifest(storage, step)  # once, for the two checks before the load
    unpadded = unpadded_vocab(tr.stage.spec, manifest, wanted)
    where = f"{storage.url.rstrip('/')} step {step}"
    check_model_fit(
        manifest,
        where,
        params,
        tp_size=tr.role.tp,
        num_layers=tr.plan.num_layers,
        unpadded=unpadded,
        vocab_size=tr.stage.spec.vocab_size,
    )
    current = identity_of(tr.data)
    tr.data_changes = check_resumed_data(
        manifest, where, current, tr.cfg.allow_data_change, tr.role.rank
    )
    for key in unpadded:  # read whole, then padded and sliced here
        dims[key] = None
    into = _destinations(tr, dims, skip=unpadded)
    if layers is None:
        got = load_for_rank(storage, tr.plan, tr.role.rank, step=step, tp_dims=dims, into=into)
    else:
        got = load(
            storage,
            sorted(wanted),
            tp_rank=tr.role.tp_rank,
            tp_size=tr.role.tp,
            step=step,
            tp_dims=dims,
            into=into,
        )
    extra = got.globals.extra
    saved_seed = extra.get("seed")
    # a checkpoint that records its data compared the seed with it before the read (and
    # allow_data_change may have accepted another)
    compared = manifest.data is not None and current is not None
    seed_differs = saved_seed is not None and int(saved_seed) != tr.cfg.seed
    if not compared and layers is None and seed_differs:
        # the data order (and dropout) follow the seed: another one would silently train on
        # other samples than the run being resumed
        raise ValueError(
            f"checkpoint {step} under {root} was trained with seed={saved_seed}, this run has "
            f"seed={tr.cfg.seed}: resume with the same seed, or start a new run"
        )
    for key in unpadded:
        got.params[key] = pad_vocab_rows(
            got.params[key], tr.stage.spec.vocab_size, tr.stage.tp.size, tr.stage.tp.rank
        )
    adam_step = float(extra.get("adam_step", got.globals.step))
    if layers is None:  # a whole restore: the run continues from the checkpoint's state
        tr.load_scaling_state(
            {
                "skipped_steps": extra.get("skipped_steps", got.globals.step - int(adam_step)),
                "loss_scale": extra.get("loss_scale"),
                "nonfinite": extra.get("nonfinite"),  # a streak under way at the save
                "precision": extra.get("precision"),  # refused if not this run's
            }
        )
    with torch.no_grad():
        for key, p in params:
            ps = got.params[key]
            if ps.weight.data_ptr() != p.data_ptr():
                p.copy_(ps.weight.to(p.device, p.dtype))
            if adam_step <= 0:
                continue
            owned = into is not None  # the moments were read into tensors of our own
            tr.optimizer.state[p] = {
                "step": torch.tensor(adam_step),
                "exp_avg": ps.exp_avg if owned else ps.exp_avg.to(p.device).clone(),
                "exp_avg_sq": ps.exp_avg_sq if owned else ps.exp_avg_sq.to(p.device).clone(),
            }


def check_resumed_data(
    manifest: CheckpointManifest,
    where: str,
    current: DataIdentity | None,
    allow_change: bool,
    rank: int,
) -> str:
    """Refuse the checkpoint of ``manifest`` before anything is read if it was trained on
    other data than ``current`` (``data_fit.check_data_fit``: ``DataMismatchError``, a
    configuration error naming each field with both values), unless ``allow_change`` (the
    training config's ``allow_data_change``): then rank 0 logs what changed, which is
    returned ('' when nothing did). Before, a run resumed on another corpus went on
    counting samples over it, silently."""
    changes = check_data_fit(manifest, current, allow_change=allow_change, where=where)
    said = describe_differences(changes)
    if changes and rank == 0:
        print(
            f"checkpoint {where}: resumed on other data than it was trained on "
            f"(allow_data_change): {said}",
            file=sys.stderr,
            flush=True,
        )
    return said


def check_model_fit(
    manifest: CheckpointManifest,
    where: str,
    params: Iterable[tuple[str, torch.Tensor]],
    *,
    tp_size: int,
    num_layers: int,
    unpadded: Collection[str] = (),
    vocab_size: int = 0,
) -> None:
    """Refuse the checkpoint of ``manifest`` (``where``: its root and step, for the message)
    before anything is read unless its layers hold exactly
    ``params`` (this rank's, keyed ``"<layer>.<param>"``: their layers are checked) at their
    full shapes (``fit.check_fit``: ``ModelMismatchError``, a configuration error naming
    each difference). ``unpadded`` (:func:`unpadded_vocab`): stored with ``vocab_size``
    rows, padded after the read. Before, another model's checkpoint failed on a ``KeyError``
    naming one key, or a torch size error on a GPU, or loaded what matched and dropped the
    rest."""
    shapes: dict[str, tuple[int, ...]] = {}
    for key, p in params:
        shape = list(p.shape)
        dim = tp_dim_of(p)
        if key in unpadded:
            shape[0] = vocab_size
        elif dim is not None:
            shape[dim] *= tp_size
        shapes[key] = tuple(shape)
    check_fit(manifest, shapes, num_layers=num_layers, where=where)


def unpadded_vocab(spec: ModelSpec, manifest: CheckpointManifest, wanted: set[int]) -> set[str]:
    """The vocabulary matrices (embedding, LM head) of the layers ``wanted`` that the
    checkpoint of ``manifest`` stores with ``vocab_size`` rows: saved before the engine
    padded the vocabulary (and split it over TP ranks). Read them whole (no TP dim) and pad them
    (:func:`pad_vocab_rows`). The DeepSpeed adapter's IO restores through it too."""
    if padded_vocab(spec.vocab_size) == spec.vocab_size:
        return set()  # the padded shape is the old shape: the reader slices it as it is
    head = spec.num_all_layers - 1
    names = {"0.wte.weight", f"{head}.lm_head.weight"}
    out: set[str] = set()
    for layer in sorted(wanted & {0, head}):
        for t in manifest.shard_of(layer).tensors:
            key = f"{t.layer}.{t.param}"
            if key in names and t.kind == "weight" and t.shape[0] == spec.vocab_size:
                out.add(key)
    return out


def pad_vocab_rows(
    ps: ParamState, vocab_size: int, tp_size: int = 1, tp_rank: int = 0
) -> ParamState:
    """A whole unpadded vocabulary matrix (weight and moments) as TP rank ``tp_rank``'s shard
    of the padded one (zero rows appended)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        return shard(pad_rows(t, vocab_size), 0, tp_size, tp_rank).clone()

    return ParamState(one(ps.weight), one(ps.exp_avg), one(ps.exp_avg_sq), 0)


def _destinations(
    tr: Trainer, dims: dict[str, int | None], skip: Collection[str] = ()
) -> dict[str, ParamState] | None:
    """Where a load may write directly: the parameters themselves and fresh moment tensors,
    if every parameter is a contiguous fp32 CPU tensor (what the checkpoint stores)."""
    out: dict[str, ParamState] = {}
    for key, p in tr.stage.keyed_parameters():
        if key not in dims or key in skip:
            continue
        if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
            return None
        w = p.detach()
        out[key] = ParamState(w, torch.empty_like(w), torch.empty_like(w), dims[key])
    return out


ABANDONED_WAIT_S = 2.0
"""How long a save waits for this rank's write of an abandoned save to end before it is
skipped, or refused if required under a root on the same storage
(``CheckpointSaves._refuse_while_abandoned_writes``). An abandoned committer, fenced, ends
within its commit poll (20 ms) and a writer's write of a healthy disk within the save's own
persist time; a hung mount never: this bounds what it costs training at each save."""

MOUNTS_WAIT_S = 1.0
"""How long a save waits for the mount table (``mounts.read_mounts``, on a thread) before it
judges by the last one read. The kernel answers in a millisecond, unless an unmount of a hung
mount is stuck holding the namespace's lock: the save must not stick there with it."""


def _in_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """``fn()`` on a daemon thread of its own (one stuck in the kernel never holds the
    interpreter's exit), its result in the future returned."""
    fut: Future[T] = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as exc:  # the caller's to judge
            fut.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


def _close_quietly(ck: Checkpointer) -> None:
    """Close a checkpointer whose save is over (it does not block): its failure was
    reported when the save was abandoned, or its world is gone."""
    with contextlib.suppress(Exception):
        ck.close()


class CheckpointSaves:
    """The save side of a checkpoint IO, whatever trains: one ``Checkpointer`` per
    (checkpoint root, retention), the save in flight and a failure from before it began.
    :class:`LayerCheckpointIO` (Sailor's engine) and the DeepSpeed adapter's IO
    (``deepspeed_glue``) save through it, so both write the same format."""

    def __init__(
        self, keep: int | None = None, mounts: Callable[[], Sequence[Mount]] = read_mounts
    ) -> None:
        self.keep = keep
        self._read_mounts = mounts
        """Reads the process's mount table (``mounts.read_mounts``), which tells which
        roots share a storage (:meth:`_refuse_while_abandoned_writes`)."""
        self._mounts: Sequence[Mount] | None = None
        """The table as last read (:meth:`_fresh_mounts`: at every save, bounded)."""
        self._mounts_read: Future[Sequence[Mount]] | None = None
        """The table's read under way, or the last one: one at a time (a stuck read holds
        one thread, not one per save)."""
        # one per (root, retention): a save's ``keep`` is its own, not the first save's
        self._by_root: dict[tuple[str, int | None], Checkpointer] = {}
        # the stored-layout copies' buffers, shared by every root's checkpointer
        self._scratch = ScratchPool()
        self._in_flight: Checkpointer | None = None
        self._failure: Exception | None = None
        """A save that failed here before it began (``save``): raised by ``wait``."""
        self._abandoned: list[tuple[str, Checkpointer]] = []
        """Checkpointers of abandoned saves (``abandon``) with their roots, whose own write
        may still run: a save takes their host copies once it ended; a save waits for it a
        moment (``ABANDONED_WAIT_S``), then an optional one is skipped while it runs, a
        required one under a root on the same storage refused, a required one under another
        storage takes copies of its own (:meth:`_refuse_while_abandoned_writes`). Kept
        across ``reset`` and ``close`` while the write runs."""

    def _checkpointer(
        self, plan: Plan, rank: int, tp_group: Any, root: str, keep: int | None
    ) -> Checkpointer:
        kept = self.keep if keep is None else keep
        ck = self._by_root.get((root, kept))
        if ck is None:
            ck = Checkpointer(
                open_storage(root),
                plan,
                rank,
                keep=kept,
                tp_group=tp_group,
                scratch=self._scratch,
            )
            self._by_root[(root, kept)] = ck
        for entry in [a for a in self._abandoned if a[1].done()]:
            # An abandoned save whose own write on this rank has ended: its host copies are
            # reused (a new checkpointer would allocate a second snapshot's worth, 12 bytes
            # per parameter). One still writing here keeps its copies: an optional save was
            # refused before (``_refuse_while_abandoned_writes``), and so was a required one
            # on its storage; a required one on another storage allocates.
            old = entry[1]
            _close_quietly(old)
            ck.take_buffers(old)
            self._abandoned.remove(entry)
        for other in self._by_root.values():  # one snapshot's host copies per process
            ck.take_buffers(other)
        return ck

    def save(
        self,
        state: Callable[[], tuple[dict[str, ParamState], TrainingGlobals]],
        plan: Plan,
        rank: int,
        tp_group: Any,
        root: str,
        keep: int | None = None,
        prune_below: int = -1,
        optional: bool = False,
        owned: bool = False,
        drop_steps: tuple[int, ...] | None = None,
    ) -> float:
        """Save what ``state()`` returns (this rank's layer-keyed weights and moments, the
        job's globals) under ``root``: ``CheckpointIO.save``. While this rank still writes
        an abandoned save (:meth:`_refuse_while_abandoned_writes`), an ``optional`` save is
        skipped, a required one on that save's storage refused, and a required one on
        another storage (a reconfiguration's, whose failure would send the job back to an
        older commit) goes ahead in copies of its own for as long as that write runs. ``owned``:
        ``state`` made host copies for this save (e.g. filling the ones :meth:`lend_copies`
        lent), handed to the checkpointer as they are (``Checkpointer.save``): one host copy
        per save, not two."""
        # A failure here (``state``'s checks, opening the storage: its directory) is the
        # save's, as one inside ``Checkpointer.save``: this rank still enters the save's
        # first collective (``agree_save_start``), where every rank learns that a save failed
        # before it began and none snapshots; ``wait`` raises it (the worker's save poll
        # agrees it). Raising here left the other ranks in that collective.
        failure: Exception | None = None
        self._fresh_mounts()  # which roots share a storage with a write still running
        try:
            self._refuse_while_abandoned_writes(root, optional, rank)
            params, g = state()
            ck = self._checkpointer(plan, rank, tp_group, root, keep)
        except Exception as exc:  # raised by wait(), once agreed
            failure = exc
        if failure is not None:
            agree_save_start(failure)
            self._in_flight, self._failure = None, failure
            return 0.0
        self._in_flight = ck
        return ck.save(params, g, prune_below=prune_below, owned=owned, drop_steps=drop_steps)

    def _fresh_mounts(self) -> None:
        """Read the mount table again into ``_mounts``, on a thread, waited
        ``MOUNTS_WAIT_S`` at most; past it (or failing) the last table read stays, and the
        read goes on: the next save takes its result if it has ended by then. Read at every
        save, not kept from one while no write was tracked: an
        automounter (``autofs``, ``/net/<server>``) mounts a server at its first use, after
        such a read, and a table without it took every server there for one."""
        if self._mounts_read is None or self._mounts_read.done():
            self._mounts_read = _in_thread(self._read_mounts, "sailor-mountinfo")
        try:
            self._mounts = self._mounts_read.result(timeout=MOUNTS_WAIT_S)
        except TimeoutError:
            print(
                f"checkpoint: the mount table did not answer within {MOUNTS_WAIT_S:g} s:"
                " roots judged by the one read before",
                file=sys.stderr,
                flush=True,
            )
        except Exception as exc:  # a reader's own failure: the last table stays
            print(f"checkpoint: the mount table unread: {exc!r}", file=sys.stderr, flush=True)

    def lend_copies(
        self, plan: Plan, rank: int, tp_group: Any, root: str, keep: int | None = None
    ) -> dict[str, ParamState]:
        """The host copies the next save under ``root`` may fill itself and hand back
        (``save``'s ``owned``), by key: the last save's (``Checkpointer.lend_copies``), none
        while it is in flight or if its checkpointer cannot be had (``save`` then fails
        alike)."""
        try:
            return self._checkpointer(plan, rank, tp_group, root, keep).lend_copies()
        except Exception:  # the save's own failure, raised by save's path
            return {}

    def _refuse_while_abandoned_writes(self, root: str, optional: bool, rank: int) -> None:
        """Refuse a save while this rank's write of an abandoned save still runs after
        ``ABANDONED_WAIT_S`` (never waits longer: a write on a hung mount may never end):

        - an optional save, whatever the roots: ``SaveSkippedError``. Its host copies are not
          back, and a snapshot now would hold a second snapshot's worth of host memory (12
          bytes per parameter the rank writes: hundreds of GB per node at 70B);
        - a required save under a root on the same storage (``mounts.same_storage``: the
          same root, another directory of one mounted file system or of one NFS/CIFS
          server, the same bucket; judged from the mount table read again at this save,
          or the last one read if it does not answer in ``MOUNTS_WAIT_S``
          (:meth:`_fresh_mounts`), never a ``stat``, which would hang on a hung mount too):
          ``AbandonedWriteError``. That storage is not known good: a write there has not
          ended in a save's interval, and a new one would most likely hang the same way, in
          a wait that never ends (the hold's save has only the controller's deadline; every
          rank would wait); failing now names the cause, and the job goes back to its last
          commit;
        - a required save on another storage goes ahead in copies of its own: failing it
          would cost the job its progress since the last commit (the reconfiguration's
          save), a certain loss against host memory that may be there, for a write elsewhere
          that is merely slow.

        The refusal is the save's failure before it began (agreed by every rank in the
        save's first collective, none snapshots): an optional one is reported and training
        goes on, a required one fails the ranks."""
        deadline = time.monotonic() + ABANDONED_WAIT_S
        for old_root, old in self._abandoned:
            if not optional and not same_storage(old_root, root, self._mounts or ()):
                continue
            if old.settle(deadline - time.monotonic()):
                continue
            gb = old.kept_bytes / 1e9
            running = (
                f"its write of an abandoned save under {old.storage.url} still runs after "
                f"{ABANDONED_WAIT_S:.0f} s (a hung or slow mount?)"
            )
            if not optional:
                raise AbandonedWriteError(
                    f"required save under {root} refused on rank {rank}: {running}; the "
                    "same storage is not known good, and a write there would most likely "
                    "hang the same way (check the mount of this node)"
                )
            raise SaveSkippedError(
                f"save under {root} skipped on rank {rank}: {running}, and its host "
                f"copies ({gb:.2f} GB) are not back; a snapshot now would hold a second "
                "snapshot's worth of host memory"
            )

    def done(self) -> bool:
        """The save in flight is over (an abandoned save's write is not waited for)."""
        return self._failure is not None or self._in_flight is None or self._in_flight.done()

    def wait(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if self._in_flight is not None:
            ck, self._in_flight = self._in_flight, None
            res = ck.wait()
            for why in (res.readback_error, res.retention_error) if res is not None else ():
                if why:
                    print(f"checkpoint retention: {why}", file=sys.stderr, flush=True)
            if res is not None and res.unrecorded_deleted:
                print(
                    f"checkpoint retention of step {res.step}: deleted step(s) "
                    f"{list(res.unrecorded_deleted)}, committed by saves the controller "
                    "gave up on (the save's drop_steps)",
                    file=sys.stderr,
                    flush=True,
                )
            if res is not None and res.readback_unchecked:
                print(
                    f"checkpoint read-back of step {res.step}: {res.readback_unchecked} "
                    "shard(s) had no block checked (none fit in the read-back's budget); "
                    "only their sizes were",
                    file=sys.stderr,
                    flush=True,
                )

    @property
    def kept_bytes(self) -> int:
        """Host bytes the checkpointers keep for their next saves (one snapshot's worth,
        whatever the number of roots: ``Checkpointer.take_buffers``)."""
        return sum(ck.kept_bytes for ck in self._by_root.values())

    def abandon(self) -> None:
        """Drop the save in flight without waiting (``SaveIO.abandon``): its checkpointer is
        fenced (``Checkpointer.cancel``: a committer waiting for a part that never comes
        writes nothing and ends) and set aside, so the next save under its root starts a
        new one, taking the abandoned one's host copies once this rank's own write of it has
        ended (``_checkpointer``); an optional save while that write still runs is skipped
        (``_refuse_while_abandoned_writes``), a required one refused on its storage and
        taking copies of its own on another. The other roots' checkpointers stay."""
        ck, self._in_flight, self._failure = self._in_flight, None, None
        if ck is None:
            return
        ck.cancel()
        roots = [k[0] for k, v in self._by_root.items() if v is ck]
        self._by_root = {k: v for k, v in self._by_root.items() if v is not ck}
        self._abandoned.append((roots[0] if roots else ck.storage.url, ck))

    def reset(self) -> None:
        """The world was abandoned (a held worker goes on in place, in a new world): every
        save of it still running on this rank (the one in flight, which may wait on dead
        peers: the committer polls for their parts; and any abandoned before) is fenced so
        that it commits nothing (a later generation may commit the same step meanwhile),
        left to end on its own, and kept tracked: this rank's own write of it may still
        run (a hung mount), and the next world's saves meet the same rules as before the
        reset (:meth:`_refuse_while_abandoned_writes`): an optional one skipped, a required
        one under its storage refused, under another storage taking copies of its own.
        Before, the reset forgot them, and the next world's required save went ahead into
        the hung mount, bounded only by the controller's CHECKPOINT deadline. A save whose
        write has ended is dropped here with its host copies (the next world's plan may
        differ; its checkpointers allocate their own)."""
        running = list(self._abandoned)
        by_root = [(k[0], ck) for k, ck in self._by_root.items()]
        if self._in_flight is not None and all(ck is not self._in_flight for _, ck in by_root):
            by_root.append((self._in_flight.storage.url, self._in_flight))
        for root, ck in by_root:
            ck.cancel()  # fenced even if done: a no-op then
            running.append((root, ck))
        self._in_flight, self._failure = None, None
        self._by_root.clear()
        self._abandoned = []
        for root, ck in running:
            if ck.done():
                _close_quietly(ck)
            else:
                self._abandoned.append((root, ck))

    def close(self) -> None:
        """Wait for the save in flight (its failure raised) and close the checkpointers.
        An abandoned save whose write on this rank still runs is not waited for: it stays
        tracked (fenced already), so a later save of this process (in place, the next
        generation's) meets the same rules, and it is dropped once its write has ended.
        Before, closing waited for it: a write hung on a mount held an in-place worker
        that had stopped, its step durable, from ever reporting ``held``."""
        self.wait()
        ended = [entry for entry in self._abandoned if entry[1].done()]
        self._abandoned = [entry for entry in self._abandoned if not entry[1].done()]
        for _, old in ended:
            _close_quietly(old)
        for ck in self._by_root.values():
            ck.close()
        self._by_root.clear()


class LayerCheckpointIO:
    """``CheckpointIO`` of the worker, backed by one ``Checkpointer`` per checkpoint root."""

    def __init__(self, keep: int | None = None) -> None:
        self._saves = CheckpointSaves(keep)

    @property
    def keep(self) -> int | None:
        return self._saves.keep

    def position(self, root: str, step: int) -> tuple[int, int]:
        m = read_manifest(open_storage(root), step)
        return m.step, m.consumed_samples

    def restore(self, trainer: Trainer, root: str, step: int) -> None:
        restore_trainer(trainer, root, step)

    def restore_layers(self, trainer: Trainer, root: str, step: int, layers: list[int]) -> None:
        restore_trainer(trainer, root, step, layers)

    def save(
        self,
        trainer: Trainer,
        root: str,
        keep: int | None = None,
        prune_below: int = -1,
        optional: bool = False,
        drop_steps: tuple[int, ...] | None = None,
    ) -> float:
        def state() -> tuple[dict[str, ParamState], TrainingGlobals]:
            opt = optimizer_state(trainer.stage, trainer.optimizer)
            steps = {s["step"] for s in opt.values()}
            if opt and steps != {trainer.adam_step}:
                raise RuntimeError(
                    f"AdamW steps {sorted(steps)} != iteration {trainer.step} minus "
                    f"{trainer.skipped_steps} skipped"
                )
            extra: dict[str, Any] = {
                "adam_step": trainer.adam_step,
                "seed": trainer.cfg.seed,
                **trainer.scaling_state(),
            }
            g = TrainingGlobals(
                trainer.step, trainer.consumed_samples, extra, identity_of(trainer.data)
            )
            return trainer_params(trainer), g

        return self._saves.save(
            state,
            trainer.plan,
            trainer.role.rank,
            trainer.groups.tp.group,
            root,
            keep,
            prune_below,
            optional,
            drop_steps=drop_steps,
        )

    def done(self) -> bool:
        return self._saves.done()

    def wait(self) -> None:
        self._saves.wait()

    @property
    def kept_bytes(self) -> int:
        """Host bytes the checkpointers keep for their next saves (one snapshot's worth,
        whatever the number of roots: ``Checkpointer.take_buffers``)."""
        return self._saves.kept_bytes

    def abandon(self) -> None:
        self._saves.abandon()

    def reset(self) -> None:
        self._saves.reset()

    def close(self) -> None:
        self._saves.close()
