"""A worker's iteration boundary: progress lines, where the rank is, and the hook that acts
on the agent's control file (injected failures, saves, the stop step and the hold there).

The agent's protocol (``sailor.agent.supervisor``): JSON progress lines on stdout, a
control file re-read at every boundary and agreed on by every rank (:mod:`control`).

A save the agent asks for fails the ranks when it fails (``save_failure``), except an
optional one (the controller's periodic checkpoint, ``ControlRequest.save_optional``): once
every rank agreed that it failed, each drops it (``SaveIO.abandon``: a committer waiting for
a part that never comes commits nothing and ends), prints a ``save_failed`` line with the
step and what failed, and trains on. The agent reports it and the controller abandons that
periodic save at once; the next is asked an interval later. The training config's own
periodic checkpoints (``checkpoint.every_steps``) are optional the same way, up to
``PERIODIC_FAILURES_LIMIT`` failures in a row. A periodic save (either kind) not durable on
a rank within ``--periodic-save-timeout-s`` fails there (``SaveTimeoutError``) instead of
holding every rank in its wait for good. The save taken at the stop step
(the hold's, which a reconfiguration commits) is never optional, whichever request it answers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Generic, Protocol, TextIO, TypeVar

import torch

from sailor.megatron_patch.checkpoint_io import SaveIO
from sailor.megatron_patch.control import (
    ControlRequest,
    agree,
    agree_save,
    agree_target,
    read_control,
)
from sailor.megatron_patch.errors import InjectedFailureError, SaveTimeoutError
from sailor.megatron_patch.load_barrier import LoadBarrier
from sailor.megatron_patch.save_failure import raise_save_failure, report_save_failure
from sailor.schemas.training import CheckpointConfig

__all__ = [
    "PERIODIC_FAILURES_LIMIT",
    "PERIODIC_SAVE_TIMEOUT_S",
    "Boundary",
    "Progress",
    "Status",
    "Stepped",
    "sub_rank",
]

PERIODIC_FAILURES_LIMIT = 3
"""Saves of the training config's periodic checkpoints (``checkpoint.every_steps``) that may
fail in a row while training goes on; the next one is required. A storage hiccup costs an
interval of progress at a crash; storage failing for this long (``3 * every_steps`` steps)
is a fault the run cannot save through, and training on would only widen what a crash
loses: better fail now, where the error names it.

