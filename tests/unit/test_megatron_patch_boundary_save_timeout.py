"""The controller's optional (periodic) save is waited for ``--periodic-save-timeout-s`` at
most at the next boundary (``Boundary._finish_save``), one process, no process group (the
boundary's agreements are then the rank's own values).

The controller abandons a periodic save at its own deadline, but a rank whose write hangs
would never reach the next boundary to hear of it: every rank sat in ``_durable``'s polls
for as long as the write took (for good on a hung mount). With the timeout, the save fails
(``SaveTimeoutError``), is dropped (``abandon``) and reported (``save_failed``), and
training goes on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from sailor.megatron_patch.boundary import Boundary, Progress, Status
from sailor.megatron_patch.rank_args import build_parser

HANG_S = 6.0
"""How long the save's write blocks: longer than the test waits with the timeout."""


class _HungSave:
    """A save whose write ends ``HANG_S`` after it starts (hung, as far as the run can
    tell); ``abandon`` drops it."""

    def __init__(self) -> None:
        self.end = 0.0
        self.saved: list[tuple[int, bool]] = []
        self.abandoned = 0

    def save(self, trainer: object, root: str, **kw: object) -> float:
        self.saved.append((trainer.step, bool(kw.get("optional"))))  # type: ignore[attr-defined]
        self.end = time.monotonic() + HANG_S
        return 0.0

    def done(self) -> bool:
        return time.monotonic() >= self.end

    def wait(self) -> None:
        time.sleep(max(0.0, self.end - time.monotonic()))

    def abandon(self) -> None:
        self.abandoned += 1
        self.end = 0.0


class _Trainer:
    def __init__(self) -> None:
        self.step = 0


def test_an_optional_save_whose_write_hangs_is_dropped_after_the_timeout(tmp_path: Path) -> None:
    control, progress = tmp_path / "control.json", tmp_path / "progress.jsonl"
    control.write_text(
        json.dumps({"save_step": 1, "save_dir": str(tmp_path), "save_optional": True})
    )
    argv = ["--plan", "-", "--rank", "0", "--world-size", "1", "--master", "-"]
    args = build_parser().parse_args([*argv, "--control", str(control), "--steps", "5"])
    args.poll_s, args.periodic_save_timeout_s = 0.02, 0.5
    save = _HungSave()
    b = Boundary(args, Status(0), Progress(str(progress), False), save, torch.device("cpu"))  # type: ignore[arg-type]
    tr = _Trainer()
    tr.step = 1
    b(tr)  # the save of step 1 starts; awaited at the next boundary
    assert save.saved == [(1, True)]
    tr.step = 2
    t0 = time.monotonic()
    b(tr)
    took = time.monotonic() - t0
    assert took < HANG_S - 2, took  # the timeout, not the write
    events = [json.loads(x) for x in progress.read_text().splitlines()]
    failed = [e for e in events if e["event"] == "save_failed"]
    assert [e["step"] for e in failed] == [1], events
    assert "SaveTimeoutError" in failed[0]["error"] and "0.5 s" in failed[0]["error"]
    assert save.abandoned == 1 and not [e for e in events if e["event"] == "saved"]
