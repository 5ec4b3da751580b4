"""The counter-based initial draw: the normal distribution, any block equal to the full
draw's slice, an independent pure-Python computation of the same numbers, bounded chunks.

What the exactness tests rely on (a TP-t run starts from the single-process reference's
weights) is checked here directly: every block of every layout holds the full tensor's
numbers, and a stage drawn at TP 4 never draws more than its shard, a chunk at a time.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from sailor.comm.strict import DryGroup
from sailor.megatron_patch import init_rng
from sailor.megatron_patch.init_rng import fill_normal_, key_of, normal_at
from sailor.megatron_patch.model import GPTStage, full_init, shard, tiny_model
from sailor.megatron_patch.tp_layers import TPContext, tp_dim_of

_MASK = 0xFFFFFFFF


def _mix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _MASK
    x ^= x >> 15
    x = (x * 0x735A2D97) & _MASK
    return x ^ (x >> 15)


def _poly(x: float, coef: tuple[float, ...]) -> float:
    out = coef[-1]
    for c in reversed(coef[:-1]):
        out = out * x + c
    return out


def _sqrt(v: float) -> float:
    """The module's square root of ``v > 0``: v = m 4**p with m in [1, 4), the linear guess
    of least relative error, three of Heron's steps, times 2**p."""
    f, q = math.frexp(v)  # v = (2 f) 2**(q - 1), 2 f in [1, 2)
    m, p = (2.0 * f, (q - 1) // 2) if (q - 1) % 2 == 0 else (4.0 * f, (q - 2) // 2)
    g = 2.0 / (1.0 + 2.0 * math.sqrt(2.0) / 3.0)
    y = m * (g / 3.0) + 2.0 * g / 3.0
    for _ in range(3):
        y = (y + m / y) * 0.5
    return y * 2.0**p


def _reference(seed: int, name: str, i: int) -> float:
    """The draw of element ``i``, in Python integers (unbounded: no overflow to hide) and
    Python floats (IEEE double, as the tensor ops), written from the module's docstring:
    counter ``i // 2``'s pair, its ``x`` for an even ``i``, its ``y`` for an odd one."""
    d = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=16).digest()
    k0, k1, k2, k3 = (int.from_bytes(d[4 * j : 4 * j + 4], "little") for j in range(4))
    k = i // 2
    s = _mix((k & _MASK) ^ k0) ^ (k >> 32)
    s = _mix(s ^ k1)
    w1, w2 = _mix(s ^ k2), _mix(s ^ k3)
    m, e = math.frexp((w1 + 0.5) * 2.0**-32)  # m in [1/2, 1)
    if m < math.sqrt(0.5):
        m, e = m + m, e - 1
    t = (m - 1.0) / (m + 1.0)
    ln_u = float(e) * math.log(2.0) + _poly(t * t, init_rng._LN_COEF) * t
    radius = _sqrt(ln_u * -2.0)
    o = w2 >> 29
    b = (w2 % 2**29) * (math.pi / 4 / 2**29)
    x, y = _poly(b * b, init_rng._COS_COEF), _poly(b * b, init_rng._SIN_COEF) * b
    if o & 1:
        x, y = y, x
    if o & 2:
        x = -x
    if o & 4:
        y = -y
    return (y if i % 2 else x) * radius


def test_draws_equal_an_independent_python_computation_bit_for_bit() -> None:
    """Both halves of a pair, every octant of the angle, counters above 2**32 and near
    2**61 (the high word; an int64 product past 2**63 would wrap and differ from Python's
    integers), through the per-element draw and through blocks of every start parity."""
    name = "3.mlp_in.weight"
    key = key_of(5, name)
    idx = [0, 1, 2, 12345, 2**32 - 1, 2**32, 2**33 + 7, 3 * 2**40 + 11, 2**62 - 2, 2**62 - 1]
    idx += range(40, 168)  # 64 pairs: all eight octants
    got = normal_at(torch.tensor(idx, dtype=torch.int64), key).tolist()
    assert got == [_reference(5, name, i) for i in idx]
    full = [_reference(5, name, i) for i in range(4096)]
    assert (
        fill_normal_(torch.empty(4096, dtype=torch.float64), key, (4096,), (0,), 1.0).tolist()
        == full
    )
    for full_shape, start, shape in [
        ((63,), (0,), (63,)),
        ((63,), (5,), (50,)),
        ((7, 9), (0, 0), (7, 9)),
        ((7, 9), (1, 3), (5, 5)),
    ]:
        block = fill_normal_(torch.empty(shape, dtype=torch.float64), key, full_shape, start, 1.0)
        rows = [start[0] + r for r in range(shape[0])]
        want = (
            [full[i] for i in range(start[0], start[0] + shape[0])]
            if len(shape) == 1
            else [full[r * 9 + c] for r in rows for c in range(start[1], start[1] + shape[1])]
        )
        assert block.reshape(-1).tolist() == want, (full_shape, start, shape)
    octants = {_mix(_mix(_mix(k ^ key[0]) ^ key[1]) ^ key[3]) >> 29 for k in range(20, 84)}
    assert octants == set(range(8))


