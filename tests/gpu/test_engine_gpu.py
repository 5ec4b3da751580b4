"""The engine on real GPUs: precision, large pipeline exchanges under NCCL, checkpoints of CUDA
tensors, the strict layer's record of a GPU run.

CPU counterparts (what runs in ``make test``): ``tests/unit/test_comm_schedule.py`` (the
schedule's exchanges replay under NCCL's rules for 2-8 stages x 1-16 microbatches),
``tests/integration/test_comm_strict_gloo.py`` (a gloo run's calls obey NCCL's rules),
``tests/unit/test_megatron_patch_precision.py`` (precision choice, agreed fp16 loss scaling),
``tests/unit/test_comm_checkpoint.py`` (the TP gather on the tensors' device) and
``tests/integration/test_megatron_patch_training.py`` (exactness against one process).
Here the same code runs on NCCL with CUDA tensors, where a hang or a device error is real.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sailor import catalog
from sailor.catalog.cuda_names import UnknownGPUError, catalog_gpu_name
from sailor.comm.nccl_replay import replay
from sailor.comm.strict import ENV_VAR, read_logs
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.launch import LocalRun, launch_local
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.precision import native_bf16
from sailor.megatron_patch.reference import train_reference
from sailor.schemas.model import ModelSpec
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

STEPS = 3


def _gpu_type() -> str:
    """The catalog name of GPU 0, so the plan's precision follows the real card."""
    props = torch.cuda.get_device_properties(0)
    try:
        return catalog_gpu_name(props.name, props.total_memory, catalog.gpus())
    except UnknownGPUError:
        return "gpu-under-test"


def _device_precision() -> str:
    return "bf16" if native_bf16() else "fp16"


def _plan(
    model: str,
    stages: list[tuple[int, int, int]],
    mbs: int,
    m: int,
    precision: str,
    num_layers: int,
) -> Plan:
    """One pipeline on one node: stage ``(first, last, tp)``, GPUs packed from 0."""
    total = sum(tp for *_, tp in stages)
    out: list[Stage] = []
    first_gpu = 0
    for a, b, tp in stages:
        rg = ReplicaGroup(
            gpu_type=_gpu_type(),
            zone="local",
            tp=tp,
            gpus_per_node=max(total, tp),
            first_gpu=first_gpu,
            node_id="gpu-host",
        )
        out.append(Stage(first_layer=a, last_layer=b, replica=rg))
        first_gpu += tp
    assert out[-1].last_layer == num_layers - 1
    pipe = Pipeline(stages=tuple(out), microbatch_size=mbs, num_microbatches=m)
    return Plan(
        model=model,
        global_batch_size=mbs * m,
        pipelines=(pipe,),
        precision=precision,  # type: ignore[arg-type]
    )


def _ok(run: LocalRun) -> None:
    if not run.ok:
        pytest.fail(f"ranks failed: {run.returncodes} killed={run.killed} {run.errors}")


def _losses(run: LocalRun, rank: int) -> list[float]:
    return [float(s["loss"]) for s in run.steps(rank)]


def _spec_file(tmp_path: Path, spec: ModelSpec) -> str:
    path = tmp_path / f"{spec.name}.json"
    path.write_text(spec.model_dump_json())
    return str(path)


def test_one_gpu_fp32_equals_the_cpu_reference_and_half_precision_stays_close(
    gpus: Callable[[int], None], tmp_path: Path
) -> None:
    """fp32 on the GPU is the CPU reference to rounding; the device's 16-bit precision (bf16
    where the card has it, else fp16 with loss scaling) stays within a 16-bit tolerance."""
    gpus(1)
    spec = tiny_model("tiny-llama", 4)
    layers = spec.num_all_layers
    ref = train_reference(spec, 4, STEPS, TrainConfig(), microbatch_size=2)
    for precision, rel in (("fp32", 1e-4), (_device_precision(), 3e-2)):
        plan = _plan("tiny-llama", [(0, layers - 1, 1)], 2, 2, precision, layers)
        run = launch_local(plan, STEPS, tmp_path / precision, deadline_s=300)
        _ok(run)
        assert run.backend == "nccl"
        steps = run.steps(0)
        assert [s["precision"] for s in steps] == [precision] * STEPS
        assert _losses(run, 0) == pytest.approx(ref.losses, rel=rel), precision