A save skipped because this rank still writes an abandoned save (``SaveSkippedError``)
counts too: that write has then not ended for a save's interval, on a mount where a save
already failed, and a skip no more saves the run than a failure does. Not counted, a mount
hung for good would skip every save for the rest of the run, silently to the job. Counted,
the required save comes after the limit and fails at once on the rank whose write still
runs (``AbandonedWriteError``: the same storage, not known good), naming it; a write that ended
meanwhile lets it go ahead."""


PERIODIC_SAVE_TIMEOUT_S = 3600.0
"""Default of ``--periodic-save-timeout-s``: how long a periodic save (the training config's
``every_steps``, the controller's optional one) may take to be durable on a rank before it
is dropped as failed. An hour: a 70B checkpoint is about 1.1 TB (16 B per parameter), so a
node writing its share (a 64-node job: 17 GB) stays under it down to about 5 MB/s; a write
that has not ended by then is on a hung mount, not a slow one. Not measured on a cluster."""


class Stepped(Protocol):
    """What the boundary reads of a trainer: the last iteration it finished (Sailor's
    ``Trainer``, or the DeepSpeed adapter's run)."""

    @property
    def step(self) -> int: ...


_T = TypeVar("_T", bound=Stepped)


def sub_rank(path: str | None, rank: int) -> str | None:
    return path.replace("{rank}", str(rank)) if path else None


class Progress:
    def __init__(self, path: str | None, echo: bool) -> None:
        self._f: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._f = Path(path).open("a")  # noqa: SIM115 - open for the whole run
        self._echo = echo

    def emit(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj)
        if self._f is not None:
            self._f.write(line + "\n")
            self._f.flush()
        if self._echo:
            print(line, flush=True)


class Status:
    """Where the worker is, for the failure record."""

    def __init__(self, rank: int = -1, error_file: str | None = None) -> None:
        self.in_training = False
        self.step = -1
        """The trainer's step at the last iteration boundary (the last step it finished)."""
        self.in_iteration = False
        """Between boundaries: the iteration to ``step + 1`` is running."""
        self.rank = rank
        """The rank of the current generation (in-place: it changes)."""
        self.error_file = error_file
        """Where the current generation's first cause goes."""
        self.holding = False
        """In-place: held (or warm), waiting for a directive; SIGTERM then exits 0."""
        self.terminated = False
        self.load_barrier: LoadBarrier | None = None
        """The current world's load barrier while it is pending (from the world's start to
        every rank's load): a failure now is written there for the waiting ranks."""

    @property
    def failed_step(self) -> int:
        """The step a failure now happens at: the boundary's, or inside an iteration the
        one it computes (``step + 1``, as the engine's agreed errors name it)."""
        return self.step + 1 if self.in_iteration and self.step >= 0 else self.step


class Boundary(Generic[_T]):
    """The iteration-boundary hook: injected failure, control requests, save, stop, hold.

    Generic in the trainer: ``ckpt`` saves whatever the boundary is called with."""

    def __init__(
        self,
        args: argparse.Namespace,
        status: Status,
        progress: Progress,
        ckpt: SaveIO[_T] | None,
        device: torch.device,
        periodic: CheckpointConfig | None = None,
    ) -> None:
        self.args, self.status, self.progress, self.ckpt = args, status, progress, ckpt
        self.device = device
        self.periodic = periodic if periodic is not None and periodic.every_steps else None
        if self.periodic is not None and ckpt is None:
            # the entry points refuse this at start (``rank_args.check_periodic_checkpoints``);
            # a caller that builds a boundary itself learns it here, not at the first save
            raise ValueError(
                f"checkpoint.every_steps={self.periodic.every_steps} needs a checkpoint "
                "implementation (ckpt=None)"
            )
        self.periodic_failures = 0
        """Saves of the training config's periodic checkpoints failed (or skipped) in a row.
        This boundary's: a new generation (in place: a new ``Boundary``) starts at 0."""
        self._save_timeout_s = float(
            getattr(args, "periodic_save_timeout_s", PERIODIC_SAVE_TIMEOUT_S)
        )
        if not self._save_timeout_s > 0:  # NaN too
            raise ValueError(
                f"--periodic-save-timeout-s={self._save_timeout_s}: must be > 0 seconds"
            )
        self.saved_requests: set[int] = set()
        self.pending_save = -1
        self.pending_optional = False
        """The save in flight is optional (``ControlRequest.save_optional``)."""
        self.last_saved = -1
        self.stopped_at = -1
        self.last_boundary = time.monotonic()

    def local_request(self) -> ControlRequest:
        """This rank's control file as it reads now (no collective)."""
        return read_control(self.args.control)

    def _request(self, tr: _T | None = None) -> ControlRequest:
        """The agreed request: the one the iteration that ended at ``tr.step`` agreed, if
        the trainer carries one (the engine's ``take_agreed_control``: no collective
        here), else one agreed now (a collective)."""
        if not self.args.control:
            return ControlRequest()
        take = getattr(tr, "take_agreed_control", None)
        if tr is not None and take is not None:
            pre = take(tr.step)
            if pre is not None:
                return pre  # type: ignore[no-any-return]
        return agree(self.local_request(), self.device)

    def _durable(self, optional: bool = False, timeout_s: float | None = None) -> str:
        """Wait until the save in flight is durable on every rank (committed, on the
        committer) in short collective polls: a rank that finished its own part would
        otherwise wait for the committer in the next step's collective, and a write longer
        than the process groups' timeout (GBs to an object store) would time it out.

        Each poll also agrees whether the save failed on some rank (``agree_save``); then
        every rank raises (:func:`raise_save_failure`), none goes on into a collective that
        the failed ones never reach. That covers a save that failed in its snapshot too
        (``CheckpointIO.save`` raises no failure of its own: it is the save's).

        ``optional``: a failure that is not job-wide is returned instead (what failed, the
        same on every rank; the save abandoned); '' once the save is durable everywhere.

        ``timeout_s``: a rank whose own part is not over that long after the wait began
        (its write, or the committer's wait for every part) fails the save with
        ``SaveTimeoutError``, agreed as any failure at its next poll; its write, if hung, is
        left running (abandoned). None: no deadline (the hold's save, whose deadline is the
        controller's: past its CHECKPOINT deadline it aborts the generation)."""
        if self.ckpt is None:
            raise RuntimeError("no checkpoint implementation")
        failure: Exception | None = None
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            late = end is not None and time.monotonic() > end
            if late and failure is None and not self.ckpt.done():
                failure = SaveTimeoutError(
                    f"save not durable on rank {self.args.rank} within {timeout_s:g} s "
                    "(--periodic-save-timeout-s): its write, or the commit's wait for every "
                    "part, still runs (a hung or slow mount?)"
                )
            every, failure, failed = self._poll(failure, optional)
            if failed:
                return failed
            if every:
                return ""
            time.sleep(self.args.poll_s)

    def _poll(
        self, failure: Exception | None, optional: bool = False
    ) -> tuple[bool, Exception | None, str]:
        """One collective poll of the save in flight: ``(every rank done, this rank's
        failure, what failed)``; once some rank's save failed (``agree_save``), raises on
        every rank, or for an ``optional`` save abandons it and says what failed."""
        if self.ckpt is None:
            raise RuntimeError("no checkpoint implementation")
        done = self.ckpt.done()
        if done and failure is None:
            try:
                self.ckpt.wait()  # done: it does not block; it raises the save's error
            except Exception as exc:
                failure = exc
        every, failed = agree_save(done, failure is not None, self.device)
        if not failed:
            return every, failure, ""
        settle = functools.partial(self._settle, failure)
        if not optional:
            raise_save_failure(failure, settle)
        why = report_save_failure(failure, settle)  # raises if job-wide
        # no rank waits for the rest of it: a committer waiting for a part that never
        # comes is fenced and ends on its own, and the next save starts afresh
        self.ckpt.abandon()
        return every, failure, why

    def _settle(self, failure: Exception | None) -> None:
        """After an agreed job-wide failure: poll on until every rank's save is over (the
        committer deletes the refused save's files once every writer is done)."""
        if self.ckpt is None:  # a save in flight has its checkpointer: cannot happen
            raise RuntimeError("a save failure was agreed with no save in flight")
        while True:
            done = self.ckpt.done()
            if done and failure is None:
                with contextlib.suppress(Exception):
                    self.ckpt.wait()
            every, _ = agree_save(done, True, self.device)
            if every:
                return
            time.sleep(self.args.poll_s)

    def _finish_save(self) -> None:
        if self.pending_save < 0 or self.ckpt is None:
            return
        # an optional save (the controller's periodic one) is bounded here: the controller
        # abandons it at its own deadline, but ranks waiting on a hung write would never
        # reach the next boundary; the hold's save is bounded by the controller's abort
        failed = self._durable(
            self.pending_optional, self._save_timeout_s if self.pending_optional else None
        )
        step, self.pending_save = self.pending_save, -1
        if failed:
            self._save_failed(step, failed)
            return
        self.last_saved = step
        self.progress.emit({"event": "saved", "rank": self.args.rank, "step": self.last_saved})

    def _save_failed(self, step: int, why: str) -> None:
        """An optional save of ``step`` failed on some rank (agreed) and was abandoned: the
        agent's ``save_failed`` line, and the rank's stderr."""
        self.progress.emit(
            {"event": "save_failed", "rank": self.args.rank, "step": step, "error": why[:2000]}
        )
        print(f"optional checkpoint save of step {step} abandoned: {why}", file=sys.stderr)

    def _periodic_save(self, tr: _T) -> None:
        """The training config's checkpoint every ``every_steps`` (its own directory and
        retention, apart from the agent's): a save that is durable before training goes on,
        reported as ``periodic_checkpoint`` (not ``saved``: the agent's protocol is about its
        own requests). Every rank takes the same decision from the step alone.

        Optional, as the controller's periodic saves: one that fails on some rank (a full or
        read-only disk, an unreachable store) is agreed, dropped and reported
        (``periodic_checkpoint_failed`` with the step, what failed and the count of failures
        in a row; the rank's stderr) and training goes on; the next one is tried
        ``every_steps`` later. After :data:`PERIODIC_FAILURES_LIMIT` failures in a row
        (skips counted: :data:`PERIODIC_FAILURES_LIMIT`) the next save is required: its
        failure fails the ranks as any save's (``save_failure``). A job-wide failure (a
        refusal of non-finite weights) fails them at once. Each save, optional or not, is
        waited for ``--periodic-save-timeout-s`` at most (``_durable``)."""
        p, ckpt = self.periodic, self.ckpt  # ckpt is set whenever periodic is (__init__)
        if p is None or p.dir is None or ckpt is None or tr.step == self.args.start_step:
            return
        if tr.step % p.every_steps:
            return
        optional = self.periodic_failures < PERIODIC_FAILURES_LIMIT
        ckpt.save(tr, p.dir, keep=p.keep, optional=optional)
        if not optional:
            print(
                f"periodic checkpoint of step {tr.step}: {self.periodic_failures} saves in a "
                "row failed before it; this one is required (its failure fails the ranks)",
                file=sys.stderr,
                flush=True,
            )
        failed = self._durable(optional, self._save_timeout_s)
        if failed:
            self.periodic_failures += 1
            self.progress.emit(
                {
                    "event": "periodic_checkpoint_failed",
                    "rank": self.args.rank,
                    "step": tr.step,
                    "dir": p.dir,
                    "error": failed[:2000],
                    "in_a_row": self.periodic_failures,
                }
            )
            print(
                f"periodic checkpoint of step {tr.step} under {p.dir} abandoned "
                f"({self.periodic_failures} in a row, {PERIODIC_FAILURES_LIMIT} allowed): "
                f"{failed}",
                file=sys.stderr,
                flush=True,
            )
            return
        self.periodic_failures = 0
        self.progress.emit(
            {"event": "periodic_checkpoint", "rank": self.args.rank, "step": tr.step, "dir": p.dir}
        )

    def _maybe_save(self, tr: _T, req: ControlRequest, holding: bool) -> None:
        if not req.wants_save:
            return
        if holding:
            # At the hold step the save wanted is this step's, whichever step the request
            # names and whatever was taken for it before: ranks that passed a periodic
            # save's step before the Stop reached them (maybe the very step the
            # reconfiguration asks for, already in ``saved_requests``) would otherwise hold
            # at T with only that older save durable, and the controller commit it.
            if max(self.pending_save, self.last_saved) >= tr.step:
                return
        elif req.save_step in self.saved_requests or tr.step < req.save_step:
            return
        self.saved_requests.add(req.save_step)
        root, drop_steps = agree_target(req)
        if self._loaded_from(tr, root):
            # The state is the commit this generation loaded from that very directory, no
            # iteration since: it is durable there. Saving it again would overwrite the
            # commit in place (``writer.commit`` removes the step's marker before it writes
            # the new one: a crash between the two lost the step, with keep_checkpoints 1
            # the only one). Reported saved, as a save would be.
            self.last_saved = tr.step
            self.progress.emit({"event": "saved", "rank": self.args.rank, "step": tr.step})
            return
        if self.ckpt is None:
            raise RuntimeError(
                f"save of step {tr.step} requested (save_dir={root!r}), but this trainer runs "
                "without a checkpoint implementation"
            )
        if not root:
            raise RuntimeError(f"save of step {tr.step} requested without a checkpoint dir")
        # The save taken at the stop step is the reconfiguration's, whatever request it
        # answers (``Supervisor.stop_at`` keeps a periodic request's fields beside the Stop):
        # the controller commits the step once it is saved, so its failure must fail the
        # ranks, not let them stop with nothing saved at the step.
        optional = req.save_optional and not holding
        self.ckpt.save(
            tr, root, prune_below=req.prune_below, optional=optional, drop_steps=drop_steps
        )
        # A save that failed in its snapshot (here or on a peer: ``ckpt.save`` raises
        # neither) is raised by every rank now (an optional one reported), before the next
        # iteration's collectives; one poll of the save, on this boundary only. A save that
        # went on is awaited at the next boundary (``_finish_save``), as before.
        _, _, failed = self._poll(None, optional)
        if failed:
            self._save_failed(tr.step, failed)
            return
        self.pending_save, self.pending_optional = tr.step, optional

    def _loaded_from(self, tr: _T, root: str) -> bool:
        """``tr`` holds the committed step it was loaded from, under ``root`` (the same on
        every rank: the arguments and the agreed root)."""
        a = self.args
        load_step, ckpt_dir = getattr(a, "load_step", -1), getattr(a, "ckpt_dir", "")
        return (
            load_step >= 0
            and tr.step == load_step == a.start_step
            and bool(ckpt_dir)
            and os.path.normpath(ckpt_dir) == os.path.normpath(root)
        )

    def __call__(self, tr: _T) -> bool:
        self.status.step, self.status.in_iteration = tr.step, False
        stop = self._at(tr)
        # the next iteration (if any) runs until the next call: a failure there is its step's
        self.status.in_iteration = not stop
        return stop

    def _at(self, tr: _T) -> bool:
        a = self.args
        if a.min_step_s > 0:
            left = a.min_step_s - (time.monotonic() - self.last_boundary)
            if left > 0:
                time.sleep(left)
            self.last_boundary = time.monotonic()
        if a.fail_at_step is not None and tr.step == a.fail_at_step:
            raise InjectedFailureError(f"injected failure at step {tr.step} on rank {a.rank}")
        if a.abort_at_step is not None and tr.step == a.abort_at_step:
            os.abort()
        # The save in flight overlapped one iteration; report it once durable.
        self._finish_save()
        self._periodic_save(tr)
        req = self._request(tr)
        stop = req.wants_stop and tr.step >= req.stop_at_step
        self._maybe_save(tr, req, holding=stop)  # at the stop step: the hold's save
        if stop:
            self._hold(tr, req)
            return True
        return bool(tr.step >= a.start_step + a.steps)

    def _hold(self, tr: _T, req: ControlRequest) -> None:
        """At the stop step: wait (in lockstep) until a save of this step is durable."""
        # A poll count, not a clock: every rank must leave the loop at the same poll, since
        # each poll is a collective.
        polls = int(self.args.pause_timeout_s / self.args.poll_s)
        while self.pending_save < 0 and self.last_saved < tr.step and polls > 0:
            polls -= 1
            time.sleep(self.args.poll_s)
            req = self._request()
            self._maybe_save(tr, req, holding=True)
        self._finish_save()
        self.stopped_at = tr.step
        self.progress.emit({"event": "stopped", "rank": self.args.rank, "step": tr.step})
