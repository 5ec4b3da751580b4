"""Pure plan -> engine mappings: DeepSpeed pipeline settings and Megatron-core parallel state."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import torch

from sailor import catalog
from sailor.megatron_patch import rank_main
from sailor.megatron_patch.boundary import Boundary, Progress, Status
from sailor.megatron_patch.control import ControlRequest
from sailor.megatron_patch.deepspeed_adapter import (
    UnsupportedPlanError,
    check_args,
    check_checkpoint_precision,
    check_train_config,
    deepspeed_config,
    deepspeed_env,
    deepspeed_layout,
    deepspeed_precision,
    device_sync,
    run,
)
from sailor.megatron_patch.deepspeed_state import DeepSpeedRun, NotCheckpointableError
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.precision import Precision
from sailor.megatron_patch.rank_args import build_parser, check_load_step
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.training import CheckpointConfig, TrainingConfig


def _pipe(cuts: list[tuple[int, int]], tp: int = 1, mbs: int = 2, m: int = 2) -> Pipeline:
    rg = ReplicaGroup(gpu_type="A100", zone="z", tp=tp, gpus_per_node=4)
    return Pipeline(
        stages=tuple(Stage(first_layer=a, last_layer=b, replica=rg) for a, b in cuts),
        microbatch_size=mbs,
        num_microbatches=m,
    )


def _plan(*pipes: Pipeline) -> Plan:
    return Plan(model="m", global_batch_size=sum(p.samples for p in pipes), pipelines=pipes)


def test_deepspeed_layout_of_a_uniform_plan_keeps_the_uneven_partition() -> None:
    lay = deepspeed_layout(_plan(_pipe([(0, 3), (4, 5)]), _pipe([(0, 3), (4, 5)])))
    assert lay.parts == (0, 4, 6)
    assert (lay.num_stages, lay.data_parallel) == (2, 2)
    assert (lay.micro_batch_size, lay.gradient_accumulation_steps) == (2, 2)
    assert lay.activation_checkpoint_interval == 0


@pytest.mark.parametrize(
    ("plan", "why"),
    [
        (_plan(_pipe([(0, 3), (4, 5)]), _pipe([(0, 2), (3, 5)])), "partition"),
        (_plan(_pipe([(0, 5)]), _pipe([(0, 5)], mbs=1)), "microbatch"),
        (_plan(_pipe([(0, 5)], tp=2)), "tp=2"),
    ],
)
def test_deepspeed_layout_rejects_what_it_cannot_run(plan: Plan, why: str) -> None:
    with pytest.raises(UnsupportedPlanError, match=why):
        deepspeed_layout(plan)


def test_deepspeed_layout_refuses_a_plan_short_of_the_models_layers() -> None:
    """A plan of layers 0..3 for a model of 6 (embedding, 4 blocks, head): the pipeline was
    cut at layer 3, the head never built, and the loss taken over the hidden states (width
    32): ``IndexError: Target 89 is out of bounds`` on the first label above 31, or a
    meaningless loss below it. Refused as Sailor's engine refuses it."""
    spec = tiny_model("tiny-llama", 4)
    with pytest.raises(
        ValueError, match=r"plan covers 4 layers, model 'tiny-llama' has 6 \(embedding \+ 4 "
    ):
        deepspeed_layout(_plan(_pipe([(0, 3)])), spec)
    assert deepspeed_layout(_plan(_pipe([(0, 3), (4, 5)])), spec).parts == (0, 4, 6)


def test_deepspeed_config_leaves_the_update_to_sailors_adamw() -> None:
    """DeepSpeed, reading the adapter's config, neither clips nor swaps the optimizer.

    Catches the adapter inheriting DeepSpeed's default global-norm clipping at 1.0
    (``GRADIENT_CLIPPING_DEFAULT``), which rescales each step's gradients before AdamW and
    drifts the parameters from Sailor's engine; and a DeepSpeed optimizer or scheduler
    section, which would replace the AdamW the adapter passes in.
    """
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    plan = _plan(_pipe([(0, 3), (4, 5)]), _pipe([(0, 3), (4, 5)]))
    cfg = deepspeed_config(deepspeed_layout(plan), plan)
    assert ds_config.get_gradient_clipping(cfg) == 0.0
    assert ds_config.get_optimizer_name(cfg) is None
    assert ds_config.get_scheduler_name(cfg) is None


