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
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

from sailor.megatron_patch.step_agreement import world_objects
from sailor.megatron_patch.vocab_parallel import IGNORE_INDEX, LabelOutOfRangeError, out_of_range

__all__ = ["LabelWatch", "label_message"]


def label_message(
    step: int, first: int, count: int, seen: str, vocab_size: int, samples: range
) -> str:
    """The agreed error's text (the same on every rank)."""
    return (
        f"step {step}: token or label id(s) outside the vocabulary [0, {vocab_size}) (a "
        f"label may be the ignore index {IGNORE_INDEX}) in the global batch of samples "
        f"{samples.start}..{samples.stop - 1}, read on {seen} (the first's microbatches: "
        f"{count} such, the first id {first}): the data "
        "was tokenized with another vocabulary, or the model's vocab_size is too small; "
        "nothing was applied"
    )


@dataclass
class LabelWatch:
    """This rank's bad labels of the iteration in flight (first id and count, on the host)."""

    vocab_size: int
    first: int | None = None
    count: int = 0

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

    def _masked(self, ids: torch.Tensor, bad: torch.Tensor, fill: int) -> torch.Tensor:
        """``ids`` with ``bad`` ones noted (the first, the count) and set to ``fill``."""
        if not bool(bad.any()):
            return ids
        if self.first is None:
            self.first = int(ids[bad].reshape(-1)[0])
        self.count += int(bad.sum())
        return ids.masked_fill(bad, fill)

    def raise_agreed(self, ranks: tuple[int, ...], step: int, samples: range) -> None:
        """Every rank calls this at the same point once some rank's flag was agreed: one
        object gather (each rank's host, first id and count), then the same error on all."""
        got = world_objects((socket.gethostname(), self.first, self.count))
        flagged = [r for r in ranks if r < len(got) and got[r][1] is not None] or list(ranks)
        r0 = flagged[0] if flagged else 0
        _, first, count = got[min(r0, len(got) - 1)]
        seen = ", ".join(f"rank {r} ({got[min(r, len(got) - 1)][0]})" for r in flagged)
        first = first if first is not None else -1
        raise LabelOutOfRangeError(
            label_message(step, first, count, seen, self.vocab_size, samples)
        )

    def reset(self) -> None:
        self.first, self.count = None, 0
