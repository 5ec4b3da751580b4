"""Ranks that hold at a stop step save that step, whatever was saved for the request before.

Two gloo ranks and the boundary's own control-file protocol. The controller asked a periodic
save of step 10 (no stop); the ranks took it at their boundary of step 10 and trained on. A
reconfiguration then asks to stop and save at step 10 too (both steps are "highest report +
a few"), but the Stop reaches the ranks only at step 12. Before, the request's step was in
``saved_requests``, the hold skipped it and waited out its pause for a save that never came:
it stopped at 12 with step 10 durable, and the controller committed 10 (2 steps lost; in
place, the ranks held 12 with a load step of 10). Now the hold saves step 12.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sailor.megatron_patch.boundary import Boundary, Progress, Status
from tests.spawn import spawn

PAUSE_S = 1.0


class _Trainer:
    def __init__(self) -> None:
        self.step = 0


class _Saves:
    """A checkpoint implementation that records the steps it was asked to save, each
    durable at once."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.optional: list[bool] = []
        self.drop: list[list[int] | None] = []

    def save(
        self,
        trainer: _Trainer,
        root: str,
        keep: int | None = None,
        prune_below: int = -1,
        optional: bool = False,
        drop_steps: tuple[int, ...] | None = None,
    ) -> float:
        self.steps.append(trainer.step)
        self.optional.append(optional)
        self.drop.append(None if drop_steps is None else list(drop_steps))
        return 0.0

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def close(self) -> None:
        return None


def _control(path: Path, **fields: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(fields))
    tmp.replace(path)


def _world(rank: int, store: str, out: str, **more: object) -> tuple[argparse.Namespace, Path]:
    """Join the two ranks' gloo world; the rank's boundary arguments (``more`` added) and
    its control file."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    control = Path(out, f"control-{rank}.json")
    args = argparse.Namespace(
        control=str(control),
        poll_s=0.02,
        pause_timeout_s=PAUSE_S,
        rank=rank,
        min_step_s=0.0,
        fail_at_step=None,
        abort_at_step=None,
        start_step=0,
        steps=100,
    )
    vars(args).update(more)
    return args, control


def _rank(rank: int, store: str, out: str) -> None:
    args, control = _world(rank, store, out)
    ckdir = str(Path(out, "ckpt"))
    progress_file = Path(out, f"progress-{rank}.jsonl")
    saves, tr = _Saves(), _Trainer()
    b = Boundary(
        args, Status(rank), Progress(str(progress_file), False), saves, torch.device("cpu")
    )  # type: ignore[arg-type]
    # the periodic request (optional); the Stop keeps its fields beside it
    _control(
        control, save_step=10, save_dir=ckdir, prune_below=-1, save_optional=True, drop_steps=[3]
    )
    stopped = False
    t0 = time.monotonic()
    while not stopped and tr.step < 20:
        tr.step += 1
        if tr.step == 12:  # the reconfiguration's Stop and Checkpoint arrive late
            _control(
                control,
                stop_at_step=10,
                save_step=10,
                save_dir=ckdir,
                prune_below=-1,
                save_optional=True,
                # the abandoned saves' steps, as each node's request names them: agreed as
                # their intersection (``control.agree_target``)
                drop_steps=[3, 5] if rank == 0 else [3, 7],
            )
        dist.barrier()  # both ranks' files written before either reads its own
        stopped = b(tr)
    took = time.monotonic() - t0
    dist.destroy_process_group()
    events = [json.loads(x) for x in progress_file.read_text().splitlines()]
    Path(out, f"r{rank}.json").write_text(
        json.dumps(
            {
                "saves": saves.steps,
                "optional": saves.optional,
                "drop": saves.drop,
                "stopped_at": b.stopped_at,
                "s": took,
                "events": events,
            }
        )
    )


def test_ranks_holding_past_a_periodic_save_save_the_step_they_hold(tmp_path: Path) -> None:
    spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    for r in (0, 1):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["stopped_at"] == 12, got
        assert got["saves"] == [10, 12], got
        # the periodic save may be skipped; the hold's is the reconfiguration's: required
        assert got["optional"] == [True, False], got
        assert got["drop"] == [[3], [3]], got  # the same on every rank
        saved = [e["step"] for e in got["events"] if e["event"] == "saved"]
        assert saved == [10, 12], got
        assert got["s"] < PAUSE_S, got  # saved at once, not after waiting out the pause


def _rank_loaded(rank: int, store: str, out: str, same_dir: bool) -> None:
    """Ranks resumed from step 10 of ``ckpt`` asked, at once, to hold there and save."""
    ckdir = str(Path(out, "ckpt"))
    # ckpt_dir: the same root, spelled otherwise
    args, control = _world(rank, store, out, start_step=10, load_step=10, ckpt_dir=ckdir + "/")
    progress_file = Path(out, f"progress-{rank}.jsonl")
    saves, tr = _Saves(), _Trainer()
    tr.step = 10
    b = Boundary(
        args, Status(rank), Progress(str(progress_file), False), saves, torch.device("cpu")
    )  # type: ignore[arg-type]
    _control(
        control,
        stop_at_step=10,
        save_step=10,
        save_dir=ckdir if same_dir else str(Path(out, "other")),
        prune_below=-1,
    )
    dist.barrier()
    stopped = b(tr)  # the boundary before the first iteration
    dist.destroy_process_group()
    events = [json.loads(x) for x in progress_file.read_text().splitlines()]
    Path(out, f"r{rank}.json").write_text(
        json.dumps({"stopped": stopped, "saves": saves.steps, "events": events})
    )


@pytest.mark.parametrize("same_dir", [True, False], ids=["loaded-dir", "other-dir"])
def test_a_hold_at_the_loaded_step_does_not_rewrite_its_commit(
    tmp_path: Path, same_dir: bool
) -> None:
    """Resumed from step 10 and asked to hold at 10 (a stop step from a status that had
    not yet seen the resume): the state is the commit just loaded. Saved again into its
    own directory, the commit was overwritten in place, its marker removed first: a crash
    then lost the step (found by review). Now it is reported saved without a write; a save
    into another directory is written as before."""
    spawn(_rank_loaded, args=(str(tmp_path / "store"), str(tmp_path), same_dir), nprocs=2)
    for r in (0, 1):
        got = json.loads((tmp_path / f"r{r}.json").read_text())
        assert got["stopped"], got
        assert got["saves"] == ([] if same_dir else [10]), got
        assert [e["step"] for e in got["events"] if e["event"] == "saved"] == [10], got
