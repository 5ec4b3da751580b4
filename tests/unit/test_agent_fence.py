"""The agent's persisted epoch fence: raised durably, never lowered, not guessed when unreadable."""

from __future__ import annotations

from pathlib import Path

import pytest

from sailor.agent.fence import EpochFence, FenceUnreadableError


def test_the_fence_outlives_its_object_and_never_goes_down(tmp_path: Path) -> None:
    path = tmp_path / "run" / "n1.epoch"
    fence = EpochFence(path)
    assert fence.epoch == 0
    assert fence.raise_to(7)
    assert not fence.raise_to(5) and fence.epoch == 7
    assert EpochFence(path).epoch == 7  # a restarted agent
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize("content", [b"", b"{", b'{"epoch": -1}', b'{"epoch": "7"}', b"[]"])
def test_an_unreadable_fence_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "n1.epoch"
    path.write_bytes(content)
    with pytest.raises(FenceUnreadableError):
        EpochFence(path)
