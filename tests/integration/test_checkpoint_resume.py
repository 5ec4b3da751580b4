"""Resume under another layout == never stopped (sailor.megatron_patch + sailor.checkpoint).

Layout A (two pipelines of different depth and split, a TP=2 stage, microbatches 2x1 and 1x2)
trains tiny-gpt without stopping for N+M+K steps, saving asynchronously at steps N, N+M and
N+M+K while training goes on. From A's checkpoint at N:

- B1 (one pipeline, three stages, all TP=1, microbatches 1x4): other depth and split, other
  replica count (2 -> 1), TP=2 -> TP=1, other microbatch split;
- B2 (three pipelines, TP=2 where A had TP=1, microbatches 2x1, 1x1, 1x1): more replicas;

each train M steps and save. Then A resumes from B1's checkpoint at N+M for K steps (A -> B ->
A). Every resumed run's losses must equal A's losses at the same steps, and its final weights
and both AdamW moments must equal A's checkpoint at the same step, within fp32 rounding of the
different reduction orders (TP splits, sync groups) — not bitwise across layouts, but tight.

The glue between the two packages is the shipped one (``sailor.training_process.ckpt_glue``:
``LayerCheckpointIO`` over ``trainer_params`` and ``restore_trainer``), called as the worker
calls it: ``position`` and ``restore`` before training, ``save`` at a boundary and ``wait``
at the next one, ``close`` at the end. Right after each restore, every rank's weights, both
AdamW moments and the AdamW step must equal what the checkpoint holds for it, bitwise, and
the weights must have been read straight into the parameters (the ``into=`` path).
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from sailor.checkpoint import LocalStorage, ParamState, load, load_for_rank, read_manifest, verify
from sailor.megatron_patch.engine import TrainConfig, Trainer
from sailor.megatron_patch.groups import build_process_groups
from sailor.megatron_patch.launch import free_port
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.state import optimizer_state, stage_state
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from sailor.training_process import ckpt_glue
from sailor.training_process.ckpt_glue import LayerCheckpointIO
from tests.spawn import spawn

MODEL = "tiny-gpt"
GBS = 4
N, M, K = 3, 3, 2
# Measured on this CPU (pytest -s prints it): loss gaps <= 2.4e-7, weight/moment gaps
# <= 4.6e-7 — fp32 rounding of different reduction orders. The bounds leave ~4x of room.
LOSS_ATOL = 2e-6
PARAM_ATOL = 2e-6


def _plan(pid: str, pipes: list[tuple[list[tuple[int, int, int]], int, int]]) -> Plan:
    return Plan(
        plan_id=pid,
        model=MODEL,
        global_batch_size=GBS,
        pipelines=tuple(
            Pipeline(
                stages=tuple(
                    Stage(
                        first_layer=a,
                        last_layer=b,
                        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=tp, gpus_per_node=2),
                    )
                    for a, b, tp in stages
                ),
                microbatch_size=mbs,
                num_microbatches=nmb,
            )
            for stages, mbs, nmb in pipes
        ),
    )


# tiny-gpt: 4 blocks -> global layers 0 (embedding) .. 5 (head).
PLAN_A = _plan("A", [([(0, 1, 2), (2, 5, 1)], 2, 1), ([(0, 2, 1), (3, 5, 1)], 1, 2)])
PLAN_B1 = _plan("B1", [([(0, 0, 1), (1, 3, 1), (4, 5, 1)], 1, 4)])
PLAN_B2 = _plan(
    "B2",
    [([(0, 5, 1)], 2, 1), ([(0, 3, 2), (4, 5, 1)], 1, 1), ([(0, 1, 1), (2, 5, 2)], 1, 1)],
)


def _restored(tr: Trainer, root: str, plan: Plan, rank: int, step: int) -> dict[str, Any]:
    """How this rank's live state, right after ``restore``, differs from the checkpoint.

    The checkpoint is read again on its own (no ``into=``) and compared bitwise with the
    parameters, the optimizer's moments and its step count.
    """
    dims = {k: d for k, (_t, d) in stage_state(tr.stage).items()}
    want = load_for_rank(LocalStorage(root), plan, rank, step=step, tp_dims=dims).params
    opt = optimizer_state(tr.stage, tr.optimizer)
    gaps = dict.fromkeys(("weight", "exp_avg", "exp_avg_sq"), 0.0)
    for key, (t, _d) in stage_state(tr.stage).items():
        if key not in opt:  # reported by "keys"
            continue
        got = {"weight": t, "exp_avg": opt[key]["exp_avg"], "exp_avg_sq": opt[key]["exp_avg_sq"]}
        for kind, x in got.items():
            w = want[key].tensor(kind)  # type: ignore[arg-type]
            gap = float((x - w).abs().max()) if x.shape == w.shape else math.inf
            gaps[kind] = max(gaps[kind], gap)
    return {
        "keys": sorted(dims) == sorted(opt),
        "steps": sorted({s["step"] for s in opt.values()}),
        "gaps": gaps,
    }


def _rank_main(rank: int, job: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    plan = Plan.model_validate_json(job["plan"])
    spec = tiny_model(MODEL, GBS)
    role = role_of(plan, rank)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{job['master']}",
        rank=rank,
        world_size=role.world_size,
        timeout=timedelta(seconds=60),
    )
    groups = build_process_groups(plan, role, spec.tie_embeddings, 60.0)
    io = LayerCheckpointIO(keep=None)
    step, consumed = 0, 0
    if job["resume_from"]:
        step, consumed = io.position(job["resume_from"], job["resume_step"])
    tr = Trainer(plan, spec, role, groups, TrainConfig(seed=0), torch.device("cpu"), step, consumed)
    if job["resume_from"]:
        ptrs = [p.data_ptr() for p in tr.stage.parameters()]
        # Watched to see that restore_trainer took the zero-copy path (fp32 CPU parameters).
        with mock.patch.object(ckpt_glue, "load_for_rank", wraps=load_for_rank) as read:
            io.restore(tr, job["resume_from"], job["resume_step"])
        check = _restored(tr, job["resume_from"], plan, rank, job["resume_step"])
        check["into"] = [c.kwargs.get("into") is not None for c in read.call_args_list] == [True]
        check["same_storage"] = ptrs == [p.data_ptr() for p in tr.stage.parameters()]
        check["position"] = [tr.step, tr.consumed_samples]
        Path(job["save_to"], f"restored-{rank}.json").write_text(json.dumps(check))

    def hook(t: Trainer) -> bool:
        io.wait()  # the save in flight overlapped one iteration, as in the worker
        if t.step in job["save_at"]:
            io.save(t, job["save_to"])
        return bool(t.step >= job["end_step"])

    losses = [r.loss for r in tr.run(job["end_step"] - step, hook=hook)]
    io.close()
    if rank == 0:
        Path(job["save_to"], "losses.json").write_text(json.dumps(losses))
    dist.barrier()
    dist.destroy_process_group()


def _run(
    plan: Plan, save_to: Path, end_step: int, save_at: list[int], resume: tuple[Path, int] | None
) -> list[float]:
    save_to.mkdir(parents=True, exist_ok=True)
    job = {
        "plan": plan.model_dump_json(),
        "master": f"127.0.0.1:{free_port()}",
        "save_to": str(save_to),
        "save_at": save_at,
        "end_step": end_step,
        "resume_from": str(resume[0]) if resume else "",
        "resume_step": resume[1] if resume else -1,
    }
    spawn(_rank_main, args=(job,), nprocs=len(plan.ranks()))
    losses: list[float] = json.loads((save_to / "losses.json").read_text())
    return losses


def _full(root: Path, step: int) -> dict[str, ParamState]:
    return load(LocalStorage(root), range(PLAN_A.num_layers), step=step).params


def _max_diff(a: dict[str, ParamState], b: dict[str, ParamState]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        for kind in ("weight", "exp_avg", "exp_avg_sq"):
            x, y = a[k].tensor(kind), b[k].tensor(kind)  # type: ignore[arg-type]
            assert x.shape == y.shape, (k, kind)
            worst = max(worst, float((x - y).abs().max()))
    return worst


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    root = tmp_path_factory.mktemp("ckpt") / "A"
    losses = _run(PLAN_A, root, N + M + K, [N, N + M, N + M + K], None)
    assert len(losses) == N + M + K and all(math.isfinite(x) for x in losses)
    for s in (N, N + M, N + M + K):
        assert verify(LocalStorage(root), s) == []
    return root, losses


@pytest.fixture(scope="module")
def resumed(
    baseline: tuple[Path, list[float]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, list[float]]]:
    root_a, _ = baseline
    out = {}
    for plan in (PLAN_B1, PLAN_B2):
        root = tmp_path_factory.mktemp("ckpt") / plan.plan_id
        out[plan.plan_id] = (root, _run(plan, root, N + M, [N + M], (root_a, N)))
    return out


def _gaps(
    losses: list[float], ref: list[float], a: Path, b: Path, step: int
) -> tuple[float, float]:
    loss_gap = max(abs(x - y) for x, y in zip(losses, ref, strict=True))
    state_gap = _max_diff(_full(a, step), _full(b, step))
    print(
        f"{a.name} vs {b.name} at step {step}: loss gap {loss_gap:.1e}, state gap {state_gap:.1e}"
    )
    return loss_gap, state_gap


def _check_restored(root: Path, plan: Plan, step: int) -> None:
    """Every rank's state right after ``restore_trainer`` is the checkpoint's, bitwise.

    Catches a restore that drops or misplaces a moment, leaves the AdamW step at 0 or sets
    another (bias correction would then differ), slices a TP shard wrongly, or stops
    reading into the live parameters (the ``into=`` path).
    """
    for rank in range(len(plan.ranks())):
        got = json.loads((root / f"restored-{rank}.json").read_text())
        assert got["keys"], (plan.plan_id, rank, "parameters without AdamW state")
        assert got["steps"] == [step], (plan.plan_id, rank, got["steps"])
        assert got["gaps"] == {"weight": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}, (
            plan.plan_id,
            rank,
            got["gaps"],
        )
        assert got["into"] and got["same_storage"], (plan.plan_id, rank, got)
        assert got["position"] == [step, step * GBS], (plan.plan_id, rank, got["position"])


@pytest.mark.parametrize("pid", ["B1", "B2"])
def test_resume_under_other_layout_equals_uninterrupted(
    baseline: tuple[Path, list[float]], resumed: dict[str, tuple[Path, list[float]]], pid: str
) -> None:
    root_a, losses_a = baseline
    root, losses = resumed[pid]
    _check_restored(root, {"B1": PLAN_B1, "B2": PLAN_B2}[pid], N)
    loss_gap, state_gap = _gaps(losses, losses_a[N : N + M], root, root_a, N + M)
    assert loss_gap <= LOSS_ATOL and state_gap <= PARAM_ATOL
    m = read_manifest(LocalStorage(root), N + M)
    assert m.consumed_samples == (N + M) * GBS and m.plan_id == pid


def test_a_to_b_to_a(
    baseline: tuple[Path, list[float]],
    resumed: dict[str, tuple[Path, list[float]]],
    tmp_path: Path,
) -> None:
    root_a, losses_a = baseline
    b, _ = resumed["B1"]
    losses = _run(PLAN_A, tmp_path / "A2", N + M + K, [N + M + K], (b, N + M))
    _check_restored(tmp_path / "A2", PLAN_A, N + M)
    loss_gap, state_gap = _gaps(losses, losses_a[N + M :], tmp_path / "A2", root_a, N + M + K)
    assert loss_gap <= LOSS_ATOL and state_gap <= PARAM_ATOL
