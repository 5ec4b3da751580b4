"""Checkpoint throughput against the disk's own sequential speed, measured in the same run.

For a model of a few hundred MB (fp32 weights + two AdamW moments), on one local directory:

* save: snapshot (what training waits for, ms per GB) and persist (shards + part + manifest +
  marker, fsync'd, SHA-256 per tensor) in GB/s, against a plain sequential write + fsync of
  the same number of bytes to one file in the same directory;
* resharded load: every rank of a new layout (2 stages x TP=2: each layer is read by both TP
  ranks of its stage and sliced) reading with checksum verification, in GB/s of bytes read,
  against a plain sequential read of the same bytes. Page cache is evicted (fadvise
  DONTNEED) before each read, for both;
* time to checkpoint one stage of ``--stage-gb`` GB (default 1), to set against a 30 s
  preemption notice.

Prints setup, machine and figures. Never asserts a timing.
Run: ``python benchmarks/checkpoint_throughput.py [--dir DIR] [--mb 300] [--stage-gb 1]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sailor.checkpoint import (
    Checkpointer,
    LocalStorage,
    ParamState,
    TrainingGlobals,
    load_for_rank,
)
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage

GB = 1e9


def _plan(pid: str, stages: list[tuple[int, int, int]], layers: int) -> Plan:
    assert stages[-1][1] == layers - 1
    return Plan(
        plan_id=pid,
        model="bench",
        global_batch_size=1,
        pipelines=(
            Pipeline(
                stages=tuple(
                    Stage(
                        first_layer=a,
                        last_layer=b,
                        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=tp, gpus_per_node=2),
                    )
                    for a, b, tp in stages
                ),
                microbatch_size=1,
                num_microbatches=1,
            ),
        ),
    )


def _state(layers: int, total_bytes: float, hidden: int = 1024) -> dict[str, ParamState]:
    """``layers`` layers of two matrices each (column- and row-parallel), ~total_bytes."""
    per_layer = total_bytes / layers / 3 / 4  # 3 tensors per param, 4 bytes per float
    ffn = max(2, int(per_layer / (2 * hidden)) // 2 * 2)
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(layers):
        for name, shape, dim in [
            ("fc1.weight", (ffn, hidden), 0),
            ("fc2.weight", (hidden, ffn), 1),
        ]:
            ts = [torch.randn(*shape, generator=g) for _ in range(3)]
            out[f"{layer}.{name}"] = ParamState(*ts, tp_dim=dim)
    return out


def _evict(path: Path) -> None:
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _plain_write(path: Path, nbytes: int, chunk: bytes) -> float:
    t0 = time.perf_counter()
    with path.open("wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[: min(len(chunk), left)])
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def _plain_read(path: Path, nbytes: int) -> float:
    buf = bytearray(64 << 20)
    mv = memoryview(buf)
    t0 = time.perf_counter()
    got = 0
    with path.open("rb", buffering=0) as f:
        while got < nbytes:
            n = f.readinto(mv[: min(len(buf), nbytes - got)])
            if not n:
                f.seek(0)  # the file is read as many times as the checkpoint reads layers
                continue
            got += n
    return time.perf_counter() - t0


def _save_once(
    root: Path, state: dict[str, ParamState], layers: int, step: int
) -> tuple[float, float]:
    plan = _plan("save", [(0, layers - 1, 1)], layers)
    ck = Checkpointer(LocalStorage(root), plan, 0, keep=1)
    snap = ck.save(state, TrainingGlobals(step, step, {"seed": 0}))
    res = ck.wait()
    ck.close()
    assert res is not None and res.manifest is not None
    return snap, res.persist_s + res.commit_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="Directory on the disk to test (default: tmp).")
    ap.add_argument("--mb", type=float, default=300.0, help="Checkpoint size, MB.")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--stage-gb", type=float, default=1.0, help="Stage size for the last figure.")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = Path(args.dir or tempfile.mkdtemp(prefix="sailor-ckpt-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    state = _state(args.layers, args.mb * 1e6)
    nbytes = sum(p.nbytes for p in state.values())
    print("== checkpoint throughput ==")
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}"
    )
    print(
        f"torch {torch.__version__}, dir {base} ({shutil.disk_usage(base).free / GB:.0f} GB free)"
    )
    print(f"model: {args.layers} layers, {nbytes / GB:.3f} GB (fp32 weights + 2 AdamW moments)")
    print(f"reps: {args.reps} (median shown); fsync on; SHA-256 per tensor")

    chunk = os.urandom(64 << 20)
    snaps, saves, plain_w = [], [], []
    for rep in range(args.reps):
        root = base / "ckpt"
        s, p = _save_once(root, state, args.layers, rep + 1)
        snaps.append(s)
        saves.append(p)
        plain = base / "plain.bin"
        plain_w.append(_plain_write(plain, nbytes, chunk))
        plain.unlink()
    save_gbs = nbytes / GB / statistics.median(saves)
    plain_wgbs = nbytes / GB / statistics.median(plain_w)
    snap_ms_per_gb = statistics.median(snaps) * 1e3 / (nbytes / GB)

    # Resharded load: 2 stages x TP=2; each TP rank reads its stage's layers whole, then slices.
    root = base / "ckpt"
    half = args.layers // 2
    new = _plan("load", [(0, half - 1, 2), (half, args.layers - 1, 2)], args.layers)
    loads, plain_r = [], []
    read_bytes = 0
    plain = base / "plain.bin"
    _plain_write(plain, nbytes, chunk)
    for _ in range(args.reps):
        _evict(root)
        t0 = time.perf_counter()
        read_bytes = 0
        for r in range(len(new.ranks())):
            got = load_for_rank(LocalStorage(root), new, r)
            read_bytes += got.bytes_read
        loads.append(time.perf_counter() - t0)
        _evict(plain)
        plain_r.append(_plain_read(plain, read_bytes))
    plain.unlink()
    load_gbs = read_bytes / GB / statistics.median(loads)
    plain_rgbs = read_bytes / GB / statistics.median(plain_r)

    # One stage of --stage-gb: snapshot + persist + commit.
    big = _state(max(2, int(args.stage_gb * 8)), args.stage_gb * GB)
    big_bytes = sum(p.nbytes for p in big.values())
    shutil.rmtree(base / "stage", ignore_errors=True)
    s_snap, s_persist = _save_once(base / "stage", big, max(2, int(args.stage_gb * 8)), 1)
    del big

    print()
    print(f"{'figure':<44}{'sailor':>12}{'plain':>12}{'ratio':>8}")
    print(
        f"{'save (persist+commit), GB/s':<44}{save_gbs:>12.3f}{plain_wgbs:>12.3f}"
        f"{save_gbs / plain_wgbs:>8.2f}"
    )
    print(
        f"{'resharded load (2 stages x TP2), GB/s read':<44}{load_gbs:>12.3f}{plain_rgbs:>12.3f}"
        f"{load_gbs / plain_rgbs:>8.2f}"
    )
    print(f"{'snapshot stall, ms per GB':<44}{snap_ms_per_gb:>12.1f}")
    print(
        f"stage of {big_bytes / GB:.2f} GB: snapshot {s_snap:.2f} s (training stall), "
        f"persist+commit {s_persist:.2f} s, total {s_snap + s_persist:.2f} s "
        f"(vs a 30 s preemption notice)"
    )
    print(
        f"raw: save s {[round(x, 3) for x in saves]}, plain write s "
        f"{[round(x, 3) for x in plain_w]}, load s {[round(x, 3) for x in loads]}, "
        f"plain read s {[round(x, 3) for x in plain_r]}, snapshot s {[round(x, 3) for x in snaps]}"
    )
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