def test_megatron_layout_maps_groups_and_rank_order() -> None:
    from sailor.megatron_patch.megatron_adapter import megatron_layout
    from sailor.megatron_patch.roles import role_of

    # 2 pipelines x 3 stages x TP 2; 10 global layers = embedding + 8 blocks + head.
    cuts = [(0, 3), (4, 6), (7, 9)]
    plan = _plan(_pipe(cuts, tp=2), _pipe(cuts, tp=2))
    lay = megatron_layout(plan)
    assert (lay.tensor_model_parallel_size, lay.pipeline_model_parallel_size) == (2, 3)
    assert lay.data_parallel_size == 2 and lay.num_layers == 8
    assert lay.num_layers_in_first_pipeline_stage is None  # 3 blocks == middle's 3
    assert lay.num_layers_in_last_pipeline_stage == 2
    perm = lay.megatron_rank_of_sailor_rank
    assert sorted(perm) == list(range(12))
    # Same groups, whichever order names them.
    sailor_tp = {tuple(role_of(plan, r).tp_group) for r in range(12)}
    megatron_tp = {
        tuple(sorted(lay.sailor_rank_of_megatron_rank(m) for m in g))
        for g in lay.tensor_parallel_groups()
    }
    assert megatron_tp == sailor_tp
    for g in lay.pipeline_groups():
        roles = [role_of(plan, lay.sailor_rank_of_megatron_rank(m)) for m in g]
        assert [r.stage for r in roles] == [0, 1, 2]
        assert len({(r.pipeline, r.tp_rank) for r in roles}) == 1
    for g in lay.data_parallel_groups():
        roles = [role_of(plan, lay.sailor_rank_of_megatron_rank(m)) for m in g]
        assert len({(r.stage, r.tp_rank) for r in roles}) == 1
        assert sorted(r.pipeline for r in roles) == [0, 1]


def test_megatron_layout_rejects_heterogeneous_plans() -> None:
    from sailor.megatron_patch.megatron_adapter import UnsupportedPlanError as MErr
    from sailor.megatron_patch.megatron_adapter import initialize_megatron, megatron_layout

    with pytest.raises(MErr, match="TP degrees"):
        megatron_layout(_plan(_pipe([(0, 5)], tp=2), _pipe([(0, 5)], tp=1)))
    with pytest.raises(MErr, match="middle"):
        megatron_layout(_plan(_pipe([(0, 1), (2, 3), (4, 6), (7, 9)])))
    lay = megatron_layout(_plan(_pipe([(0, 5)])))
    assert lay.pipeline_model_parallel_size == 1 and lay.num_layers == 4
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="optional"):
            initialize_megatron(lay)


def _placed(gpu: str, node: str, first: int) -> Pipeline:
    rg = ReplicaGroup(gpu_type=gpu, zone="z", gpus_per_node=4, node_id=node, first_gpu=first)
    return Pipeline(
        stages=(
            Stage(first_layer=0, last_layer=3, replica=rg),
            Stage(
                first_layer=4, last_layer=5, replica=rg.model_copy(update={"first_gpu": first + 1})
            ),
        ),
        microbatch_size=2,
        num_microbatches=2,
    )


def test_deepspeed_local_rank_is_the_gpu_of_the_rank_on_its_node() -> None:
    # Pipeline 0 on GPUs 2, 3 of node a; pipeline 1 on GPUs 0, 1 of node b. DeepSpeed makes
    # cuda:LOCAL_RANK current: the global rank (2, 3 on node b) was the wrong GPU.
    plan = _plan(_placed("A100-40", "a", 2), _placed("A100-40", "b", 0))
    local = [deepspeed_env(plan, r, 4, "10.0.0.1:29500", "nccl")["LOCAL_RANK"] for r in range(4)]
    assert local == ["2", "3", "0", "1"]
    env = deepspeed_env(plan, 3, 4, "10.0.0.1:29500", "gloo")
    assert env == {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
    }


