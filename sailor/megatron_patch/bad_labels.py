"""Labels outside the vocabulary, found by one rank, raised by every rank alike.

Only the ranks that read labels (the first and last stage of the pipeline whose microbatch
holds the bad id) can see one. Raising there at once left every other rank in its next
collective: the pipeline's neighbours in a p2p, the other pipelines in the gradient
all-reduce, where NCCL blocks until the process group's timeout (or the controller's abort)
and gloo times out; the record said ``origin=local`` on the two nodes that raised, so
they were charged, and the relaunch from the same checkpoint met the same sample on other
nodes. Now the rank that reads one (:meth:`LabelWatch.screen`) notes it, masks those labels
to the ignore index so its microbatch runs on (no device assert, no silent loss at TP > 1),
and sets its flag in the iteration's one collective (``step_agreement``); then every rank
raises the same :class:`~sailor.megatron_patch.vocab_parallel.LabelOutOfRangeError` before
the optimizer step (:meth:`LabelWatch.raise_agreed`), which the controller holds against
the job (``failure_text.AGREED_ERRORS``): the data is bad wherever it runs.

The input tokens are screened the same way (:meth:`LabelWatch.screen_tokens`): a badly
tokenized sample holds its bad id in both (the labels are the inputs shifted by one), and the
first stage's embedding raised on it alone (an IndexError on CPU, a device assert on a GPU),
or at TP > 1 took a zero row silently (review). They are masked to id 0 and flagged alike.

The check runs on the host, before the copy to the device (no sync in the hot loop).

An engine with no collective of its own between reading its batches and its update (the
DeepSpeed adapter: ``train_batch`` runs the forward, the backward and the optimizer step in
one call) agrees the flags before it (:func:`agree_before_update`): one all-reduce of an int32
per rank each step, so every rank raises the same error there and nothing is applied. Its
flags are read after ``clock.synchronize``, as every host read after a collective is.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sailor.comm import api as comm
from sailor.comm.codec import expect
from sailor.comm.device_copy import to_device
from sailor.megatron_patch.clock import synchronize
from sailor.megatron_patch.step_agreement import world_objects
from sailor.megatron_patch.vocab_parallel import IGNORE_INDEX, LabelOutOfRangeError, out_of_range

__all__ = [
    "LabelWatch",
    "agree_before_update",
    "label_message",
    "total_count",
    "training_batch",
    "validation_batches",
]


def label_message(
    step: int, first: int, count: int, seen: str, vocab_size: int, where: str, detail: str = ""
) -> str:
    """The agreed error's text (the same on every rank). ``where``: the batch it names
    (:func:`training_batch`, :func:`validation_batches`); ``count``: the bad ids of that
    batch over every pipeline (inputs and labels counted apart: a badly tokenized id is in
    both); ``detail``: the first bad id's file and sample, as its data source named it
    (``data.IndexedTokens.checked_batch``), '' if it names none."""
    return (
        f"step {step}: token or label id(s) outside the vocabulary [0, {vocab_size}) (a "
        f"label may be the ignore index {IGNORE_INDEX}) in {where}, read on {seen} "
        f"({count} such id(s) in all, inputs and labels counted apart; the first id "
        f"{first}): the data was tokenized with another vocabulary, or the model's "
        "vocab_size is too small; nothing was applied" + (f" (first: {detail})" if detail else "")
    )


def training_batch(samples: range) -> str:
    """``where`` of an iteration's global batch."""
    return f"the global batch of samples {samples.start}..{samples.stop - 1}"


def validation_batches(batches: int, global_batch_size: int) -> str:
    """``where`` of an evaluation: the validation split's first ``batches`` global batches."""
    n = batches * global_batch_size
    what = "global batch" if batches == 1 else f"{batches} global batches"
    return f"the validation split's first {what} (its samples 0..{n - 1})"


def total_count(got: Sequence[tuple[str, int | None, int, int]], flagged: Sequence[int]) -> int:
    """The bad ids of the batch: each pipeline's count once (every rank that reads a
    pipeline's microbatches, its first and last stage at every TP rank, screens the same
    inputs and labels and counts the same), summed over the pipelines of ``flagged`` ranks.
    ``got``: each rank's ``(host, first id, count, pipeline)``."""
    per_pipeline: dict[int, int] = {}
    for r in flagged:
        if r < len(got):
            _, _, count, pipeline = got[r]
            per_pipeline[pipeline] = max(per_pipeline.get(pipeline, 0), count)
    return sum(per_pipeline.values())