def test_a_block_of_a_tensor_past_2_33_elements_draws_the_high_word() -> None:
    """A tensor of more than 2**33 elements has counters past 2**32, whose high word is
    mixed in (skipped, being zero, for smaller tensors): its blocks, below 2**33 and past
    it, agree with the per-element draw and the Python computation."""
    key = key_of(1, "0.wte.weight")
    for start in (2**35 + 3, 2**33 - 5):
        block = fill_normal_(torch.empty(9, dtype=torch.float64), key, (2**36,), (start,), 1.0)
        want = normal_at(torch.arange(start, start + 9, dtype=torch.int64), key)
        assert torch.equal(block, want)
        assert block.tolist() == [_reference(1, "0.wte.weight", i) for i in range(start, start + 9)]


def test_the_square_root_is_a_python_computation_and_within_1e_14() -> None:
    """torch's CPU ``sqrt`` is not correctly rounded (a GPU's is): the module's own, from
    ``+ - * /`` on bit views, is the same number everywhere, and close to the true root."""
    v = torch.cat(
        [torch.rand(20000, dtype=torch.float64) * 46.2, torch.tensor([2.0**-33, 1.0, 4.0, 46.2])]
    )
    got = init_rng._sqrt_(v.clone(), torch.empty_like(v), torch.empty_like(v, dtype=torch.int64))
    assert got.tolist() == [_sqrt(x) for x in v.tolist()]
    assert float(((got - v.sqrt()) / v.sqrt()).abs().max()) < 1e-14


def test_draws_are_standard_normal() -> None:
    z = normal_at(torch.arange(1 << 20, dtype=torch.int64), key_of(0, "1.attn_q.weight"))
    n = z.numel()
    se = 1 / math.sqrt(n)
    assert abs(float(z.mean())) < 5 * se
    assert abs(float(z.std()) - 1) < 5 * se
    assert abs(float((z**3).mean())) < 5 * math.sqrt(15 / n)  # skewness 0
    assert abs(float((z**4).mean()) - 3) < 5 * math.sqrt(96 / n)  # kurtosis 3
    # the normal's quantiles: P(|z| < 1) = 0.6827, P(|z| < 2) = 0.9545
    assert abs(float((z.abs() < 1).double().mean()) - 0.6827) < 0.003
    assert abs(float((z.abs() < 2).double().mean()) - 0.9545) < 0.002
    near = torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1]
    assert abs(float(near)) < 5 * se  # neighbours uncorrelated
    # the two halves of a pair share a radius: independent only if the point is uniform on
    # the circle, so their squares are uncorrelated too (se of a correlation: 1/sqrt(n/2))
    sq = (z * z).view(-1, 2)
    assert abs(float(torch.corrcoef(sq.T)[0, 1])) < 5 * math.sqrt(2 / n)
    other = normal_at(torch.arange(1 << 20, dtype=torch.int64), key_of(0, "1.attn_k.weight"))
    assert abs(float(torch.corrcoef(torch.stack([z, other]))[0, 1])) < 5 * se


def test_init_has_the_stds_of_the_previous_release() -> None:
    spec = tiny_model("tiny-gpt")
    w = full_init(spec, "1.mlp_in.weight", (512, 512), seed=1)
    assert abs(float(w.std()) - 0.02) < 0.0005 and abs(float(w.mean())) < 0.0002
    out = full_init(spec, "1.mlp_out.weight", (512, 512), seed=1)
    want = 0.02 / math.sqrt(2 * spec.num_layers)
    assert abs(float(out.std()) - want) < want / 40
    assert torch.equal(full_init(spec, "1.ln1.weight", (32,), 1), torch.ones(32))
    assert torch.equal(full_init(spec, "1.attn_q.bias", (32,), 1), torch.zeros(32))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 18])
def test_any_block_is_the_full_draws_slice_whatever_the_chunk(chunk: int) -> None:
    key = key_of(3, "2.attn_out.weight")
    full = fill_normal_(torch.empty(24, 40), key, (24, 40), (0, 0), 0.5)
    for start, shape in [((0, 10), (24, 10)), ((6, 0), (6, 40)), ((5, 3), (4, 9))]:
        block = fill_normal_(torch.empty(shape), key, (24, 40), start, 0.5, chunk=chunk)
        assert torch.equal(block, full[start[0] :, start[1] :][: shape[0], : shape[1]])
    vec = fill_normal_(torch.empty(30), key, (100,), (70,), 1.0, chunk=chunk)
    assert torch.equal(vec, fill_normal_(torch.empty(100), key, (100,), (0,), 1.0)[70:])


