"""Checkpoint throughput against the disk's own sequential speed, measured in the same run.

For a model of a few hundred MB (fp32 weights + two AdamW moments), on one local directory,
each figure repeated ``--reps`` times, each repetition paired with its own baseline run right
after it (median and min-max of the paired ratios are printed):

* save: snapshot (what training waits for, ms per GB; the first save into fresh memory and the
  later ones into the reused buffers) and persist + commit (shards + part + manifest + marker,
  each fsync'd with its directory, per-block checksums, until the commit marker is durable)
  in GB/s, against a plain sequential write + fsync of the same number of bytes to one new
  file in the same directory. Retention (deleting the previous checkpoint, after the commit)
  is timed and printed separately: the plain write deletes nothing either;
* resharded load: every rank of a new layout (2 stages x TP=2: each rank range-reads only its
  slice of each layer) reading with checksum verification, in GB/s of bytes read, against a
  plain sequential read of the same bytes into a reused buffer. Twice: into fresh tensors
  (``load`` allocates), and into preallocated tensors (``load(into=...)``, as a resume into an
  already built model). Page cache is evicted (fadvise DONTNEED) before each read, for both
  sides, so both read from the disk (on a VM: through the host's cache, the same for both).
  The loader reads ranges of 1-16 MB with O_DIRECT (around the page cache); so that this
  shows, a third pair runs with both sides' files in the page cache ("warm");
* time to checkpoint one stage of ``--stage-gb`` GB (default 1), to set against a 30 s
  preemption notice.

In each repetition the two sides of a pair run back to back, in alternating order (sailor
first in even repetitions, plain first in odd ones), so a disk or neighbour slowing down over
the run does not favour either side. Prints setup, machine (CPUs, load average before and
after), checksum algorithm and figures. Never asserts a timing.
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
    place_of,
    split_key,
    tp_slice,
)
from sailor.checkpoint.blocks import MAX_BLOCKS, default_algorithm
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


def _loadavg() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


def _cache(path: Path) -> None:
    """Read every file under ``path`` once, so the page cache holds it."""
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        with f.open("rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


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
    ck: Checkpointer, state: dict[str, ParamState], step: int
) -> tuple[float, float, float]:
    """(snapshot, persist + commit, retention) seconds of one save."""
    snap = ck.save(state, TrainingGlobals(step, step, {"seed": 0}))
    res = ck.wait()
    assert res is not None and res.manifest is not None
    return snap, res.persist_s + res.commit_s, res.retention_s


def _one_stage(layers: int) -> Plan:
    return _plan("save", [(0, layers - 1, 1)], layers)


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def _dest(plan: Plan, rank: int, state: dict[str, ParamState]) -> dict[str, ParamState]:
    """Preallocated, touched tensors of this rank's slices (a built model's own buffers)."""
    place = place_of(plan, rank)
    out = {}
    for key, p in state.items():
        if split_key(key)[0] in place.layers:
            out[key] = p.map(
                lambda t, d=p.tp_dim: torch.ones_like(tp_slice(t, d, place.tp_rank, place.tp_size))
            )
    return out


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
    print(f"load average at start: {_loadavg()}")
    print(
        f"torch {torch.__version__}, dir {base} ({shutil.disk_usage(base).free / GB:.0f} GB free)"
    )
    print(f"model: {args.layers} layers, {nbytes / GB:.3f} GB (fp32 weights + 2 AdamW moments)")
    print(
        f"reps: {args.reps} (median, min-max of paired ratios); fsync on; checksum "
        f"{default_algorithm()} per block of <= {MAX_BLOCKS} per tensor"
    )

    # Save: one Checkpointer, as in training (the first save allocates, later ones reuse).
    chunk = os.urandom(64 << 20)
    snaps, saves, plain_w, retention = [], [], [], []
    root = base / "ckpt"
    ck = Checkpointer(LocalStorage(root), _one_stage(args.layers), 0, keep=1)
    plain = base / "plain.bin"
    for rep in range(args.reps):
        if rep % 2:
            plain_w.append(_plain_write(plain, nbytes, chunk))
        s, p, r = _save_once(ck, state, rep + 1)
        snaps.append(s)
        saves.append(p)
        retention.append(r)
        if not rep % 2:
            plain_w.append(_plain_write(plain, nbytes, chunk))
        plain.unlink()
    ck.close()
    save_ratio = [w / s for s, w in zip(saves, plain_w, strict=True)]
    step = args.reps

    # Resharded load: 2 stages x TP=2; each TP rank range-reads its slice of its stage's layers.
    half = args.layers // 2
    new = _plan("load", [(0, half - 1, 2), (half, args.layers - 1, 2)], args.layers)
    ranks = range(len(new.ranks()))
    dests = {r: _dest(new, r, state) for r in ranks}
    plain = base / "plain.bin"
    _plain_write(plain, nbytes, chunk)
    runs: dict[str, tuple[list[float], list[float]]] = {"fresh": ([], []), "into": ([], [])}
    cpu: dict[str, list[float]] = {"fresh": [], "into": [], "plain": []}
    read_bytes = sum(load_for_rank(LocalStorage(root), new, r, step=step).bytes_read for r in ranks)
    for rep in range(args.reps):
        for mode, (loads, plain_r) in runs.items():
            if rep % 2:
                _evict(plain)
                c0 = time.process_time()
                plain_r.append(_plain_read(plain, read_bytes))
                cpu["plain"].append(time.process_time() - c0)
            _evict(root)
            c0 = time.process_time()
            t0 = time.perf_counter()
            got_bytes = 0
            for r in ranks:
                into = dests[r] if mode == "into" else None
                got = load_for_rank(LocalStorage(root), new, r, step=step, into=into)
                got_bytes += got.bytes_read
            loads.append(time.perf_counter() - t0)
            cpu[mode].append(time.process_time() - c0)
            assert got_bytes == read_bytes
            if not rep % 2:
                _evict(plain)
                c0 = time.process_time()
                plain_r.append(_plain_read(plain, read_bytes))
                cpu["plain"].append(time.process_time() - c0)
    # Warm: both sides' files in the page cache (read once first, not timed). The loader
    # reads 1-16 MB ranges with O_DIRECT, so it does not profit from the cache; the plain
    # read does. Printed so that trade-off shows.
    warm: tuple[list[float], list[float]] = ([], [])
    for _ in range(args.reps):
        _cache(root)
        t0 = time.perf_counter()
        for r in ranks:
            load_for_rank(LocalStorage(root), new, r, step=step, into=dests[r])
        warm[0].append(time.perf_counter() - t0)
        _cache(plain)
        warm[1].append(_plain_read(plain, read_bytes))
    plain.unlink()

    # One stage of --stage-gb: snapshot + persist + commit.
    big_layers = max(2, int(args.stage_gb * 8))
    big = _state(big_layers, args.stage_gb * GB)
    big_bytes = sum(p.nbytes for p in big.values())
    shutil.rmtree(base / "stage", ignore_errors=True)
    ck = Checkpointer(LocalStorage(base / "stage"), _one_stage(big_layers), 0, keep=1)
    s_snap, s_persist, _ = _save_once(ck, big, 1)
    ck.close()
    del big

    print()
    print(f"{'figure (median of paired runs)':<46}{'sailor':>9}{'plain':>9}  ratio (min-max)")
    print(
        f"{'save (persist+commit, durable), GB/s':<46}"
        f"{nbytes / GB / statistics.median(saves):>9.3f}"
        f"{nbytes / GB / statistics.median(plain_w):>9.3f}  {_spread(save_ratio)}"
    )
    for mode, (loads, plain_r) in runs.items():
        ratio = [p / s for s, p in zip(loads, plain_r, strict=True)]
        label = f"resharded load 2x TP2 {mode}, GB/s read"
        print(
            f"{label:<46}{read_bytes / GB / statistics.median(loads):>9.3f}"
            f"{read_bytes / GB / statistics.median(plain_r):>9.3f}  {_spread(ratio)}"
        )
    wr = [p / s for s, p in zip(*warm, strict=True)]
    label = "resharded load into, warm page cache, GB/s"
    print(
        f"{label:<46}{read_bytes / GB / statistics.median(warm[0]):>9.3f}"
        f"{read_bytes / GB / statistics.median(warm[1]):>9.3f}  {_spread(wr)}"
    )
    print(
        f"bytes read by the new layout: {read_bytes / GB:.3f} GB "
        f"({read_bytes / nbytes:.2f}x the checkpoint)"
    )
    print(
        "CPU s of this process per load (user+sys, all threads; what a busy machine charges): "
        + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in cpu.items())
    )
    per_gb = [x * 1e3 / (nbytes / GB) for x in snaps]
    later = per_gb[1:] or per_gb
    print(
        f"snapshot stall, ms per GB: first save {per_gb[0]:.0f}, later saves (reused "
        f"buffers) {statistics.median(later):.0f} ({min(later):.0f}-{max(later):.0f})"
    )
    print(
        f"stage of {big_bytes / GB:.2f} GB (first save): snapshot {s_snap:.2f} s (training "
        f"stall), persist+commit {s_persist:.2f} s, total {s_snap + s_persist:.2f} s "
        f"(vs a 30 s preemption notice)"
    )
    print(
        f"retention after each commit (delete the previous step, not in the save figure): "
        f"{[round(x, 3) for x in retention]} s"
    )
    print(f"save ratios: {[round(x, 2) for x in save_ratio]}")
    for mode, (loads, plain_r) in runs.items():
        ratio = [p / s for s, p in zip(loads, plain_r, strict=True)]
        print(f"load {mode} ratios: {[round(x, 2) for x in ratio]}")
    print(
        f"raw s: save {[round(x, 3) for x in saves]}, plain write "
        f"{[round(x, 3) for x in plain_w]}, snapshot {[round(x, 3) for x in snaps]}"
    )
    for mode, (loads, plain_r) in runs.items():
        print(
            f"raw s: load {mode} {[round(x, 3) for x in loads]}, plain read "
            f"{[round(x, 3) for x in plain_r]}"
        )
    print(f"load average at end: {_loadavg()}")
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
