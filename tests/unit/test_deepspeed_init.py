"""The DeepSpeed adapter's layers start from Sailor's engine weights for the same seed (the
parameter keys line up, ``"{layer}.{param}"``), each drawn in place on the layer's device,
a chunk at a time, with no host copy of a whole parameter.

No DeepSpeed here: the layer classes are plain modules (``PipelineModule`` only builds them
from their ``LayerSpec``); the adapter's losses against the reference are checked by
``tests/integration/test_megatron_patch_deepspeed.py``.
"""

from __future__ import annotations

import pytest
import torch

from sailor.megatron_patch import init_rng
from sailor.megatron_patch.deepspeed_adapter import DSBlock, DSEmbedding, DSHead
from sailor.megatron_patch.model import GPTStage, tiny_model


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_the_adapters_layers_start_from_the_engines_weights(name: str) -> None:
    spec = tiny_model(name).model_copy(update={"tie_embeddings": False})
    last = spec.num_all_layers - 1
    layers = [DSEmbedding(spec, 7)]
    layers += [DSBlock(spec, i, 7) for i in range(1, spec.num_layers + 1)]
    layers.append(DSHead(spec, 7))
    ours = {
        f"{i if i < last else last}.{n}": p
        for i, layer in enumerate(layers)
        for n, p in layer.named_parameters()
    }
    engine = dict(GPTStage(spec, 0, last, seed=7).keyed_parameters())
    assert ours.keys() == engine.keys()
    for key, p in engine.items():
        assert torch.equal(ours[key].detach(), p.detach()), key


def test_each_parameter_is_drawn_on_the_layers_device_a_chunk_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On ``meta`` (standing for a GPU here): every draw runs on the layer's device, none on
    the host, and none is larger than a chunk. It used to draw each whole parameter on the
    host (``full_init``) and copy it over. The adapter passes the rank's device
    (``_build_module``); here it is the default device."""
    spec = tiny_model("tiny-gpt")
    draws: list[tuple[str, int]] = []
    real = init_rng._pairs

    def seen(
        counter: torch.Tensor, key: tuple[int, int, int, int], scale: float, wide: bool
    ) -> torch.Tensor:
        draws.append((counter.device.type, 2 * counter.numel()))
        return real(counter, key, scale, wide)

    monkeypatch.setattr(init_rng, "_pairs", seen)
    monkeypatch.setattr(init_rng, "DEVICE_CHUNK", 256)
    with torch.device("meta"):
        layers = [DSEmbedding(spec, 0), DSBlock(spec, 1, 0), DSHead(spec, 0)]
    assert all(p.is_meta for layer in layers for p in layer.parameters())
    assert draws and {dev for dev, _ in draws} == {"meta"}
    assert max(n for _, n in draws) <= 256
    biggest = max(p.numel() for layer in layers for p in layer.parameters())
    assert biggest > 256


def test_the_layers_device_argument_places_them_without_a_default_device() -> None:
    """The adapter passes the rank's device to each layer (``_build_module``), outside any
    default-device context: every parameter is allocated there (``meta`` standing for a GPU)."""
    spec = tiny_model("tiny-gpt")
    meta = torch.device("meta")
    layers = [DSEmbedding(spec, 0, meta), DSBlock(spec, 1, 0, meta), DSHead(spec, 0, meta)]
    assert all(p.is_meta for layer in layers for p in layer.parameters())
