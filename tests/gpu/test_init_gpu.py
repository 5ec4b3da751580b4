"""Initialisation on a GPU: a stage built on its device draws there, the same numbers as the
host draws (``init_rng`` uses integer ops, IEEE ``+ - * /`` and bit views only), and so do the
DeepSpeed adapter's layers.
CPU counterpart: ``tests/unit/test_init_rng.py`` (every shard against the full draw, the
draw against a pure-Python computation)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from sailor.megatron_patch.deepspeed_adapter import DSBlock, DSEmbedding, DSHead
from sailor.megatron_patch.model import GPTStage, tiny_model


def test_a_stage_built_on_a_gpu_starts_from_the_hosts_weights(
    gpus: Callable[[int], None],
) -> None:
    gpus(1)
    spec = tiny_model("tiny-llama")
    last = spec.num_all_layers - 1
    host = GPTStage(spec, 0, last, seed=4)
    with torch.device("cuda", 0):
        dev = GPTStage(spec, 0, last, seed=4)
    for (name, a), (_, b) in zip(host.keyed_parameters(), dev.keyed_parameters(), strict=True):
        assert b.device.type == "cuda", name
        assert torch.equal(a.detach(), b.detach().cpu()), name


def test_the_deepspeed_adapters_layers_drawn_on_a_gpu_are_the_engines_host_weights(
    gpus: Callable[[int], None],
) -> None:
    gpus(1)
    spec = tiny_model("tiny-llama").model_copy(update={"tie_embeddings": False})
    last = spec.num_all_layers - 1
    dev = torch.device("cuda", 0)
    layers = {0: DSEmbedding(spec, 4, dev), 1: DSBlock(spec, 1, 4, dev), last: DSHead(spec, 4, dev)}
    host = dict(GPTStage(spec, 0, last, seed=4).keyed_parameters())
    for layer, module in layers.items():
        for name, p in module.named_parameters():
            assert p.device.type == "cuda", name
            assert torch.equal(p.detach().cpu(), host[f"{layer}.{name}"].detach()), name
