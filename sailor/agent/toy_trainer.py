"""A toy training process speaking the agent's worker protocol (no torch): a stand-in for training.

Used where real training is beside the point: protocol tests, large simulated clusters in
the benchmarks, and runs on machines without torch. It "trains" a 4-parameter model on a
deterministic data stream, so its loss at a step depends only on the step (any layout gives
the same loss curve), and it checkpoints that state per rank with an atomic commit by rank 0.

Protocol (shared with the real worker's adapter):
- stdout: one JSON object per line: ``{"event": "ready"}``, ``{"event": "step", "step",
  "loss"}``, ``{"event": "saved", "step"}``, ``{"event": "stopped", "step"}``;
- ``--control FILE``: JSON ``{"stop_at_step": S, "save_step": S, "save_dir": DIR,
  "prune_below": P, "save_optional": B, "drop_steps": K}``, re-read at every iteration
  boundary (written atomically by the agent); once a save commits, rank 0 deletes the step
  directories below ``P``, and (K a list: the steps of saves the controller gave up on) every
  step of K at or above ``P`` that was committed when its save began, its ``COMMIT`` still
  the one it saw, and of it only that commit's files (``checkpoint/unrecorded.py``'s rule;
  a ``COMMIT`` names the attempt and a fresh id, so a save of the step again writes
  another), naming them in its ``saved`` line
  (``"deleted"``); a deletion that fails (``OSError``) after the commit leaves the save
  ``saved``, its error on stderr (the real worker's ``retention_error``). The toy's ranks
  share no collective to agree a later step on, so each saves at exactly ``S``; an optional
  save (the controller's periodic checkpoint) that a rank learns of only after it passed
  ``S`` is a save it missed: it leaves a ``rank-R.missed``
  marker in the step's directory and prints ``{"event": "save_failed", "step", "error"}``, and
  rank 0 gives that save up at once (a ``save_failed`` line, nothing committed) instead of
  waiting for the part (rank 0 clears the step's markers when its own save of it starts: those
  of an earlier attempt are not this one's); an optional save whose parts do not all come
  within the wait is given up the same way, and so is one whose write fails on a rank
  (``OSError``: a full or read-only disk, a root that cannot be made; that rank leaves its
  marker if it can). Training goes on. A required save (a reconfiguration's) still fails
  rank 0 when a part is missing, and any rank whose write fails. A part names its attempt
  (``--master`` and ``--load-step``: a later world saving the same step under the same root
  has another), and rank 0 counts only its own attempt's: a part an earlier world left there
  (saved, never committed) is not this save's;
- ``--error-file FILE``: the first failure cause, JSON, written before a non-zero exit;
- ``--train-config FILE``: the job's training config, which the agent appends to any worker's
  argv. Validated as the real worker does (an invalid one fails the rank before ``ready``,
  naming field and value), otherwise unused: the toy model has nothing to configure;
- ``--slowness "KIND=X,..."`` (or the environment's ``SAILOR_TOY_SLOWNESS``): each step line
  also carries the timings online calibration reads (``fwd_s``, ``bwd_s``, ``p2p_s``,
  ``sync_s``, ``optim_s``, ``step_s``, ``microbatches``), made up from the cost model for a
  cluster whose GPU types KIND compute X times slower than profiled, with ``--timing-noise``
  relative noise (:mod:`toy_timings`: simulated, not measured; the toy's own pace stays
  ``--step-s``). Without it, step lines carry no timings, as before;
- ``--in-place`` / ``--warm`` / SIGUSR1: the in-place protocol of the real worker (hold at
  the stop step or when the world is aborted, ``held`` line, relayout directive in the
  control file; see ``sailor.agent.supervisor``): a held toy keeps its weights when the
  directive's ``--load-step`` is the step it holds, else reads the checkpoint. It waits for
  a directive as the real worker does (``FileWait``: ~no CPU while idle) and, like it, dies
  with the agent that started it (``SAILOR_PARENT_PID``, ``parent_death``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sailor.durable import write_durably
from sailor.megatron_patch.file_wait import FileWait
from sailor.megatron_patch.parent_death import die_with_parent

if TYPE_CHECKING:
    from sailor.agent.toy_timings import ToyTimings

__all__ = ["main"]


def _target(step: int) -> list[float]:
    return [math.sin(0.1 * step + i) for i in range(4)]


def _write_atomic(path: Path, data: str) -> None:
    """``path`` replaced with ``data`` durably (:func:`write_durably`: its directory fsync'd
    too, as the real worker's storage does), its directory made if missing, and made again
    if it goes before the write (emptied and removed by another committer's deletion of a
    commit given up on, ``_drop_commit``). The temporary name carries the pid: ranks and
    generations may write one name at once (a ``rank-R.missed``)."""
    write_durably(path, data.encode(), tmp_suffix=f".tmp{os.getpid()}", make_dirs=True)


def _emit(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _ckpt_dir(root: str, step: int) -> Path:
    return Path(root) / "sim" / f"step-{step:08d}"


class _SaveGivenUpError(Exception):
    """An optional save given up (a rank missed its step, or a part never came)."""


def _save(
    root: str,
    step: int,
    w: list[float],
    rank: int,
    world: int,
    timeout: float,
    prune_below: int,
    optional: bool = False,
    attempt: str = "",
    drop_steps: list[int] | None = None,
) -> list[int]:
    """This rank's part of the save of ``step``; on rank 0 the commit and retention, and
    the steps retention deleted as unrecorded."""
    d = _ckpt_dir(root, step)
    seen = _commits(root, but=step) if rank == 0 and drop_steps else {}
    if rank == 0:
        # Markers of an earlier attempt at this step (a later generation saving it again
        # under the same root) are not this one's: without this, it was given up at once.
        # A rank that misses this attempt before the committer gets here loses its marker
        # too; the save is then given up after ``timeout`` instead of at once.
        for marker in d.glob("rank-*.missed"):
            marker.unlink(missing_ok=True)
    part = {"step": step, "w": w, "attempt": attempt}
    _write_atomic(d / f"rank-{rank}.json", json.dumps(part))
    if rank != 0:
        return []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        missed = [r for r in range(world) if (d / f"rank-{r}.missed").exists()]
        if missed and optional:
            why = (d / f"rank-{missed[0]}.missed").read_text()
            raise _SaveGivenUpError(f"rank(s) {missed} missed the save of step {step}: {why}")
        if all(_part_of(d / f"rank-{r}.json", attempt) for r in range(world)):
            # The marker names this attempt and a fresh id, and so does the state: a save
            # of the step again (another generation, or this one retried) writes another
            # marker, which a committer holding the old one (``_prune_unrecorded``) tells
            # from it; the state it deletes is the old commit's only.
            mark = json.dumps({"step": step, "attempt": attempt, "id": uuid.uuid4().hex})
            state = {"step": step, "w": w, "commit": mark}
            _write_atomic(d / "state.json", json.dumps(state))
            _write_atomic(d / "COMMIT", mark)
            below = min(prune_below, step)
            try:
                _prune(root, below)
                return _prune_unrecorded(root, seen, drop_steps or [], step, below)
            except OSError as exc:
                # committed: the save stands, its retention's failure is reported beside it
                # (the real worker's ``retention_error``), never the save's failure
                print(
                    f"checkpoint retention of step {step}: {type(exc).__name__}: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
                return []
        time.sleep(0.01)
    why = f"not every rank saved step {step} within {timeout}s"
    raise _SaveGivenUpError(why) if optional else TimeoutError(why)


def _attempt(a: argparse.Namespace) -> str:
    """What the ranks of one world share and a later world saving the same step does not:
    the rendezvous address (the controller gives each generation its own port,
    ``base_port + generation % 1000``) and the step the world started from.

    Not unique for good: a world 1000 generations later with the same first node, started
    from the same step, saving the same step under the same root, has the same attempt and
    would count an earlier world's leftover part (never committed) as its own. The
    generation itself would make it unique, but the toy knows it only from an in-place
    directive, not at a launch (its argv names no generation), and every rank of a world
    must compute the same attempt: a world mixing launched and directed ranks would then
    never commit. Left as is: the clash needs a thousand generations at one step (no test
    runs that many), and even then only a rank whose part of this save is not yet written
    when rank 0 looks is miscounted (its own save of the step overwrites the old part)."""
    return f"{a.master}|{a.load_step}"


def _part_of(path: Path, attempt: str) -> bool:
    """Whether ``path`` is a rank's part of this attempt: one left by an earlier attempt at
    the same step (a world that saved it and never committed) is not."""
    try:
        part = json.loads(path.read_text())
    except (OSError, ValueError):
        return False  # absent (or, written atomically, never half): not yet
    return isinstance(part, dict) and part.get("attempt") == attempt


def _missed(root: str, save_step: int, step: int, rank: int) -> str:
    """An optional save of ``save_step`` this rank learned of at ``step``, past it: its
    marker for the committer, and why."""
    why = f"rank {rank} read the request at step {step}, after step {save_step}"
    _write_atomic(_ckpt_dir(root, save_step) / f"rank-{rank}.missed", why)
    return why


def _prune(root: str, below: int) -> None:
    """The committer's retention (``prune_below`` of the control file): every step directory
    below ``below`` goes, un-committed first, as the real worker's checkpointer does."""
    for d in sorted((Path(root) / "sim").glob("step-*")):
        step = int(d.name.split("-")[1]) if d.name.split("-")[1].isdigit() else -1
        if 0 <= step < below:
            (d / "COMMIT").unlink(missing_ok=True)
            shutil.rmtree(d, ignore_errors=True)


def _commits(root: str, but: int) -> dict[int, str]:
    """Step -> its ``COMMIT`` marker, for every committed step directory but ``but``."""
    out: dict[int, str] = {}
    for d in (Path(root) / "sim").glob("step-*"):
        step = int(d.name.split("-")[1]) if d.name.split("-")[1].isdigit() else -1
        with contextlib.suppress(OSError):
            if step >= 0 and step != but:
                out[step] = (d / "COMMIT").read_text()
    return out


def _prune_unrecorded(
    root: str, seen: dict[int, str], drop: list[int], step: int, below: int
) -> list[int]:
    """The committer's deletion of the saves the controller gave up on
    (``checkpoint/unrecorded.py``): the commits seen (``seen``: committed when the save
    began) of the steps of ``drop`` at or above ``below``, other than ``step``; each the
    commit seen and nothing else of its step (``_drop_commit``)."""
    gone = []
    for s in sorted(seen):
        if s == step or s not in drop or s < max(below, 0):
            continue
        if _drop_commit(_ckpt_dir(root, s), seen[s]):
            gone.append(s)
    return gone


def _drop_commit(d: Path, marker: str) -> bool:
    """Delete the commit in ``d`` whose ``COMMIT`` held ``marker``, and only it (the real
    worker's ``unrecorded.drop_commit``): the step may be being saved again meanwhile by
    another generation, whose parts and state are not touched. The marker is taken away
    atomically (renamed) and compared; then the state goes if it is that commit's, the
    parts if they are of that commit's attempt, and the directory only if then empty.
    Whether the commit seen was there to delete."""
    try:
        attempt = json.loads(marker).get("attempt")
    except (ValueError, AttributeError):
        return False  # an older toy's marker (the bare step): not judged
    if not _take(d / "COMMIT", lambda now: now == marker):
        return False
    _take(d / "state.json", lambda now: _field(now, "commit") == marker)
    for part in sorted(d.glob("rank-*.json")):
        _take(part, lambda now: _field(now, "attempt") == attempt)
    with contextlib.suppress(OSError):
        d.rmdir()  # fails if a file is there: a save of the step writing into it
    return True


def _take(path: Path, ours: Callable[[str], bool]) -> bool:
    """Rename ``path`` to a unique hidden name and delete it if its text is ``ours``, else
    put it back (unless ``path`` was written again meanwhile: that newer file supersedes
    it); whether it was deleted."""
    hidden = path.with_name(f".{path.name}.dropped-{uuid.uuid4().hex[:12]}")
    try:
        path.rename(hidden)
        now = hidden.read_text()
    except OSError:
        return False
    if ours(now):
        hidden.unlink(missing_ok=True)
        return True
    if path.exists():
        hidden.unlink(missing_ok=True)
    else:
        hidden.rename(path)
    return False


def _field(text: str, key: str) -> object:
    """``key`` of the JSON object ``text``; None if it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj.get(key) if isinstance(obj, dict) else None


def _check_train_config(path: str) -> None:
    """Refuse an invalid training config like the real worker (imported only when given:
    pydantic adds to the start-up of the many toy workers that run without one)."""
    from sailor.schemas.training import parse_training_config

    parse_training_config(Path(path).read_text(), path)


def _timings(a: argparse.Namespace) -> ToyTimings:
    """The made-up step timings of this rank (imported only when asked: see toy_timings)."""
    from sailor.agent.toy_timings import ToyTimings, parse_slowness

    return ToyTimings(Path(a.plan), a.rank, parse_slowness(a.slowness), a.timing_noise)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sailor-toy-trainer")
    p.add_argument("--plan", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master", default="")
    p.add_argument("--control", required=True)
    p.add_argument("--load-dir", default="")
    p.add_argument("--load-step", type=int, default=-1)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--error-file", default="")
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--train-config", default="")
    p.add_argument("--slowness", default=os.environ.get("SAILOR_TOY_SLOWNESS"))
    p.add_argument("--timing-noise", type=float, default=0.02)
    p.add_argument("--in-place", action="store_true", help="Hold instead of exiting.")
    p.add_argument("--warm", action="store_true", help="A spare: wait for a directive.")
    p.add_argument("--pause-timeout-s", type=float, default=600.0)
    return p


class _Held:
    """What a held toy keeps: its step and weights, and whether its world broke."""

    def __init__(self, step: int, w: list[float], broken: bool) -> None:
        self.step, self.w, self.broken = step, w, broken


_aborted = False


def _on_usr1(_sig: int, _frame: object) -> None:
    global _aborted
    _aborted = True


def _directive(control: Path, after: int, timeout_s: float) -> tuple[int, list[str]] | None:
    """``(generation, argv)`` of a relayout directive of a generation above ``after``; the
    file is read again when it is replaced (``FileWait``: an idle spare costs ~no CPU)."""
    end = time.monotonic() + timeout_s
    with FileWait(control, poll_s=0.01) as waiter:
        while time.monotonic() < end:
            try:
                ctl = json.loads(control.read_text() or "{}")
            except (OSError, ValueError):
                ctl = {}
            d = ctl.get("relayout") if isinstance(ctl, dict) else None
            if isinstance(d, dict) and int(d.get("generation", -1)) > after:
                return int(d["generation"]), [str(x) for x in d.get("argv", [])]
            waiter.wait(end - time.monotonic())
    return None


def _generation(a: argparse.Namespace, held: _Held | None) -> _Held | None:
    """Train one generation; returns the held state (``--in-place``) or None (exit 0)."""
    global _aborted
    if a.train_config:
        _check_train_config(a.train_config)
    step, w = 0, [0.0, 0.0, 0.0, 0.0]
    if held is not None and not held.broken and held.step == a.load_step:
        step, w = held.step, held.w  # kept in memory: nothing read back
    elif a.load_dir and a.load_step >= 0:
        d = _ckpt_dir(a.load_dir, a.load_step)
        if not (d / "COMMIT").exists():
            raise FileNotFoundError(f"no committed checkpoint at {d}")
        state = json.loads((d / "state.json").read_text())
        step, w = int(state["step"]), [float(x) for x in state["w"]]
    timings = _timings(a) if a.slowness is not None else None
    path = "in_place" if held is not None else "restart"
    _aborted = False
    _emit({"event": "ready", "rank": a.rank, "start_step": step, "path": path})
    control = Path(a.control)
    seen: set[int] = set()  # the save steps acted on: saved, missed or given up
    while step < a.max_steps:
        time.sleep(a.step_s)
        if _aborted and a.in_place:
            _emit(
                {
                    "event": "held",
                    "rank": a.rank,
                    "step": step,
                    "broken": True,
                    "cause": "world aborted (SIGUSR1)",
                }
            )
            return _Held(step, w, broken=True)
        tgt = _target(step)
        w = [wi - 0.3 * (wi - ti) for wi, ti in zip(w, tgt, strict=True)]
        loss = sum((wi - ti) ** 2 for wi, ti in zip(w, tgt, strict=True))
        step += 1
        if step == a.fail_at_step:
            raise RuntimeError(f"injected failure at step {step}")
        line: dict[str, object] = {"event": "step", "rank": a.rank, "step": step}
        line["loss"] = round(loss, 10)
        if timings is not None:
            line.update(timings.step(step))
        _emit(line)
        try:
            ctl = json.loads(control.read_text() or "{}")
        except (OSError, ValueError):
            ctl = {}
        _maybe_save(ctl, step, w, a, seen)
        stop = ctl.get("stop_at_step")
        if stop is not None and step >= int(stop):
            _emit({"event": "stopped", "rank": a.rank, "step": step})
            if not a.in_place:
                return None
            # hold once the save of this step (if one is asked) is done: it was, above
            _emit({"event": "held", "rank": a.rank, "step": step, "broken": False})
            return _Held(step, w, broken=False)
    return None


def _maybe_save(
    ctl: dict[str, object], step: int, w: list[float], a: argparse.Namespace, seen: set[int]
) -> None:
    """The save the control file asks for, at exactly its step; an optional one missed,
    given up or failing on storage (``OSError``) is reported (``save_failed``) and training
    goes on, a required one that fails raises."""
    save, root, prune = ctl.get("save_step"), ctl.get("save_dir"), ctl.get("prune_below")
    if not isinstance(save, int) or isinstance(save, bool) or save < 0 or not root:
        return
    optional = ctl.get("save_optional") is True
    drop = ctl.get("drop_steps")
    drop_steps = [int(k) for k in drop if isinstance(k, int)] if isinstance(drop, list) else None
    if save in seen or save > step or (save < step and not optional):
        return
    seen.add(save)
    try:
        if save < step:
            raise _SaveGivenUpError(_missed(str(root), save, step, a.rank))
        deleted = _save(
            str(root),
            step,
            w,
            a.rank,
            a.world_size,
            timeout=30.0,
            prune_below=prune if isinstance(prune, int) else -1,
            optional=optional,
            attempt=_attempt(a),
            drop_steps=drop_steps,
        )
    except _SaveGivenUpError as exc:
        _emit({"event": "save_failed", "rank": a.rank, "step": save, "error": str(exc)})
        return
    except OSError as exc:
        if not optional:
            raise  # a required save's failure fails the rank (its error file names it)
        # As the real worker: an optional save that fails on storage (a full or read-only
        # disk, a root that cannot be made) is reported and training goes on.
        why = f"rank {a.rank} could not save step {save}: {type(exc).__name__}: {exc}"
        if a.rank != 0:  # the committer gives the save up at once, if the marker gets there
            with contextlib.suppress(OSError):
                _write_atomic(_ckpt_dir(str(root), save) / f"rank-{a.rank}.missed", why)
        _emit({"event": "save_failed", "rank": a.rank, "step": save, "error": why})
        return
    _emit(
        {
            "event": "saved",
            "rank": a.rank,
            "step": step,
            **({"deleted": deleted} if deleted else {}),
        }
    )


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # as the real worker: an agent's toy ends with it (parent_death)
    a = _parser().parse_args(argv)
    signal.signal(signal.SIGUSR1, _on_usr1)
    held: _Held | None = None
    generation = -1
    try:
        if a.warm:
            _emit({"event": "warm", "pid": os.getpid()})
            got = _directive(Path(a.control), generation, math.inf)  # as rank_main's spares
            if got is None:
                return 0
            generation, opts = got
            a = _parser().parse_args(opts)
        while True:
            held = _generation(a, held)
            if held is None:
                return 0
            got = _directive(Path(a.control), generation, a.pause_timeout_s)
            if got is None:
                return 0
            generation, opts = got
            a = _parser().parse_args(opts)
    except Exception as exc:
        if a.error_file:
            _write_atomic(
                Path(a.error_file),
                json.dumps({"rank": a.rank, "error": type(exc).__name__, "message": str(exc)}),
            )
        return 1


if __name__ == "__main__":
    sys.exit(main())
