"""The agent's control file, read by every rank and agreed on at each iteration boundary.

The agent writes ``{"stop_at_step": S, "save_step": S, "save_dir": DIR, "prune_below": P,
"save_optional": B, "drop_steps": K}`` atomically into one control file per node (the protocol
of ``sailor.agent.supervisor``); a rank re-reads it at every iteration boundary. Nodes see
their file change at different moments, so a rank must never act on its own copy alone: one
rank stopping at step 10 while a rank on another node goes on to step 11 would leave the
latter waiting in a collective until the timeout. Hence :func:`agree`: one all-reduce (MAX) of
``(stop_at_step, save_step, prune_below, required save step)`` over the world at every
boundary, so every rank takes the same decision at the same boundary. The save directory, a
string, and the steps of saves the controller gave up on (``drop_steps``, a list) are gathered
only on the rare boundary where a new save is agreed (:func:`agree_target`). In the engine's
training loop the all-reduce rides on the iteration's one host wait: issued beside the step's
agreement (:func:`start_agree`), read with it (:func:`read_agreed`), so the boundary after the
iteration acts on a request read during it, before its optimizer step, and waits for nothing
(``Trainer.control_source``; ``boundary.Boundary`` takes it). The first boundary and the
hold's polls agree at the boundary itself.

A stop step the ranks learn of only after they passed it means "stop now" (the controller
picks the stop step a few steps ahead of the reported progress, but reports lag); a save is
taken at the first boundary at or after its step. The controller commits the step the
workers report as saved, so an overshoot costs nothing but the extra steps.

``save_optional`` marks the controller's periodic checkpoint (``Checkpoint.periodic``): a save
whose failure every rank reports and trains on (``boundary``), where a reconfiguration's save
failing fails the ranks. The save agreed is optional only if no rank knows a required request
at all: the fourth value of the all-reduce is each rank's save step when its request is
required, -1 when optional. A reconfiguration's Checkpoint replaces a periodic request in the
agent's file and nodes see the change at different boundaries, so one node may still hold a
periodic request of a later step (300) while another has the required one (105): the agreed
save (of 300, or this step's at the hold) answers the required request too, whatever their
order, and its failure must fail the ranks.

Never raises on a missing or half-written file (that is "no request yet").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from sailor.comm import api as comm
from sailor.comm.codec import PeerObjectError, expect
from sailor.comm.device_copy import to_device
from sailor.megatron_patch.clock import synchronize
from sailor.schemas.json_text import load_json

__all__ = [
    "ControlRequest",
    "agree",
    "agree_save",
    "agree_target",
    "gathered_targets",
    "merge_drop_steps",
    "read_agreed",
    "read_control",
    "start_agree",
]

_NONE = -1


@dataclass(frozen=True)
class ControlRequest:
    """What the agent asks of the workers (``-1``: nothing asked)."""

    stop_at_step: int = _NONE
    save_step: int = _NONE
    save_dir: str = ""
    prune_below: int = _NONE
    """After the save of ``save_step`` commits, delete every checkpoint below this step."""
    save_optional: bool = False
    """The controller's periodic save: its failure is reported and training goes on."""
    drop_steps: tuple[int, ...] | None = None
    """The steps of saves the controller gave up on (``Checkpoint.drop_steps``): after the
    commit, those of them at or above ``prune_below`` that were committed when the save
    began go; None: none (an older controller's request, or no request)."""
    drop_for: int = _NONE
    """The save step of the request ``drop_steps`` came with (this rank's control file's
    ``save_step``; the agreed request's ``save_step`` is the MAX over ranks)."""

    @property
    def wants_stop(self) -> bool:
        return self.stop_at_step >= 0

    @property
    def wants_save(self) -> bool:
        return self.save_step >= 0


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _NONE
    return int(value) if value >= 0 else _NONE


def read_control(path: str | Path | None) -> ControlRequest:
    """This node's control file; an empty request if there is none or it is unreadable."""
    if not path:
        return ControlRequest()
    try:
        data = load_json(Path(path).read_text() or "{}", str(path))
    except (OSError, ValueError):  # JsonTooDeepError too: nested past json's limit
        return ControlRequest()
    if not isinstance(data, dict):
        return ControlRequest()
    save_dir = data.get("save_dir")
    return ControlRequest(
        stop_at_step=_int(data.get("stop_at_step")),
        save_step=_int(data.get("save_step")),
        save_dir=save_dir if isinstance(save_dir, str) else "",
        prune_below=_int(data.get("prune_below")),
        save_optional=data.get("save_optional") is True,
        drop_steps=_steps(data.get("drop_steps")),
        drop_for=_int(data.get("save_step")),
    )


def _steps(value: object) -> tuple[int, ...] | None:
    """A list of steps (ints >= 0); None for anything else: no deletion of abandoned
    saves rather than one from a list misread."""
    if not isinstance(value, list):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return None
    return tuple(sorted(set(value)))


