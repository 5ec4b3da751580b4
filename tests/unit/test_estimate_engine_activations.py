"""The analytic block estimate for Sailor's engine against what the engine keeps.

``Calibration.activations = "engine"`` prices an unprofiled block by
:func:`~sailor.simulator.estimate_profile.engine_block_bytes`. Here the engine's own
``Block`` runs a forward on CPU (autocast bf16 standing in for a GPU's, and fp32) and every
tensor autograd saves for the backward is counted once per storage, leaving out the weights
and their autocast casts (the weight copies, priced apart). CPU's fused
``scaled_dot_product_attention`` keeps no seq x seq scores, as the GPU kernels (flash,
memory-efficient) do not; Korthikanti et al.'s Megatron count keeps them, and overcounts the
engine several times at long sequences.
"""

from __future__ import annotations

import pytest
import torch

from sailor.comm.api import use_backend
from sailor.comm.strict import DryGroup, StrictBackend
from sailor.megatron_patch.architecture import Architecture
from sailor.megatron_patch.model import Block, Head
from sailor.megatron_patch.tp_layers import TPContext
from sailor.schemas import ModelSpec
from sailor.simulator.estimate_profile import engine_block_bytes, estimate_layer_size

BATCH = 3
"""Samples per forward: 3 x seq tokens matches no weight's shape."""


def _spec(**kw: object) -> ModelSpec:
    base: dict[str, object] = {
        "name": "t",
        "num_layers": 2,
        "hidden_size": 64,
        "num_heads": 4,
        "ffn_hidden_size": 160,
        "seq_length": 96,
        "vocab_size": 1000,
        "global_batch_size": 1,
        "precision": "bf16",
    }
    base.update(kw)
    return ModelSpec.model_validate(base)


def _kept_per_sample(
    spec: ModelSpec,
    tp: int = 1,
    autocast: bool = True,
    arch: Architecture | None = None,
    head: bool = False,
) -> float:
    """Bytes per sample one TP rank's block (or head, with its loss) saves for its backward
    (weights and their casts left out: their shapes are the weights', transposed or not)."""
    ctx = TPContext() if tp == 1 else TPContext(size=tp, rank=0, group=DryGroup(tuple(range(tp))))
    block: torch.nn.Module
    if head:
        block = Head(spec, ctx)
    else:
        block = Block(spec, ctx) if arch is None else Block(spec, ctx, arch)
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}
    shapes |= {s[::-1] for s in shapes}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and tuple(t.shape) not in shapes:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    # not a leaf: autocast caches its casts of leaves that require grad (the weights), so a
    # leaf input would be cast once for all its readers
    x = torch.randn(BATCH, spec.seq_length, spec.hidden_size, requires_grad=True) * 1.0
    with (
        use_backend(StrictBackend(0, torch.device("cpu"), tp)),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        if head:
            block(x, torch.randint(0, spec.vocab_size, (BATCH, spec.seq_length)))
        else:
            block(x)
    return sum(saved.values()) / BATCH


CASES = {
    "gelu": {},
    "relu": {"activation": "relu"},
    "swiglu, rope": {"activation": "swiglu", "position_embedding": "rope"},
    "swiglu, rope, GQA": {"activation": "swiglu", "position_embedding": "rope", "num_kv_heads": 2},
}


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast bf16", "fp32"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_estimate_counts_what_the_engine_keeps(
    case: str, tp: int, autocast: bool
) -> None:
    spec = _spec(**CASES[case], precision="bf16" if autocast else "fp32")
    kept = _kept_per_sample(spec, tp, autocast)
    est = engine_block_bytes(spec, tp)
    # an overcount of at most the output projection's input, which is a view of the
    # attention's output when the layout allows (counted as a copy)
    slack = spec.param_bytes() * spec.seq_length * spec.hidden_size / tp
    assert kept * 0.97 <= est <= kept + slack + 0.01 * kept, (kept, est)


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast bf16", "fp32"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_engine_estimate_counts_what_the_vocab_parallel_head_keeps(
    tp: int, autocast: bool
) -> None:
    """The head split by vocabulary keeps a TP-th of the fp32 softmax, and its inputs."""
    spec = _spec(precision="bf16" if autocast else "fp32")
    kept = _kept_per_sample(spec, tp, autocast, head=True)
    head = spec.num_all_layers - 1
    est = estimate_layer_size(spec, tp, head, activations="engine").activation_bytes_per_sample
    # the padded vocabulary (1024 rows for 1000) is kept, the estimate counts the real one
    assert kept * 0.97 <= est <= kept * 1.01, (kept, est)


def test_a_post_norm_block_keeps_as_much() -> None:
    spec = _spec()
    post = Architecture(pre_norm=False)
    kept = _kept_per_sample(spec, arch=post)
    est = engine_block_bytes(spec, 1)
    slack = spec.param_bytes() * spec.seq_length * spec.hidden_size
    assert kept * 0.99 <= est <= kept + slack + 0.01 * kept, (kept, est)


def test_megatrons_count_keeps_the_scores_the_engine_does_not() -> None:
    """At sequence 512 and hidden 64 the scores dominate Megatron's count: it is several
    times what the engine keeps; the engine's count is within its bound."""
    spec = _spec(seq_length=512)
    kept = _kept_per_sample(spec)
    megatron = estimate_layer_size(spec, 1, 1).activation_bytes_per_sample
    engine = estimate_layer_size(spec, 1, 1, activations="engine").activation_bytes_per_sample
    assert megatron > 3 * kept
    assert kept * 0.99 <= engine <= 1.1 * kept


def test_the_built_in_calibration_prices_sailors_engine() -> None:
    from sailor import catalog

    assert catalog.calibration().activations == "engine"
    by_name = catalog.deployments()
    assert by_name["sailor"].activations == "engine"
    assert by_name["megatron-deepspeed"].activations == "megatron"


def test_estimated_sizes_take_the_deployments_count_and_the_original_corner_megatrons() -> None:
    from sailor import catalog
    from sailor.schemas import ProfileDB
    from sailor.simulator.lookup import layer_sizes
    from sailor.simulator.uncertainty import corners

    spec = _spec(seq_length=512)
    empty = ProfileDB(model="t", timings=(), sizes=())
    mine, _ = layer_sizes(empty, spec, 2, activations="engine")
    theirs, _ = layer_sizes(empty, spec, 2)
    assert mine[1].activation_bytes_per_sample == int(engine_block_bytes(spec, 2))
    assert theirs[1].activation_bytes_per_sample > 3 * mine[1].activation_bytes_per_sample
    assert mine[0] == theirs[0]  # the embedding as it was
    # the head: Megatron's count keeps the logits in compute precision too
    assert mine[-1].params == theirs[-1].params
    assert mine[-1].activation_bytes_per_sample < theirs[-1].activation_bytes_per_sample
    got = {name: c.activations for name, c in corners(catalog.calibration())}
    assert got == {
        "optimistic": "engine",
        "median": "engine",
        "pessimistic": "engine",
        "original": "megatron",
    }
