"""A checkpoint records the identity of the data it was trained on; a resume over other data is
refused by name before any shard is read, unless the training config accepts it.

Real ranks (``launch_local``, gloo) of ``sailor worker`` train on a corpus prepared by ``sailor
data prepare`` and save a checkpoint. Before, nothing in a checkpoint said which data its
``consumed_samples`` indexed: a run resumed with another prepared corpus (here the same text
shuffled with another seed) continued its sample counter over other samples, exit 0, the
loss curve unremarkable. Now:

- another corpus: every rank (of two, resuming the one-rank run's checkpoint under a two-stage
  pipeline) refuses it before its first step, a configuration error
  (``origin="config"``, not retried, no node blamed) naming the fields that differ with the
  checkpoint's and the run's values;
- the same corpus copied to another directory: the same data, resumed (the identity holds
  no path), with the uninterrupted run's next loss;
- ``allow_data_change: true``: resumed, and the log says what changed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sailor.checkpoint import LocalStorage, read_manifest
from sailor.checkpoint.cli import inspect_text
from sailor.data.corpus import builtin_corpus
from sailor.data.prepare import PrepareOptions, prepare
from sailor.megatron_patch.launch import LocalRun, launch_local
from sailor.schemas.plan import Pipeline, Plan, ReplicaGroup, Stage

VOCAB = 320
SAVED_AT = 2

CONFIG = f"""
model:
  kind: spec
  spec: {{name: tiny-text, num_layers: 2, hidden_size: 32, num_heads: 4, ffn_hidden_size: 64,
         seq_length: 16, vocab_size: {VOCAB}, global_batch_size: 4, precision: fp32}}
seed: 1
optimizer: {{lr: 0.003, weight_decay: 0.0}}
"""


def _plan(ranks: int) -> Plan:
    """One rank (layers 0-3), or a two-stage pipeline. Only the refusal needs two ranks (every
    rank refuses); the saving run and the resumed ones check rank 0 alone, and each rank
    process costs seconds of CPU, so they run one."""

    def stage(a: int, b: int) -> Stage:
        return Stage(
            first_layer=a, last_layer=b, replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=1)
        )

    stages = (stage(0, 3),) if ranks == 1 else (stage(0, 1), stage(2, 3))
    pipe = Pipeline(stages=stages, microbatch_size=1, num_microbatches=4)
    return Plan(model="tiny-text", global_batch_size=4, pipelines=(pipe,))


def _config(root: Path, name: str, prefix: Path, extra: str = "") -> Path:
    path = root / f"{name}.yaml"
    path.write_text(CONFIG + f"data: {{kind: indexed, prefix: {prefix}}}\n" + extra)
    return path


def _run(
    config: Path, workdir: Path, steps: int, resume_from: Path | None = None, ranks: int = 1
) -> LocalRun:
    args = ["--train-config", str(config)]
    if resume_from is not None:
        args += ["--ckpt-dir", str(resume_from), "--load-step", str(SAVED_AT)]
    return launch_local(
        _plan(ranks), steps, workdir, extra_args=args, module="sailor.training_process"
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LocalRun]:
    """Corpus A (shuffle seed 0) and B (the same text, shuffle seed 1) prepared; a run on A
    (one rank) saved at step 2 (``checkpoint.every_steps``) and trained one step more."""
    root = tmp_path_factory.mktemp("dataid")
    for name, seed in (("a", 0), ("b", 1)):
        prepare(
            builtin_corpus("python-docs"),
            PrepareOptions(
                out=root / name / "corpus", vocab_size=VOCAB, max_bytes=40_000, seed=seed
            ),
        )
    config = _config(
        root,
        "first",
        root / "a" / "corpus",
        f"checkpoint: {{dir: {root / 'ckpt'}, every_steps: {SAVED_AT}}}\n",
    )
    run = _run(config, root / "first-run", SAVED_AT + 1)
    assert run.ok, (run.errors, run.stderr)
    return root, run


def test_the_manifest_records_the_data_without_its_path(saved: tuple[Path, LocalRun]) -> None:
    root, _ = saved
    m = read_manifest(LocalStorage(str(root / "ckpt")), SAVED_AT)
    assert m.data is not None and m.data.kind == "indexed"
    assert (m.data.seq_length, m.data.seed, m.data.shuffle_seed) == (16, 1, 0)
    assert m.data.vocab_size is not None and m.data.vocab_size <= VOCAB
    assert m.data.content_sha256 is not None and m.data.tokenizer_sha256 is not None
    raw = json.loads((root / "ckpt" / f"step-{SAVED_AT:09d}" / "manifest.json").read_text())
    assert str(root) not in json.dumps(raw["data"])  # no path: a copied corpus is the same
    shown = inspect_text(str(root / "ckpt"), SAVED_AT)  # `sailor ckpt inspect`
    assert 'data {"kind": "indexed", "seq_length": 16, "seed": 1' in shown


def test_another_corpus_is_refused_by_name_before_any_step(
    saved: tuple[Path, LocalRun], tmp_path: Path
) -> None:
    root, _ = saved
    other = _config(tmp_path, "other", root / "b" / "corpus")
    run = _run(other, tmp_path / "run", 1, resume_from=root / "ckpt", ranks=2)
    assert run.returncodes == [1, 1], (run.errors, run.stderr)
    for rank, err in enumerate(run.errors):
        assert err is not None, run.stderr[rank]
        assert err["error_type"] == "DataMismatchError"
        assert err["origin"] == "config" and err["retry"] is False
        msg = err["message"]
        assert f"{root / 'ckpt'} step {SAVED_AT}" in msg
        assert "data.shuffle_seed: trained with shuffle_seed=0, this run has shuffle_seed=1" in msg
        assert "data.content_sha256: trained with content_sha256=" in msg
        assert "allow_data_change: true" in msg
        assert run.steps(rank) == []


def test_the_same_corpus_copied_elsewhere_resumes(
    saved: tuple[Path, LocalRun], tmp_path: Path
) -> None:
    root, first = saved
    shutil.copytree(root / "a", tmp_path / "moved")
    moved = _config(tmp_path, "moved", tmp_path / "moved" / "corpus")
    run = _run(moved, tmp_path / "run", 1, resume_from=root / "ckpt")
    assert run.ok, (run.errors, run.stderr)
    assert [s["loss"] for s in run.steps(0)] == pytest.approx(
        [s["loss"] for s in first.steps(0)][SAVED_AT:], rel=1e-6
    )
    assert "resumed on other data" not in run.stderr[0]
    assert all("data_changed" not in e for e in run.progress[0] if e["event"] == "ready")


def test_the_override_resumes_on_other_data_and_says_what_changed(
    saved: tuple[Path, LocalRun], tmp_path: Path
) -> None:
    root, _ = saved
    other = _config(tmp_path, "other", root / "b" / "corpus", "allow_data_change: true\n")
    run = _run(other, tmp_path / "run", 1, resume_from=root / "ckpt")
    assert run.ok, (run.errors, run.stderr)
    assert [s["step"] for s in run.steps(0)] == [SAVED_AT + 1]
    said = run.stderr[0]
    assert "resumed on other data than it was trained on (allow_data_change)" in said
    assert "data.shuffle_seed: trained with shuffle_seed=0, this run has shuffle_seed=1" in said
    # and in rank 0's ready event, which its agent logs (worker_data_changed)
    ready = [e for e in run.progress[0] if e["event"] == "ready"]
    assert "data.shuffle_seed: trained with shuffle_seed=0" in ready[0]["data_changed"]
