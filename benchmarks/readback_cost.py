"""What reading a commit back before retention costs (``sailor.checkpoint.readback``),
against ``verify`` (every byte checked) of the same checkpoint, measured in the same run.

A ~100 MB checkpoint (``--mb``: fp32 weights and both AdamW moments, 8 layers) is saved
once with ``save_full`` into a temporary directory; then, ``--reps`` times each, in
alternating order: ``read_back`` (manifest, every shard's size, the tail and head block of
each shard within its byte budget) and ``verify``. The page cache is warm for both (the
checkpoint was just written, as when a committer reads its own commit back). Prints setup,
median and min-max seconds and bytes read. Never asserts a timing.
Run: ``python benchmarks/readback_cost.py [--mb 100] [--reps 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from sailor.checkpoint.readback import READBACK_BYTES, read_back
from sailor.checkpoint.reader import verify
from sailor.checkpoint.state import ParamState, TrainingGlobals
from sailor.checkpoint.storage import LocalStorage
from sailor.checkpoint.writer import save_full

LAYERS = 8


def _state(mb: int) -> dict[str, ParamState]:
    # 3 tensors (weight, exp_avg, exp_avg_sq) of fp32 per parameter, 2 parameters a layer
    per_tensor = mb * (1 << 20) // (LAYERS * 2 * 3 * 4)
    rows = max(16, per_tensor // 1024 // 16 * 16)  # 16 checksummed blocks a tensor
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(LAYERS):
        for name, dim in (("w", 0), ("v", 1)):
            shape = (rows, 1024) if dim == 0 else (1024, rows)
            ts = [torch.randn(*shape, generator=g) for _ in range(3)]
            out[f"{layer}.{name}"] = ParamState(*ts, tp_dim=dim)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        s = LocalStorage(d)
        m = save_full(s, _state(a.mb), TrainingGlobals(1, 1, {}), model="toy", num_layers=LAYERS)
        total = sum(sh.size for sh in m.shards)
        print(f"checkpoint: {total / 1e6:.1f} MB in {len(m.shards)} shards under {d}")
        print(f"read_back budget: {READBACK_BYTES / 1e6:.1f} MB; reps: {a.reps}")
        times: dict[str, list[float]] = {"read_back": [], "verify": []}
        nread = 0
        for rep in range(a.reps):
            order = ["read_back", "verify"] if rep % 2 == 0 else ["verify", "read_back"]
            for which in order:
                t0 = time.perf_counter()
                if which == "read_back":
                    rb = read_back(s, 1)
                    nread = rb.bytes_read
                    if not rb.ok:
                        raise SystemExit(f"read_back failed: {rb.problems}")
                elif verify(s, 1):
                    raise SystemExit("verify failed")
                times[which].append(time.perf_counter() - t0)
        for which, ts in times.items():
            read = nread if which == "read_back" else total
            print(
                f"{which:>9}: median {statistics.median(ts) * 1e3:7.1f} ms "
                f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f}), "
                f"{read / 1e6:.1f} MB of shard data read"
            )


if __name__ == "__main__":
    main()
