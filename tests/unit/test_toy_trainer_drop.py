"""The toy trainer's deletion of commits the controller gave up on (``drop_steps``), run
in-process on a real directory: only the commit its committer saw goes, never a save of
the same step by a later generation (the real worker's ``checkpoint/unrecorded.py`` rule).
"""

from __future__ import annotations

import json
from pathlib import Path

from sailor.agent.toy_trainer import _ckpt_dir, _commits, _prune_unrecorded, _save

W = [0.0, 1.0, 2.0, 3.0]


def _commit(root: str, step: int, attempt: str) -> None:
    """A one-rank world's save of ``step``, committed."""
    assert _save(root, step, W, 0, 1, 2.0, -1, attempt=attempt) == []


def test_a_late_committer_leaves_a_save_of_its_step_in_flight_alone(tmp_path: Path) -> None:
    """Generation g's committer (its save of 300 began with 200's given-up commit on disk)
    deletes 200 late, while generation g+1 is saving 200 again: one rank's part written,
    the commit not yet made. Deleting 200's directory took that part: g+1's committer
    then waited for it and failed its required save."""
    root = str(tmp_path)
    _commit(root, 100, "g0")
    _commit(root, 200, "g0")  # committed, given up on by the controller
    seen = _commits(root, but=300)  # g's committer, as its save of 300 begins
    assert _save(root, 200, W, 1, 2, 2.0, 100, attempt="g1") == []  # g+1's rank 1
    assert _prune_unrecorded(root, seen, [200], 300, 100) == [200]
    assert _save(root, 200, W, 0, 2, 2.0, 100, attempt="g1") == []  # g+1 commits
    d = _ckpt_dir(root, 200)
    names = sorted(p.name for p in d.iterdir())
    assert names == ["COMMIT", "rank-0.json", "rank-1.json", "state.json"]
    assert json.loads((d / "COMMIT").read_text())["attempt"] == "g1"


def test_the_step_committed_again_is_not_deleted(tmp_path: Path) -> None:
    """A save of the step again writes another marker, even under the same attempt, so a
    committer holding the old one leaves the new commit alone: the bare step a marker held
    before was the same bytes at every save, and the check could never fail."""
    root = str(tmp_path)
    _commit(root, 200, "g0")
    seen = _commits(root, but=300)
    _commit(root, 200, "g0")  # saved again, committed
    assert (_ckpt_dir(root, 200) / "COMMIT").read_text() != seen[200]
    assert _prune_unrecorded(root, seen, [200], 300, 100) == []
    assert (_ckpt_dir(root, 200) / "COMMIT").is_file()
    # the commit seen goes, all of it, and its directory with it
    assert _prune_unrecorded(root, _commits(root, but=300), [200], 300, 100) == [200]
    assert not _ckpt_dir(root, 200).exists()
