"""The DeepSpeed adapter saves and resumes Sailor's checkpoints (real DeepSpeed, CPU gloo).

The adapter's ranks run as ``python -m sailor.training_process.deepspeed_glue`` (the adapter
with Sailor's checkpoint IO); Sailor's engine as ``python -m sailor.training_process``. Every
run is checked against one uninterrupted single-process run (``train_reference``) within the
bounds of the adapter's own test (test_megatron_patch_deepspeed.py): a resume that lost the
weights, the AdamW moments, the AdamW step count or the data position moves the losses or the
parameters by far more (the parameters must also have moved >10 tolerances from their start).

- the adapter stops and saves at step 2 on the agent's control file, and resumes to step 4;
- a checkpoint the adapter saved resumes in Sailor's engine under another layout (one
  pipeline of two stages cut elsewhere), and one the engine saved periodically
  (``checkpoint.every_steps`` of a training config) resumes in the adapter, which saves
  periodically in turn;
- a checkpoint trained in another precision (bf16) is refused by name, and resumes with
  ``allow_precision_change``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sailor.checkpoint import (
    Checkpointer,
    LocalStorage,
    ParamState,
    TrainingGlobals,
    committed_steps,
    load,
    read_manifest,
)
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.launch import LocalRun, launch_local
from sailor.megatron_patch.model import tiny_model
from sailor.megatron_patch.reference import ReferenceRun, train_reference
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.training import TrainingConfig

pytest.importorskip("deepspeed")

ADAPTER = "sailor.training_process.deepspeed_glue"
ENGINE = "sailor.training_process"
MODEL = "tiny-llama"  # untied embeddings: the adapter maps no tied head
GBS = 8
# The adapter's own bounds (test_megatron_patch_deepspeed.py), the engine's fp32 rounding.
RTOL, ATOL = 1e-4, 2e-5
# The ranks wait for the world to form and load on the rendezvous store: polled at the load
# barrier's own default (0.05 s), not a worker's 1 s, each wait ends up to a second sooner
# (a few ranks on one host; what they wait for is unchanged).
FAST_POLL = ["--load-poll-s", "0.05"]
LOSS_REL, LOSS_ABS = 1e-5, 1e-6


def _plan(cuts: list[tuple[int, int]], pipelines: int, m: int) -> Plan:
    rg = ReplicaGroup(gpu_type="cpu", zone="z")
    pipe = Pipeline(
        stages=tuple(Stage(first_layer=a, last_layer=b, replica=rg) for a, b in cuts),
        microbatch_size=2,
        num_microbatches=m,
    )
    return Plan(model=MODEL, global_batch_size=GBS, pipelines=(pipe,) * pipelines)


# DeepSpeed: uneven stages (layers 0..3 | 4..5); two pipelines, or one.
DS_2X2 = _plan([(0, 3), (4, 5)], pipelines=2, m=2)
DS_1X2 = _plan([(0, 3), (4, 5)], pipelines=1, m=4)
# Sailor's engine: one pipeline of two stages cut elsewhere than the adapter's (its second
# stage holds layers each of the adapter's stages wrote), or two single-stage replicas.
ENGINE_1X2 = _plan([(0, 1), (2, 5)], pipelines=1, m=4)
ENGINE_2X1 = _plan([(0, 5)], pipelines=2, m=2)


def _reference(cfg: TrainConfig) -> tuple[ReferenceRun, dict[str, torch.Tensor]]:
    spec = tiny_model(MODEL, GBS)
    return train_reference(spec, GBS, 4, cfg, params_at=2), train_reference(
        spec, GBS, 0, cfg
    ).params


def _run(plan: Plan, steps: int, work: Path, module: str, *args: str) -> LocalRun:
    run = launch_local(
        plan, steps, work, module=module, extra_args=[*args, *FAST_POLL], deadline_s=180
    )
    assert run.ok, (run.returncodes, run.errors, [e[-2000:] for e in run.stderr])
    return run


def _stop_and_save(path: Path, ckpt: Path) -> str:
    """The agent's control file asking to stop at step 2 and save it into ``ckpt``."""
    path.write_text(json.dumps({"stop_at_step": 2, "save_step": 2, "save_dir": str(ckpt)}))
    return str(path)