def test_pipeline_with_64_mib_activations_under_nccl_equals_one_process(
    gpus: Callable[[int], None], tmp_path: Path
) -> None:
    """Two stages, four microbatches, an fp32 activation of 64 MiB per exchange (well above
    NCCL's eager buffers: a lone send would need its receive posted). No hang, and the losses
    equal single-process training on one GPU."""
    gpus(2)
    spec = tiny_model("tiny-gpt", 8).model_copy(
        update={
            "name": "wide-gpt",
            "num_layers": 2,
            "hidden_size": 1024,
            "num_heads": 8,
            "ffn_hidden_size": 2048,
            "seq_length": 4096,
            "vocab_size": 512,
            "precision": "fp32",
        }
    )
    mbs = 4
    assert mbs * spec.seq_length * spec.hidden_size * 4 >= 64 << 20
    layers = spec.num_all_layers
    plan = _plan(spec.name, [(0, 1, 1), (2, layers - 1, 1)], mbs, 2, "fp32", layers)
    run = launch_local(
        plan,
        2,
        tmp_path,
        extra_args=["--model", _spec_file(tmp_path, spec)],
        timeout_s=120,
        deadline_s=600,
    )
    _ok(run)
    ref = train_reference(
        spec, 8, 2, TrainConfig(), microbatch_size=mbs, device=torch.device("cuda", 0)
    )
    assert _losses(run, 1) == pytest.approx(ref.losses, rel=1e-4)


def test_vocab_split_head_under_nccl_equals_one_process(
    gpus: Callable[[int], None], tmp_path: Path
) -> None:
    """TP 1 -> TP 2 with tied embeddings and a vocabulary the TP-2 head pads (50 rows to 64,
    rank 1 holding 18 real rows): the vocab-parallel loss's max/sum all-reduces and the tied
    copies' chunk groups run under NCCL, and the losses equal one process's in fp32."""
    gpus(3)
    spec = tiny_model("tiny-gpt", 4).model_copy(update={"vocab_size": 50, "name": "gpt-v50"})
    layers = spec.num_all_layers
    plan = _plan(spec.name, [(0, 2, 1), (3, layers - 1, 2)], 2, 2, "fp32", layers)
    run = launch_local(
        plan,
        STEPS,
        tmp_path,
        extra_args=["--model", _spec_file(tmp_path, spec)],
        timeout_s=120,
        deadline_s=300,
    )
    _ok(run)
    assert run.backend == "nccl"
    ref = train_reference(spec, 4, STEPS, TrainConfig(), microbatch_size=2)
    assert _losses(run, 1) == pytest.approx(ref.losses, rel=1e-4)


