"""The vocabulary split over a stage's TP ranks: embedding lookup and cross entropy.

As Megatron does, the embedding table and the LM head are split by vocabulary rows over the
TP ranks of a stage (rank ``r`` of ``t`` holds rows ``[r·V'/t, (r+1)·V'/t)``), so each rank
keeps ``1/t`` of both matrices, their gradients and Adam moments, and computes ``1/t`` of
the logits:

- **lookup**: each rank embeds the tokens its rows hold, zeros for the others, and the TP
  group sums the partial embeddings (one all-reduce of ``b·s·h`` forward; its backward is the
  identity);
- **cross entropy**: each rank holds logits of its rows only; the loss needs three
  all-reduces of one value per token (the max for a stable softmax, the sum of exponentials,
  the target's logit), and the gradient is local (``softmax - onehot``). It keeps the fp32
  softmax of its rows for the backward (``4·s·V'/t`` bytes per sample), which becomes the
  gradient in place.

``V'`` is the vocabulary padded up to a multiple of :data:`VOCAB_MULTIPLE`, whatever the
layout, so every TP degree up to that multiple (a power of two) splits it evenly and a
checkpoint's full tensors have the same shape under any plan. The padded rows are never
looked up (token ids are below ``V``) and their logits are left out of the softmax, so the
model computes exactly the unpadded model's loss; their gradients are zero, and they are
initialised to zero.

At TP 1 both are the plain lookup and ``F.cross_entropy`` of the real vocabulary. At every TP
degree a label of :data:`IGNORE_INDEX` (-100, ``F.cross_entropy``'s default) is left out of the
loss and its mean, and gets no gradient; a microbatch whose labels are all ignored has a NaN
loss and zero gradients, as ``F.cross_entropy`` gives. The mean is per microbatch (the engine
then weights microbatches by samples): with ignored labels spread unevenly, the step's
gradient depends on how the batch is cut into microbatches (Megatron divides by the batch's
count of kept tokens instead). The data sources produce no ignored labels today. Other token
ids and labels are ids of the real vocabulary (the data sources check them). A label out of
``[0, V)`` that is not the ignore index is refused by :func:`check_labels` with the same
``LabelOutOfRangeError`` at every TP degree and on every rank that holds the labels (they
are the same on every TP rank: no collective): at TP > 1 the split loss would otherwise
take it silently (no rank's rows hold it), and on a GPU ``F.cross_entropy``'s check is a
device assert that kills the process without a message. :func:`vocab_cross_entropy` checks
labels on the host itself; the engine checks each microbatch's on the host before copying it
to the GPU (a check of device labels would sync the device in the hot loop).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

from sailor.comm import api as comm
from sailor.megatron_patch.tp_layers import TPContext, reduce_from_tp
from sailor.schemas.model import VOCAB_MULTIPLE, padded_vocab

__all__ = [
    "IGNORE_INDEX",
    "VOCAB_MULTIPLE",
    "LabelOutOfRangeError",
    "check_labels",
    "embed",
    "out_of_range",
    "pad_rows",
    "padded_vocab",
    "real_rows",
    "rows_per_rank",
    "unpad_rows",
    "vocab_cross_entropy",
]


IGNORE_INDEX = -100
"""A label the loss leaves out (``F.cross_entropy``'s ``ignore_index`` default)."""


class LabelOutOfRangeError(ValueError):
    """A label id outside the vocabulary that is not :data:`IGNORE_INDEX` (bad data)."""


def out_of_range(labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The mask of labels outside ``[0, vocab_size)`` that are not :data:`IGNORE_INDEX`."""
    return (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))


def check_labels(labels: torch.Tensor, vocab_size: int) -> None:
    """Raise :class:`LabelOutOfRangeError` naming the first label outside ``[0,
    vocab_size)`` that is not :data:`IGNORE_INDEX`. Reads the values: call it on host labels
    (on a GPU tensor it waits for the device)."""
    bad = out_of_range(labels, vocab_size)
    if bool(bad.any()):
        first = int(labels[bad].reshape(-1)[0])
        raise LabelOutOfRangeError(
            f"label id {first} is outside the vocabulary [0, {vocab_size}) and is not the "
            f"ignore index {IGNORE_INDEX} ({int(bad.sum())} such label(s) in the batch): the "
            "data was tokenized with another vocabulary, or the model's vocab_size is too small"
        )


def rows_per_rank(vocab_size: int, tp: TPContext) -> int:
    """Rows of the vocabulary matrices on each TP rank (the padded vocabulary over ``t``)."""
    padded = padded_vocab(vocab_size)
    if padded % tp.size:
        raise ValueError(
            f"TP degree {tp.size} does not divide the padded vocabulary {padded} "
            f"(vocab_size={vocab_size} rounded up to a multiple of {VOCAB_MULTIPLE})"
        )
    return padded // tp.size


def real_rows(vocab_size: int, rows: int, rank: int) -> int:
    """How many of rank ``rank``'s ``rows`` rows are real tokens (the rest is padding)."""
    return max(0, min(rows, vocab_size - rank * rows))


def pad_rows(full: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A full ``[vocab_size, ...]`` matrix (an imported or older checkpoint's) padded with
    zero rows to the padded vocabulary."""
    if full.shape[0] != vocab_size:
        raise ValueError(
            f"a vocabulary matrix of {full.shape[0]} rows, the model has vocab_size={vocab_size}"
        )
    extra = padded_vocab(vocab_size) - vocab_size
    if not extra:
        return full
    return torch.cat([full, full.new_zeros((extra, *full.shape[1:]))])


def unpad_rows(full: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The real vocabulary's rows of a full padded matrix (one of ``vocab_size`` rows, from a
    checkpoint saved before the padding, as it is)."""
    if full.shape[0] not in (vocab_size, padded_vocab(vocab_size)):
        raise ValueError(
            f"a vocabulary matrix of {full.shape[0]} rows, expected the padded "
            f"{padded_vocab(vocab_size)} of vocab_size={vocab_size}"
        )
    return full[:vocab_size]


def embed(
    tokens: torch.Tensor, weight: torch.Tensor, tp: TPContext, padding_idx: int | None
) -> torch.Tensor:
    """The embedding of ``tokens`` from this rank's rows ``weight``, summed over the TP group.

    ``padding_idx`` (a global token id, or None) gets no gradient, as in ``nn.Embedding``.
    """
    rows = weight.shape[0]
    lo = tp.rank * rows
    local_pad = None
    if padding_idx is not None and lo <= padding_idx < lo + rows:
        local_pad = padding_idx - lo
    if tp.size == 1:
        return F.embedding(tokens, weight, padding_idx=local_pad)
    outside = (tokens < lo) | (tokens >= lo + rows)
    local = (tokens - lo).masked_fill(outside, 0)
    part = F.embedding(local, weight, padding_idx=local_pad)
    part = part.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tp(part, tp)


class _VocabCrossEntropy(torch.autograd.Function):
    """Per-token loss from vocabulary-split fp32 logits ``[N, rows]``."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        lo: int,
        real: int,
        group: Any,
    ) -> torch.Tensor:
        rows = logits.shape[-1]
        # padded columns are left out of the softmax: out of the max, then -inf in ``shifted``
        # (no masked copy of the logits: one [tokens, rows] fp32 tensor fewer at the peak)
        if real == rows:
            top = logits.max(dim=-1).values
        elif real > 0:
            top = logits[:, :real].max(dim=-1).values
        else:  # a shard of padding only
            top = logits.new_full(logits.shape[:-1], float("-inf"))
        comm.all_reduce(top, op="max", group=group)
        shifted = logits - top.unsqueeze(-1)
        if real < rows:
            shifted[:, real:] = float("-inf")
        inside = (labels >= lo) & (labels < lo + real)
        idx = (labels - lo).masked_fill(~inside, 0)
        target = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        comm.all_reduce(target, group=group)
        probs = shifted.exp_()
        total = probs.sum(dim=-1)
        comm.all_reduce(total, group=group)
        probs.div_(total.unsqueeze(-1))
        ctx.save_for_backward(probs, idx, inside)
        return total.log_() - target

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # the saved probabilities become the gradient in place (as Megatron's does): no
        # second [tokens, rows] fp32 tensor at the head's backward peak. A graph is
        # backpropagated once (the engine never retains it).
        probs, idx, inside = ctx.saved_tensors
        grad = probs
        grad.scatter_add_(-1, idx.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grads[0].unsqueeze(-1))
        return grad, None, None, None, None


def vocab_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, tp: TPContext
) -> torch.Tensor:
    """Mean cross entropy of ``labels`` under this rank's fp32 logits ``[..., rows]``, over
    the labels that are not :data:`IGNORE_INDEX` (NaN when every label is, as
    ``F.cross_entropy``).

    At TP 1, ``F.cross_entropy`` over the real vocabulary's columns. A label out of range
    raises :class:`LabelOutOfRangeError` at every TP degree (checked here for host labels;
    the engine checks device labels on the host before the copy)."""
    if labels.device.type == "cpu":
        check_labels(labels, vocab_size)
    rows = logits.shape[-1]
    flat, target = logits.reshape(-1, rows), labels.reshape(-1)
    if tp.size == 1:
        if rows != vocab_size:
            flat = flat[:, :vocab_size]
        return F.cross_entropy(flat, target, ignore_index=IGNORE_INDEX)
    real = real_rows(vocab_size, rows, tp.rank)
    loss: torch.Tensor = _VocabCrossEntropy.apply(  # type: ignore[no-untyped-call]
        flat, target, tp.rank * rows, real, tp.group
    )
    # an ignored label is inside no rank's rows: its target logit is 0 and its gradient's
    # one-hot is empty; its weight here is 0, so its softmax gradient is 0 too
    keep = target != IGNORE_INDEX
    kept = keep.sum()
    mean = (loss * keep).sum() / kept.clamp_min(1)
    # every label ignored: NaN as F.cross_entropy gives at TP 1, and a zero gradient (the
    # NaN is a constant of the other branch; 0/0 would send NaN into every gradient)
    return torch.where(kept > 0, mean, torch.full_like(mean, float("nan")))
