"""A save that fails inside ``ckpt.save`` on one rank is raised by every rank, none left in a
collective (three real gloo ranks, tiny-gpt, the worker's boundary and checkpoint glue).

Plan: one pipeline, layers 0-2 on a TP-2 stage (ranks 0 and 1: the checkpoint's TP gather),
layers 3-5 on rank 2. The save of step 1 fails on one rank, at one point:

- ``copy``: rank 2's copy of its layers to host memory (a pinned buffer failing);
- ``d2h``: the TP writer's copy of the gathered pieces to the host, after the gather;
- ``alloc``: the other TP rank's device memory for the gather, before it;
- ``storage``: opening the checkpoint root (its directory) on rank 1, before the save began;
- ``manifest``: the committer's manifest (the persist thread: already agreed in the poll).

By the agent's request (``_maybe_save``), the training config's periodic save (optional up to
``PERIODIC_FAILURES_LIMIT`` failures in a row: the failure injected stays, so the saves of
steps 1-3 are reported and the one of step 4 is raised) and the save at a hold. Each rank
records what it raised and when, then stays up until every rank has (under NCCL a peer that
raised is not seen as a closed socket: its peers wait in their collective). Every rank must
raise within a bound far below the process group's timeout: the failing rank its own error,
the others ``PeerFailedError`` naming it and its host. Before, the failing rank raised out of
``ckpt.save`` and the others waited in the save's gather or the next iteration's exchanges
until the timeout.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sailor.checkpoint import writer_assignment
from sailor.megatron_patch import boundary
from sailor.megatron_patch.boundary import PERIODIC_FAILURES_LIMIT, Boundary, Progress, Status
from sailor.megatron_patch.control import ControlRequest
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.groups import build_process_groups
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.rank_args import build_parser
from sailor.megatron_patch.roles import role_of
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.training import CheckpointConfig
from tests.spawn import spawn

WORLD = 3
TIMEOUT_S = 25.0
"""The process group's timeout: a rank left in a collective raises after this long."""
BOUND_S = 12.0
"""Each rank must have raised within this long of the save."""


def _stage(a: int, b: int, tp: int) -> Stage:
    return Stage(
        first_layer=a,
        last_layer=b,
        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=tp, gpus_per_node=2),
    )


PLAN = Plan(
    plan_id="tp-pp",
    model="tiny-gpt",
    global_batch_size=2,
    pipelines=(
        Pipeline(stages=(_stage(0, 2, 2), _stage(3, 5, 1)), microbatch_size=1, num_microbatches=2),
    ),
)
TP_WRITER = writer_assignment(PLAN)[0]
TP_OTHER = 1 - TP_WRITER
FAILING = {"copy": 2, "d2h": TP_WRITER, "alloc": TP_OTHER, "storage": 1, "manifest": 0}
"""The rank each failure point is injected on."""


class InjectedError(RuntimeError):
    pass


def _inject(point: str, rank: int) -> None:
    """Make the save fail at ``point`` on this rank (monkeypatching, in this process only)."""
    from sailor.checkpoint import checkpointer
    from sailor.training_process import ckpt_glue

    if point == "copy":

        def copy(*_a: Any, **_k: Any) -> Any:
            raise InjectedError(f"pinned host buffer failed on rank {rank}")

        checkpointer._copy_param = copy  # type: ignore[assignment]
    elif point == "d2h":

        def to_host(*_a: Any, **_k: Any) -> Any:
            raise InjectedError(f"device-to-host copy failed on rank {rank}")

        checkpointer._to_host = to_host  # type: ignore[assignment]
    elif point == "alloc":

        def flat(*_a: Any, **_k: Any) -> Any:
            raise InjectedError(f"device allocation failed on rank {rank}")

        checkpointer._flat = flat  # type: ignore[attr-defined]
    elif point == "storage":

        def open_storage(*_a: Any, **_k: Any) -> Any:
            raise OSError(f"mkdir: read-only file system on rank {rank}")

        ckpt_glue.open_storage = open_storage  # type: ignore[assignment]
    elif point == "manifest":

        def commit(*_a: Any, **_k: Any) -> Any:
            raise OSError(f"manifest write failed on rank {rank}")

        checkpointer.commit = commit  # type: ignore[assignment]


