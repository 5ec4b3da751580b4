"""What one layer costs, as the profiler measures it: the value both ways of measuring return.

:mod:`layer_bench` measures a layer kind alone and :mod:`in_situ` every layer in place; both
return :class:`LayerMeasurement`, and ``layer_bench`` calls ``in_situ`` for a whole model, so
the value lives here, below both (no import circle). A plain value: measures nothing, no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sailor.profiler.timing import Stats
from sailor.schemas.model import LayerKind

__all__ = ["KIND_LAYER", "LayerMeasurement"]

KIND_LAYER: tuple[LayerKind, ...] = ("embedding", "block", "head")
"""Layer kinds in the order they are measured."""


@dataclass(frozen=True)
class LayerMeasurement:
    """What one layer kind costs at one (TP degree, microbatch size), per TP rank."""

    kind: LayerKind
    tp: int
    mbs: int
    fwd: Stats
    bwd: Stats
    update: Stats
    params: int
    """Parameters on one TP rank."""
    saved_bytes: int
    """Bytes saved for backward by one microbatch (parameters excluded)."""
    output_bytes: int
    """Bytes of the layer's output for one microbatch (0 for the head: a scalar loss)."""
    input_bytes: int
    """Bytes of the layer's input for one microbatch."""
    peak_growth_bytes: int
    """Peak growth of allocated bytes over one forward + backward."""
    layer: int = -1
    """Global layer index when measured in place (:mod:`in_situ`); -1: the kind, measured alone."""

    def with_peak(self, peak: int) -> LayerMeasurement:
        return dataclasses.replace(self, peak_growth_bytes=peak)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "tp": self.tp,
            "mbs": self.mbs,
            "fwd": self.fwd.to_dict(),
            "bwd": self.bwd.to_dict(),
            "update": self.update.to_dict(),
            "params": self.params,
            "saved_bytes": self.saved_bytes,
            "output_bytes": self.output_bytes,
            "input_bytes": self.input_bytes,
            "peak_growth_bytes": self.peak_growth_bytes,
            "layer": self.layer,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerMeasurement:
        kind = str(d["kind"])
        if kind not in KIND_LAYER:
            raise ValueError(f"kind={kind!r}: not one of {KIND_LAYER}")
        return cls(
            kind=kind,  # type: ignore[arg-type,unused-ignore]
            tp=int(d["tp"]),
            mbs=int(d["mbs"]),
            fwd=Stats.from_dict(d["fwd"]),
            bwd=Stats.from_dict(d["bwd"]),
            update=Stats.from_dict(d["update"]),
            params=int(d["params"]),
            saved_bytes=int(d["saved_bytes"]),
            output_bytes=int(d["output_bytes"]),
            input_bytes=int(d["input_bytes"]),
            peak_growth_bytes=int(d["peak_growth_bytes"]),
            layer=int(d.get("layer", -1)),
        )