def _alone() -> bool:
    """No other rank to agree with (no process group, or a world of one)."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1


def agree(local: ControlRequest, device: torch.device) -> ControlRequest:
    """The request every rank acts on at this boundary: the MAX over ranks of each field;
    the save optional only if no rank knows a required save request (any step).

    A collective: every rank must call it at the same boundary. Without an initialised
    process group (a single process) the local request is returned as it is.
    """
    pending = start_agree(local, device)
    if pending is not None:
        synchronize(pending.device)  # abortable where the host waits (in-place workers)
    return read_agreed(local, pending)


def start_agree(
    local: ControlRequest, device: torch.device, world_size: int | None = None
) -> torch.Tensor | None:
    """:func:`agree`'s collective, issued and not read (no host wait; None alone, where
    there is none): the engine issues it beside the iteration's agreement and reads both
    after one device wait (``Trainer.take_agreed_control``). ``world_size``: the world's
    (the dry run's, which has no process group); None: the process group's."""
    if world_size == 1 or (world_size is None and _alone()):
        return None
    required = _NONE if local.save_optional else local.save_step
    t = _on_device([local.stop_at_step, local.save_step, local.prune_below, required], device)
    comm.all_reduce(t, op="max")
    return t


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device`` without a host wait: on a GPU through
    pinned memory, non-blocking. ``torch.tensor(values, device=cuda)`` copies from pageable
    memory and synchronizes the stream, a wait in C that no signal handler interrupts: the
    engine issues this after the iteration's gradient and step all-reduces, so that wait
    hung on a dead peer where the in-place abort (``comm.abort``) must reach the host."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def read_agreed(local: ControlRequest, pending: torch.Tensor | None) -> ControlRequest:
    """The agreed request of a :func:`start_agree` (``local`` itself when alone). Reads the
    tensor: call it after the device ran the all-reduce, or it waits for it."""
    if pending is None:
        return local
    stop, save, prune, required = (int(x) for x in pending.tolist())
    return ControlRequest(
        stop_at_step=stop,
        save_step=save,
        save_dir=local.save_dir,
        prune_below=prune,
        save_optional=save >= 0 and required < 0,
        drop_steps=local.drop_steps,
        drop_for=local.save_step,
    )


def agree_save(done: bool, failed: bool, device: torch.device) -> tuple[bool, bool]:
    """``(every rank done, some rank failed)`` of a save in flight: one all-reduce MAX of
    ``(not done, failed)`` over the world (collective: every rank calls it at the same
    point). Without a process group, the local values."""
    if _alone():
        return done, failed
    t = _on_device([int(not done), int(failed)], device)
    comm.all_reduce(t, op="max")
    synchronize(t.device)
    pending, bad = (bool(x) for x in t.tolist())
    return not pending, bad


def merge_drop_steps(
    known: list[tuple[str, int, tuple[int, ...] | None]], save_step: int
) -> tuple[int, ...] | None:
    """The ``drop_steps`` of the agreed save of ``save_step`` from each rank's
    ``(save_dir, drop_for, drop_steps)``: the intersection over the ranks whose request is
    that save's (a save directory, ``drop_for == save_step``); None when none is, or one of
    them has none (an older controller's request: no deletion of abandoned saves).

    Only the agreed request's lists, and only the steps all of them name: a rank still
    holding an earlier request (a periodic save's, sent before the controller recorded a
    save of one of its steps again) may name a step that is recorded now, which the agreed
    request's list (computed after that record, without recorded steps) does not. A step
    is deleted only if every list the save answers names it. Pure."""
    out: set[int] | None = None
    for save_dir, drop_for, drop in known:
        if not save_dir or drop_for != save_step:
            continue
        if drop is None:
            return None
        out = set(drop) if out is None else out & set(drop)
    return None if out is None else tuple(sorted(out))


def agree_target(local: ControlRequest) -> tuple[str, tuple[int, ...] | None]:
    """The save directory some rank knows (the first non-empty wins) and the agreed save's
    ``drop_steps`` (:func:`merge_drop_steps` with ``local.save_step``, the agreed one): one
    object all-gather over the world, on the boundary where a new save is agreed (all ranks
    call it)."""
    mine = (local.save_dir, local.drop_for, local.drop_steps)
    if _alone():
        return local.save_dir, merge_drop_steps([mine], local.save_step)
    got: list[object] = [None] * dist.get_world_size()
    comm.all_gather_object(got, mine)
    known = gathered_targets(got)
    root = next((d for d, _, _ in known if d), "")
    return root, merge_drop_steps(known, local.save_step)


_TARGET_SHAPE = (str, int, frozenset({None, tuple}))
"""A rank's save target in :func:`agree_target`: save directory, ``drop_for``, ``drop_steps``."""


def gathered_targets(got: list[object]) -> list[tuple[str, int, tuple[int, ...] | None]]:
    """Each rank's ``(save_dir, drop_for, drop_steps)`` of :func:`agree_target`'s gather
    (rank ``r``'s at index ``r``), checked: :class:`PeerObjectError` naming the first rank
    whose object is not one (a wrong shape, a step that is not an int >= 0). The ranks of one
    world run one release (docs/operations.md), so every rank sends the three; a malformed
    one is its sender's fault (``culprit`` in the failure record), never skipped: skipping
    it would decide the save's directory and the steps it deletes from the others' alone.
    Pure."""
    out: list[tuple[str, int, tuple[int, ...] | None]] = []
    for r, g in enumerate(got):
        save_dir, drop_for, drop = expect(g, _TARGET_SHAPE, r, "its save target")
        if drop is not None and not all(type(s) is int and s >= 0 for s in drop):
            raise PeerObjectError(
                f"rank {r} sent steps to drop {str(drop)[:200]}: ints >= 0 expected", rank=r
            )
        out.append((save_dir, drop_for, drop))
    return out