@pytest.mark.parametrize(
    ("gpus", "backend", "device_bf16", "expected"),
    [
        (("A100-40", "H100-80"), "nccl", False, "bf16"),
        (("A100-40", "V100-16"), "nccl", True, "fp16"),  # one GPU type without bf16 units
        (("T4", "T4"), "nccl", True, "fp16"),
        (("A100-40", "A100-40"), "gloo", True, "fp32"),  # the CPU run of a GPU plan
        (("cpu", "cpu"), "gloo", True, "fp32"),
        (("MI300X", "MI300X"), "nccl", True, "bf16"),  # not in the catalog: ask the device
        (("MI300X", "MI300X"), "nccl", False, "fp16"),
    ],
)
def test_deepspeed_precision_is_one_for_the_job(
    gpus: tuple[str, str], backend: str, device_bf16: bool, expected: str
) -> None:
    plan = _plan(_placed(gpus[0], "a", 0), _placed(gpus[1], "b", 0))
    spec = catalog.model("tiny-llama").model_copy(update={"precision": "bf16"})
    assert deepspeed_precision(plan, spec, backend, lambda: device_bf16) == expected


def test_deepspeed_precision_honours_fp32_on_gpus_as_the_engine_does() -> None:
    """On NCCL the adapter used to run bf16/fp16 whatever the job asked (and refused a
    training config asking fp32), so a GPU job could never checkpoint. The training config,
    the plan's recorded precision and a model asking fp32 fix it, as ``plan_precision``."""
    plan = _plan(_placed("A100-40", "a", 0), _placed("A100-40", "b", 0))
    spec = catalog.model("tiny-llama").model_copy(update={"precision": "bf16"})
    assert deepspeed_precision(plan, spec, "nccl") == "bf16"
    assert deepspeed_precision(plan, spec, "nccl", requested="fp32") == "fp32"
    assert deepspeed_precision(plan, spec, "nccl", requested="fp16") == "fp16"
    fp32_plan = plan.model_copy(update={"precision": "fp32"})
    assert deepspeed_precision(fp32_plan, spec, "nccl") == "fp32"
    fp32_model = spec.model_copy(update={"precision": "fp32"})
    assert deepspeed_precision(plan, fp32_model, "nccl") == "fp32"
    assert "bf16" not in deepspeed_config(deepspeed_layout(plan), plan, "fp32")
    with pytest.raises(ValueError, match=r"plan.precision='fp32'.*precision='bf16'"):
        deepspeed_precision(fp32_plan, spec, "nccl", requested="bf16")
    v100 = _plan(_placed("V100-16", "a", 0), _placed("V100-16", "b", 0))
    with pytest.raises(ValueError, match=r"gpu_type='V100-16': cannot run.*'bf16'"):
        deepspeed_precision(v100, spec, "nccl", requested="bf16")
    assert deepspeed_precision(fp32_plan, spec, "gloo", requested="bf16") == "fp32"


@pytest.mark.parametrize(
    ("extra", "config", "named"),
    [
        ((), {"checkpoint": {"dir": "ck", "every_steps": 1000}}, "checkpoint.every_steps=1000"),
        (("--control", "/c.json"), {}, "--control='/c.json'"),
        (("--ckpt-dir", "/ck", "--load-step", "3"), {}, "--load-step=3"),
    ],
)
def test_an_fp16_deepspeed_run_that_may_checkpoint_is_refused_at_start(
    extra: tuple[str, ...], config: dict[str, object], named: str
) -> None:
    """Refused before DeepSpeed starts, not at the first save (after every step before it);
    fp32 and bf16 runs save and resume (bf16 was refused alike before its masters were
    mapped)."""
    args = build_parser().parse_args(_args(*extra))
    tc = TrainingConfig.model_validate({"model": {"kind": "builtin", "name": "m"}, **config})
    check_checkpoint_precision("fp32", args, tc)
    check_checkpoint_precision("bf16", args, tc)
    with pytest.raises(UnsupportedPlanError, match=r"precision='fp16' with .*") as e:
        check_checkpoint_precision("fp16", args, tc)
    assert named in str(e.value) and "FP16_UnfusedOptimizer" in str(e.value)
    assert "Sailor's engine" in str(e.value)
    check_checkpoint_precision("fp16", build_parser().parse_args(_args()), None)


