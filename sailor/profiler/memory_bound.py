"""How much of a model the layer profiler may build on one device: the bound, worked out first.

Measuring in place (:mod:`in_situ`) trains a real stage: fp32 weights, fp32 gradients and the
AdamW state of every layer it holds, the autocast copies of the weights and the activations of
a microbatch. The whole of an 8B Llama is ~128 GB of that state, OPT-30B far more: no GPU of
the catalog holds it, and GPT-Neo-2.7B (~43 GB) does not fit a 40 GB card. So before anything
is built, this module estimates the bytes of each layer from the model spec and decides what
to measure:

* the whole model, when it fits;
* else a **window**: the embedding, the first ``k`` blocks and the head — a real GPT of ``k``
  blocks, the most that fits. The blocks of a GPT are one module with the same shapes, so the
  blocks outside the window take a measured block's figures (the profile format's per-kind
  entry, :func:`~sailor.profiler.layers.to_profile_db`);
* else (not even one block between the embedding and the head fits) each layer alone;
* a layer that does not fit even alone is refused (:class:`LayerTooLargeError`) with the
  bytes it needs and the bytes available.

Bytes of one layer on one TP rank (``e`` = bytes of the compute precision: 2 under bf16/fp16
autocast, 4 in fp32; ``s`` sequence, ``h`` hidden, ``f`` FFN inner size, ``V`` vocabulary,
``t`` TP degree; per sample of a microbatch of ``m``):

* state: 16 B per parameter — fp32 weight, fp32 gradient, AdamW ``exp_avg`` and
  ``exp_avg_sq`` (the engine's optimizer, which the profiler steps);
* autocast copies: ``e`` B per parameter under autocast (the cast weights stay cached for
  the whole autocast region, the forward of every layer measured);
* kept for backward, per sample: a block keeps its fp32 residual inputs (``8·s·h``; with
  RMSNorm another ``8·s·h`` of fp32 intermediates), its two normalised inputs (``2·e·s·h``),
  q, k, v, the attention output and its contiguous copy (``5·e·s·h/t``; +2 for the rotated q
  and k with RoPE, +2 for k and v repeated to every head with GQA), the attention's
  log-sum-exp (``4·a·s/t``) and the MLP intermediates (``e·s·f·(2 or 4)/t``, 4 with SwiGLU's
  gate). A fused attention kernel is
  assumed (flash / memory-efficient on CUDA, the flash kernel on CPU: SDPA picks them for
  these shapes), so no ``a·s²`` score matrix. The embedding's output is fp32 (``4·s·h``);
  the head keeps its fp32 input, the normalised input (RMSNorm: and an fp32 intermediate),
  the norm's statistics and the labels, and the fp32 softmax of its vocabulary rows
  (``4·s·V'/t``, ``V'`` the vocabulary padded to a multiple of 64: the embedding and head are
  split by vocabulary, ``megatron_patch.vocab_parallel``);
* working set of a layer's own backward, per sample: its kept bytes again (the gradients of
  the same tensors), and for the head the gradient of its logits, fp32 and cast;
* the window: every layer's state, copies and kept bytes at the largest microbatch, plus the
  largest working set (one layer runs its backward at a time).

The estimate is checked against what autograd saves on the CPU (the unit tests), where it must
be an upper bound. The budget is the device's free memory (``torch.cuda.mem_get_info``) less a
margin for what no tensor count sees (CUDA context, cuBLAS workspaces, NCCL buffers, allocator
fragmentation), or a limit given explicitly (``--memory-limit``; on the CPU there is none by
default). Pure apart from :func:`device_budget`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sailor.schemas.model import ModelSpec, padded_vocab

__all__ = [
    "MARGIN_BYTES",
    "MARGIN_FRACTION",
    "STATE_BYTES_PER_PARAM",
    "LayerBytes",
    "LayerTooLargeError",
    "Window",
    "device_budget",
    "layer_bytes",
    "plan_window",
    "window_bytes",
    "window_layers",
    "window_spec",
]

STATE_BYTES_PER_PARAM = 16
"""fp32 weight (4) + fp32 gradient (4) + AdamW exp_avg and exp_avg_sq (4 + 4)."""

MARGIN_BYTES = 1 << 30
"""Kept free on a GPU beyond the estimate: the CUDA context is counted by ``mem_get_info``
already, but cuBLAS workspaces, NCCL's buffers (TP > 1) and the caching allocator's
fragmentation are not tensors of the model."""

MARGIN_FRACTION = 0.08
"""... or this fraction of the device's memory, whichever is larger (fragmentation grows with
the sizes allocated)."""


class LayerTooLargeError(ValueError):
    """A layer that cannot be profiled on this device even alone. Permanent: retrying will not
    help; profile on a larger device, at a higher TP degree or at smaller microbatches."""

    def __init__(
        self, layer: int, kind: str, tp: int, mbs: int, needed: int, available: int
    ) -> None:
        super().__init__(
            f"layer {layer} ({kind}) at tp={tp}, mbs={mbs} needs ~{needed:,} B "
            f"({needed / 2**30:.2f} GiB: weights, gradients, AdamW state, autocast copies and "
            f"activations) but only {available:,} B ({available / 2**30:.2f} GiB) are "
            "available for it: profile it at a higher TP degree or smaller microbatches, or "
            "on a device with more memory"
        )
        self.layer, self.kind, self.tp, self.mbs = layer, kind, tp, mbs
        self.needed, self.available = needed, available


@dataclass(frozen=True)
class LayerBytes:
    """Estimated bytes of one layer on one TP rank."""

    state: int
    """Weights, gradients and optimizer state (fp32)."""
    copies: int
    """Autocast copies of the weights."""
    kept_per_sample: int
    """Kept for backward, per sample."""
    working_per_sample: int
    """Extra while the layer runs its own backward, per sample."""

    def alone(self, mbs: int) -> int:
        """Bytes of the layer built and trained alone at microbatch ``mbs``."""
        return self.state + self.copies + mbs * (self.kept_per_sample + self.working_per_sample)


def _params_on_rank(spec: ModelSpec, layer: int, tp: int) -> int:
    """Parameters one TP rank holds: a block is split but for its norms (replicated;
    counted whole, an upper bound); the embedding and head are split by vocabulary
    (megatron_patch.vocab_parallel; up to 63 padding rows, counted) but for their position
    table and norm (counted whole)."""
    p = spec.layer_params(layer)
    if spec.layer_kind(layer) != "block":
        h = spec.hidden_size
        return p - spec.vocab_size * h + -(-padded_vocab(spec.vocab_size) * h // tp)
    if tp == 1:
        return p
    return -(-p // tp) + 4 * spec.hidden_size


def layer_bytes(spec: ModelSpec, layer: int, tp: int, compute_bytes: int) -> LayerBytes:
    """The estimate of the module docstring for global layer ``layer`` of ``spec``."""
    if compute_bytes not in (2, 4):
        raise ValueError(f"compute_bytes={compute_bytes}: 2 (bf16/fp16) or 4 (fp32)")
    e = compute_bytes
    s, h, f = spec.seq_length, spec.hidden_size, spec.ffn_hidden_size
    params = _params_on_rank(spec, layer, tp)
    copies = params * e if e == 2 else 0
    kind = spec.layer_kind(layer)
    if kind == "embedding":
        kept = 4 * s * h
        working = 2 * 4 * s * h
    elif kind == "head":
        rows = -(-padded_vocab(spec.vocab_size) // tp)
        # + the norm's statistics, the int64 labels and the loss's scalars (24·s bounds them);
        # RMSNorm runs as composite ops that keep an fp32 intermediate
        kept = 4 * s * h + e * s * h + 4 * s * rows + 24 * s
        kept += 4 * s * h if spec.norm == "rmsnorm" else 0
        working = 4 * s * h + s * rows * (e + 4)
    else:
        # per rank: q, k, v, attention output and its contiguous copy (the out-projection's
        # input); rotary: the rotated q and k; GQA: k and v repeated to every head
        attn = 5 + (2 if spec.position_embedding == "rope" else 0)
        attn += 2 if spec.kv_heads != spec.num_heads else 0
        mlp = 4 if spec.activation == "swiglu" else 2
        # RMSNorm runs as composite ops that keep an fp32 intermediate of each of the two norms
        norms = 2 * 4 * s * h if spec.norm == "rmsnorm" else 0
        kept = 8 * s * h + norms + e * s * h * 2 + -(-e * s * h * attn // tp)
        kept += -(-4 * spec.num_heads * s // tp) + -(-e * s * f * mlp // tp)
        working = kept
    return LayerBytes(
        state=params * STATE_BYTES_PER_PARAM,
        copies=copies,
        kept_per_sample=kept,
        working_per_sample=working,
    )


def window_bytes(
    spec: ModelSpec, layers: Sequence[int], tp: int, mbs: int, compute_bytes: int
) -> int:
    """Bytes of a stage holding global ``layers`` of ``spec`` trained at microbatch ``mbs``."""
    lb = [layer_bytes(spec, i, tp, compute_bytes) for i in layers]
    return sum(b.state + b.copies + mbs * b.kept_per_sample for b in lb) + mbs * max(
        b.working_per_sample for b in lb
    )


def window_spec(spec: ModelSpec, blocks: int) -> ModelSpec:
    """The model of the window: ``spec`` with ``blocks`` blocks (embedding and head as is)."""
    if not 1 <= blocks <= spec.num_layers:
        raise ValueError(f"blocks={blocks}: a window holds 1..{spec.num_layers} blocks")
    return ModelSpec.model_validate({**spec.model_dump(), "num_layers": blocks})


def window_layers(spec: ModelSpec, blocks: int) -> list[int]:
    """Global layer of each layer of the window of ``blocks`` blocks: the embedding, blocks
    ``1..blocks-1``, the last block (the one the head follows) and the head."""
    n = spec.num_all_layers
    if blocks >= spec.num_layers:
        return list(range(n))
    return [0, *range(1, blocks), n - 2, n - 1]


@dataclass(frozen=True)
class Window:
    """What the profiler builds at one TP degree (decided by :func:`plan_window`)."""

    blocks: int
    """Blocks measured in place between the embedding and the head (``num_layers``: the whole
    model); 0: each layer alone."""
    needed_bytes: int
    """Estimated bytes of the largest stage built."""
    limit_bytes: int | None
    """The budget it was planned for (None: no bound)."""

    def describe(self, spec: ModelSpec) -> str:
        lim = "no bound" if self.limit_bytes is None else _size(self.limit_bytes)
        need = f"~{_size(self.needed_bytes)} of {lim}"
        if self.blocks >= spec.num_layers:
            return f"whole model in place ({need})"
        if self.blocks == 0:
            return f"each layer alone ({need}); blocks share the measured block's figures"
        return (
            f"embedding, {self.blocks} of {spec.num_layers} blocks and head in place ({need}); "
            f"blocks {self.blocks}..{spec.num_layers - 1} take a measured block's figures"
        )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def plan_window(
    spec: ModelSpec,
    tp: int,
    mbs: int,
    compute_bytes: int,
    limit: int | None,
    in_situ: bool = True,
) -> Window:
    """The largest window of ``spec`` that fits ``limit`` bytes at microbatch ``mbs`` (the
    largest profiled), or each layer alone; raises :class:`LayerTooLargeError` for a layer that
    does not fit alone. ``in_situ=False``: every layer is measured alone anyway."""
    kinds = {"embedding": 0, "block": 1, "head": spec.num_all_layers - 1}
    alone = {k: layer_bytes(spec, i, tp, compute_bytes).alone(mbs) for k, i in kinds.items()}
    if limit is not None:
        for k, need in alone.items():
            if need > limit:
                raise LayerTooLargeError(kinds[k], k, tp, mbs, need, limit)
    biggest_alone = max(alone.values())
    if not in_situ:
        return Window(0, biggest_alone, limit)
    for blocks in range(spec.num_layers, 0, -1):
        need = window_bytes(spec, window_layers(spec, blocks), tp, mbs, compute_bytes)
        if limit is None or need <= limit:
            return Window(blocks, need, limit)
    return Window(0, biggest_alone, limit)


def device_budget(
    indices: Sequence[int], limit: int | None = None, margin_bytes: int | None = None
) -> int | None:
    """Bytes the profiler may use on each of CUDA devices ``indices``: the least free memory
    among them less the margin (:data:`MARGIN_BYTES` or :data:`MARGIN_FRACTION` of the total,
    the larger), and at most ``limit``. No devices (the CPU): ``limit``."""
    if not indices:
        return limit
    import torch

    budgets = []
    for i in indices:
        free, total = torch.cuda.mem_get_info(i)
        margin = (
            margin_bytes
            if margin_bytes is not None
            else max(MARGIN_BYTES, int(MARGIN_FRACTION * total))
        )
        budgets.append(max(0, int(free) - margin))
    least = min(budgets)
    return least if limit is None else min(least, limit)