def _requests(path: str, root: str) -> Any:
    """The control file every rank reads, by boundary: a save of step 1 at once (agent), or
    a stop at step 1 first and the save only while held there (hold)."""
    calls = [0]

    def read(_path: object) -> ControlRequest:
        calls[0] += 1
        if path == "hold":
            save = 1 if calls[0] >= 4 else -1
            return ControlRequest(stop_at_step=1, save_step=save, save_dir=root if save else "")
        return ControlRequest(save_step=1, save_dir=root)

    return read


def _rank(rank: int, store: str, out: str, point: str, path: str) -> None:
    from sailor.training_process.ckpt_glue import LayerCheckpointIO

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    spec = tiny_model(PLAN.model, PLAN.global_batch_size)
    role = role_of(PLAN, rank)
    groups = build_process_groups(PLAN, role, spec.tie_embeddings, TIMEOUT_S)
    tr = Trainer(PLAN, spec, role, groups, TrainConfig(seed=0), torch.device("cpu"))
    root = str(Path(out, "ckpt"))
    argv = ["--plan", "-", "--rank", str(rank), "--world-size", str(WORLD), "--master", "-"]
    steps = PERIODIC_FAILURES_LIMIT + 1 if path == "periodic" else 3
    args = build_parser().parse_args([*argv, "--steps", str(steps)])
    args.poll_s, args.pause_timeout_s = 0.05, 30.0
    periodic = None
    if path == "periodic":
        periodic = CheckpointConfig(dir=root, every_steps=1, keep=2)
    else:
        args.control = "control.json"  # read through _requests, never opened
        boundary.read_control = _requests(path, root)  # type: ignore[assignment]
    if rank == FAILING[point]:
        _inject(point, rank)
    b = Boundary(
        args, Status(rank), Progress(None, False), LayerCheckpointIO(), tr.device, periodic
    )
    dist.barrier()
    t0 = time.monotonic()
    raised: list[str] | None = None
    try:
        tr.run(steps, hook=b)
    except Exception as exc:  # the type and text are what the test checks
        raised = [type(exc).__name__, str(exc)]
    took = time.monotonic() - t0
    Path(out, f"r{rank}.json").write_text(
        json.dumps({"raised": raised, "s": took, "step": tr.step})
    )
    # Stay up (sockets open, as an NCCL peer that raised looks to the others) until every
    # rank has recorded, or past the process group's timeout.
    end = time.monotonic() + TIMEOUT_S + 10
    while time.monotonic() < end and not all(
        Path(out, f"r{r}.json").exists() for r in range(WORLD)
    ):
        time.sleep(0.1)
    # as the worker leaves (os._exit): the committer's persist thread may wait for a part
    # that never comes, and a normal exit would join it
    os._exit(0)


CASES = [
    ("copy", "agent"),
    ("d2h", "agent"),
    ("alloc", "agent"),
    ("storage", "agent"),
    ("manifest", "agent"),
    ("copy", "periodic"),
    ("alloc", "periodic"),
    ("d2h", "hold"),
    ("storage", "hold"),
]


@pytest.mark.parametrize(("point", "path"), CASES, ids=[f"{p}-{q}" for p, q in CASES])
def test_a_save_failing_on_one_rank_is_raised_by_every_rank(
    tmp_path: Path, point: str, path: str
) -> None:
    spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), point, path), nprocs=WORLD)
    got = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(WORLD)]
    bad = FAILING[point]
    host = socket.gethostname()
    for r, o in enumerate(got):
        assert o["raised"] is not None, (r, got)
        assert o["s"] < BOUND_S, (
            f"rank {r} raised after {o['s']:.1f} s (left in a collective?): {got}"
        )
        name, text = o["raised"]
        if r == bad:
            assert name in ("InjectedError", "OSError") and f"on rank {bad}" in text, (r, got)
        else:
            assert name == "PeerFailedError", (r, got)
            assert f"rank(s) {bad} ({host})" in text and f"on rank {bad}" in text, (r, got)
    # every rank raised at the same boundary: the save's (step 1; the periodic saves', the
    # first required one) for a failure in the snapshot; a manifest written on the persist
    # thread may fail one boundary later
    steps = {o["step"] for o in got}
    first = PERIODIC_FAILURES_LIMIT + 1 if path == "periodic" else 1
    assert steps == {first} or (point == "manifest" and len(steps) == 1), got
