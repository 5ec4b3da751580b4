"""The fp32 master weights and AdamW moments of a bf16 DeepSpeed run, by parameter.

In bf16 DeepSpeed's pipe engine steps a ``BF16_Optimizer`` (``deepspeed/runtime/
bf16_optimizer.py``) around the adapter's AdamW: the module's parameters are bf16 views into
one flat bf16 buffer per parameter group, and the AdamW steps one flat fp32 *partition* per
group instead (``fp32_groups_flat_partition``): the fp32 master of this data-parallel rank's
1/DP slice of the flat buffer (padded to a multiple of 2·DP elements), its moments in
``optimizer.state[partition]``, created by the first step and then linked to each parameter's
fragment (``_lazy_init_hp_params_optimizer_state``). A parameter may span several ranks'
partitions, so its full master is assembled with one all-reduce over its data-parallel group.

DeepSpeed's public fragment API covers this optimizer (``deepspeed.utils``:
``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state`` all-reduce over the parameter's
``_dp_group``; ``safe_set_full_fp32_param``, ``safe_set_full_optimizer_state`` write this rank's
fragment, no collective), so nothing here maps the flat groups by hand: what it adds is the
AdamW step count (one per flat partition, which the API does not reach) and the moments'
creation and linking on a resume before the first step, when the API has no fragment to
write into.

Reading is a collective over each parameter's data-parallel group: every rank of a stage
reads its parameters in the same order (``DeepSpeedRun.state`` does). deepspeed is imported
inside the functions only (the adapter imports it only when it runs).

fp16 is not here: DeepSpeed steps an ``FP16_UnfusedOptimizer`` around a torch AdamW, whose
per-parameter fp32 copies the fragment API does not cover, whose construction takes one
AdamW step on zero gradients (the step count is one ahead of the updates, and weight decay
was applied once), and whose loss-scale window counts one step more than Sailor's
``LossScaler``; none of that runs on DeepSpeed's CPU accelerator (``Type fp16 is not
supported on your device``) to be tested here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "adam_steps",
    "full_master",
    "full_moments",
    "is_bf16_optimizer",
    "load_moments",
    "set_master",
]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def is_bf16_optimizer(engine_optimizer: Any, params: Sequence[nn.Parameter]) -> bool:
    """Whether ``engine_optimizer`` is DeepSpeed's ``BF16_Optimizer`` with every parameter
    linked to its fp32 master (``link_hp_params`` gives each the fragment methods), as
    this module reads it (duck-typed: deepspeed is not imported to ask)."""
    return (
        type(engine_optimizer).__name__ == "BF16_Optimizer"
        and hasattr(engine_optimizer, "fp32_groups_flat_partition")
        and all(hasattr(p, "get_full_hp_param") for p in params)
    )


def _partitions(engine_optimizer: Any) -> list[torch.Tensor]:
    return list(engine_optimizer.fp32_groups_flat_partition)


def adam_steps(engine_optimizer: Any) -> list[int]:
    """The AdamW step count of each flat fp32 partition (0 for one without state yet)."""
    out = []
    for flat in _partitions(engine_optimizer):
        step = engine_optimizer.optimizer.state.get(flat, {}).get("step", 0)
        out.append(int(step.item() if isinstance(step, torch.Tensor) else step))
    return out


def full_master(p: nn.Parameter) -> torch.Tensor:
    """The full fp32 master of ``p`` (a collective over its data-parallel group)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out: torch.Tensor = safe_get_full_fp32_param(p)
    return out


def full_moments(p: nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
    """The full fp32 AdamW moments of ``p`` (two collectives over its data-parallel group);
    only after the first step has created and linked them."""
    from deepspeed.utils import safe_get_full_optimizer_state

    m, v = (safe_get_full_optimizer_state(p, key) for key in _MOMENTS)
    return m, v


@torch.no_grad()
def set_master(p: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``value`` (full, fp32) the master of ``p``: this rank's fragment of it, and the
    bf16 parameter itself (what ``update_lp_params`` would gather: no collective)."""
    from deepspeed.utils import safe_set_full_fp32_param

    value = value.to(p.device, torch.float32)
    safe_set_full_fp32_param(p, value)
    p.copy_(value.to(p.dtype))


@torch.no_grad()
def load_moments(
    engine_optimizer: Any,
    keyed: Sequence[tuple[str, nn.Parameter]],
    moments: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    adam_step: int,
) -> None:
    """Make ``moments`` (full, by key) the AdamW state of ``keyed`` at ``adam_step``.

    ``adam_step`` 0 drops any state (the first step creates it). Otherwise each flat
    partition gets its step count and, before the first step, zero moments that are then
    linked to the parameters' fragments as that step would link them; the fragments are
    then written through DeepSpeed's API (the partition's alignment padding stays zero)."""
    from deepspeed.utils import safe_set_full_optimizer_state

    state = engine_optimizer.optimizer.state
    if adam_step <= 0:
        for flat in _partitions(engine_optimizer):
            state.pop(flat, None)
        return
    for flat in _partitions(engine_optimizer):
        st = state.setdefault(flat, {})
        for key in _MOMENTS:
            if key not in st:
                st[key] = torch.zeros_like(flat)
        st["step"] = torch.tensor(float(adam_step))
    # BF16_Optimizer links the fragments after its first step; a resume writes them first
    engine_optimizer._lazy_init_hp_params_optimizer_state()
    for key, p in keyed:
        for name, value in zip(_MOMENTS, moments[key], strict=True):
            safe_set_full_optimizer_state(p, value.to(p.device, torch.float32), name)
