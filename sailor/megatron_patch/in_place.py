"""The I/O shell of in-place reconfiguration: directives, handshake, state exchange.

A worker started with ``--in-place`` (see ``rank_main`` and ``/docs/training.md``, "In-place
reconfiguration") survives a reconfiguration: it holds after its stop step (or after a
communication failure, "broken"), waits for a relayout directive in its control file, and
runs the next generation in the same process. This module is what that needs around the
pure schedule of :mod:`~sailor.megatron_patch.relayout`:

- :func:`parse_directive` / :func:`await_directive`: the directive
  ``{"relayout": {"generation": G, "argv": [...]}}`` (newer generations only);
- :func:`handshake`: once per new world, every rank's ``(old rank | -1, step, broken,
  old plan id, consumed samples)``, gathered; the old plan from the lowest valid holder;
- :func:`exchange`: the kept shards copied, the received ones in globally ordered
  ``batch_isend_irecv`` batches of bounded size (NCCL's pairing rules), concatenated along
  the TP dim and sliced.

It never reads checkpoints (``megatron_patch`` may not import ``sailor.checkpoint``): the
layers no live rank holds are the caller's to restore through its ``CheckpointIO``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from sailor.comm import abort as comm_abort
from sailor.comm import api as comm
from sailor.comm.codec import PeerObjectError, expect
from sailor.megatron_patch.data import identity_of
from sailor.megatron_patch.engine import Trainer
from sailor.megatron_patch.file_wait import FileWait
from sailor.megatron_patch.relayout import Schedule, Transfer, buckets
from sailor.megatron_patch.state import (
    gather_full,
    key_layer,
    optimizer_state,
    place,
    shard,
    stage_state,
)
from sailor.megatron_patch.tp_layers import tp_dim_of
from sailor.megatron_patch.vocab_parallel import padded_vocab
from sailor.schemas.data_identity import DataIdentity, data_differences, describe_differences
from sailor.schemas.json_text import load_json
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Plan

__all__ = [
    "EXCHANGE_BUCKET_BYTES",
    "ExchangeStats",
    "Held",
    "Peers",
    "await_directive",
    "check_held_data",
    "exchange",
    "exchange_layer_bytes",
    "handshake",
    "parse_directive",
    "state_kinds",
]

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Held:
    """What a held rank keeps for the next generation."""

    trainer: Trainer | None
    """The last generation's trainer (None: broken, or a fresh/warm process)."""
    old_rank: int
    step: int
    consumed_samples: int
    broken: bool
    generation: int
    """The last generation this process applied (-1: none yet)."""
    cause: str = ""
    culprit: int = -1
    """The global rank the failure that broke the world names as guilty (a
    ``PeerObjectError``'s sender; -1: none): the held line carries it to the agent, and the
    controller charges that rank's node (``controller/culprits.py``)."""


def parse_directive(text: str, last_generation: int) -> tuple[int, list[str]] | None:
    """``(generation, argv)`` of a relayout directive newer than ``last_generation``; None
    for anything else (no directive, an old one, a half-written or malformed file)."""
    try:
        data = load_json(text or "{}", "the relayout directive")
    except ValueError:  # JsonTooDeepError too: nested past json's limit
        return None
    d = data.get("relayout") if isinstance(data, dict) else None
    if not isinstance(d, dict):
        return None
    gen, argv = d.get("generation"), d.get("argv")
    if isinstance(gen, bool) or not isinstance(gen, int) or gen <= last_generation:
        return None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        return None
    return gen, list(argv)


def await_directive(
    control: str | None,
    last_generation: int,
    poll_s: float,
    timeout_s: float,
    stop: Callable[[], bool],
) -> tuple[int, list[str]] | None:
    """Wait on ``control`` alone (no collective) for a newer directive, up to ``timeout_s``.

    None once ``stop()`` (the caller's SIGTERM flag) or on the timeout. The file is read
    again whenever it is replaced and after a signal (:class:`FileWait`: an idle waiter
    costs ~no CPU); where that cannot block, every ``poll_s``.
    """
    end = time.monotonic() + timeout_s
    if not control:
        while not stop() and time.monotonic() < end:
            time.sleep(max(0.0, min(poll_s, end - time.monotonic())))
        return None
    with FileWait(control, poll_s) as waiter:
        while not stop() and time.monotonic() < end:
            try:
                got = parse_directive(Path(control).read_text(), last_generation)
            except OSError:
                got = None
            if got is not None:
                return got
            waiter.wait(end - time.monotonic())
    return None


