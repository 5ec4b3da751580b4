"""What AdamW is told each step: the learning-rate schedule and the weight-decay groups.

- :class:`LRSchedule` / :func:`lr_at`: linear warmup, then constant, linear or cosine decay
  to ``min_lr_ratio * lr``. A pure function of the step about to be taken (0-based), so a
  run resumed at step ``s`` under any layout uses exactly the rates the uninterrupted run
  used. The factors are those of ``transformers``' ``get_linear_schedule_with_warmup`` /
  ``get_cosine_with_min_lr_schedule_with_warmup`` (``num_cycles=0.5``), checked against them.
- :class:`DecayGroups` / :func:`param_groups`: no weight decay on biases, norm weights and/or
  embeddings (a tied LM head is the embedding), decided from the layer-keyed name alone, so
  every rank and layout puts a parameter in the same group.

Pure: no process group, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from sailor.schemas._base import Frozen, field_error

__all__ = ["DecayGroups", "LRSchedule", "decays", "lr_at", "param_groups"]

NoDecay = Literal["bias", "norm", "embedding"]


class LRSchedule(Frozen):
    """Warmup then decay of the learning rate (factors of the configured ``lr``)."""

    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup from 0 over these steps.")
    decay: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="Shape after warmup."
    )
    total_steps: int = Field(
        default=0, ge=0, description="Step where the decay reaches min_lr_ratio (decay only)."
    )
    min_lr_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Floor of the decay, as a fraction of lr."
    )

    @model_validator(mode="after")
    def _total(self) -> LRSchedule:
        if self.decay != "constant" and self.total_steps <= self.warmup_steps:
            raise field_error(
                "total_steps",
                self.total_steps,
                f"must exceed warmup_steps={self.warmup_steps} for decay={self.decay!r}",
            )
        return self


def lr_at(schedule: LRSchedule, lr: float, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based: the first step is 0)."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if step < schedule.warmup_steps:
        return lr * step / schedule.warmup_steps
    if schedule.decay == "constant":
        return lr
    span = schedule.total_steps - schedule.warmup_steps
    progress = min(1.0, (step - schedule.warmup_steps) / span)
    if schedule.decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (schedule.min_lr_ratio + (1.0 - schedule.min_lr_ratio) * shape)


class DecayGroups(Frozen):
    """Which parameters AdamW does not decay."""

    no_decay: tuple[NoDecay, ...] = Field(
        default=(),
        description="Kinds exempt from weight decay: 'bias', 'norm' (norm weights), "
        "'embedding' (token and position tables, a tied head). Empty: decay everything.",
    )


def _kind(name: str, tied: bool) -> str:
    _, pname = name.split(".", 1)
    module, _, leaf = pname.rpartition(".")
    if leaf == "bias":
        return "bias"
    if module in ("ln1", "ln2", "norm"):
        return "norm"
    if module in ("wte", "wpe") or (tied and module == "lm_head"):
        return "embedding"
    return "matrix"


def decays(name: str, groups: DecayGroups, tied: bool) -> bool:
    """Whether the layer-keyed parameter ``name`` gets weight decay."""
    return _kind(name, tied) not in groups.no_decay


def param_groups(
    named: Iterable[tuple[str, torch.nn.Parameter]],
    weight_decay: float,
    groups: DecayGroups,
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
        (yes if decays(name, groups, tied) else no).append(p)
    out = []
    if yes:
        out.append({"params": yes, "weight_decay": weight_decay})
    if no:
        out.append({"params": no, "weight_decay": 0.0})
    return out
