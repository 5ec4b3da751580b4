"""Does an in-place relayout fit on the rank's device, and how: a pure decision.

While a relayout fills the new stage, the rank still holds its old one (weights and both
AdamW moments; the gradients are dropped first). A rank that moves to other layers would
need both stages on its GPU at once, ~24 B per parameter where training needs ~16 plus
activations, and could run out of memory where a restart from the checkpoint would not.
The rank chooses, before the exchange:

- ``keep``: the old stage stays on the device. The new stage needs memory for every layer
  it does not keep (a kept layer's tensors are the held ones, taken over), plus the
  exchange's transients.
- ``offload``: the old stage moves to host memory first; the device then needs the whole
  new stage plus the transients, and each shard a rank sends is copied back to its device
  for the batch that sends it (``relayout.buckets(staged_sends=True)`` counts those copies
  in the batch budget).
- ``too_large``: not even the new stage and the transients fit once the old stage is off
  the device. The relayout fails before any exchange with the figures; the agent falls back
  to the restart path.

The exchange's transients are the rank's largest batch (what it receives there, and with
its old stage on the host what it stages to send; a layer larger than the batch budget is
in a batch whole) and, where a received layer comes from several old TP shards, the full
tensor of the key being gathered (at most that layer). ``margin`` leaves room for what this
count does not see: the allocator's fragmentation, the communicators' buffers, the CUDA
context's growth. The host must hold the offloaded stage too: its share of the host's
available memory (one GPU's share of the node's) is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["VERDICT_CODES", "RelayoutMemory", "Verdict", "decide", "margin_bytes"]

Verdict = Literal["keep", "offload", "too_large"]

VERDICT_CODES: dict[Verdict, int] = {"keep": 0, "offload": 1, "too_large": 2}
"""Ordered: the world's verdict is the largest of its ranks' (one MAX all-reduce)."""


@dataclass(frozen=True)
class RelayoutMemory:
    """One rank's figures, bytes."""

    new_bytes: int
    """The new stage's state: weights, and both moments once the optimizer has stepped."""
    kept_bytes: int
    """The part of ``new_bytes`` in layers the rank keeps (taken over from the held stage)."""
    held_bytes: int
    """The held stage's state on the device (weights and moments)."""
    keep_exchange_bytes: int
    """The exchange's transients with the held stage on the device (receives only)."""
    offload_exchange_bytes: int
    """The exchange's transients with the held stage on the host (receives and staged
    sends)."""
    free_bytes: int
    """What the device can still allocate: free memory plus the allocator's unused cache."""
    margin_bytes: int
    host_free_bytes: int | None = None
    """This rank's share of the host's available memory (None: unknown, not checked)."""

    def __post_init__(self) -> None:
        for name in (
            "new_bytes",
            "kept_bytes",
            "held_bytes",
            "keep_exchange_bytes",
            "offload_exchange_bytes",
            "free_bytes",
            "margin_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.kept_bytes > self.new_bytes:
            raise ValueError(f"kept_bytes={self.kept_bytes} > new_bytes={self.new_bytes}")

    @property
    def keep_need(self) -> int:
        """Bytes to allocate with the old stage left on the device."""
        return self.new_bytes - self.kept_bytes + self.keep_exchange_bytes + self.margin_bytes

    @property
    def offload_need(self) -> int:
        """Bytes to allocate once the old stage is on the host (its memory is free again)."""
        return self.new_bytes + self.offload_exchange_bytes + self.margin_bytes - self.held_bytes

    @property
    def host_fits(self) -> bool:
        return self.host_free_bytes is None or self.held_bytes <= self.host_free_bytes

    def describe(self) -> str:
        gib = 2.0**30
        host = (
            f", host share {self.host_free_bytes / gib:.2f} GiB"
            if self.host_free_bytes is not None
            else ""
        )
        return (
            f"new stage {self.new_bytes / gib:.2f} GiB ({self.kept_bytes / gib:.2f} kept), "
            f"held stage {self.held_bytes / gib:.2f} GiB, exchange "
            f"{self.keep_exchange_bytes / gib:.2f} GiB kept / "
            f"{self.offload_exchange_bytes / gib:.2f} GiB offloaded, free "
            f"{self.free_bytes / gib:.2f} GiB, margin {self.margin_bytes / gib:.2f} GiB{host}"
        )


def decide(m: RelayoutMemory) -> Verdict:
    """``keep`` if it fits with the old stage on the device, else ``offload`` if it fits
    with the old stage on the host (and the host holds it), else ``too_large``."""
    if m.keep_need <= m.free_bytes:
        return "keep"
    if m.offload_need <= m.free_bytes and m.host_fits:
        return "offload"
    return "too_large"


def margin_bytes(total_bytes: int) -> int:
    """The margin on a device of ``total_bytes``: 5% of it, at least 512 MiB."""
    return max(1 << 29, total_bytes // 20)