@dataclass(frozen=True)
class Peers:
    """The handshake's result, the same on every rank of the new world."""

    old_plan: Plan | None
    holders: dict[int, int]
    """New rank -> old rank of every valid holder (unbroken, at the relayout step)."""
    step: int
    consumed_samples: int
    scaling: dict[str, Any] | None = None
    """The holders' ``Trainer.scaling_state`` (skipped steps, loss scale); None: no holder."""
    data: DataIdentity | None = None
    """The data the holders' state was trained on (``data.identity_of`` of their trainer);
    None: no holder, or their data does not say."""


_T = TypeVar("_T")

_HELD_SHAPE = (int, int, bool, str, int, str, str)
"""A rank's held state in the handshake: old rank, step, broken, plan id, consumed samples,
scaling state's JSON, the data identity's JSON ('' for none). The ranks of one world run one
release (docs/operations.md), so every holder sends all seven."""


def _peer_json(parse: Callable[[str], _T], text: str, rank: int, what: str) -> _T:
    """``parse(text)``, JSON rank ``rank`` sent; ``PeerObjectError`` naming it if it does
    not parse."""
    try:
        return parse(text)
    except ValueError as exc:  # json's and pydantic's errors
        raise PeerObjectError(
            f"rank {rank} sent {what} that does not parse: {str(exc)[:300]}", rank=rank
        ) from None


def handshake(held: Held | None, load_step: int, rank: int, world_size: int) -> Peers:
    """Every rank's held state, gathered (collective over the new world).

    A holder is valid if it is not broken and holds step ``load_step`` (any step, all
    equal, when ``load_step`` < 0: a relayout without a checkpoint). Its step, data
    position, scaling state (skipped steps, loss scale) and data identity must agree with
    the other valid holders'; the old plan is broadcast from the lowest valid holder, and
    every valid holder must have held that plan.
    """
    tr = held.trainer if held is not None and not held.broken else None
    ident = identity_of(tr.data) if tr is not None else None
    mine = (
        (
            held.old_rank,
            held.step,
            held.broken,
            tr.plan.plan_id,
            held.consumed_samples,
            json.dumps(tr.scaling_state(), sort_keys=True),
            ident.model_dump_json() if ident is not None else "",
        )
        if held is not None and tr is not None
        else (-1, -1, True, "", -1, "", "")
    )
    got: list[Any] = [None] * world_size
    comm.all_gather_object(got, mine)
    got = [expect(g, _HELD_SHAPE, r, "its held state") for r, g in enumerate(got)]
    valid = {
        r: g
        for r, g in enumerate(got)
        if g[0] >= 0 and not g[2] and (load_step < 0 or g[1] == load_step)
    }
    for r, g in valid.items():
        _peer_json(lambda t: load_json(t, "scaling state"), g[5], r, "its scaling state")
        if g[6]:
            _peer_json(DataIdentity.model_validate_json, g[6], r, "its data identity")
    if not valid:
        return Peers(None, {}, -1, -1)
    positions = {(g[1], g[4], g[5], g[6]) for g in valid.values()}
    plans = {g[3] for g in valid.values()}
    if len(positions) != 1 or len(plans) != 1:
        raise RuntimeError(
            f"holders disagree: (step, consumed_samples, scaling, data) {sorted(positions)}, "
            f"plans {plans}"
        )
    src = min(valid)
    box: list[Any] = [tr.plan.model_dump_json() if tr is not None and src == rank else None]
    comm.broadcast_object_list(box, src=src)
    old_json = expect(box[0], str, src, "the old plan's JSON")
    old_plan = _peer_json(Plan.model_validate_json, old_json, src, "the old plan")
    if old_plan.plan_id not in plans:
        raise RuntimeError(f"old plan {old_plan.plan_id!r} is not the holders' {plans}")
    ((step, consumed, scaling, data),) = positions
    return Peers(
        old_plan,
        {r: g[0] for r, g in valid.items()},
        step,
        consumed,
        json.loads(scaling),
        DataIdentity.model_validate_json(data) if data else None,
    )


def check_held_data(peers: Peers, current: DataIdentity | None, allow_change: bool) -> str:
    """Refuse to continue the holders' state (an in-place relayout) on other data than it
    was trained on (``peers.data`` against this generation's ``current``: a directive whose
    training config names another corpus, sequence length or seed), naming every field
    with both values, unless ``allow_change`` (the training config's
    ``allow_data_change``); return what changed ('' if nothing, or either side does not
    say). A ``ValueError`` before training: a configuration error, as a checkpoint's
    ``DataMismatchError`` (``sailor.checkpoint.data_fit``) on the restart path. Before, the
    relayout went on counting samples over the new data."""
    if peers.data is None or current is None:
        return ""
    changes = data_differences(peers.data, current)
    said = describe_differences(changes)
    if changes and not allow_change:
        raise ValueError(
            f"the live state held at step {peers.step} (in-place relayout) was trained on "
            f"other data than this generation's: {said}. Its consumed_samples="
            f"{peers.consumed_samples} would index other samples. Relayout with the data it "
            "was trained on, or set allow_data_change: true in the training config to "
            "continue on this data"
        )
    return said


