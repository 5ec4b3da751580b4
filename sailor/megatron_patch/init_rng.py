"""Counter-based normal draws: any slice of a parameter's initial value, on any device.

A parameter's initial value is a pure function of ``(seed, parameter name, global element
index)``: element ``i`` of the full (unsharded) tensor, in row-major order, is the same
number whatever the TP degree, the stage split or the device that draws it. So every rank
draws only its own shard, on its own device, a bounded chunk at a time (:func:`fill_normal_`),
and a TP-t run starts from exactly the single-device reference's weights. Before, every TP
rank drew the whole tensor on the host from a seeded ``torch.Generator`` and sliced it: 8
copies of a vocabulary matrix in host memory on an 8-GPU node, and 8 times the work.

One Box-Muller pair serves two elements: counter ``k`` gives element ``2k`` (``r x``) and
``2k + 1`` (``r y``), ``(x, y)`` a uniform point of the unit circle, so the hash, the
logarithm and the square root are paid once for two elements. A block that starts or ends
at an odd element draws the whole pair and keeps its half: the values never depend on
where a block starts or how it is cut into chunks.

The generator, written with integer tensor ops, IEEE float64 ``+ - * /`` (each correctly
rounded on every device) and bit views of float64 as int64 only:

- a key of four 32-bit words from ``blake2b(seed, name)`` (on the host, once per parameter);
- two 32-bit words per counter from rounds of Wellons' ``lowbias32`` mixer (``x ^= x >>
  16; x *= 0x21f0aaad; x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15``, both multipliers
  below 2**31): ``s = mix(mix(lo ^ k0) ^ hi ^ k1)`` of the counter's low and high words,
  then ``w1 = mix(s ^ k2)``, ``w2 = mix(s ^ k3)``. Values are held in int64 below 2**32, so
  a product stays below 2**63: no signed overflow anywhere. Each round is a bijection of
  32-bit words, so no two counters of one aligned block of 2**32 (a whole tensor below 8G
  elements) share a word;
- the radius, each step one rounding, in this order: ``u = (w1 + 1/2) / 2**32`` in (0, 1)
  (exact); ``u = m 2**e`` with ``m`` in ``[sqrt(1/2), sqrt(2))`` (from the bits, exact);
  ``t = (m - 1) / (m + 1)``; ``ln m = P(t * t) * t`` (``P``: the series of ``2 atanh``);
  ``v = (e * ln 2 + ln m) * -2``, in (2**-33, 46.2); ``r = sqrt(v)`` (below); ``r * std``;
- the square root without ``sqrt``: torch's CPU ``sqrt`` is not correctly rounded (1.3% of
  float64 results one unit off ``math.sqrt``'s, measured on this AVX-512 host) while a
  GPU's is, which split the host's draws from the device's. ``v = m 4**p`` with ``m`` in
  [1, 4) (from the bits, exact); ``y = m * B + A``, the linear guess of least relative
  error (2.94%; ``B = g / 3``, ``A = 2 g / 3``, ``g = 2 / (1 + 2 sqrt(2) / 3)``); three of
  Heron's steps ``y = (y + m / y) * 0.5`` (relative error then under 4.3e-4, 9.2e-8,
  4e-15, then rounding: under 1e-14 measured); ``r = y 2**p`` (exact, on the bits);
- the point: the octant ``o`` (``w2``'s top three bits) and ``b = (w2 mod 2**29) * (pi/4 /
  2**29)`` in [0, pi/4); ``C = Q(b * b)``, ``S = R(b * b) * b`` (Taylor series of ``cos``
  and ``sin / b``); ``(x, y) = (C, S)``, swapped where bit 0 of ``o`` is set, ``x``
  negated where bit 1 is, ``y`` where bit 2 is: the eight symmetries of the square carry
  the octant [0, pi/4) onto the whole circle, so the point is uniform on it.

Element ``2k`` is ``x * (r std)``, ``2k + 1`` is ``y * (r std)`` (swaps and signs are
exact). Library ``log``/``sin``/``cos``/``sqrt`` are left out on purpose: their last bit
may differ between CPU vectorized and scalar loops and between devices. Truncation of each
series is below 1e-12 relative, far under the float32 rounding of the result. The draw's
tails end at ``sqrt(2 ln 2**33)``, 6.76 standard deviations.

Not ``torch.randn``'s stream, nor the one-element-per-counter stream of the releases of
2026-11-28: a fresh start draws other numbers than they did (checkpoints hold values and
are unaffected).

This module must never read a global generator or the default device: what it draws depends
on its arguments alone.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence

import torch

__all__ = ["DEVICE_CHUNK", "HOST_CHUNK", "fill_normal_", "key_of", "normal_at"]

HOST_CHUNK = 1 << 16
"""Elements drawn at a time on the host (half as many counters; 8-byte temporaries of 256 KB,
in cache; the stacked word pairs and results are twice that, the three-row float scratch three
times). Measured on this 2-core machine (one thread, a 2048 x 1024 matrix, CPU time under
other jobs' load): 2**15 25 ns an element, 2**16 25-27, 2**17 20-27, 2**18 23-26; the
smallest of the fast ones is kept (transient memory grows with the chunk)."""
DEVICE_CHUNK = 1 << 20
"""Elements drawn at a time on a GPU: ~130 elementwise kernels a chunk, so a small chunk is
launch-bound (at ~5 us a launch, 2**16 elements would cost ~10 ns an element in launches
alone, 2**20 under 1 ns); its temporaries are 4 MB a counter row (8 MB for the stacked word
pairs, 12 MB for the three-row float scratch). Not measured here (no GPU)."""

_MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x21F0AAAD, 0x735A2D97  # lowbias32 (Wellons' hash prospector), both < 2**31
_SIGN = -(2**63)  # the sign bit of a float64's int64 view
_UNIT = 1 << 52  # one unit of a float64's exponent field, in its int64 view
_ONE_BITS = 1023 << 52  # the int64 view of 1.0
_SQRT_HALF_BITS: int = struct.unpack("<q", struct.pack("<d", math.sqrt(0.5)))[0]
_TWO_M32 = 2.0**-32
_LN2 = math.log(2.0)
_ANGLE_STEP = 2.0**-29 * (math.pi / 4)  # the angle of one unit of w2's low 29 bits
# the linear guess of least relative error for sqrt on [1, 4]: g (1 + m / 2) / 3 is 1 + d
# at 1 and 4 and 1 - d at 2, d = 2.94%
_GUESS = 2.0 / (1.0 + 2.0 * math.sqrt(2.0) / 3.0)
_GUESS_B, _GUESS_A = _GUESS / 3.0, 2.0 * _GUESS / 3.0
# 2 * atanh(t) = ln((1 + t) / (1 - t)): coefficients 2 / (2k + 1), k = 0..7 (|t| < 0.172;
# the first term left out, 2 t**17 / 17, is < 3e-14 of ln m)
_LN_COEF = tuple(2.0 / (2 * k + 1) for k in range(8))
# Taylor coefficients of cos and sin / b on [0, pi/4], to b**12 and b**13 (the first terms
# left out: < 4e-13 of cos b, < 3e-14 of sin b)
_COS_COEF = tuple((-1) ** k / math.factorial(2 * k) for k in range(7))
_SIN_COEF = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(7))


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


def _poly(x: torch.Tensor, coef: Sequence[float], out: torch.Tensor) -> torch.Tensor:
    """Horner's rule into ``out``, highest coefficient first, one IEEE op at a time (no
    fused multiply-add: a device may fuse it, another round twice)."""
    out.fill_(coef[-1])
    for c in reversed(coef[:-1]):
        out.mul_(x).add_(c)
    return out


def _words(counter: torch.Tensor, key: tuple[int, int, int, int], wide: bool) -> torch.Tensor:
    """The words ``(w1, w2)`` of each counter, stacked on a new leading dimension. ``wide``:
    some counter may reach 2**32 (else the high word, zero, is skipped)."""
    k0, k1, k2, k3 = key
    words = torch.empty((2, *counter.shape), dtype=torch.int64, device=counter.device)
    state, tmp = words[0], words[1]
    if wide:
        torch.bitwise_and(counter, _MASK32, out=state).bitwise_xor_(k0)
    else:
        torch.bitwise_xor(counter, k0, out=state)
    _mix(state, tmp)
    if wide:
        state ^= torch.bitwise_right_shift(counter, 32, out=tmp)
    _mix(state.bitwise_xor_(k1), tmp)
    # both last rounds at once: half the kernel launches
    torch.bitwise_xor(state, k3, out=words[1])
    state.bitwise_xor_(k2)
    return _mix(words, torch.empty_like(words))


def _sqrt_(v: torch.Tensor, tmp: torch.Tensor, power: torch.Tensor) -> torch.Tensor:
    """The square root of positive normal float64 ``v``, in ``tmp`` (the module docstring's
    steps); ``v`` is overwritten, ``power`` is int64 scratch of its shape."""
    bits = v.view(torch.int64)
    # p = floor((biased exponent - 1023) / 2), read off the bits
    torch.sub(bits, _ONE_BITS, out=power).bitwise_right_shift_(53)
    m = bits.sub_(power * (2 * _UNIT)).view(torch.float64)  # v / 4**p, in [1, 4)
    y = torch.mul(m, _GUESS_B, out=tmp).add_(_GUESS_A)
    for step in range(3):
        quotient = torch.div(m, y, out=v) if step == 2 else m / y  # m is not needed after
        y.add_(quotient).mul_(0.5)
    return y.view(torch.int64).add_(power.mul_(_UNIT)).view(torch.float64)


def _pairs(
    counter: torch.Tensor, key: tuple[int, int, int, int], scale: float, wide: bool
) -> torch.Tensor:
    """``scale`` times the normals of each counter: float64 of a leading dimension of 2
    (element ``2k``, element ``2k + 1``) and then ``counter``'s shape."""
    w = _words(counter, key, wide)
    w1, w2 = w[0], w[1]
    shape = counter.shape
    f = torch.empty((3, *shape), dtype=torch.float64, device=counter.device)
    out = torch.empty((2, *shape), dtype=torch.float64, device=counter.device)
    # u = m 2**e: e is the exponent of u / sqrt(1/2), read off the bits (u's minus
    # sqrt(1/2)'s, rounded down), m = u / 2**e on the bits
    u = f[0].copy_(w1).add_(0.5).mul_(_TWO_M32)
    bits = u.view(torch.int64)
    e = torch.sub(bits, _SQRT_HALF_BITS, out=w1).bitwise_right_shift_(52)
    m = bits.sub_(e * _UNIT).view(torch.float64)
    t = torch.sub(m, 1.0, out=f[1]).div_(m.add_(1.0))
    tt = torch.mul(t, t, out=f[2])
    ln_m = _poly(tt, _LN_COEF, out[0]).mul_(t)
    v = f[0].copy_(e).mul_(_LN2).add_(ln_m).mul_(-2.0)
    radius = _sqrt_(v, f[1], e)
    if scale != 1.0:
        radius.mul_(scale)
    # the point: octant o = w2's top three bits, b = its low 29 bits as an angle
    octant = torch.bitwise_right_shift(w2, 29, out=w1)
    b = f[0].copy_(w2.bitwise_and_((1 << 29) - 1)).mul_(_ANGLE_STEP)
    bb = torch.mul(b, b, out=f[2])
    _poly(bb, _COS_COEF, out[0])
    _poly(bb, _SIN_COEF, out[1]).mul_(b)
    xy = out.view(torch.int64)
    # swapped where bit 0 is set: x ^= d and y ^= d, d = x ^ y there and 0 elsewhere
    diff = torch.bitwise_xor(xy[0], xy[1], out=w2)
    xy ^= diff.bitwise_and_(torch.bitwise_and(octant, 1).neg_())
    xy[0] ^= torch.bitwise_and(octant, 2).neg_().bitwise_and_(_SIGN)
    xy[1] ^= octant.bitwise_and_(4).neg_().bitwise_and_(_SIGN)
    return out.mul_(radius)