def test_strict_layer_records_a_gpu_run_that_replays_under_nccl_rules(
    gpus: Callable[[int], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TP 2 -> TP 1 pipeline on three GPUs: every call's tensor is on its rank's own GPU, and
    the recorded calls replay without deadlock."""
    gpus(3)
    spec = tiny_model("tiny-gpt", 4)
    layers = spec.num_all_layers
    plan = _plan("tiny-gpt", [(0, 2, 2), (3, layers - 1, 1)], 1, 4, _device_precision(), layers)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "comm"))
    run = launch_local(plan, 2, tmp_path / "run", deadline_s=300)
    _ok(run)
    logs = read_logs(tmp_path / "comm")
    res = replay(logs)
    assert res.ok, res.message
    for rank, log in logs.items():
        devices = {op.device for op in log if op.kind != "wait" and op.device}
        assert devices == {f"cuda:{rank}"}, (rank, devices)


def _save_then_resume(
    plan_a: Plan,
    plan_b: Plan,
    tmp_path: Path,
    save_at: int | Callable[[LocalRun], int],
    total: int,
    args: tuple[str, ...] = (),
) -> tuple[LocalRun, LocalRun, LocalRun]:
    """Run A uninterrupted for ``total`` steps; run A to ``save_at`` saving there; resume
    under B for the rest. ``save_at`` may be chosen from the uninterrupted run; ``args`` go
    to every rank of the three runs. Returns (uninterrupted, first part, resumed)."""
    module = "sailor.training_process"
    extra = list(args)
    whole = launch_local(
        plan_a, total, tmp_path / "whole", module=module, extra_args=extra, deadline_s=300
    )
    _ok(whole)
    step = save_at(whole) if callable(save_at) else save_at
    ckpt = tmp_path / "ckpt"
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"save_step": step, "save_dir": str(ckpt)}))
    first = launch_local(
        plan_a,
        step,
        tmp_path / "first",
        module=module,
        extra_args=[*extra, "--control", str(control)],
        deadline_s=300,
    )
    _ok(first)
    resumed = launch_local(
        plan_b,
        total - step,
        tmp_path / "resumed",
        module=module,
        extra_args=[*extra, "--ckpt-dir", str(ckpt), "--load-step", str(step)],
        deadline_s=300,
    )
    _ok(resumed)
    return whole, first, resumed


def test_checkpoint_of_cuda_tensors_round_trips(
    gpus: Callable[[int], None], tmp_path: Path
) -> None:
    """Save on one GPU at step 2, resume on it: the resumed losses are the uninterrupted run's."""
    gpus(1)
    layers = tiny_model("tiny-gpt").num_all_layers
    plan = _plan("tiny-gpt", [(0, layers - 1, 1)], 2, 2, "fp32", layers)
    whole, _, resumed = _save_then_resume(plan, plan, tmp_path, 2, 4)
    assert _losses(resumed, 0) == pytest.approx(_losses(whole, 0)[2:], rel=1e-5)


def test_tp2_checkpoint_resumes_at_tp1(gpus: Callable[[int], None], tmp_path: Path) -> None:
    """A TP 2 stage saves (its shards gathered on the GPU through NCCL, then written); a TP 1
    layout on one GPU resumes from it and continues the uninterrupted TP 2 run's losses."""
    gpus(2)
    layers = tiny_model("tiny-gpt").num_all_layers
    tp2 = _plan("tiny-gpt", [(0, layers - 1, 2)], 2, 2, "fp32", layers)
    tp1 = _plan("tiny-gpt", [(0, layers - 1, 1)], 2, 2, "fp32", layers)
    whole, _, resumed = _save_then_resume(tp2, tp1, tmp_path, 2, 4)
    assert _losses(resumed, 0) == pytest.approx(_losses(whole, 0)[2:], rel=1e-4)


def test_an_fp16_run_that_skipped_steps_checkpoints_and_resumes_its_scale(
    gpus: Callable[[int], None], tmp_path: Path
) -> None:
    """fp16 on a GPU, the scale started at 2**28 so that the first iterations overflow and
    are skipped (doubling after 2 good steps): a checkpoint after skipped steps is written
    (it used to refuse: AdamW steps != iteration), and the run resumed from it continues the
    scale and the skips of the uninterrupted run, and its losses."""
    gpus(1)
    layers = tiny_model("tiny-gpt").num_all_layers
    plan = _plan("tiny-gpt", [(0, layers - 1, 1)], 2, 2, "fp16", layers)
    config = tmp_path / "train.json"
    config.write_text(
        json.dumps(
            {
                "model": {"kind": "builtin", "name": "tiny-gpt"},
                "precision": "fp16",
                "loss_scaling": {"initial_scale_power": 28, "loss_scale_window": 2},
            }
        )
    )
    total = 24

    def after_the_first_skips(whole: LocalRun) -> int:
        """One iteration after the first good one that follows a skipped one."""
        steps = whole.steps(0)
        scales = [(s["skipped"], s["loss_scale"]) for s in steps]
        good = [s["step"] for s in steps if not s["skipped"] and steps[0]["skipped"]]
        assert good and good[0] + 1 < total, f"no good iteration after the skipped ones: {scales}"
        return int(good[0]) + 1

    whole, _, resumed = _save_then_resume(
        plan, plan, tmp_path, after_the_first_skips, total, ("--train-config", str(config))
    )
    steps = whole.steps(0)
    save_at = after_the_first_skips(whole)
    assert all(s["precision"] == "fp16" for s in steps)
    got = [(s["step"], s["skipped"], s["loss_scale"]) for s in resumed.steps(0)]
    assert got == [(s["step"], s["skipped"], s["loss_scale"]) for s in steps[save_at:]]
    assert _losses(resumed, 0) == pytest.approx(_losses(whole, 0)[save_at:], rel=1e-5, nan_ok=True)


def test_span_timer_reads_cuda_events_after_the_sync(gpus: Callable[[int], None]) -> None:
    """On CUDA a span is two events on the stream (no host sync); collect() after a device
    sync reads the device's time, not the host's launch time."""
    from sailor.megatron_patch.clock import SpanTimer, timestamp

    gpus(1)
    dev = torch.device("cuda", 0)
    t = SpanTimer(dev)
    a = torch.randn(2048, 2048, device=dev)
    t0 = timestamp(dev)
    for _ in range(3):
        mark = t.begin()
        for _ in range(10):
            a = a @ a
            a = a / a.norm()
        t.end("fwd", mark)
    wall = timestamp(dev) - t0
    spans = t.collect()
    assert spans["fwd"][1] == 3
    assert 0 < spans["fwd"][0] <= wall * 1.05
    assert t.collect() == {}