def test_deepspeed_config_has_the_precision_section() -> None:
    plan = _plan(_pipe([(0, 3), (4, 5)]), _pipe([(0, 3), (4, 5)]))
    lay = deepspeed_layout(plan)
    assert "bf16" not in deepspeed_config(lay, plan) and "fp16" not in deepspeed_config(lay, plan)
    assert deepspeed_config(lay, plan, "bf16")["bf16"] == {"enabled": True}
    fp16 = deepspeed_config(lay, plan, "fp16")["fp16"]
    assert fp16["enabled"] is True and fp16["loss_scale"] == 0  # 0: dynamic loss scaling
    assert "bf16" not in deepspeed_config(lay, plan, "fp16")


def test_deepspeed_step_timing_waits_for_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    device_sync(torch.device("cpu"))()
    assert synced == []
    device_sync(torch.device("cuda", 1))()
    assert synced == [torch.device("cuda", 1)]


def _args(*extra: str) -> list[str]:
    base = ["--plan", "/nonexistent.json", "--rank", "0", "--world-size", "1"]
    return [*base, "--master", "127.0.0.1:1", *extra]


def test_the_deepspeed_adapter_resumes_only_with_a_checkpoint_implementation() -> None:
    """Run as ``deepspeed_adapter`` alone it has no checkpoint IO: a resume is refused by
    name before anything starts (``training_process.deepspeed_glue`` passes one)."""
    args = build_parser().parse_args(_args("--ckpt-dir", "/ck", "--load-step", "3"))
    check_args(args, has_ckpt=True)  # with Sailor's checkpoints it resumes
    check_args(build_parser().parse_args(_args()), has_ckpt=False)  # a fresh start runs
    with pytest.raises(UnsupportedPlanError, match=r"load_step=3 \(ckpt_dir='/ck'\)"):
        check_args(args, has_ckpt=False)
    with pytest.raises(UnsupportedPlanError, match="load_step=3"):
        run(_args("--ckpt-dir", "/ck", "--load-step", "3"))
    with pytest.raises(UnsupportedPlanError, match="--in-place=True"):
        check_args(build_parser().parse_args(_args("--in-place")), has_ckpt=True)


def test_the_deepspeed_adapter_refuses_a_bad_load_wait_by_name() -> None:
    """``--load-liveness-s`` was parsed and ignored, and ``--load-timeout-s nan`` waited for
    ever: both are refused at start, as the engine refuses them (``check_load_waits``)."""
    for flag, value in (("--load-liveness-s", "0.0"), ("--load-timeout-s", "nan")):
        args = build_parser().parse_args(_args(flag, value))
        with pytest.raises(ValueError, match=f"{flag}={value}: must be > 0 seconds"):
            check_args(args, has_ckpt=True)
        with pytest.raises(ValueError, match=f"{flag}={value}"):
            run(_args(flag, value))  # before the plan (/nonexistent.json) is read


def test_the_deepspeed_adapter_refuses_periodic_checkpoints_without_a_checkpoint_io(
    tmp_path: Path,
) -> None:
    """``deepspeed_adapter`` alone with ``checkpoint.every_steps`` used to pass its checks and
    die at that step; it is refused at start, before the plan is even read."""
    tc = TrainingConfig.model_validate(
        {
            "model": {"kind": "builtin", "name": "tiny-llama"},
            "checkpoint": {"dir": "ck", "every_steps": 1000},
        }
    )
    args = build_parser().parse_args(_args())
    check_args(args, has_ckpt=True, tc=tc)
    with pytest.raises(UnsupportedPlanError, match=r"checkpoint.every_steps=1000 \(dir='ck'\)"):
        check_args(args, has_ckpt=False, tc=tc)
    cfg = tmp_path / "run.json"
    cfg.write_text(tc.model_dump_json())
    with pytest.raises(UnsupportedPlanError, match="deepspeed_glue"):
        run(_args("--train-config", str(cfg)))  # the plan (/nonexistent.json) is not read


def test_a_load_step_without_a_ckpt_dir_is_refused_not_a_fresh_start() -> None:
    """``--load-step 3`` without ``--ckpt-dir`` used to start at step 0 silently, in the
    adapter and in Sailor's engine alike; both refuse it by name, before the plan is read."""
    named = r"--load-step=3 without --ckpt-dir"
    args = build_parser().parse_args(_args("--load-step", "3"))
    for has_ckpt in (True, False):
        with pytest.raises(ValueError, match=named):
            check_args(args, has_ckpt=has_ckpt)
    with pytest.raises(ValueError, match=named):
        run(_args("--load-step", "3"))
    with pytest.raises(ValueError, match=named):
        rank_main.run(args, Status(0))
    check_load_step(build_parser().parse_args(_args("--load-step", "-1")))
    # a relayout in place without a checkpoint takes the held ranks' step
    check_load_step(build_parser().parse_args(_args("--load-step", "3", "--in-place")))