def _losses(run: LocalRun) -> dict[int, float]:
    return {int(s["step"]): float(s["loss"]) for s in run.steps(0)}


def _check_losses(got: dict[int, float], ref: ReferenceRun, steps: list[int]) -> None:
    assert sorted(got) == steps
    for step in steps:
        assert got[step] == pytest.approx(ref.losses[step - 1], rel=LOSS_REL, abs=LOSS_ABS), step


def _check_params(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], init: dict[str, torch.Tensor]
) -> None:
    assert set(got) == set(ref)
    for key, value in got.items():
        torch.testing.assert_close(value, ref[key], rtol=RTOL, atol=ATOL, msg=key)
        tol = ATOL + RTOL * ref[key].abs()
        assert ((ref[key] - init[key]).abs() / tol).median() > 10, key  # training moved it


def _dumped(work: Path, ranks: range) -> dict[str, torch.Tensor]:
    """Every parameter the ranks dumped at their end (``--dump-state``)."""
    out: dict[str, torch.Tensor] = {}
    for r in ranks:
        out.update({k: t for k, (t, _d) in torch.load(work / f"state-{r}.pt").items()})
    return out


def _check_checkpoint(root: Path, step: int, ref: ReferenceRun, at: int) -> None:
    """Checkpoint ``step`` under ``root`` holds the reference's weights and moments after
    ``at`` iterations (``ref.params_at`` if at == 2, else its last)."""
    storage = LocalStorage(str(root))
    manifest = read_manifest(storage, step)
    assert (manifest.step, manifest.consumed_samples) == (step, step * GBS)
    got = load(storage, range(DS_2X2.num_layers), step=step)
    assert got.globals.extra["adam_step"] == step
    assert got.globals.extra["precision"] == "fp32"
    params = ref.params_at if at == 2 else ref.params
    moments = ref.moments_at if at == 2 else ref.moments
    assert set(got.params) == set(params)
    for key, ps in got.params.items():
        torch.testing.assert_close(ps.weight, params[key], rtol=RTOL, atol=ATOL, msg=key)
        m, v = moments[key]
        torch.testing.assert_close(ps.exp_avg, m, rtol=RTOL, atol=ATOL, msg=key)
        torch.testing.assert_close(ps.exp_avg_sq, v, rtol=RTOL, atol=ATOL**2, msg=key)


@pytest.fixture(scope="module")
def reference() -> tuple[ReferenceRun, dict[str, torch.Tensor]]:
    """The uninterrupted run without a training config, and its initial parameters."""
    return _reference(TrainConfig())


@pytest.fixture(scope="module")
def adapter_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalRun, Path]:
    """The adapter (two pipelines of two stages) stopped and saved at step 2 on the agent's
    control file: the run and the checkpoint root. One run serves every test resuming it."""
    work = tmp_path_factory.mktemp("adapter")
    ckpt = work / "ckpt"
    stop = _stop_and_save(work / "control.json", ckpt)
    return _run(DS_2X2, 4, work / "a", ADAPTER, "--control", stop), ckpt


def test_the_adapter_stops_saves_and_resumes_like_one_uninterrupted_run(
    reference: tuple[ReferenceRun, dict[str, torch.Tensor]],
    adapter_saved: tuple[LocalRun, Path],
    tmp_path: Path,
) -> None:
    ref, init = reference
    first, ckpt = adapter_saved
    for r in range(4):  # the agent's protocol: saved once durable, stopped at the stop step
        events = [(e["event"], e.get("step")) for e in first.progress[r]]
        assert ("saved", 2) in events and ("stopped", 2) in events, (r, events)
        assert max(s["step"] for s in first.steps(r)) == 2
    assert committed_steps(LocalStorage(str(ckpt))) == [2]
    _check_checkpoint(ckpt, 2, ref, at=2)

    second = _run(DS_2X2, 2, tmp_path / "b", ADAPTER, "--ckpt-dir", str(ckpt), "--load-step", "2")
    _check_losses({**_losses(first), **_losses(second)}, ref, [1, 2, 3, 4])
    _check_params(_dumped(tmp_path / "b", range(4)), ref.params, init)