def _keys_by_layer(names: list[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for k in sorted(names):
        out.setdefault(key_layer(k), []).append(k)
    return out


@dataclass
class ExchangeStats:
    """What an exchange did on this rank."""

    kept_keys: int = 0
    received_keys: int = 0
    bytes_received: int = 0
    checkpoint_layers: list[int] = field(default_factory=list)
    batches: int = 0
    """``batch_isend_irecv`` batches this rank took part in."""
    largest_batch_bytes: int = 0
    """The most bytes this rank received in one batch (its receive buffers' peak)."""


def _old_shards(
    tr: Trainer | None,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int | None]]:
    """The held trainer's shards by key (``weight`` and, after a step, both moments), and
    each key's TP dim (None: replicated)."""
    if tr is None:
        return {}, {}
    opt = optimizer_state(tr.stage, tr.optimizer)
    out: dict[str, dict[str, torch.Tensor]] = {}
    dims: dict[str, int | None] = {}
    for key, (t, d) in stage_state(tr.stage).items():
        out[key], dims[key] = {"weight": t}, d
        if key in opt:
            out[key].update({m: opt[key][m] for m in _MOMENTS})
    return out, dims


def state_kinds(adam_step: int) -> tuple[str, ...]:
    """The tensors the exchange moves per parameter: the moments exist once AdamW stepped."""
    return ("weight", *_MOMENTS) if adam_step > 0 else ("weight",)


def exchange_layer_bytes(spec: ModelSpec, adam_step: int) -> Callable[[int], int]:
    """What a receiver takes in for one layer: the full layer (all old TP shards) in fp32,
    per kind (:func:`state_kinds`); the embedding and head with the padded vocabulary's rows
    (``vocab_parallel``: counted at the model's width, which bounds a narrower embedding)."""
    n = 4 * len(state_kinds(adam_step))
    pad = (padded_vocab(spec.vocab_size) - spec.vocab_size) * spec.hidden_size

    def of(layer: int) -> int:
        extra = pad if spec.layer_kind(layer) != "block" else 0
        return (spec.layer_params(layer) + extra) * n

    return of


EXCHANGE_BUCKET_BYTES = 1 << 30
"""Default receive budget of one batch of the exchange, per rank (1 GiB of fp32 state)."""


@torch.no_grad()
def exchange(
    new: Trainer,
    old: Trainer | None,
    sched: Schedule,
    adam_step: int,
    device: torch.device,
    now: Callable[[], float] = time.perf_counter,
    bucket_bytes: int = EXCHANGE_BUCKET_BYTES,
    staged_sends: bool = False,
) -> ExchangeStats:
    """Fill ``new``'s stage and AdamW state from the schedule: kept shards copied from
    ``old``, received ones over ``batch_isend_irecv`` batches (every rank runs the batches
    it has a part in, in one global order: :func:`~sailor.megatron_patch.relayout.buckets`),
    each installed and its buffers dropped before the next, so that a rank holds at most
    ``bucket_bytes`` of received state at a time (one layer more if a layer is larger).
    Checkpoint layers are left to the caller (``ExchangeStats.checkpoint_layers``).
    ``adam_step``: the optimizer's step count (``Trainer.adam_step``; the moments exist, and
    are sent, only once it is > 0). ``staged_sends``: some rank's held state is on the host
    (:mod:`~sailor.megatron_patch.relayout_memory`), so its sends are copied to its device
    per batch: the batches count them (the same value on every rank)."""
    me = new.role.rank
    mine = sched.of(me)
    kinds = state_kinds(adam_step)
    # which keys are TP-sharded: a property of the parameter, not of the TP degree, so a
    # sender (its held stage) and a receiver (its new stage) read the same for a key
    held, held_dims = _old_shards(old)
    params = dict(new.stage.keyed_parameters())
    new_keys = _keys_by_layer(list(params))
    old_keys = _keys_by_layer(list(held))
    stats = ExchangeStats(checkpoint_layers=list(mine.checkpoint))

    def install(key: str, tensors: dict[str, torch.Tensor], own: bool = False) -> None:
        """``own``: the tensors are this process's held shards, which nothing else will
        use: the new parameter and moments take them over where they already sit on the
        device in their dtype (no second copy of a kept layer on the GPU while both stages
        exist); else they are copied. A parameter of a stage built empty (on ``meta``) gets
        its tensor here."""
        p = params[key]

        def here(t: torch.Tensor, dtype: torch.dtype) -> bool:
            return own and t.device == device and t.dtype == dtype and t.shape == p.shape

        w = tensors["weight"]
        if here(w, p.dtype):
            place(p, w)
        elif p.is_meta:
            place(p, torch.empty(p.shape, dtype=p.dtype, device=device).copy_(w))
        else:
            p.copy_(w)
        if adam_step > 0:
            new.optimizer.state[p] = {
                "step": torch.tensor(float(adam_step)),
                **{
                    m: t if here(t, t.dtype) else torch.empty_like(t, device=device).copy_(t)
                    for m, t in ((m, tensors[m]) for m in _MOMENTS)
                },
            }

    for layer in mine.kept:
        for key in new_keys[layer]:
            install(key, held[key], own=True)
            stats.kept_keys += 1

    batch_of = buckets(
        sched, exchange_layer_bytes(new.spec, adam_step), bucket_bytes, staged_sends=staged_sends
    )
    mine_by_batch: dict[int, list[Transfer]] = {}
    for t, b in zip(sched.transfers, batch_of, strict=True):
        if t.receiver == me or me in t.sources:
            mine_by_batch.setdefault(b, []).append(t)

    def one_batch(transfers: list[Transfer]) -> None:
        """This rank's sends and receives of ``transfers`` (in the global order), then the
        received keys concatenated, sliced and installed."""
        ops: list[comm.P2POp] = []
        inbox: list[tuple[str, int, str, torch.Tensor]] = []  # key, shard index, kind, tensor
        staged: dict[tuple[str, str], torch.Tensor] = {}  # a shard sent to several receivers
        before = stats.bytes_received
        drained = False

        def local(x: torch.Tensor) -> torch.Tensor:
            """A held shard on this rank's device. From host memory (an offloaded stage)
            after an abortable wait for the stream: the copy, pageable (pinning the stage
            would lock it in RAM for the process's life), waits in C for the stream, where
            the previous batch's p2p with a peer that died would hold it out of the abort
            signal's reach."""
            nonlocal drained
            if x.device.type == "cpu" and device.type == "cuda" and not drained:
                comm_abort.host_sync(device)
                drained = True
            return x.to(device)

        for t in transfers:
            keys = new_keys[t.layer] if t.receiver == me else old_keys[t.layer]
            # a replicated parameter (a norm, a bias, position embeddings) is one copy per
            # old TP rank: old TP rank 0's is taken (the one the gather below kept before,
            # and a checkpoint's), the others not sent. Before, every old TP rank sent its
            # copy: t times what the batch budget counts (``exchange_layer_bytes``)
            for key in keys:
                dim = tp_dim_of(params[key]) if t.receiver == me else held_dims[key]
                for i, src in enumerate(t.sources):
                    if dim is None and i > 0:
                        continue
                    for kind in kinds:
                        # a held shard may sit on this process's previous device (a rank that
                        # moved GPUs) or in host memory (offloaded): NCCL sends only from the
                        # rank's own device, and the gather below needs one device
                        if src == t.receiver:  # the receiver's own old shard: no message
                            if me == src:
                                inbox.append((key, i, kind, local(held[key][kind])))
                            continue
                        if me == src:
                            out = staged.get((key, kind))
                            if out is None:
                                out = local(held[key][kind]).contiguous()
                                staged[(key, kind)] = out
                            ops.append(comm.P2POp("send", out, t.receiver))
                        elif me == t.receiver:
                            shape = _old_shape(params[key], new.role.tp, len(t.sources))
                            buf = torch.empty(shape, device=device)
                            ops.append(comm.P2POp("recv", buf, src))
                            inbox.append((key, i, kind, buf))
                            stats.bytes_received += buf.numel() * buf.element_size()
        comm.wait_all(comm.batch_isend_irecv(ops))
        stats.largest_batch_bytes = max(stats.largest_batch_bytes, stats.bytes_received - before)

        got: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        for key, i, kind, buf in inbox:
            got.setdefault(key, {}).setdefault(kind, {})[i] = buf
        tp = new.stage.tp
        for key, by_kind in got.items():
            dim = tp_dim_of(params[key])
            full = {k: gather_full([v[i] for i in sorted(v)], dim) for k, v in by_kind.items()}
            install(key, {k: shard(f, dim, tp.size, tp.rank) for k, f in full.items()})
            stats.received_keys += 1

    for b in sorted(mine_by_batch):
        one_batch(mine_by_batch[b])
    stats.batches = len(mine_by_batch)
    return stats


def _old_shape(p: torch.Tensor, new_tp: int, old_tp: int) -> tuple[int, ...]:
    """The shape of one old TP shard of ``p`` (a shard of TP degree ``new_tp``)."""
    dim = tp_dim_of(p)
    shape = list(p.shape)
    if dim is None:
        return tuple(shape)
    full = shape[dim] * new_tp
    if full % old_tp:
        raise RuntimeError(f"dim {dim} of size {full} does not split into {old_tp} shards")
    shape[dim] = full // old_tp
    return tuple(shape)