def test_a_save_request_without_a_checkpoint_io_says_so() -> None:
    """The message said "without a checkpoint dir" when the dir was given."""
    args = build_parser().parse_args(_args())
    b: Boundary[argparse.Namespace] = Boundary(
        args, Status(0), Progress(None, False), None, torch.device("cpu")
    )
    req = ControlRequest(save_step=2, save_dir="/ck")
    with pytest.raises(RuntimeError, match=r"save_dir='/ck'.*without a checkpoint implementation"):
        b._maybe_save(argparse.Namespace(step=2), req, holding=True)


def test_a_boundary_with_periodic_checkpoints_and_no_checkpoint_io_is_refused_when_built() -> None:
    """A boundary built with ``checkpoint.every_steps`` and no checkpoint IO used to raise only
    at the first save's step; it refuses at construction (the entry points refuse earlier)."""
    args = build_parser().parse_args(_args())
    periodic = CheckpointConfig(dir="/ck", every_steps=1000)
    with pytest.raises(ValueError, match=r"checkpoint.every_steps=1000 needs a checkpoint"):
        Boundary(args, Status(0), Progress(None, False), None, torch.device("cpu"), periodic)
    # every_steps 0 is no periodic checkpoint: nothing to refuse
    off = CheckpointConfig(dir="/ck", every_steps=0)
    Boundary(args, Status(0), Progress(None, False), None, torch.device("cpu"), off)


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"schedule": {"warmup_steps": 2}}, "schedule"),
        ({"clipping": {"max_norm": 1.0}}, "clipping.max_norm=1.0"),
        ({"eval": {"every_steps": 5}}, "eval.every_steps=5"),
        ({"loss_scaling": {"mode": "dynamic"}}, "loss_scaling.mode='dynamic'"),
        ({"metrics": {"jsonl": "m.jsonl"}}, "metrics"),
    ],
)
def test_the_deepspeed_adapter_refuses_training_config_fields_it_does_not_run(
    section: dict[str, object], field: str
) -> None:
    check_train_config(None)
    ok = {
        "model": {"kind": "builtin", "name": "tiny-llama"},
        "checkpoint": {"dir": "ck", "every_steps": 2},
    }
    check_train_config(TrainingConfig.model_validate({**ok, "allow_precision_change": True}))
    tc = TrainingConfig.model_validate({**ok, **section})
    with pytest.raises(UnsupportedPlanError, match=re.escape(field)):
        check_train_config(tc)


def _ds_run(engine_optimizer: object = None, precision: Precision = "fp32") -> DeepSpeedRun:
    module = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(module.parameters())
    plan = _plan(_pipe([(0, 5)]))
    return DeepSpeedRun(
        plan, 0, module, opt, engine_optimizer or opt, TrainConfig(), precision, 3, 24
    )


def test_a_deepspeed_run_checkpoints_only_optimizers_it_maps() -> None:
    """Its own AdamW (fp32) or DeepSpeed's BF16_Optimizer around it; anything else (fp16's
    FP16_UnfusedOptimizer) is refused by name, not written from the 16-bit weights."""
    _ds_run().check_checkpointable()
    wrapped = _ds_run(engine_optimizer=object(), precision="fp16")
    with pytest.raises(NotCheckpointableError, match=r"precision='fp16'.*fp32 and bf16 runs"):
        wrapped.check_checkpointable()
    with pytest.raises(NotCheckpointableError):
        wrapped.state()


def test_a_deepspeed_run_refuses_another_precision_with_the_engines_error() -> None:
    run = _ds_run()
    with pytest.raises(ValueError, match=r"precision='bf16' of the state being loaded"):
        run.load_scaling_state({"precision": "bf16", "skipped_steps": 0})
    run.cfg = TrainConfig(allow_precision_change=True)
    run.load_scaling_state({"precision": "bf16", "skipped_steps": 1})
    assert run.adam_step == 2
    with pytest.raises(RuntimeError, match="no AdamW state at AdamW step 2"):
        run.state()  # moments missing at a step past 0: never saved as zeros