def test_an_adapter_checkpoint_resumes_in_sailors_engine_under_another_layout(
    reference: tuple[ReferenceRun, dict[str, torch.Tensor]],
    adapter_saved: tuple[LocalRun, Path],
    tmp_path: Path,
) -> None:
    ref, init = reference
    first, ckpt = adapter_saved
    engine = _run(
        ENGINE_1X2, 2, tmp_path / "b", ENGINE, "--ckpt-dir", str(ckpt), "--load-step", "2"
    )
    _check_losses({**_losses(first), **_losses(engine)}, ref, [1, 2, 3, 4])
    _check_params(_dumped(tmp_path / "b", range(2)), ref.params, init)


@dataclass(frozen=True)
class _EngineSaved:
    run: LocalRun
    """Sailor's engine (two single-stage replicas), 2 steps under ``cfg_file``."""
    ckpt: Path
    """Its periodic checkpoint's root: step 2 (and the adapter's step 4 once it resumed)."""
    cfg_file: Path
    tc: TrainingConfig


@pytest.fixture(scope="module")
def engine_saved(tmp_path_factory: pytest.TempPathFactory) -> _EngineSaved:
    """A checkpoint Sailor's engine saved periodically (``checkpoint.every_steps`` of a
    training config) at step 2, on synthetic sequences of 16 tokens (tiny-llama's). One run
    serves the test resuming it in the adapter and the test refusing it on other data (that
    one is refused before it reads anything and writes nothing)."""
    work = tmp_path_factory.mktemp("engine")
    ckpt = work / "ckpt"
    tc = TrainingConfig.model_validate(
        {
            "model": {"kind": "builtin", "name": MODEL},
            "optimizer": {"weight_decay": 1.0},
            "checkpoint": {"dir": str(ckpt), "every_steps": 2, "keep": 3},
        }
    )
    cfg_file = work / "run.json"
    cfg_file.write_text(tc.model_dump_json())
    run = _run(ENGINE_2X1, 2, work / "a", ENGINE, "--train-config", str(cfg_file))
    assert committed_steps(LocalStorage(str(ckpt))) == [2]
    return _EngineSaved(run, ckpt, cfg_file, tc)


def test_an_engine_checkpoint_resumes_in_the_adapter_which_saves_periodically(
    engine_saved: _EngineSaved, tmp_path: Path
) -> None:
    """Both under one training config (its default AdamW exempts biases and norms from
    weight decay: the adapter's parameter groups must be the engine's). The weight decay is
    large so that decaying the exempt weights shows: lr 1e-3 x 1.0 moves a norm weight of ~1
    by ~1e-3 a step, ~8 tolerances (at the default 0.01 it moved them ~1e-5, within one)."""
    tc, ckpt, cfg_file = engine_saved.tc, engine_saved.ckpt, engine_saved.cfg_file
    assert tc.optimizer.no_decay  # the default exempts some kinds
    ref, init = _reference(TrainConfig.of(tc))
    assert committed_steps(LocalStorage(str(ckpt))) == [2]
    resumed = [*("--train-config", str(cfg_file), "--ckpt-dir", str(ckpt), "--load-step", "2")]
    # one pipeline: another layout than the engine's; the adapter's save from two
    # data-parallel replicas is the test resuming its own checkpoint's (adapter_saved)
    ds = _run(DS_1X2, 2, tmp_path / "b", ADAPTER, *resumed)
    _check_losses({**_losses(engine_saved.run), **_losses(ds)}, ref, [1, 2, 3, 4])
    _check_params(_dumped(tmp_path / "b", range(2)), ref.params, init)
    # the adapter's own periodic checkpoint at step 4 (its training config's)
    assert committed_steps(LocalStorage(str(ckpt))) == [2, 4]
    assert [e["step"] for e in ds.progress[0] if e["event"] == "periodic_checkpoint"] == [4]
    _check_checkpoint(ckpt, 4, ref, at=4)


