"""Precision choice, the fp16 loss scaler (agreed over ranks), the gradient-reduce dtype and
the synchronized step clock.

What each test catches in the code before these fixes: bf16 forced on GPUs without it
(``test_precision_*``); no loss scaling, so fp16 overflow went unnoticed or was skipped by
some ranks only (``test_scaler_*``, the 2-rank gloo run); the gradient all-reduce in the
gradients' own dtype rather than an explicit fp32 (``test_gradient_reduce_*``); step times
read without a device synchronize (``test_timestamp_*``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sailor.comm.api import use_backend
from sailor.comm.strict import StrictBackend
from sailor.megatron_patch import clock
from sailor.megatron_patch.dry_run import META, _stage_on_meta
from sailor.megatron_patch.grad_sync import GRAD_REDUCE_DTYPE, sync_gradients
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.precision import (
    LossScaler,
    autocast_of,
    compute_dtype,
    device_precision,
    job_precision,
    pick_precision,
    scaled_step,
)
from sailor.megatron_patch.roles import role_of
from sailor.megatron_patch.sync_groups import rank_sync_items, sync_groups
from sailor.megatron_patch.tp_layers import TPContext
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from tests.spawn import spawn


@pytest.mark.parametrize(
    ("device", "bf16", "expected"),
    [
        ("cpu", False, "fp32"),
        ("cpu", True, "fp32"),
        ("cuda", True, "bf16"),
        ("cuda", False, "fp16"),
    ],
)
def test_precision_follows_the_device(device: str, bf16: bool, expected: str) -> None:
    assert pick_precision(device, bf16) == expected


def test_precision_dtypes_and_autocast() -> None:
    assert compute_dtype("fp32") == torch.float32
    assert compute_dtype("fp16") == torch.float16
    assert autocast_of("fp32", torch.device("cpu")) is None
    ctx = autocast_of("bf16", torch.device("cpu"))
    assert ctx is not None
    with ctx():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_scaler_halves_on_overflow_and_grows_after_good_steps() -> None:
    s = LossScaler(scale=8.0, growth_interval=2)
    s.update(True)
    assert (s.scale, s.skipped_steps, s.good_steps) == (4.0, 1, 0)
    s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert (s.scale, s.good_steps) == (8.0, 0)
    with pytest.raises(ValueError, match="growth_interval"):
        LossScaler(growth_interval=0)


def test_scaler_detects_inf_and_nan_and_unscales() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, 2.0, 4.0])
    cpu = torch.device("cpu")
    assert LossScaler.local_overflow([p], cpu).item() == 0.0
    LossScaler.unscale_([p], 2.0)
    assert p.grad.tolist() == [0.5, 1.0, 2.0]
    for bad in (math.inf, math.nan):
        p.grad = torch.tensor([1.0, bad, 0.0])
        assert LossScaler.local_overflow([p], cpu).item() == 1.0


def _scaler_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = LossScaler(scale=1024.0, growth_interval=2)
    seen = []
    for step in range(3):
        p.grad = torch.full((4,), scaler.scale)  # a gradient of 1 under the loss scale
        if step == 0 and rank == 1:
            p.grad[2] = math.inf  # only rank 1 overflows
        taken = scaled_step(opt, [p], scaler, torch.device("cpu"))
        seen.append((taken, scaler.scale, p.detach().tolist()))
    Path(out, f"{rank}.txt").write_text(repr(seen))
    dist.destroy_process_group()


def test_scaler_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    spawn(_scaler_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    expected = [
        (False, 512.0, [0.0] * 4),  # skipped everywhere, scale halved
        (True, 512.0, [-1.0] * 4),  # unscaled gradient of 1, lr 1
        (True, 1024.0, [-2.0] * 4),  # two good steps: the scale grows
    ]
    for rank in (0, 1):
        assert eval((tmp_path / f"{rank}.txt").read_text()) == expected


def test_gradient_reduce_buffers_are_fp32_on_the_rank_device() -> None:
    """Even with half-precision gradients the all-reduce runs in fp32 (GRAD_REDUCE_DTYPE)."""
    assert torch.float32 == GRAD_REDUCE_DTYPE

    def st(a: int, b: int) -> Stage:
        return Stage(
            first_layer=a,
            last_layer=b,
            replica=ReplicaGroup(gpu_type="A100", zone="z", tp=1, gpus_per_node=4),
        )

    pipe = Pipeline(stages=(st(0, 5),), microbatch_size=1, num_microbatches=1)
    plan = Plan(model="tiny-gpt", global_batch_size=2, pipelines=(pipe, pipe))
    spec = tiny_model("tiny-gpt", 2)
    groups = sync_groups(plan, spec.tie_embeddings)
    stage = _stage_on_meta(spec, role_of(plan, 0), TPContext())
    stage.to(torch.bfloat16)
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)
    sync = [(item, None) for item in rank_sync_items(plan, groups, 0)]
    backend = StrictBackend(0, META, 2)
    with use_backend(backend):
        sync_gradients(stage, sync)
    reduces = [op for op in backend.ops if op.kind == "all_reduce"]
    assert reduces and {op.dtype for op in reduces} == {"torch.float32"}
    assert {op.device for op in reduces} == {"meta"}


def test_timestamp_synchronizes_cuda_and_not_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(d))
    clock.timestamp(torch.device("cpu"))
    assert calls == []
    gpu = torch.device("cuda", 1)
    t0 = clock.timestamp(gpu)
    assert calls == [gpu] and clock.timestamp(gpu) >= t0


def _one_stage_plan(gpu: str, precision: str | None = None) -> Plan:
    rg = ReplicaGroup(gpu_type=gpu, zone="z", tp=1, gpus_per_node=4)
    stage = Stage(first_layer=0, last_layer=5, replica=rg)
    pipe = Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=1)
    return Plan(
        model="tiny-gpt",
        global_batch_size=1,
        pipelines=(pipe,),
        precision=precision,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("gpu", "recorded", "device_bf16", "expected"),
    [
        ("A100-40", None, True, "bf16"),  # every GPU type has bf16
        ("V100-16", None, False, "fp16"),  # the catalog's V100 has none: fp16 + loss scaling
        ("A100-40", "fp16", True, "fp16"),  # the plan's record wins
    ],
)
def test_job_precision_is_the_plans_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
    gpu: str,
    recorded: str | None,
    device_bf16: bool,
    expected: str,
) -> None:
    """The worker runs the plan's precision (as priced), not one picked from the device."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: device_bf16)
    spec = tiny_model("tiny-gpt", 1).model_copy(update={"precision": "bf16"})
    assert job_precision(_one_stage_plan(gpu, recorded), spec, torch.device("cuda", 0)) == expected


