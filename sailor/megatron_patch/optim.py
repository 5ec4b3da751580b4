"""AdamW's parameter groups: weight decay or not, by the layer-keyed name.

The rule itself (:func:`sailor.schemas.training.decays`: no decay on biases, norm weights
and/or embeddings, a tied LM head being the embedding) is decided from the name alone, so
every rank and layout puts a parameter in the same group. The learning-rate schedule is
:meth:`sailor.schemas.training.ScheduleConfig.lr_at`.

Pure: no process group, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from sailor.schemas.training import NoDecay, decays

__all__ = ["param_groups"]


def param_groups(
    named: Iterable[tuple[str, torch.nn.Parameter]],
    weight_decay: float,
    no_decay: tuple[NoDecay, ...],
    tied: bool,
) -> list[dict[str, Any]]:
    """AdamW parameter groups: decayed first, then exempt (empty groups left out).

    A parameter seen twice (a tied matrix shared in one module) is placed once, by its
    first name.
    """
    yes: list[torch.nn.Parameter] = []
    no: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for name, p in named:
        if id(p) in seen:
            continue
        seen.add(id(p))
        (yes if decays(name, no_decay, tied) else no).append(p)
    out = []
    if yes:
        out.append({"params": yes, "weight_decay": weight_decay})
    if no:
        out.append({"params": no, "weight_decay": 0.0})
    return out
