"""``sailor worker --train-config``: real text from ``sailor data prepare`` through the engine.

Two layouts (one rank; a two-stage pipeline with other microbatches) and plain single-process
training read the same samples of a prepared corpus at the same data positions, so their
losses agree at every step; rank 0
writes the step metrics as JSON lines and TensorBoard events. A config with a wrong field
is refused by the rank before any process group starts, naming the field and value.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sailor.data.corpus import builtin_corpus
from sailor.data.prepare import PrepareOptions, prepare
from sailor.megatron_patch.data import build_dataset
from sailor.megatron_patch.engine import TrainConfig
from sailor.megatron_patch.launch import LocalRun, launch_local
from sailor.megatron_patch.reference import train_reference
from sailor.metrics import read_events
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.training import SpecFileModel, parse_training_config

STEPS = 4
VOCAB = 320

CONFIG = f"""
model:
  kind: spec
  spec: {{name: tiny-text, num_layers: 2, hidden_size: 32, num_heads: 4, ffn_hidden_size: 64,
         seq_length: 16, vocab_size: {VOCAB}, global_batch_size: 4, precision: fp32}}
data: {{kind: indexed, prefix: data/pydocs}}
seed: 1
optimizer: {{lr: 0.003, weight_decay: 0.0}}
metrics: {{jsonl: out/metrics.jsonl, tensorboard_dir: out/tb}}
"""


def _stage(a: int, b: int) -> Stage:
    return Stage(first_layer=a, last_layer=b, replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=1))


def _plan(*pipelines: Pipeline) -> Plan:
    return Plan(
        model="tiny-text",
        global_batch_size=sum(p.samples for p in pipelines),
        pipelines=pipelines,
    )


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("textrun")
    prepare(
        builtin_corpus("python-docs"),
        PrepareOptions(out=root / "data" / "pydocs", vocab_size=VOCAB, max_bytes=40_000),
    )
    path = root / "run.yaml"
    path.write_text(CONFIG)
    return path


TWO = _plan(Pipeline(stages=(_stage(0, 1), _stage(2, 3)), microbatch_size=1, num_microbatches=4))
CKPT_DIR = "ckpt-periodic"


@pytest.fixture(scope="module")
def periodic(config: Path) -> tuple[Path, LocalRun]:
    """The two-stage pipeline (``sailor worker``) for STEPS + 1 steps under the config plus
    ``checkpoint: {dir, every_steps: 2, keep: 1}``: the pipeline layout of the layouts test
    (saves do not change a loss) and the saving run of the periodic-checkpoint test, one run
    for both (a rank process costs seconds of CPU)."""
    path = config.parent / "run-ckpt.yaml"
    path.write_text(CONFIG + f"checkpoint: {{dir: {CKPT_DIR}, every_steps: 2, keep: 1}}\n")
    run = launch_local(
        TWO,
        STEPS + 1,
        config.parent / "periodic",
        extra_args=["--train-config", str(path)],
        module="sailor.training_process",
    )
    assert run.ok, (run.errors, run.stderr)
    return path, run


def test_layouts_agree_on_prepared_text(
    config: Path, periodic: tuple[Path, LocalRun], tmp_path: Path
) -> None:
    one = _plan(Pipeline(stages=(_stage(0, 3),), microbatch_size=2, num_microbatches=2))
    # the two-stage layout: the shared run's first STEPS steps (written to out/ before this
    # one-rank run, so the metrics checked below are the one-rank run's)
    run = launch_local(one, STEPS, tmp_path / "one", extra_args=["--train-config", str(config)])
    assert run.ok, (run.errors, run.stderr)
    losses = [[s["loss"] for s in run.steps(0)], [s["loss"] for s in periodic[1].steps(0)][:STEPS]]
    assert len(losses[0]) == STEPS
    assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-6)
    assert losses[0][-1] < losses[0][0]

    # and one plain process on the same samples (the reference takes the data set)
    tc = parse_training_config(config.read_text(), str(config))
    assert isinstance(tc.model, SpecFileModel) and tc.model.spec is not None
    spec = tc.model.spec
    data = build_dataset(tc.data, spec, tc.seed, base_dir=config.parent)
    cfg = TrainConfig.of(tc)
    ref = train_reference(spec, 4, STEPS, cfg, data=data)
    assert losses[0] == pytest.approx(ref.losses, rel=1e-5, abs=1e-6)

    out = config.parent / "out"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[-STEPS:]] == list(range(1, STEPS + 1))
    last = rows[-1]
    assert last["tokens_per_s"] == pytest.approx(4 * 16 / last["step_s"])
    assert last["mfu/cpu"] is None and last["lr"] == 0.003
    assert "loss_scale" not in last  # fp32 on CPU: no loss scaling unless asked
    tb_files = sorted((out / "tb").glob("events.out.tfevents.*"))
    assert len(tb_files) == 2  # one per run, rank 0 only
    events = read_events(tb_files[-1])
    assert [e.step for e in events[1:]] == list(range(1, STEPS + 1))
    assert events[-1].scalars["loss"] == pytest.approx(losses[0][-1], rel=1e-6)


def test_wrong_field_refused_before_any_process_group(tmp_path: Path) -> None:
    plan = _plan(Pipeline(stages=(_stage(0, 3),), microbatch_size=1, num_microbatches=4))
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    bad = tmp_path / "run.yaml"
    bad.write_text(CONFIG.replace("lr: 0.003", "lr: -0.5"))
    # world size 2 with one rank started: reaching the rendezvous would block for the timeout
    cmd = [
        sys.executable,
        "-m",
        "sailor.megatron_patch.rank_main",
        "--plan",
        str(tmp_path / "plan.json"),
        "--rank",
        "0",
        "--world-size",
        "1",
        "--master",
        "127.0.0.1:9",
        "--steps",
        "1",
        "--timeout-s",
        "600",
        "--error-file",
        str(tmp_path / "err.json"),
        "--train-config",
        str(bad),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    err = json.loads((tmp_path / "err.json").read_text())
    assert err["origin"] == "config" and err["retry"] is False
    assert "optimizer.lr=-0.5: Input should be greater than 0" in err["message"]
    assert "init_process_group" not in err["traceback"]


def test_periodic_checkpoints_of_the_config_keep_their_own_retention(
    config: Path, periodic: tuple[Path, LocalRun], tmp_path: Path
) -> None:
    """``checkpoint: {dir, every_steps: 2, keep: 1}``: steps 2 and 4 are saved under the
    config's directory (anchored at the config file) and only the newest stays; the run
    resumes from it with the uninterrupted run's next loss. The saving run is the module's
    two-stage run; the resume runs the same microbatches on one rank (a rank process costs
    seconds of CPU): it reads both stages' shards of the kept step."""
    from sailor.checkpoint import LocalStorage
    from sailor.checkpoint.reader import committed_steps

    path, run = periodic
    args = ["--train-config", str(path)]
    root = config.parent / CKPT_DIR
    assert committed_steps(LocalStorage(str(root))) == [4]
    events = [e for e in run.progress[0] if e.get("event") == "periodic_checkpoint"]
    assert [e["step"] for e in events] == [2, 4]
    resumed = launch_local(
        _plan(Pipeline(stages=(_stage(0, 3),), microbatch_size=1, num_microbatches=4)),
        1,
        tmp_path / "b",
        extra_args=[*args, "--ckpt-dir", str(root), "--load-step", "4"],
        module="sailor.training_process",
    )
    assert resumed.ok, (resumed.errors, resumed.stderr)
    assert [s["loss"] for s in resumed.steps(0)] == pytest.approx(
        [s["loss"] for s in run.steps(0)][4:], rel=1e-6
    )


