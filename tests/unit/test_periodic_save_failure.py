"""A periodic (optional) save that fails on one rank is reported and training goes on; a
reconfiguration's save failing the same way still fails every rank (two real gloo ranks,
tiny-gpt, the worker's boundary and checkpoint glue, control files as the agent writes them).

Plan: one pipeline, layers 0-2 on rank 0 (also the committer), layers 3-5 on rank 1. Rank 1's
checkpoint storage refuses its first write of layer files (``ENOSPC``): a storage hiccup, in
the persist thread, through the real save path. The save of step 2 is asked for by each
rank's control file; after step 4 the control files ask for step 5.

- ``optional`` (``save_optional``: the controller's periodic checkpoint): both ranks agree
  the failure, print ``save_failed`` for step 2 naming rank 1 and the error, drop the save
  (rank 0's committer, waiting for rank 1's part, commits nothing and does not hold the
  next save up) and train on to step 7; the save of step 5 commits. Before, both ranks
  raised at step 3 and the job was relaunched.
- ``required`` (a reconfiguration's): rank 1 raises its OSError, rank 0 ``PeerFailedError``,
  as before.

The save taken while the ranks hold at a reconfiguration's stop step (3 here) is required
whatever request it answers, so the same failure there fails both ranks as above:

- ``hold-stop``: both control files carry the Stop beside a periodic request of step 6
  (``Supervisor.stop_at`` keeps a periodic request's save fields);
- ``hold-masked``: both files have the reconfiguration's Stop at step 3; rank 0's also its
  required Checkpoint of step 3, rank 1's still the periodic request of step 6 (``agree``
  took the save as optional: the required step 3 was below the agreed 6). Both ranks hold,
  so the hold's rule alone covers this case; ``agree``'s rule (optional only when no rank
  knows a required request) is covered by test_megatron_patch_control.py's table.

Before, both ranks reported ``save_failed`` and stopped at step 3 with nothing saved there;
the controller waited for a saved step 3 until its deadline.
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
from sailor.megatron_patch.boundary import Boundary, Progress, Status
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.rank_args import build_parser
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from tests.gloo_world import join_gloo, tiny_trainer
from tests.spawn import spawn

WORLD = 2
STEPS = 7
HOLD = 3
TIMEOUT_S = 25.0


def _stage(a: int, b: int) -> Stage:
    return Stage(
        first_layer=a,
        last_layer=b,
        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=1, gpus_per_node=1),
    )


PLAN = Plan(
    plan_id="pp",
    model="tiny-gpt",
    global_batch_size=2,
    pipelines=(
        Pipeline(stages=(_stage(0, 2), _stage(3, 5)), microbatch_size=1, num_microbatches=2),
    ),
)


class _FullOnce:
    """Local storage whose first ``write_all`` (a rank's layer files) fails as a full disk."""

    def __init__(self, inner: Any) -> None:
        self._inner, self.url, self.failed = inner, inner.url, False

    def write_all(self, objects: Sequence[tuple[str, Iterable[Any]]], **kw: Any) -> list[int]:
        if not self.failed:
            self.failed = True
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return list(self._inner.write_all(objects, **kw))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _control(path: Path, root: str, step: int, optional: bool, stop: int = -1) -> None:
    body: dict[str, object] = {"save_step": step, "save_dir": root, "prune_below": -1}
    if optional:
        body["save_optional"] = True
    if stop >= 0:
        body["stop_at_step"] = stop
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


def _rank(rank: int, store: str, out: str, case: str) -> None:
    from sailor.training_process import ckpt_glue
    from sailor.training_process.ckpt_glue import LayerCheckpointIO

    join_gloo(store, rank, WORLD, TIMEOUT_S)
    if rank == 1:
        real = ckpt_glue.open_storage
        ckpt_glue.open_storage = lambda url, **kw: _FullOnce(real(url, **kw))  # type: ignore[assignment,misc]
    tr = tiny_trainer(PLAN, rank, TrainConfig(seed=0), TIMEOUT_S)
    root = str(Path(out, "ckpt"))
    control = Path(out, f"control-{rank}.json")
    optional = case == "optional"
    if case == "hold-stop":  # the Stop beside the periodic request, on both nodes
        _control(control, root, 6, True, stop=HOLD)
    elif case == "hold-masked":  # the Stop reached both, the required Checkpoint rank 0's
        _control(control, root, *((HOLD, False) if rank == 0 else (6, True)), stop=HOLD)
    else:
        _control(control, root, 2, optional)
    argv = ["--plan", "-", "--rank", str(rank), "--world-size", str(WORLD), "--master", "-"]
    args = build_parser().parse_args([*argv, "--steps", str(STEPS)])
    args.poll_s, args.pause_timeout_s, args.control = 0.05, 30.0, str(control)
    progress = str(Path(out, f"progress-{rank}.jsonl"))
    b = Boundary(args, Status(rank), Progress(progress, False), LayerCheckpointIO(), tr.device)

    def hook(t: Trainer) -> bool:
        if t.step == 4 and not case.startswith("hold"):  # the next request: a save of step 5
            _control(control, root, 5, optional)
        return b(t)

    dist.barrier()
    t0 = time.monotonic()
    raised: list[str] | None = None
    try:
        tr.run(STEPS, hook=hook)
        b._finish_save()  # the save of step 5 durable (the worker's end of run)
    except Exception as exc:  # the type and text are what the test checks
        raised = [type(exc).__name__, str(exc)]
    took = time.monotonic() - t0
    Path(out, f"r{rank}.json").write_text(
        json.dumps({"raised": raised, "s": took, "step": tr.step, "saved": b.last_saved})
    )
    end = time.monotonic() + TIMEOUT_S + 10  # stay up until every rank recorded
    while time.monotonic() < end and not all(
        Path(out, f"r{r}.json").exists() for r in range(WORLD)
    ):
        time.sleep(0.1)
    os._exit(0)  # as the worker leaves: an abandoned committer's thread is not joined


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("case", ["optional", "required"])
def test_a_failed_periodic_save_is_reported_and_training_goes_on(tmp_path: Path, case: str) -> None:
    spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), case), nprocs=WORLD)
    got = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(WORLD)]
    lines = [_lines(tmp_path / f"progress-{r}.jsonl") for r in range(WORLD)]
    for r, o in enumerate(got):
        assert o["s"] < 20, f"rank {r} took {o['s']:.1f} s (a committer waited?): {got}"
    if case == "required":  # a reconfiguration's save: fatal on every rank, as before
        assert got[1]["raised"][0] == "OSError" and "No space left" in got[1]["raised"][1]
        assert got[0]["raised"][0] == "PeerFailedError", got
        assert "rank(s) 1" in got[0]["raised"][1], got
        assert not any(x["event"] == "save_failed" for rank in lines for x in rank), lines
        return
    for r, o in enumerate(got):
        assert o["raised"] is None and o["step"] == STEPS, (r, got)
        failed = [x for x in lines[r] if x["event"] == "save_failed"]
        assert len(failed) == 1 and failed[0]["step"] == 2 and failed[0]["rank"] == r, lines[r]
        assert "rank(s) 1" in failed[0]["error"] and "No space left" in failed[0]["error"]
        saved = [x["step"] for x in lines[r] if x["event"] == "saved"]
        assert saved == [5], lines[r]
    # the failed save committed nothing; the next one, after it, did
    assert committed_steps(open_storage(tmp_path / "ckpt")) == [5]


@pytest.mark.parametrize("case", ["hold-stop", "hold-masked"])
def test_a_failed_save_at_the_hold_fails_the_ranks(tmp_path: Path, case: str) -> None:
    """The save of the stop step answers the reconfiguration: its failure fails every rank,
    whichever request the control files hold (module docstring), instead of ``stopped``
    with the step unsaved."""
    spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), case), nprocs=WORLD)
    got = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(WORLD)]
    lines = [_lines(tmp_path / f"progress-{r}.jsonl") for r in range(WORLD)]
    for r, o in enumerate(got):
        assert o["s"] < 20, f"rank {r} took {o['s']:.1f} s: {got}"
        assert o["step"] == HOLD and o["saved"] < HOLD, got
    assert got[1]["raised"] is not None and got[1]["raised"][0] == "OSError", got
    assert "No space left" in got[1]["raised"][1], got
    assert got[0]["raised"] is not None and got[0]["raised"][0] == "PeerFailedError", got
    assert "rank(s) 1" in got[0]["raised"][1], got
    for rank in lines:
        assert not any(x["event"] in ("save_failed", "stopped") for x in rank), lines
    assert committed_steps(open_storage(tmp_path / "ckpt")) == []