_SEEN_SHAPE = (str, frozenset({int, None}), int, int, str)
"""What a rank tells the others in :meth:`LabelWatch.raise_agreed`."""


@dataclass
class LabelWatch:
    """This rank's bad labels of the iteration in flight (first id and count, on the host)."""

    vocab_size: int
    """Ids are below this: the model's vocabulary, or the data's when smaller (an id the
    data's tokenizer cannot produce is as bad as one the model cannot embed)."""
    first: int | None = None
    count: int = 0
    detail: str = ""
    """Where the first bad id is (file, sample), when its data source said (:meth:`note`)."""

    @property
    def seen(self) -> bool:
        return self.first is not None

    def screen(self, labels: torch.Tensor) -> torch.Tensor:
        """``labels`` (host) with every out-of-range one noted and set to the ignore index."""
        return self._masked(labels, out_of_range(labels, self.vocab_size), IGNORE_INDEX)

    def screen_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input ``tokens`` (host) with every id outside ``[0, vocab_size)`` noted and set to
        0 (any row: the iteration is raised before its update)."""
        return self._masked(tokens, (tokens < 0) | (tokens >= self.vocab_size), 0)

    def note(self, detail: str) -> None:
        """Keep where the iteration's first bad id is (its data source's words), once."""
        if not self.detail:
            self.detail = detail

    def _masked(self, ids: torch.Tensor, bad: torch.Tensor, fill: int) -> torch.Tensor:
        """``ids`` with ``bad`` ones noted (the first, the count) and set to ``fill``."""
        if not bool(bad.any()):
            return ids
        if self.first is None:
            self.first = int(ids[bad].reshape(-1)[0])
        self.count += int(bad.sum())
        return ids.masked_fill(bad, fill)

    def raise_agreed(self, ranks: tuple[int, ...], step: int, where: str, pipeline: int) -> None:
        """Every rank calls this at the same point once some rank's flag was agreed: one
        object gather (each rank's host, first id, count and pipeline), then the same error
        on all. ``where``: the batch (:func:`training_batch`, :func:`validation_batches`);
        ``pipeline``: this rank's, so that each pipeline's microbatches count once."""
        mine = (socket.gethostname(), self.first, self.count, pipeline, self.detail)
        got = [
            expect(g, _SEEN_SHAPE, r, "its bad labels (host, first id, count, pipeline, detail)")
            for r, g in enumerate(world_objects(mine))
        ]
        flagged = [r for r in ranks if r < len(got) and got[r][1] is not None] or list(ranks)
        r0 = flagged[0] if flagged else 0
        first = got[min(r0, len(got) - 1)][1]
        seen = ", ".join(f"rank {r} ({got[min(r, len(got) - 1)][0]})" for r in flagged)
        count = total_count([g[:4] for g in got], flagged)
        detail = next((got[r][4] for r in flagged if r < len(got) and got[r][4]), "")
        raise LabelOutOfRangeError(
            label_message(
                step,
                -1 if first is None else first,
                count,
                seen,
                self.vocab_size,
                where,
                detail,
            )
        )

    def reset(self) -> None:
        self.first, self.count, self.detail = None, 0, ""


def agree_before_update(
    watch: LabelWatch, device: torch.device, step: int, where: str, pipeline: int
) -> None:
    """Every rank calls this once its iteration's batches are read and screened, before the
    iteration's first collective: one all-reduce (MAX) of a flag per rank; if some rank saw
    a bad id, every rank raises the same ``LabelOutOfRangeError`` (:meth:`LabelWatch
    .raise_agreed`), else the watch is reset. Without a process group the rank raises alone.
    ``step``: the iteration's (the one it would complete); ``pipeline``: this rank's."""
    if not (dist.is_available() and dist.is_initialized()):
        if watch.seen:
            watch.raise_agreed((0,), step, where, pipeline)
        return
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32)
    flags[dist.get_rank()] = int(watch.seen)
    flags = to_device(flags, device)
    comm.all_reduce(flags, op="max")
    synchronize(flags.device)  # abortable where the host waits (in-place workers)
    ranks = tuple(int(r) for r in torch.nonzero(flags.cpu()).reshape(-1))
    if ranks:
        watch.raise_agreed(ranks, step, where, pipeline)
    watch.reset()
