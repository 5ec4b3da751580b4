"""The training config's own periodic checkpoints (``checkpoint.every_steps``) that fail on a
rank's storage are reported and training goes on, up to ``PERIODIC_FAILURES_LIMIT`` failures
in a row (two real gloo ranks, tiny-gpt, the worker's boundary and checkpoint glue).

Plan: one pipeline, layers 0-2 on rank 0 (the committer), layers 3-5 on rank 1; a save every
step. Rank 1's storage refuses writes of layer files with ``ENOSPC`` (a full disk, in the
persist thread, through the real save path):

- ``transient``: its first write only. Both ranks agree the save of step 1 failed, print
  ``periodic_checkpoint_failed`` naming rank 1 and the error, and train on; the saves of steps
  2-6 commit (``keep`` 2: steps 5 and 6 are left). Before, rank 1 raised its OSError and
  rank 0 ``PeerFailedError`` at step 1: the run ended on one full-disk moment.
- ``persistent``: every write. Steps 1-3 fail and are reported (1, 2, 3 in a row); the save
  of step 4 is required and fails the ranks as any save's: rank 1 its OSError, rank 0
  ``PeerFailedError``.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from sailor.checkpoint import committed_steps, open_storage
from sailor.megatron_patch.boundary import PERIODIC_FAILURES_LIMIT, Boundary, Progress, Status
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.rank_args import build_parser
from sailor.schemas.training import CheckpointConfig
from tests.gloo_world import join_gloo, tiny_trainer
from tests.spawn import spawn
from tests.unit.test_periodic_save_failure import PLAN, WORLD

STEPS = 6
TIMEOUT_S = 25.0


class _Full:
    """Local storage whose ``write_all`` (a rank's layer files) fails as a full disk: the
    first call only (``once``) or every call."""

    def __init__(self, inner: Any, once: bool) -> None:
        self._inner, self.url, self.once, self.failed = inner, inner.url, once, 0

    def write_all(self, objects: Sequence[tuple[str, Iterable[Any]]], **kw: Any) -> list[int]:
        if not (self.once and self.failed):
            self.failed += 1
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return list(self._inner.write_all(objects, **kw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _rank(rank: int, store: str, out: str, case: str) -> None:
    from sailor.training_process import ckpt_glue
    from sailor.training_process.ckpt_glue import LayerCheckpointIO

    join_gloo(store, rank, WORLD, TIMEOUT_S)
    if rank == 1:
        real = ckpt_glue.open_storage
        full: dict[str, _Full] = {}

        def storage(url: str, **kw: Any) -> Any:  # one per root, as the disk is
            if url not in full:
                full[url] = _Full(real(url, **kw), once=case == "transient")
            return full[url]

        ckpt_glue.open_storage = storage  # type: ignore[assignment]
    tr = tiny_trainer(PLAN, rank, TrainConfig(seed=0), TIMEOUT_S)
    periodic = CheckpointConfig(dir=str(Path(out, "ckpt")), every_steps=1, keep=2)
    argv = ["--plan", "-", "--rank", str(rank), "--world-size", str(WORLD), "--master", "-"]
    args = build_parser().parse_args([*argv, "--steps", str(STEPS)])
    args.poll_s, args.pause_timeout_s = 0.05, 30.0
    progress = str(Path(out, f"progress-{rank}.jsonl"))
    b = Boundary(
        args, Status(rank), Progress(progress, False), LayerCheckpointIO(), tr.device, periodic
    )
    dist.barrier()
    raised: list[str] | None = None
    try:
        tr.run(STEPS, hook=b)
    except Exception as exc:  # the type and text are what the test checks
        raised = [type(exc).__name__, str(exc)]
    Path(out, f"r{rank}.json").write_text(json.dumps({"raised": raised, "step": tr.step}))
    end = time.monotonic() + TIMEOUT_S + 10  # stay up until every rank recorded
    while time.monotonic() < end and not all(
        Path(out, f"r{r}.json").exists() for r in range(WORLD)
    ):
        time.sleep(0.1)
    os._exit(0)  # as the worker leaves: an abandoned committer's thread is not joined


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("case", ["transient", "persistent"])
def test_a_failed_every_steps_save_is_reported_and_training_goes_on(
    tmp_path: Path, case: str
) -> None:
    spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), case), nprocs=WORLD)
    got = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(WORLD)]
    lines = [_lines(tmp_path / f"progress-{r}.jsonl") for r in range(WORLD)]
    for r in range(WORLD):
        failed = [x for x in lines[r] if x["event"] == "periodic_checkpoint_failed"]
        saved = [x["step"] for x in lines[r] if x["event"] == "periodic_checkpoint"]
        assert all("rank(s) 1" in x["error"] and "No space left" in x["error"] for x in failed)
        if case == "transient":
            assert got[r] == {"raised": None, "step": STEPS}, got
            assert [(x["step"], x["in_a_row"]) for x in failed] == [(1, 1)], lines[r]
            assert saved == [2, 3, 4, 5, 6], lines[r]
        else:
            limit = PERIODIC_FAILURES_LIMIT
            assert [x["step"] for x in failed] == list(range(1, limit + 1)), lines[r]
            assert [x["in_a_row"] for x in failed] == list(range(1, limit + 1))
            assert saved == [] and got[r]["step"] == limit + 1, got
    if case == "transient":
        assert committed_steps(open_storage(tmp_path / "ckpt")) == [5, 6]
    else:  # the save after the limit is required: fatal on every rank
        assert got[1]["raised"][0] == "OSError" and "No space left" in got[1]["raised"][1]
        assert got[0]["raised"][0] == "PeerFailedError" and "rank(s) 1" in got[0]["raised"][1]
        assert committed_steps(open_storage(tmp_path / "ckpt")) == []