def _bf16_checkpoint(root: Path, ref: ReferenceRun) -> None:
    """The reference's state after 2 steps, saved as a run in bf16 would save it (one rank
    holding every layer; no process group)."""
    plan = _plan([(0, 5)], pipelines=1, m=4)
    params = {
        k: ParamState(w.clone(), ref.moments_at[k][0].clone(), ref.moments_at[k][1].clone(), None)
        for k, w in ref.params_at.items()
    }
    extra = {"adam_step": 2, "seed": 0, "precision": "bf16", "skipped_steps": 0}
    ck = Checkpointer(LocalStorage(str(root)), plan, 0)
    ck.save(params, TrainingGlobals(2, 2 * GBS, {**extra, "loss_scale": None, "nonfinite": {}}))
    ck.close()
    assert committed_steps(LocalStorage(str(root))) == [2]


def test_the_adapter_refuses_another_precision_unless_allowed(
    reference: tuple[ReferenceRun, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    ref, init = reference
    ckpt = tmp_path / "ckpt"
    _bf16_checkpoint(ckpt, ref)
    resume = ["--ckpt-dir", str(ckpt), "--load-step", "2"]
    refused = launch_local(
        DS_1X2, 2, tmp_path / "a", module=ADAPTER, extra_args=[*resume, *FAST_POLL]
    )
    assert not refused.ok
    for err in refused.errors:
        assert err is not None
        assert "precision='bf16' of the state being loaded" in err["message"], err
        assert "allow_precision_change" in err["message"], err
    assert not refused.steps(0)

    tc = TrainingConfig.model_validate(
        {"model": {"kind": "builtin", "name": MODEL}, "allow_precision_change": True}
    )
    tc = tc.model_copy(update={"optimizer": tc.optimizer.model_copy(update={"no_decay": ()})})
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(tc.model_dump_json())
    allowed = _run(DS_1X2, 2, tmp_path / "b", ADAPTER, *resume, "--train-config", str(cfg_file))
    _check_losses(_losses(allowed), ref, [3, 4])
    _check_params(_dumped(tmp_path / "b", range(2)), ref.params, init)


def test_the_adapter_refuses_a_checkpoint_of_other_data_by_name(
    engine_saved: _EngineSaved, tmp_path: Path
) -> None:
    """An engine checkpoint of tiny-llama trained on sequences of 16 tokens, resumed by the
    adapter on sequences of 8: RoPE has no parameter of the sequence length, so the model
    fits, and before, the adapter resumed it (exit 0) with its sample counter over other
    samples. Now every rank refuses it before the read, naming ``data.seq_length``, a
    configuration error (the checkpoint records its data: ``CheckpointManifest.data``)."""
    ckpt = engine_saved.ckpt
    spec = tiny_model(MODEL, GBS)
    assert spec.seq_length == 16  # what the engine trained on (its builtin model's)
    data = read_manifest(LocalStorage(str(ckpt)), 2).data
    assert data is not None and (data.kind, data.seq_length) == ("synthetic", 16)
    tc = TrainingConfig.model_validate(
        {"model": {"kind": "spec", "spec": spec.model_dump() | {"seq_length": 8}}}
    )
    (tmp_path / "b.json").write_text(tc.model_dump_json())
    resume = ["--train-config", str(tmp_path / "b.json"), "--ckpt-dir", str(ckpt)]
    refused = launch_local(
        DS_1X2,
        2,
        tmp_path / "b",
        module=ADAPTER,
        extra_args=[*resume, "--load-step", "2", *FAST_POLL],
        deadline_s=180,
    )
    assert refused.returncodes == [1, 1], (refused.errors, refused.stderr)
    for err in refused.errors:
        assert err is not None and err["error_type"] == "DataMismatchError", err
        assert err["origin"] == "config" and err["retry"] is False
        assert (
            "data.seq_length: trained with seq_length=16, this run has seq_length=8"
            in (err["message"])
        )
    assert not refused.steps(0)
