"""The engine's host waits for the device: one per iteration, the step agreement's read.

Two real gloo ranks (tiny-gpt, one pipeline of two stages) train with clipping and an
evaluation every other step, under the worker's boundary with a control file per rank, as
an agent runs them. Every wait goes through ``comm.abort.host_sync`` (``clock.synchronize``)
and every host read of a tensor by Sailor's code through ``Tensor.item``/``tolist``: both
are counted in each rank (instrumentation of the real path, nothing replaced), between
iteration markers. On CPU a wait returns at once, but the sites are the ones that wait on a
GPU. (Before: five waits in the train step, the timestamps' and the agreement's, and one
more with a read in the boundary's control agreement.)

Expected per iteration: the train step waits once and reads only after that wait (the
agreement's vector and the control request's, issued beside it); the boundary after it
neither waits nor reads (the request was agreed in the iteration); an evaluation adds its own
wait and read; under a loss scaler with clipping, the norm of the unscaled gradients adds one.
Rank 1's control file alone asks to stop at step 3: both ranks stop there (the MAX agreed).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sailor.comm import abort as comm_abort
from sailor.megatron_patch.boundary import Boundary, Progress, Status
from sailor.megatron_patch.control import read_control
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.rank_args import build_parser
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.training import LossScalingConfig
from tests.gloo_world import join_gloo, tiny_trainer
from tests.spawn import spawn

WORLD = 2
STOP = 3
TIMEOUT_S = 25.0


def _stage(a: int, b: int) -> Stage:
    return Stage(
        first_layer=a,
        last_layer=b,
        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=1, gpus_per_node=1),
    )


PLAN = Plan(
    plan_id="waits",
    model="tiny-gpt",
    global_batch_size=2,
    pipelines=(
        Pipeline(stages=(_stage(0, 2), _stage(3, 5)), microbatch_size=1, num_microbatches=2),
    ),
)


def _rank(rank: int, store: str, out: str, scaler: bool) -> None:
    join_gloo(store, rank, WORLD, TIMEOUT_S)
    scaling = LossScalingConfig(mode="dynamic") if scaler else LossScalingConfig()
    cfg = TrainConfig(seed=0, clip_grad_norm=0.5, eval_every=2, loss_scaling=scaling)
    tr = tiny_trainer(PLAN, rank, cfg, TIMEOUT_S)
    control = Path(out, f"control-{rank}.json")
    control.write_text(json.dumps({"stop_at_step": STOP} if rank == 1 else {}))
    argv = ["--plan", "-", "--rank", str(rank), "--world-size", str(WORLD), "--master", "-"]
    args = build_parser().parse_args([*argv, "--steps", "10"])
    args.poll_s, args.pause_timeout_s, args.control = 0.02, 0.1, str(control)
    b = Boundary(args, Status(rank), Progress(None, False), None, tr.device)
    tr.control_source = functools.partial(read_control, str(control))  # as rank_main sets it

    log: list[str] = []
    real_sync = comm_abort.host_sync
    real_item, real_tolist = torch.Tensor.item, torch.Tensor.tolist

    def host_sync(device: Any) -> None:
        log.append("wait")
        real_sync(device)

    def note_read() -> None:  # Sailor's reads (torch's AdamW reads its host step counters)
        if sys._getframe(2).f_globals.get("__name__", "").startswith("sailor."):
            log.append("read")

    def item(self: torch.Tensor) -> Any:
        note_read()
        return real_item(self)

    def tolist(self: torch.Tensor) -> Any:
        note_read()
        return real_tolist(self)

    comm_abort.host_sync = host_sync  # type: ignore[assignment]
    torch.Tensor.item = item  # type: ignore[method-assign]
    torch.Tensor.tolist = tolist  # type: ignore[method-assign]

    def hook(t: Trainer) -> bool:
        stop = b(t)
        log.append("|")
        return stop

    results = tr.run(10, hook=hook, on_step=lambda res: log.append("step"))
    torch.Tensor.item, torch.Tensor.tolist = real_item, real_tolist  # type: ignore[method-assign]
    comm_abort.host_sync = real_sync
    Path(out, f"r{rank}.json").write_text(
        json.dumps({"log": log, "steps": [r.step for r in results], "stopped": b.stopped_at})
    )
    end = time.monotonic() + TIMEOUT_S
    while time.monotonic() < end and not all(
        Path(out, f"r{r}.json").exists() for r in range(WORLD)
    ):
        time.sleep(0.05)
    os._exit(0)


def _iterations(log: list[str]) -> list[tuple[list[str], list[str]]]:
    """(train step's events, boundary's events) of each iteration, after the first
    boundary (which agrees its request itself)."""
    text = " ".join(log).split("|")[1:]  # [0]: the first boundary
    out = []
    for chunk in text:
        if "step" not in chunk:
            continue
        step, boundary = chunk.split("step")
        out.append((step.split(), boundary.split()))
    return out


@pytest.mark.parametrize("scaler", [False, True], ids=["fp32", "loss-scaler"])
def test_one_host_wait_per_iteration(tmp_path: Path, scaler: bool) -> None:
    spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), scaler), nprocs=WORLD)
    for rank in range(WORLD):
        got = json.loads((tmp_path / f"r{rank}.json").read_text())
        assert got["steps"] == [1, 2, 3] and got["stopped"] == STOP, got
        its = _iterations(got["log"])
        assert len(its) == STOP, got["log"]
        for step, (train, boundary) in enumerate(its, start=1):
            # the agreement: one wait, then its two reads (the step's and the control's)
            want = ["wait", "read", "read"]
            if scaler:  # clipping's norm of the unscaled gradients
                want += ["wait", "read"]
            if step % 2 == 0:  # the evaluation's loss
                want += ["wait", "read"]
            assert train == want, (rank, step, got["log"])
            if step < STOP:  # the stop step's boundary holds, polling: collectives
                assert boundary == [], (rank, step, got["log"])
