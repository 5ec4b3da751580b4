"""Counter-based normal draws: any slice of a parameter's initial value, on any device.

A parameter's initial value is a pure function of ``(seed, parameter name, global element
index)``: element ``i`` of the full (unsharded) tensor, in row-major order, is the same
number whatever the TP degree, the stage split or the device that draws it. So every rank
draws only its own shard, on its own device, a bounded chunk at a time (:func:`fill_normal_`),
and a TP-t run starts from exactly the single-device reference's weights. Before, every TP
rank drew the whole tensor on the host from a seeded ``torch.Generator`` and sliced it: 8
copies of a vocabulary matrix in host memory on an 8-GPU node, and 8 times the work.

The generator, written with integer tensor ops only (the same on CPU and CUDA):

- a key of four 32-bit words from ``blake2b(seed, name)`` (on the host, once per parameter);
- two 32-bit words per element from rounds of Wellons' ``lowbias32`` mixer (``x ^= x >>
  16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15``, both multipliers
  below 2**31): ``s = mix(mix(lo ^ k0) ^ hi ^ k1)`` of the index's low and high words, then
  ``w1 = mix(s ^ k2)``, ``w2 = mix(s ^ k3)``. Values are held in int64 below 2**32, so a
  product stays below 2**63: no signed overflow anywhere. Each round is a bijection of
  32-bit words, so no two elements of one aligned block of 2**32 (a whole tensor below 4G
  elements) share a word;
- Box-Muller on the two words: ``sqrt(-2 ln u1) * cos(2 pi u2)`` with ``u1 = (w1 + 1) /
  2**32`` in (0, 1] and ``u2 = w2 / 2**32``, computed in float64 with ``+ - * /``, ``sqrt``
  and ``frexp`` only (IEEE operations, correctly rounded on every device): ``ln`` from the
  exponent and a series in ``(m - 1) / (m + 1)``, ``cos`` from the quadrant (the word's top
  two bits) and a Taylor series on ``[0, pi/2]``. Library ``log``/``cos`` are left out on
  purpose: their last bit differs between CPU vectorized and scalar loops (so between element
  positions) and between devices. Truncation of the series is below 1e-12 relative, far
  under the float32 rounding of the result. The draw's tails end at ``sqrt(2 ln 2**32)``,
  6.66 standard deviations.

Not ``torch.randn``'s stream: a fresh start draws other numbers than the releases that
sliced a generator's full draw (checkpoints hold values and are unaffected).

This module must never read a global generator or the default device: what it draws depends
on its arguments alone.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

__all__ = ["DEVICE_CHUNK", "HOST_CHUNK", "fill_normal_", "key_of", "normal_at"]

HOST_CHUNK = 1 << 16
"""Elements drawn at a time on the host: the chunk's 8-byte temporaries (512 KB each) stay in
cache. Measured on this 2-core machine (one thread, a 50000 x 1024 matrix): 2**16 drew at
39 ns an element with 13 MB of peak growth, 2**18 at 67 ns with 59 MB, 2**14 at 47 ns."""
DEVICE_CHUNK = 1 << 20
"""Elements drawn at a time on a GPU: ~100 elementwise kernels a chunk, so a small chunk is
launch-bound (at ~5 us a launch, 2**16 elements would cost ~8 ns an element in launches
alone, 2**20 under 1 ns); its temporaries are 8 MB each. Not measured here (no GPU)."""

_MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x21F0AAAD, 0x735A2D97  # lowbias32 (Wellons' hash prospector), both < 2**31
_TWO_M32 = 2.0**-32
_TWO_M30 = 2.0**-30
_LN2 = math.log(2.0)
_SQRT_HALF = math.sqrt(0.5)
_HALF_PI = math.pi / 2
# 2 * atanh(s) = ln((1 + s) / (1 - s)): coefficients 2 / (2k + 1), k = 0..8 (|s| < 0.172)
_LN_COEF = tuple(2.0 / (2 * k + 1) for k in range(9))
# Taylor coefficients of cos on [0, pi/2], to b**18 (error < 4e-15)
_COS_COEF = tuple((-1) ** k / math.factorial(2 * k) for k in range(10))


def key_of(seed: int, name: str) -> tuple[int, int, int, int]:
    """Four 32-bit key words of the stream of ``(seed, name)`` (host, pure)."""
    if seed < 0:
        raise ValueError(f"seed={seed}: must be >= 0")
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=16).digest()
    k = [int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(4)]
    return k[0], k[1], k[2], k[3]


def _mix(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 words in [0, 2**32), in place (``tmp``: scratch of x's shape)."""
    x ^= torch.bitwise_right_shift(x, 16, out=tmp)
    x.mul_(_M1).bitwise_and_(_MASK32)
    x ^= torch.bitwise_right_shift(x, 15, out=tmp)
    x.mul_(_M2).bitwise_and_(_MASK32)
    x ^= torch.bitwise_right_shift(x, 15, out=tmp)
    return x


def _poly(x: torch.Tensor, coef: Sequence[float]) -> torch.Tensor:
    """Horner's rule, highest coefficient first, one IEEE op at a time."""
    out = torch.full_like(x, coef[-1])
    for c in reversed(coef[:-1]):
        out.mul_(x).add_(c)
    return out


