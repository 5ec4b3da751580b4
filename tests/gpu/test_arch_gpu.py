"""The installed torch build has kernels for this host's GPUs: ``sailor check``'s ``arch``
rule (``serving_arch``) agrees with the device, and a kernel really runs on each GPU."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sailor.agent.check_gather import gather_gpu
from sailor.agent.check_verdicts import judge
from sailor.catalog.torch_builds import serving_arch
from sailor.schemas.node_check import NodeFacts


def test_every_device_capability_is_served_by_the_arch_list(gpus: Callable[[int], None]) -> None:
    gpus(1)
    arch = torch.cuda.get_arch_list()
    for i in range(torch.cuda.device_count()):
        cap = torch.cuda.get_device_capability(i)
        entry = serving_arch(arch, cap)
        assert entry is not None, (torch.cuda.get_device_name(i), cap, arch)
        # and the rule's word is the device's: a kernel runs there
        x = torch.arange(4, device=f"cuda:{i}", dtype=torch.float32)
        assert float((x * 2).sum()) == 12.0
    facts = NodeFacts.model_validate({"node_kind": "gpu", **gather_gpu(probe=False)})
    assert facts.arch_list == tuple(arch)
    (line,) = [x for x in judge(facts).lines if x.check == "arch"]
    assert line.verdict == "ok", line
