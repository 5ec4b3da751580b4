"""The local non-finite check of one iteration, on this CPU: the fused check against the
per-parameter one it replaced, measured in the same run.

Old (``LossScaler.local_overflow`` before): per gradient, ``isfinite`` (a bool tensor the
size of the gradient), ``~``, ``any``, ``to(float)``, ``maximum``: five kernels and two
allocations per parameter. New (``step_agreement.local_nonfinite``): one
``torch._foreach_norm(ord=inf)`` over every gradient, one ``stack().max()`` and ``isfinite``.
Also the checkpoint writer's pre-check (``writer.nonfinite_key``, 1M-element slices) against
``isfinite(t).all()`` per tensor, the check it replaced.

Gradient shapes: a GPT block of hidden ``H`` (12 tensors: qkv, proj, 2 MLP matrices, biases,
2 norms) times ``layers``, fp32. Prints the median of ``reps`` runs (ms) and the ratio.
On a CPU both are memory-bound loops (here the fused one came out 0.88-0.92x, quiet
machine); the fused check's gains are a GPU's kernel launches and, everywhere, no bool
tensor the size of each gradient. A run under another job's load is noise (1.6x once).
Never asserts a timing. Run: ``.venv/bin/python benchmarks/nonfinite_check.py``.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from collections.abc import Callable

import torch

from sailor.checkpoint.state import ParamState
from sailor.checkpoint.writer import nonfinite_key
from sailor.megatron_patch.step_agreement import local_nonfinite


def _old_flag(grads: list[torch.Tensor]) -> torch.Tensor:
    flag = torch.zeros(1, dtype=torch.float32)
    for g in grads:
        flag = torch.maximum(flag, (~torch.isfinite(g)).any().to(flag.dtype))
    return flag


def _old_ckpt(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _grads(hidden: int, layers: int) -> list[torch.Tensor]:
    h, f = hidden, 4 * hidden
    shapes = [(3 * h, h), (3 * h,), (h, h), (h,), (f, h), (f,), (h, f), (h,)] + [(h,)] * 4
    return [torch.randn(s) for _ in range(layers) for s in shapes]


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    grads = _grads(a.hidden, a.layers)
    n = sum(g.numel() for g in grads)
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{a.threads} thread(s); {len(grads)} gradients, {n / 1e6:.1f}M fp32 elements "
        f"(hidden {a.hidden}, {a.layers} blocks); median of {a.reps}"
    )
    cpu = torch.device("cpu")
    old = _median_ms(lambda: float(_old_flag(grads)), a.reps)
    new = _median_ms(lambda: bool(local_nonfinite(grads, cpu)), a.reps)
    print(
        f"gradient flag: per-parameter {old:.2f} ms, fused {new:.2f} ms, old/new {old / new:.2f}x"
    )
    grads[-5].view(-1)[7] = math.nan
    assert float(_old_flag(grads)) == 1.0 and bool(local_nonfinite(grads, cpu))
    grads[-5].view(-1)[7] = 0.0
    by_layer = {
        i: {f"p{j}": ParamState(g, g, g, None) for j, g in enumerate(grads[i * 12 : i * 12 + 12])}
        for i in range(a.layers)
    }
    tensors = [g for _ in range(3) for g in grads]
    old = _median_ms(lambda: _old_ckpt(tensors), a.reps)
    new = _median_ms(lambda: nonfinite_key(by_layer), a.reps)
    print(
        f"checkpoint pre-check (weight + 2 moments): isfinite().all() {old:.2f} ms, "
        f"sliced max-abs {new:.2f} ms, old/new {old / new:.2f}x"
    )


if __name__ == "__main__":
    main()
