"""A seeded permutation of ``[0, n)`` evaluated at any index in O(1) memory: ``permute``.

Which window of the token stream sample ``k`` reads must be a pure function of
``(seed, k)``, the same in every process, layout, and NumPy version, and cheap at any
position (a resumed run starts in the middle of an epoch). Megatron's GPT dataset
materialises a shuffle index with NumPy's RNG and caches it on disk; here the permutation is
computed instead: a balanced Feistel network over the smallest even number of bits that
covers ``n``, with cycle walking (re-apply until the value falls below ``n``, which stays a
bijection of ``[0, n)``; the domain is < 4n, so fewer than 4 rounds trips on average). The
round function is SplitMix64's finaliser (Steele et al., "Fast splittable pseudorandom
number generators", OOPSLA 2014), written out here so no library's stream can change under
a checkpoint.

Pure: no I/O, no global state.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["mix64", "permute"]

_M64 = (1 << 64) - 1
_C1, _C2, _GOLDEN = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15
_ROUNDS = 6


def mix64(x: int) -> int:
    """SplitMix64's finaliser on a Python int (mod 2**64): a key-derivation hash."""
    x &= _M64
    x = ((x ^ (x >> 30)) * _C1) & _M64
    x = ((x ^ (x >> 27)) * _C2) & _M64
    return x ^ (x >> 31)


def _mix_array(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    # uint64 array arithmetic wraps mod 2**64, as mix64 does explicitly
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_C1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_C2)
    return x ^ (x >> np.uint64(31))


def permute(index: npt.ArrayLike, n: int, key: int) -> npt.NDArray[np.int64]:
    """Image of ``index`` (values in ``[0, n)``) under the permutation of ``[0, n)`` of ``key``."""
    if n <= 0:
        raise ValueError(f"n={n}: must be > 0")
    x = np.asarray(index, dtype=np.int64)
    if x.size and (x.min() < 0 or x.max() >= n):
        raise ValueError(f"index outside [0, {n}): {int(x.min())}..{int(x.max())}")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(mix64(key * _GOLDEN + r + 1)) for r in range(_ROUNDS)]
    out = x.astype(np.uint64).reshape(-1)
    todo = np.arange(out.size)
    while todo.size:
        v = out[todo]
        left, right = v >> np.uint64(half), v & mask
        for k in keys:
            left, right = right, left ^ (_mix_array(right ^ k) & mask)
        v = (left << np.uint64(half)) | right
        out[todo] = v
        todo = todo[v >= np.uint64(n)]
    return out.astype(np.int64).reshape(x.shape)
