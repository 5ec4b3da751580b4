"""The DeepSpeed adapter saves and resumes bf16 runs in Sailor's format (real DeepSpeed, gloo).

In bf16 DeepSpeed steps a ``BF16_Optimizer`` holding the fp32 master weights and AdamW moments
in flat partitions across the data-parallel ranks; the checkpoint must hold those masters
(not the bf16 copies) and moments by layer key. The ranks run bf16 on the CPU through
``deepspeed_bf16_rank`` (DeepSpeed's CPU accelerator runs bf16; it refuses fp16), against one
uninterrupted bf16 run of the same plan (two pipelines of two uneven stages):

- stopped and saved at step 2, resumed under the same layout: the losses and the fp32 masters
  are *equal* to the uninterrupted run's (the same computation from the same state: a master,
  moment or step count restored inexactly shows);
- the same checkpoint resumed under another layout (one pipeline: the masters partitioned
  over one rank instead of two) and in Sailor's engine (one pipeline of three stages, fp32 on
  the CPU, with ``allow_precision_change``): bf16 rounding now differs (another reduction
  order; the engine computes in fp32), so the bounds are the measured noise with a margin,
  far below what a lost moment or step count moves (below).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from sailor.checkpoint import LocalStorage, committed_steps, load
from sailor.megatron_patch.launch import LocalRun
from sailor.schemas.training import TrainingConfig
from tests.integration.test_deepspeed_checkpoints import (
    DS_1X2,
    DS_2X2,
    ENGINE,
    ENGINE_1X3,
    GBS,
    MODEL,
    _dumped,
    _losses,
    _run,
    _stop_and_save,
)

pytest.importorskip("deepspeed")

BF16_RANK = "tests.integration.deepspeed_bf16_rank"
REPO = Path(__file__).resolve().parents[2]
# Another layout or engine than the uninterrupted run's, measured over 2 steps after the
# resume: per tensor the median |difference| was <= 2.1e-6 (adapter, one pipeline) and
# <= 5e-6 (engine); the 2 steps moved each tensor's median element by 0.8e-3 to 1.8e-3
# (lr 1e-3: Adam moves an element ~lr a step), and a resume that lost the moments or the
# step count changes each update by a fraction of lr. 2e-5 sits between the two. Single
# elements differ more where the gradient is noise (a key bias: softmax ignores it) or
# appears after quiet steps (an embedding row: 2.3e-3 in the engine): Adam scales either up
# to lr (1 - beta1) / sqrt(1 - beta2) ~ 3.2 lr a step (Kingma & Ba, sec. 2.1), so elements
# are bounded by two such steps, 7e-3.
MEDIAN_TOL, MAX_TOL = 2e-5, 7e-3
# losses: the adapter in another layout differed by 3e-6 relative, the engine (fp32
# compute from the same state, bf16 rounding gone) by 2e-4: bf16 keeps 8 bits (4e-3).
LAYOUT_LOSS_REL, ENGINE_LOSS_REL = 1e-4, 1e-3


@dataclass(frozen=True)
class _Saved:
    full: LocalRun
    """The uninterrupted bf16 run of 4 steps."""
    full_params: dict[str, torch.Tensor]
    first: LocalRun
    """The run stopped and saved at step 2."""
    at_2: dict[str, torch.Tensor]
    """The first run's fp32 masters at its stop (``--dump-state``)."""
    ckpt: Path


@pytest.fixture(scope="module", autouse=True)
def _ranks_find_the_tests() -> Iterator[None]:
    """The ranks start as ``python -m tests.integration.deepspeed_bf16_rank`` in their
    work directories: the repository must be on their path."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> _Saved:
    work = tmp_path_factory.mktemp("bf16")
    full = _run(DS_2X2, 4, work / "full", BF16_RANK)
    ckpt = work / "ckpt"
    stop = _stop_and_save(work / "control.json", ckpt)
    first = _run(DS_2X2, 4, work / "a", BF16_RANK, "--control", stop)
    assert committed_steps(LocalStorage(str(ckpt))) == [2]
    return _Saved(
        full, _dumped(work / "full", range(4)), first, _dumped(work / "a", range(4)), ckpt
    )


def test_a_bf16_checkpoint_holds_the_fp32_masters_and_resumes_exactly(
    saved: _Saved, tmp_path: Path
) -> None:
    got = load(LocalStorage(str(saved.ckpt)), range(DS_2X2.num_layers), step=2)
    extra = got.globals.extra
    assert (got.globals.step, got.globals.consumed_samples) == (2, 2 * GBS)
    assert (extra["precision"], extra["adam_step"], extra["skipped_steps"]) == ("bf16", 2, 0)
    assert set(got.params) == set(saved.at_2)
    for key, ps in got.params.items():
        assert ps.weight.dtype == torch.float32, key
        # the masters, not the bf16 copies: few of them are bf16 numbers
        in_bf16 = (ps.weight.bfloat16().float() == ps.weight).float().mean()
        assert in_bf16 < 0.1, (key, float(in_bf16))
        assert torch.equal(ps.weight, saved.at_2[key]), key
        assert ps.exp_avg.abs().sum() > 0 and (ps.exp_avg_sq > 0).any(), key

    resume = ["--ckpt-dir", str(saved.ckpt), "--load-step", "2"]
    second = _run(DS_2X2, 2, tmp_path / "b", BF16_RANK, *resume)
    assert {**_losses(saved.first), **_losses(second)} == _losses(saved.full)
    resumed = _dumped(tmp_path / "b", range(4))
    assert set(resumed) == set(saved.full_params)
    for key, value in resumed.items():
        assert torch.equal(value, saved.full_params[key]), key


def _check_close(
    got: dict[int, float],
    params: dict[str, torch.Tensor],
    saved: _Saved,
    loss_rel: float,
) -> None:
    want = _losses(saved.full)
    assert sorted(got) == [3, 4]
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=loss_rel), step
    assert set(params) == set(saved.full_params)
    for key, value in params.items():
        diff = (value - saved.full_params[key]).abs()
        moved = (saved.full_params[key] - saved.at_2[key]).abs().median()
        assert diff.median() <= MEDIAN_TOL, (key, float(diff.median()))
        assert diff.max() <= MAX_TOL, (key, float(diff.max()))
        assert moved > 20 * MEDIAN_TOL, (key, float(moved))  # the steps moved it


def test_a_bf16_checkpoint_resumes_under_another_layout_and_in_sailors_engine(
    saved: _Saved, tmp_path: Path
) -> None:
    resume = ["--ckpt-dir", str(saved.ckpt), "--load-step", "2"]
    other = _run(DS_1X2, 2, tmp_path / "ds", BF16_RANK, *resume)
    _check_close(_losses(other), _dumped(tmp_path / "ds", range(2)), saved, LAYOUT_LOSS_REL)

    # the engine computes fp32 on the CPU: it loads bf16 state with allow_precision_change;
    # AdamW as the adapter's without a training config (weight decay on every parameter)
    tc = TrainingConfig.model_validate(
        {"model": {"kind": "builtin", "name": MODEL}, "allow_precision_change": True}
    )
    tc = tc.model_copy(update={"optimizer": tc.optimizer.model_copy(update={"no_decay": ()})})
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(tc.model_dump_json())
    engine = _run(ENGINE_1X3, 2, tmp_path / "e", ENGINE, *resume, "--train-config", str(cfg_file))
    _check_close(_losses(engine), _dumped(tmp_path / "e", range(3)), saved, ENGINE_LOSS_REL)
