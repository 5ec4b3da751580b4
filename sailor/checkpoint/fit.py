"""Whether a committed checkpoint holds the tensors of the model a rank is about to load.

A checkpoint is layout-free (any pipeline split, TP degree or replica count loads it), but
not model-free: a rank of another model (other depth, a parameter added or removed, another
hidden size) must be refused by name before anything is read, not fail on a dictionary
lookup or a torch copy deep in its restore, nor load what matches and leave the rest (a
checkpoint of a LayerNorm model loaded into an RMSNorm one kept every weight and dropped
the biases, silently).

Pure: a manifest and the model's expected full shapes in, an error or nothing out. Must
never read storage or import the training framework.
"""

from __future__ import annotations

from collections.abc import Mapping

from sailor.checkpoint.errors import ModelMismatchError
from sailor.checkpoint.state import split_key
from sailor.schemas.checkpoint import TENSOR_KINDS, CheckpointManifest

__all__ = ["check_fit"]

_SHOWN = 4
"""Problems named in the error; the rest are counted."""


def check_fit(
    manifest: CheckpointManifest,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    num_layers: int,
    where: str,
) -> None:
    """Raise :class:`ModelMismatchError` unless ``manifest`` fits the model: ``num_layers``
    global layers, and for each layer named in ``shapes`` (keyed ``"<layer>.<param>"``,
    each the parameter's full, TP-gathered shape as stored) exactly those parameters with
    those shapes, each with its weight and both AdamW moments. ``where`` names the
    checkpoint in the message (its root and step)."""
    problems: list[str] = []
    if manifest.num_layers != num_layers:
        problems.append(f"num_layers: checkpoint {manifest.num_layers}, this model {num_layers}")
    by_layer: dict[int, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        layer, param = split_key(key)
        by_layer.setdefault(layer, {})[param] = tuple(shape)
    have = set(manifest.layers)
    for layer in sorted(by_layer):
        want = by_layer[layer]
        if layer not in have:
            problems.append(f"layer {layer}: not in the checkpoint")
            continue
        stored: dict[str, dict[str, tuple[int, ...]]] = {}
        for t in manifest.shard_of(layer).tensors:
            stored.setdefault(t.param, {})[t.kind] = tuple(t.shape)
        lacks = sorted(set(want) - set(stored))
        extra = sorted(set(stored) - set(want))
        if lacks:
            problems.append(f"layer {layer}: the checkpoint lacks {lacks}")
        if extra:
            problems.append(f"layer {layer}: only the checkpoint has {extra}")
        for param in sorted(set(want) & set(stored)):
            kinds = stored[param]
            missing = [k for k in TENSOR_KINDS if k not in kinds]
            if missing:
                problems.append(f"{layer}.{param}: the checkpoint lacks its {missing}")
                continue
            got = {kinds[k] for k in TENSOR_KINDS}
            if got != {want[param]}:
                saved = (
                    str(kinds["weight"])
                    if len(got) == 1
                    else " / ".join(f"{k} {kinds[k]}" for k in TENSOR_KINDS)
                )
                problems.append(
                    f"{layer}.{param}: shape {saved} in the checkpoint, {want[param]} in this model"
                )
    if not problems:
        return
    more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
    raise ModelMismatchError(
        f"checkpoint {where} (model {manifest.model!r}, plan {manifest.plan_id!r}) does "
        f"not fit the model being loaded: {'; '.join(problems[:_SHOWN])}{more}. Resume "
        "with the model it was saved from, or start a new run in another checkpoint "
        "directory"
    )
