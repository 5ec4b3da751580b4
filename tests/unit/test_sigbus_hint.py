"""A data ``.bin`` truncated in place under a running rank: the rank dies by SIGBUS (the
kernel's answer to a read past the end of a mapped file), with no Python error and no
record of its own. Its parent's record says what most often causes it and how to replace a
data file safely (by rename); before, it said only "killed by SIGBUS"."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from sailor.data import IndexedDatasetWriter
from sailor.megatron_patch.errors import signal_failure_record

_READER = textwrap.dedent(
    """
    import os, sys
    from sailor.data import IndexedDataset, TokenDataset
    prefix = sys.argv[1]
    tokens = TokenDataset(IndexedDataset(prefix), 8, seed=0)
    tokens.samples([0])  # mapped and read
    os.truncate(prefix + ".bin", 0)  # rewritten in place, as a copy over it starts
    tokens.samples(range(tokens.num_windows))
    """
)


def test_a_rank_reading_a_bin_truncated_in_place_dies_by_sigbus_and_the_record_says_why(
    tmp_path: Path,
) -> None:
    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
        for _ in range(64):
            w.add_document(np.arange(1, 2000, dtype=np.uint16) % 300)
    res = subprocess.run(
        [sys.executable, "-c", _READER, str(tmp_path / "ds")], capture_output=True, timeout=60
    )
    assert res.returncode == -signal.SIGBUS, res.stderr[-2000:]
    rec = signal_failure_record(0, res.returncode, 4)
    assert rec["signal"] == "SIGBUS" and rec["retry"] is True
    message = str(rec["message"])
    assert message.startswith("rank 0 killed by SIGBUS after step 4 without an error record")
    assert "data .bin truncated or rewritten in place" in message and "renaming it" in message