def test_periodic_checkpoints_without_a_checkpoint_implementation_refused_at_start(
    config: Path, tmp_path: Path
) -> None:
    """``python -m sailor.megatron_patch.rank_main`` has no checkpoint implementation (an
    agent whose ``worker_argv`` names it, or ``launch_local``): with ``checkpoint.every_steps``
    every rank used to train until the first save was due and die there, hours into a real
    run (here, with the save at step 1000, it trained every step and exited 0). Every rank now
    refuses it at start, before its process group and any step, naming the field and value."""
    path = config.parent / "run-no-ckpt-io.yaml"
    path.write_text(CONFIG + "checkpoint: {dir: ckpt-none, every_steps: 1000}\n")
    plan = _plan(
        Pipeline(stages=(_stage(0, 1), _stage(2, 3)), microbatch_size=1, num_microbatches=4)
    )
    run = launch_local(plan, STEPS, tmp_path, extra_args=["--train-config", str(path)])
    assert run.returncodes == [1, 1], (run.errors, run.stderr)
    for rank, err in enumerate(run.errors):
        assert err is not None
        assert err["origin"] == "config" and err["retry"] is False
        assert "checkpoint.every_steps=1000 (dir='ckpt-none')" in err["message"]
        assert "sailor worker" in err["message"]
        assert "init_process_group" not in err["traceback"]
        assert run.steps(rank) == []
    assert not (config.parent / "ckpt-none").exists()