def _neg2_ln(u: torch.Tensor) -> torch.Tensor:
    """``-2 ln u`` for float64 u in (0, 1], in place of ``u``."""
    m, e = torch.frexp(u)  # u = m * 2**e, m in [0.5, 1): exact
    low = m < _SQRT_HALF
    m.add_(m * low)  # doubled below sqrt(1/2): now in [sqrt(1/2), sqrt(2))
    e = e.to(u.dtype).sub_(low.to(u.dtype))
    s = (m - 1.0).div_(m.add_(1.0))
    ln_m = _poly(s * s, _LN_COEF).mul_(s)
    # no fused multiply-add (``alpha``): a device may fuse it, another round twice
    return torch.mul(e, _LN2, out=u).add_(ln_m).mul_(-2.0)


def normal_at(index: torch.Tensor, key: tuple[int, int, int, int]) -> torch.Tensor:
    """Standard normal float64 draws of the stream ``key`` at the int64 element indices
    ``index`` (each in [0, 2**62)); on ``index``'s device, of its shape."""
    k0, k1, k2, k3 = key
    tmp = torch.empty_like(index)
    state = _mix(index & _MASK32 ^ k0, tmp)  # the low word, then the high one
    state ^= torch.bitwise_right_shift(index, 32, out=tmp)
    state = _mix(state.bitwise_xor_(k1), tmp)
    w2 = _mix(state ^ k3, tmp)
    w1 = _mix(state.bitwise_xor_(k2), tmp)
    radius = _neg2_ln(w1.add_(1).to(torch.float64).mul_(_TWO_M32)).sqrt_()
    # cos(2 pi u2) = cos(q pi/2 + a), q = the top two bits: +-cos(b), b = a (q even) or
    # pi/2 - a (q odd), minus for q = 1, 2
    quadrant = torch.bitwise_right_shift(w2, 30, out=tmp)
    a = w2.bitwise_and_((1 << 30) - 1).to(torch.float64).mul_(_TWO_M30 * _HALF_PI)
    odd = (quadrant & 1).to(torch.float64)
    b = a.add_(odd * (_HALF_PI - 2 * a))  # exact choice: odd is 0 or 1
    value = _poly(b * b, _COS_COEF)
    negative = (quadrant ^ (quadrant >> 1)) & 1
    return value.mul_(radius).mul_(1.0 - 2.0 * negative.to(torch.float64))


def _strides(shape: Sequence[int]) -> list[int]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * shape[d + 1]
    return out


@torch.no_grad()
def fill_normal_(
    out: torch.Tensor,
    key: tuple[int, int, int, int],
    full_shape: Sequence[int],
    start: Sequence[int],
    std: float,
    zero_rows_from: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Fill ``out`` (contiguous, any device and float dtype) with ``std`` times the stream's
    values of the block of a ``full_shape`` tensor that starts at ``start`` and has
    ``out``'s shape (a TP shard: one dimension offset, the others whole).

    ``zero_rows_from``: full rows (dimension 0) from this one on are zero (a vocabulary
    matrix's padding). Drawn ``chunk`` elements (default :data:`HOST_CHUNK` on the CPU,
    :data:`DEVICE_CHUNK` elsewhere) at a time, at least one row of the block, on ``out``'s
    device: no temporary exceeds that size."""
    shape = tuple(out.shape)
    if len(full_shape) != len(shape) or len(start) != len(shape):
        raise ValueError(
            f"full_shape={tuple(full_shape)}, start={tuple(start)}: need one entry per "
            f"dimension of the block {shape}"
        )
    for d, (n, s, f) in enumerate(zip(shape, start, full_shape, strict=True)):
        if s < 0 or s + n > f:
            raise ValueError(
                f"start[{d}]={s}: the block's {n} entries exceed the full dimension {f}"
            )
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.numel() == 0:
        return out
    if math.prod(full_shape) >= 2**62:
        raise ValueError(f"full_shape={tuple(full_shape)}: at least 2**62 elements")
    dev = out.device
    if not shape:  # a 0-dim parameter: the block of one element
        shape, start, full_shape = (1,), (0,), (1,)
    strides = _strides(full_shape)
    trailing = torch.zeros((), dtype=torch.int64, device=dev)
    for d in range(1, len(shape)):
        ar = torch.arange(start[d], start[d] + shape[d], dtype=torch.int64, device=dev)
        trailing = trailing.unsqueeze(-1) + ar * strides[d]
    trailing = trailing.reshape(-1)
    width = trailing.numel()
    flat = out.view(shape[0], width)
    if chunk is None:
        chunk = HOST_CHUNK if dev.type == "cpu" else DEVICE_CHUNK
    rows = max(1, chunk // width)
    for a in range(0, shape[0], rows):
        b = min(shape[0], a + rows)
        full_rows = torch.arange(start[0] + a, start[0] + b, dtype=torch.int64, device=dev)
        index = (full_rows * strides[0]).unsqueeze(-1) + trailing
        z = normal_at(index, key).mul_(std)
        if zero_rows_from is not None:
            z.masked_fill_((full_rows >= zero_rows_from).unsqueeze(-1), 0.0)
        flat[a:b].copy_(z)
    return out