def test_job_precision_is_fp32_on_cpu_and_refuses_bf16_on_a_gpu_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = tiny_model("tiny-gpt", 1).model_copy(update={"precision": "bf16"})
    assert job_precision(_one_stage_plan("A100-40", "bf16"), spec, torch.device("cpu")) == "fp32"
    # torch's default answer on a V100 is yes (bf16 emulated): only the hardware's counts
    monkeypatch.setattr(
        torch.cuda,
        "is_bf16_supported",
        lambda including_emulation=True: including_emulation,
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100-SXM2-16GB")
    with pytest.raises(ValueError, match=r"precision='bf16'.*has no bf16"):
        job_precision(_one_stage_plan("V100-16", "bf16"), spec, torch.device("cuda", 0))
    assert device_precision(torch.device("cuda", 0)) == "fp16"


def test_scaler_state_round_trips_and_bad_states_are_refused() -> None:
    a = LossScaler(scale=2.0**10, growth_interval=3)
    for overflow in (False, True, False, False):
        a.update(overflow)
    b = LossScaler(scale=2.0**16, growth_interval=3)
    b.load_state(json.loads(json.dumps(a.state())))  # as a checkpoint's globals carry it
    assert (b.scale, b.good_steps) == (a.scale, a.good_steps) == (2.0**9, 2)
    for overflow in (False, False, True):
        a.update(overflow)
        b.update(overflow)
        assert (b.scale, b.good_steps) == (a.scale, a.good_steps)
    for bad in ({"scale": 0.0, "good_steps": 0}, {"scale": math.inf, "good_steps": 0}):
        with pytest.raises(ValueError, match="loss scale state"):
            b.load_state(bad)


def test_loss_scaling_settings_reach_the_engine() -> None:
    from sailor.megatron_patch.engine import TrainConfig
    from sailor.schemas.training import LossScalingConfig, TrainingConfig

    tc = TrainingConfig.model_validate(
        {
            "model": {"kind": "builtin", "name": "tiny-gpt"},
            "loss_scaling": {"mode": "dynamic", "initial_scale_power": 12, "loss_scale_window": 50},
        }
    )
    assert TrainConfig.of(tc).loss_scaling == LossScalingConfig(
        mode="dynamic", initial_scale_power=12, loss_scale_window=50
    )
    with pytest.raises(ValueError, match="initial_scale_power"):
        LossScalingConfig(initial_scale_power=128)


def test_metrics_carry_the_loss_scale_and_the_gradient_norm_when_there_are_some() -> None:
    from sailor.megatron_patch.engine import StepResult
    from sailor.megatron_patch.rank_main import optimizer_metrics

    base = StepResult(1, 4, 3.0, 0.1, 0.05, 0.01, 0.01, 4)
    assert optimizer_metrics(base, 0) == {}
    scaled = StepResult(6, 24, 3.0, 0.1, 0.05, 0.01, 0.01, 4, grad_norm=0.5, loss_scale=2.0**14)
    assert optimizer_metrics(scaled, 2) == {
        "grad_norm": 0.5,
        "loss_scale": 2.0**14,
        "skipped_steps": 2,
    }


def _clip_worker(rank: int, store: str, out: str) -> None:
    """One rank, one stage, two iterations with a tight clip: under no scaler and under a
    dynamic loss scaler; the gradient norm AdamW sees, and the one the step reports."""
    from sailor.megatron_patch.engine import TrainConfig, Trainer
    from sailor.megatron_patch.groups import build_process_groups
    from sailor.schemas.training import LossScalingConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=1)
    group = ReplicaGroup(gpu_type="cpu", zone="z", tp=1, gpus_per_node=1)
    stage = Stage(first_layer=0, last_layer=5, replica=group)
    pipe = Pipeline(stages=(stage,), microbatch_size=1, num_microbatches=2)
    plan = Plan(model="tiny-gpt", global_batch_size=2, pipelines=(pipe,))
    spec = tiny_model("tiny-gpt", 2)
    role = role_of(plan, 0)
    groups = build_process_groups(plan, role, spec.tie_embeddings, 20.0)
    got = {}
    for mode in ("auto", "dynamic"):  # auto: fp32 on CPU, no scaler
        scaling = LossScalingConfig(mode=mode, initial_scale_power=4)
        cfg = TrainConfig(seed=0, clip_grad_norm=1e-3, loss_scaling=scaling)
        tr = Trainer(plan, spec, role, groups, cfg, torch.device("cpu"))
        seen: list[float] = []
        params = list(tr.stage.parameters())
        step = tr.optimizer.step

        def watched(
            *a: object, _seen: list[float] = seen, _ps: Any = params, _step: Any = step, **k: object
        ) -> Any:
            grads = [p.grad for p in _ps if p.grad is not None]
            _seen.append(math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads)))
            return _step(*a, **k)

        tr.optimizer.step = watched  # type: ignore[method-assign]
        got[mode] = (seen, [r.grad_norm for r in tr.run(2)])
    Path(out, "clip.txt").write_text(repr(got))
    dist.destroy_process_group()


def test_a_loss_scaled_step_clips_as_an_unscaled_one(tmp_path: Path) -> None:
    """With a loss scaler, the gradients AdamW sees are clipped to ``clip_grad_norm`` and the
    step reports their norm, as without one (review: the clip went into ``scaled_step``'s
    process-group argument, so a loss-scaled run was never clipped and reported no norm)."""
    spawn(_clip_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=1)
    got = eval((tmp_path / "clip.txt").read_text())
    (plain, plain_norms), (scaled, scaled_norms) = got["auto"], got["dynamic"]
    # (the sum over every parameter counts the tied head's copy too: above the clip's 1e-3)
    assert len(plain) == len(scaled) == 2 and all(n < 2e-3 for n in plain), plain
    assert scaled == pytest.approx(plain, rel=1e-5)
    assert all(n is not None and n > 1e-2 for n in plain_norms + scaled_norms)
    assert scaled_norms == pytest.approx(plain_norms, rel=1e-5)
