"""A periodic save whose write hangs on one rank's mount (an NFS server gone) ends neither
training nor the ranks' wait for good: two real gloo ranks, tiny-gpt, the worker's boundary
and checkpoint glue, the training config's ``checkpoint.every_steps`` (every step).

Rank 1's storage blocks its first write of layer files (for ``HANG_S``, far longer than the
test takes: hung as far as the run can tell); ``--periodic-save-timeout-s`` is 1 s.

- step 1: rank 1's write does not end, nor the committer's wait for its part: both ranks'
  deadline passes, the save fails (``SaveTimeoutError``), is dropped and reported (1 in a
  row); rank 1's write is left running;
- steps 2, 3: rank 1 still writes the abandoned save: skipped (``SaveSkippedError``),
  counted (2, 3 in a row);
- step 4 is required (``PERIODIC_FAILURES_LIMIT``) and under the same root as the hung
  write: refused at once on rank 1 (``AbandonedWriteError``, naming the root), rank 0
  ``PeerFailedError``.

Before, step 1's save was waited for until the write ended (``Boundary._durable`` had no
deadline): every rank stood still for the whole hang; and after three skips the required
save took a second snapshot and wrote into the hung mount.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

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
HANG_S = 20.0
"""How long rank 1's first write blocks: longer than the run takes with the deadline."""


class _Hung:
    """Local storage whose first ``write_all`` (a rank's layer files) blocks for ``HANG_S``,
    as a write to a hung mount does; later ones go through."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.url = inner, inner.url
        self._first = threading.Event()

    def write_all(self, objects: Sequence[tuple[str, Iterable[Any]]], **kw: Any) -> list[int]:
        if not self._first.is_set():
            self._first.set()
            time.sleep(HANG_S)
        return list(self._inner.write_all(objects, **kw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _rank(rank: int, store: str, out: str) -> None:
    from sailor.training_process import ckpt_glue
    from sailor.training_process.ckpt_glue import LayerCheckpointIO

    join_gloo(store, rank, WORLD, TIMEOUT_S)
    ckpt_glue.ABANDONED_WAIT_S = 0.2  # type: ignore[misc]
    if rank == 1:
        real = ckpt_glue.open_storage
        hung: dict[str, _Hung] = {}

        def storage(url: str, **kw: Any) -> Any:  # one per root, as the mount is
            if url not in hung:
                hung[url] = _Hung(real(url, **kw))
            return hung[url]

        ckpt_glue.open_storage = storage  # type: ignore[assignment]
    tr = tiny_trainer(PLAN, rank, TrainConfig(seed=0), TIMEOUT_S)
    periodic = CheckpointConfig(dir=str(Path(out, "ckpt")), every_steps=1, keep=2)
    argv = ["--plan", "-", "--rank", str(rank), "--world-size", str(WORLD), "--master", "-"]
    args = build_parser().parse_args([*argv, "--steps", str(STEPS)])
    args.poll_s, args.pause_timeout_s, args.periodic_save_timeout_s = 0.05, 30.0, 1.0
    progress = str(Path(out, f"progress-{rank}.jsonl"))
    b = Boundary(
        args, Status(rank), Progress(progress, False), LayerCheckpointIO(), tr.device, periodic
    )
    dist.barrier()
    raised: list[str] | None = None
    t0 = time.monotonic()
    try:
        tr.run(STEPS, hook=b)
    except Exception as exc:  # the type and text are what the test checks
        raised = [type(exc).__name__, str(exc)]
    took = time.monotonic() - t0
    Path(out, f"r{rank}.json").write_text(
        json.dumps({"raised": raised, "step": tr.step, "s": took})
    )
    end = time.monotonic() + TIMEOUT_S + 10  # stay up until every rank recorded
    while time.monotonic() < end and not all(
        Path(out, f"r{r}.json").exists() for r in range(WORLD)
    ):
        time.sleep(0.1)
    os._exit(0)  # as the worker leaves: the hung write's thread is not joined


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_a_hung_periodic_write_times_out_and_the_required_save_fails_at_once(
    tmp_path: Path,
) -> None:
    spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    got = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(WORLD)]
    limit = PERIODIC_FAILURES_LIMIT
    for r in range(WORLD):
        lines = _lines(tmp_path / f"progress-{r}.jsonl")
        failed = [x for x in lines if x["event"] == "periodic_checkpoint_failed"]
        assert [(x["step"], x["in_a_row"]) for x in failed] == [
            (s, s) for s in range(1, limit + 1)
        ], lines
        assert "SaveTimeoutError" in failed[0]["error"] and "rank(s)" in failed[0]["error"]
        assert all("SaveSkippedError" in x["error"] for x in failed[1:]), failed
        assert not [x for x in lines if x["event"] == "periodic_checkpoint"], lines
        assert got[r]["step"] == limit + 1, got
        assert got[r]["s"] < HANG_S, got  # never waited for the hung write
    assert got[1]["raised"][0] == "AbandonedWriteError", got
    assert "not known good" in got[1]["raised"][1], got
    assert got[0]["raised"][0] == "PeerFailedError" and "rank(s) 1" in got[0]["raised"][1]
    assert committed_steps(open_storage(tmp_path / "ckpt")) == []
