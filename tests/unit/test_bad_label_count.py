"""The agreed ``LabelOutOfRangeError`` counts the whole batch's bad ids, and names the batch.

Four ranks (two pipelines of two stages) flag bad ids: each pipeline's first and last stage
read the same microbatches, so each counts its pipeline's. The message said the first flagged
rank's count (``the first's microbatches: 2 such``) and, for an evaluation, "the global batch
of samples 0..7" when it was the validation split's first batches. Now the count is the sum
over pipelines, each counted once, from the object gather the error already makes (no other
collective), and an evaluation names the validation batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sailor.comm import abort as comm_abort
from sailor.megatron_patch import bad_labels
from sailor.megatron_patch.bad_labels import LabelWatch, training_batch, validation_batches
from sailor.megatron_patch.vocab_parallel import LabelOutOfRangeError

VOCAB = 64
# rank -> (host, first bad id, count, pipeline, where its data source found the first):
# pipeline 0 read 2 bad ids (ranks 0 and 1, its first and last stage, saw both), pipeline 1
# read 3 (ranks 2 and 3), from an indexed data set that named the file and sample
AT = "/d/ds.bin: sample 13 holds token id 99"
GOT = [("a", 70, 2, 0, ""), ("a", 70, 2, 0, ""), ("b", 99, 3, 1, AT), ("b", 99, 3, 1, AT)]


def _raised(monkeypatch: pytest.MonkeyPatch, where: str) -> str:
    def world_objects(_obj: Any, _group: Any = None) -> list[Any]:
        return list(GOT)

    monkeypatch.setattr(bad_labels, "world_objects", world_objects)
    watch = LabelWatch(VOCAB, first=70, count=2)
    with pytest.raises(LabelOutOfRangeError) as err:
        watch.raise_agreed((0, 1, 2, 3), 5, where, 0)
    return str(err.value)


def test_the_count_is_the_batchs_over_every_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _raised(monkeypatch, training_batch(range(8, 16)))
    assert "5 such id(s) in all" in text, text
    assert text.endswith(f"(first: {AT})"), text  # the first flagged rank that knows where
    assert "the first id 70" in text and "rank 2 (b)" in text
    assert "the global batch of samples 8..15" in text


def test_an_evaluation_names_the_validation_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _raised(monkeypatch, validation_batches(2, 4))
    assert "global batch of samples" not in text, text
    assert "the validation split's first 2 global batches (its samples 0..7)" in text


@pytest.mark.usefixtures("gloo_world")
@pytest.mark.parametrize("seen", [False, True])
def test_the_agreement_waits_for_the_device_before_reading_the_flags(
    monkeypatch: pytest.MonkeyPatch, seen: bool
) -> None:
    """The flags are read on the host after ``clock.synchronize`` (abortable in an in-place
    worker, and it names a communicator's NCCL error), as every host read after a collective
    is: before, ``flags.cpu()`` waited in ``cudaStreamSynchronize``, where no signal handler
    runs, and read whatever a failed NCCL all-reduce left. On CPU: one world of gloo, the
    wait a no-op, the outcome as before."""
    log: list[str] = []
    real_sync, real_cpu = comm_abort.host_sync, torch.Tensor.cpu

    def host_sync(device: Any) -> None:
        log.append(f"wait {torch.device(device).type}")
        real_sync(device)

    def cpu(self: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        log.append("read")
        return real_cpu(self, *a, **kw)

    monkeypatch.setattr(comm_abort, "host_sync", host_sync)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    watch = LabelWatch(VOCAB, first=70 if seen else None, count=int(seen))
    if seen:
        with pytest.raises(LabelOutOfRangeError, match="70"):
            bad_labels.agree_before_update(watch, torch.device("cpu"), 3, "batch", 0)
    else:
        bad_labels.agree_before_update(watch, torch.device("cpu"), 3, "batch", 0)
        assert not watch.seen
    assert log[:2] == ["wait cpu", "read"], log
