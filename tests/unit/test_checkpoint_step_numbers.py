"""Step numbers at the edges: step 0, and steps past the nine digits of a step directory.

A step directory is ``step-`` and the step with at least nine digits (``format.step_dir``).
Step 1_000_000_000 has ten: its directory was written and committed, but the listing took it
for no step at all (``step-(\\d{9})``), so ``latest_step`` named an older commit (a resume
of "the latest" loaded it silently), ``sailor ckpt ls`` and ``gc`` did not see it, and
retention never counted nor deleted such commits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sailor.checkpoint import LocalStorage, committed_steps, latest_step, load, verify
from sailor.checkpoint.format import parse_step_dir, step_dir
from sailor.checkpoint.gc import collect
from tests.unit.test_checkpoint_local import _save, _state

BIG = 1_000_000_000  # ten digits


@pytest.mark.parametrize("step", [0, 7, 999_999_999, BIG, 2**40], ids=str)
def test_a_step_directory_name_reads_back_as_its_step(step: int) -> None:
    assert parse_step_dir(step_dir(step)) == step


@pytest.mark.parametrize(
    "name", ["step-00000001", "step-0000000001", "step-", "step-12345678x", "steps-000000001"]
)
def test_names_the_writer_never_makes_are_no_step(name: str) -> None:
    # a 10-digit name with a leading zero would read as a step whose directory is another
    assert parse_step_dir(name) is None


def test_a_commit_past_nine_digits_is_the_latest_and_retention_counts_it(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ck"
    storage = LocalStorage(root)
    _save(root, 999_999_999, seed=1)
    _save(root, BIG, keep=1, seed=2)
    # the newest commit is the latest, and retention (keep=1) took the older one
    assert committed_steps(storage) == [BIG]
    assert latest_step(storage) == BIG
    assert not (root / step_dir(999_999_999)).exists()
    got = load(storage, range(4))
    assert got.globals.step == BIG
    want = _state(2)
    assert all(torch.equal(got.params[k].weight, want[k].weight) for k in want)
    assert verify(storage, BIG) == []
    # an operator's gc sees it too: keep=1 leaves it alone, an older one goes
    _save(root, 5, seed=3)
    assert collect(storage, keep=1) == [f"{step_dir(5)}/"]
    assert committed_steps(storage) == [BIG]


def test_step_zero_commits_and_loads(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _save(root, 0, keep=1)
    storage = LocalStorage(root)
    assert latest_step(storage) == 0
    got = load(storage, range(4), step=0)
    want = _state(0)
    assert got.globals.step == 0 and got.globals.consumed_samples == 0
    assert all(torch.equal(got.params[k].exp_avg_sq, want[k].exp_avg_sq) for k in want)