def test_padding_rows_are_zero_and_the_real_rows_layout_free() -> None:
    key = key_of(0, "0.wte.weight")
    full = fill_normal_(torch.empty(16, 4), key, (16, 4), (0, 0), 1.0, zero_rows_from=11)
    assert torch.count_nonzero(full[11:]) == 0 and torch.count_nonzero(full[:11]) == 44
    part = fill_normal_(torch.empty(8, 4), key, (16, 4), (8, 0), 1.0, zero_rows_from=11)
    assert torch.equal(part, full[8:])


@pytest.mark.parametrize(("name", "tp"), [("tiny-gpt", 4), ("tiny-llama", 2)])
def test_each_tp_rank_draws_its_shard_only_a_chunk_at_a_time(
    name: str, tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TP-t stage's every parameter equals its shard of the full init, while no draw is
    larger than a chunk (or one row) and none covers a whole sharded parameter."""
    spec = tiny_model(name)
    last = spec.num_all_layers - 1
    sizes: list[int] = []
    real = init_rng._pairs

    def counted(
        counter: torch.Tensor, key: tuple[int, int, int, int], scale: float, wide: bool
    ) -> torch.Tensor:
        sizes.append(2 * counter.numel())  # two elements a counter
        return real(counter, key, scale, wide)

    monkeypatch.setattr(init_rng, "_pairs", counted)
    monkeypatch.setattr(init_rng, "HOST_CHUNK", 256)
    for rank in range(tp):
        ctx = TPContext(tp, rank, DryGroup(tuple(range(tp))))
        stage = GPTStage(spec, 0, last, tp=ctx, seed=9)
        for key, p in stage.keyed_parameters():
            want = shard(full_init(spec, key, _full(p, tp), 9), tp_dim_of(p), tp, rank)
            assert torch.equal(p.detach(), want), (rank, key)
    assert sizes and max(sizes) <= 256
    biggest = max(p.numel() for _, p in GPTStage(spec, 0, last, seed=9).keyed_parameters())
    assert biggest > 256


def _full(p: torch.Tensor, t: int) -> tuple[int, ...]:
    dim = tp_dim_of(p)
    return tuple(n * t if d == dim else n for d, n in enumerate(p.shape))


def test_bad_blocks_are_refused_naming_the_field() -> None:
    key = key_of(0, "x")
    with pytest.raises(ValueError, match=r"start\[1\]=5"):
        fill_normal_(torch.empty(2, 4), key, (2, 8), (0, 5), 1.0)
    with pytest.raises(ValueError, match="full_shape"):
        fill_normal_(torch.empty(2, 4), key, (8,), (0,), 1.0)
    with pytest.raises(ValueError, match="seed=-1"):
        key_of(-1, "x")


# What the draw may call: integer and bit ops, IEEE + - * / (each rounds once, alike on every
# device), copies, selections and views. Not sqrt, log, exp, sin/cos, addcmul, lerp: torch's
# CPU sqrt is not correctly rounded, and a transcendental's last bit differs between devices.
_ROUNDS_ALIKE_EVERYWHERE = frozenset(
    {
        "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg_",
        "bitwise_and", "bitwise_and_", "bitwise_xor", "bitwise_xor_",
        "bitwise_right_shift", "bitwise_right_shift_",
        "empty", "empty_like", "full", "arange", "fill_", "copy_", "clone", "_to_copy",
        "where", "gather", "view", "_unsafe_view", "select", "slice", "permute",
        "unsqueeze", "squeeze", "expand", "alias", "detach", "zero_", "lift_fresh",
    }
)  # fmt: skip


def test_the_draw_calls_only_ops_that_round_alike_on_every_device() -> None:
    """The CPU tests cannot see a GPU's rounding, so they check what the draw calls. Every op
    is in the list above; ``add``/``sub`` scale by 1 only (a fused ``a + alpha*b`` is then
    exact); no division by a Python scalar or a 0-dim tensor (CUDA turns a division by a
    CPU scalar into a multiplication by its reciprocal: a bit lost, on the GPU alone)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    bad: list[str] = []

    class Guard(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name not in _ROUNDS_ALIKE_EVERYWHERE:
                bad.append(name)
            if name in ("add", "add_", "sub", "sub_") and kwargs.get("alpha", 1) not in (1, -1):
                bad.append(f"{name}(alpha={kwargs['alpha']})")
            if name in ("div", "div_") and (
                not isinstance(args[1], torch.Tensor) or args[1].dim() == 0
            ):
                bad.append(f"{name} by a scalar")
            return func(*args, **kwargs)

    k = key_of(0, "x")
    with Guard():
        fill_normal_(torch.empty(37, 65), k, (100, 65), (3, 0), 0.02, chunk=200)
        fill_normal_(torch.empty(1000), k, (1001,), (1,), 1.0)
        fill_normal_(torch.empty(10, dtype=torch.bfloat16), k, (2**33 + 12,), (2**33 + 1,), 1.0)
        normal_at(torch.arange(5), k)
    assert not bad, sorted(set(bad))
