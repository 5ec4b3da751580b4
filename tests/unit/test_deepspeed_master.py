"""``deepspeed_master``'s check of what DeepSpeed's ``BF16_Optimizer`` links to each parameter.

The module reads DeepSpeed's private ``_hp_mapping`` and ``_dp_group`` on every parameter: a
DeepSpeed version without them is refused by name, not met as an ``AttributeError`` partway
through a save. No DeepSpeed needed: the check is duck-typed.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from torch import nn

from sailor.megatron_patch.deepspeed_master import UnlinkedParametersError, is_bf16_optimizer


class BF16_Optimizer:  # noqa: N801 - DeepSpeed's class name, which is what is checked
    def __init__(self) -> None:
        self.fp32_groups_flat_partition: list[torch.Tensor] = []


def _linked(drop: str | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(2))
    for name, value in (("_hp_mapping", None), ("_dp_group", None), ("get_full_hp_param", None)):
        if name != drop:
            setattr(p, name, value)
    return p


def test_a_bf16_optimizer_whose_parameters_lack_deepspeeds_links_is_refused_by_name() -> None:
    assert is_bf16_optimizer(BF16_Optimizer(), [_linked(), _linked()])
    assert not is_bf16_optimizer(object(), [nn.Parameter(torch.zeros(1))])  # fp32: no wrapper
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    for attr in ("_hp_mapping", "_dp_group"):
        with pytest.raises(
            UnlinkedParametersError, match=rf"DeepSpeed {version}: .*parameters lack {attr}\b"
        ):
            is_bf16_optimizer(BF16_Optimizer(), [_linked(), _linked(drop=attr)])