def normal_at(index: torch.Tensor, key: tuple[int, int, int, int]) -> torch.Tensor:
    """Standard normal float64 draws of the stream ``key`` at the int64 element indices
    ``index`` (each in [0, 2**62)); on ``index``'s device, of its shape. Draws each
    element's whole pair: :func:`fill_normal_` draws a block at half the cost."""
    pair = _pairs(torch.bitwise_right_shift(index, 1), key, 1.0, wide=True)
    return pair.gather(0, (index & 1).unsqueeze(0)).squeeze(0)


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
        matrix's padding; not drawn). Drawn about ``chunk`` elements (default
        :data:`HOST_CHUNK` on the CPU, :data:`DEVICE_CHUNK` elsewhere; at least 4) at a time, on
        ``out``'s device: the temporaries are sized by the chunk (at most 1.5 times its elements, in
    8-byte words), never by the block. The block is cut into lines (its runs
        along the last dimension, contiguous in the full tensor); each piece of a line draws the
        counters that cover it, at most one pair more than its elements."""
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
    total = math.prod(full_shape)
    if total >= 2**62:
        raise ValueError(f"full_shape={tuple(full_shape)}: at least 2**62 elements")
    if not shape:  # a 0-dim parameter: the block of one element
        shape, start, full_shape = (1,), (0,), (1,)
    block = out.view(shape)
    if zero_rows_from is not None:  # padding rows: zero, not drawn
        keep = min(max(zero_rows_from - start[0], 0), shape[0])
        block[keep:].zero_()
        block, shape = block[:keep], (keep, *shape[1:])
        if keep == 0:
            return out
    _fill_lines(block, key, full_shape, start, std, chunk)
    return out


def _fill_lines(
    block: torch.Tensor,
    key: tuple[int, int, int, int],
    full_shape: Sequence[int],
    start: Sequence[int],
    std: float,
    chunk: int | None,
) -> None:
    """:func:`fill_normal_` of a non-empty contiguous block, line by line."""
    dev = block.device
    shape = tuple(block.shape)
    strides = _strides(full_shape)
    n = shape[-1]
    # each line's first element in the full tensor
    line_start = torch.full((), start[-1], dtype=torch.int64, device=dev)
    for d in range(len(shape) - 1):
        ar = torch.arange(start[d], start[d] + shape[d], dtype=torch.int64, device=dev)
        line_start = line_start.unsqueeze(-1) + ar * strides[d]
    line_start = line_start.reshape(-1)
    flat = block.view(-1, n)
    lines = flat.shape[0]
    # all lines start at the same parity when every stride but the last is even
    same_parity = len(shape) == 1 or full_shape[-1] % 2 == 0
    wide = (math.prod(full_shape) - 1) >> 1 >= 2**32
    if chunk is None:
        chunk = HOST_CHUNK if dev.type == "cpu" else DEVICE_CHUNK
    chunk = max(chunk, 4)
    if n + 2 <= chunk:
        per, seg = chunk // (n + 2), n
    else:
        per, seg = 1, (chunk - 2) & ~1
    steps = torch.arange(seg // 2 + 1, dtype=torch.int64, device=dev)
    for la in range(0, lines, per):
        lb = min(lines, la + per)
        for ca in range(0, n, seg):
            w = min(n, ca + seg) - ca
            first = line_start[la:lb] + ca
            if same_parity:
                off = (start[-1] + ca) & 1
                count = (off + w + 1) // 2
            else:
                count = w // 2 + 1
            counter = torch.bitwise_right_shift(first, 1).unsqueeze(-1) + steps[:count]
            pairs = _pairs(counter, key, std, wide).permute(1, 2, 0)  # (lines, count, 2)
            dest = flat[la:lb, ca : ca + w]
            if same_parity and off == 0 and w == 2 * count:  # interleaved as it is cast
                dest.view(lb - la, count, 2).copy_(pairs)
                continue
            drawn = pairs.reshape(lb - la, 2 * count)
            if same_parity:
                dest.copy_(drawn[:, off : off + w])
            else:
                odd = (first & 1).bool().unsqueeze(-1)
                dest.copy_(torch.where(odd, drawn[:, 1 : w + 1], drawn[:, :w]))
