"""Per-block checksums, TP-dim-first layout and range reads (``sailor/checkpoint/blocks.py``).

A rank reads and checks only the blocks covering its TP slice; ``verify`` checks every byte;
checkpoints written before blocks (whole-tensor SHA-256) still load and verify.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from pathlib import Path

import pytest
import torch

from sailor.checkpoint import (
    Checkpointer,
    CheckpointError,
    CorruptCheckpointError,
    LocalStorage,
    ParamState,
    ReshardError,
    TrainingGlobals,
    load,
    read_manifest,
    save_full,
    tp_slice,
    verify,
)
from sailor.checkpoint import blocks as blocks_mod
from sailor.checkpoint import fetch as fetch_mod
from sailor.checkpoint import reader as reader_mod
from sailor.checkpoint.blocks import (
    MAX_BLOCKS,
    MIN_BLOCK_BYTES,
    block_rows_for,
    default_algorithm,
    plan_read,
)
from sailor.checkpoint.buffers import ScratchPool
from sailor.checkpoint.format import MANIFEST, MARKER, step_dir
from sailor.schemas import Pipeline, Plan, ReplicaGroup, Stage
from sailor.schemas.checkpoint import TENSOR_KINDS

KINDS = TENSOR_KINDS


def _state(seed: int = 0) -> dict[str, ParamState]:
    """Layer 0: a column-parallel (dim 0) and a row-parallel (dim 1) weight of 1 MB each
    (4 blocks of 256 KB), a 768 KB weight split 3 ways (2 blocks), a replicated bias."""
    g = torch.Generator().manual_seed(seed)

    def p(shape: tuple[int, ...], dim: int | None) -> ParamState:
        return ParamState(*(torch.randn(*shape, generator=g) for _ in KINDS), tp_dim=dim)

    return {
        "0.col": p((64, 4096), 0),
        "0.row": p((4096, 64), 1),
        "0.odd": p((48, 4096), 0),
        "0.bias": p((64,), None),
    }


def _save(root: Path, checksum: str | None = None, step: int = 1) -> None:
    save_full(
        LocalStorage(root),
        _state(),
        TrainingGlobals(step, step, {}),
        model="toy",
        num_layers=1,
        save_id=f"s{step}",
        checksum=checksum,
    )


def _flip(path: Path, at: int) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def _shard_path(root: Path, step: int = 1) -> Path:
    return root / step_dir(step) / read_manifest(LocalStorage(root), step).shards[0].path


def test_block_rows_and_read_plans() -> None:
    assert block_rows_for((64, 4096), 0, 64 * 4096 * 4) == 16  # 4 blocks of 256 KB
    assert block_rows_for((4096, 64), 1, 64 * 4096 * 4) == 16  # rows = dim 1
    assert block_rows_for((8, 4), 0, 128) == 8  # small: one block
    assert block_rows_for((1 << 20,), 0, 4 << 20) == (1 << 20) // MAX_BLOCKS
    assert block_rows_for((0, 3), 0, 0) == 1
    big = 64 << 20
    for rows in (1, 3, 48, 64, 1000, 4096):
        br = block_rows_for((rows, 1 << 20), 0, big * rows)
        assert rows % br == 0 and rows // br <= MAX_BLOCKS
    # Power-of-two TP degrees up to the block count read exactly their slice.
    for tp in (1, 2, 4):
        for r in range(tp):
            plan = plan_read(64, 16, r, tp)
            assert plan.exact or tp == 4  # tp=4: 16 rows per rank = one block, exact too
            assert plan.row0 % 16 == 0 and (plan.keep0, plan.keep1) == (
                r * 64 // tp,
                (r + 1) * 64 // tp,
            )
    # Another degree reads the covering blocks.
    plan = plan_read(48, 24, 1, 3)
    assert (plan.row0, plan.row1, plan.keep0, plan.keep1, plan.first_block) == (0, 48, 16, 32, 0)
    assert MIN_BLOCK_BYTES == 256 << 10


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_range_reads_give_the_slices(tmp_path: Path, tp: int) -> None:
    _save(tmp_path)
    shard = read_manifest(LocalStorage(tmp_path), 1).shards[0]
    assert shard.checksum == default_algorithm()
    full = _state()
    total = 0
    for r in range(tp):
        dims = None if tp != 3 else {"0.col": None, "0.row": None}  # 64 does not split 3 ways
        got = load(LocalStorage(tmp_path), [0], tp_rank=r, tp_size=tp, tp_dims=dims)
        for key, p in got.params.items():
            dim = full[key].tp_dim if dims is None else dims.get(key, full[key].tp_dim)
            for k in KINDS:
                want = tp_slice(full[key].tensor(k), dim, r, tp)
                assert torch.equal(p.tensor(k), want), (key, k)
                assert p.tensor(k).is_contiguous()
        total += got.bytes_read
    bias = full["0.bias"].nbytes
    if tp == 2:  # the split tensors are read once in all; the bias by every rank
        assert total == shard.size + bias
    if tp == 4:  # as TP 2, but "odd" has 2 blocks: each block is read by two ranks
        assert total == shard.size + 3 * bias + full["0.odd"].nbytes


def test_flipped_bit_in_a_slice_is_caught_by_the_rank_reading_it(tmp_path: Path) -> None:
    _save(tmp_path)
    s = LocalStorage(tmp_path)
    shard = read_manifest(s, 1).shards[0]
    row = next(t for t in shard.tensors if t.name == "0.row.exp_avg")
    assert row.major_dim == 1 and len(row.blocks) == 4
    # Byte in the last quarter of the stored rows: rank 1 of TP 2 reads it, rank 0 does not.
    at = row.offset + row.nbytes - 100
    _flip(_shard_path(tmp_path), at)
    with pytest.raises(CorruptCheckpointError) as err:
        load(s, [0], tp_rank=1, tp_size=2)
    msg = str(err.value)
    assert err.value.path.endswith(shard.path) and "0.row.exp_avg block 3 of 4" in msg
    # Rank 0 never reads those bytes; its own blocks check out.
    got = load(s, [0], tp_rank=0, tp_size=2)
    assert torch.equal(got.params["0.row"].exp_avg, _state()["0.row"].exp_avg[:, :32])
    # TP 1 reads everything and so catches it; so does verify.
    with pytest.raises(CorruptCheckpointError, match="block 3 of 4"):
        load(s, [0])
    problems = verify(s, 1)
    assert len(problems) == 1 and shard.path in problems[0] and "0.row.exp_avg" in problems[0]


def test_verify_checks_every_byte(tmp_path: Path) -> None:
    _save(tmp_path)
    s = LocalStorage(tmp_path)
    path = _shard_path(tmp_path)
    size = path.stat().st_size
    rng = random.Random(7)
    for at in [0, size - 1, *rng.sample(range(size), 24)]:
        _flip(path, at)
        problems = verify(s, 1)
        assert len(problems) == 1 and path.name in problems[0], at
        _flip(path, at)
    assert verify(s, 1) == []


@pytest.mark.parametrize("mode", ["legacy", "sha256-blocks"])
def test_sha256_checkpoints_still_load_and_verify(tmp_path: Path, mode: str) -> None:
    _save(tmp_path, checksum="sha256")
    d = tmp_path / step_dir(1)
    if mode == "legacy":
        # Rewrite the manifest as written before blocks existed: plain row-major tensors with
        # a whole-tensor SHA-256 and none of the new fields.
        m = read_manifest(LocalStorage(tmp_path), 1)
        doc = json.loads((d / MANIFEST).read_text())
        shard = m.shards[0]
        chunks = []
        digests = []
        for t, e in zip(shard.tensors, doc["shards"][0]["tensors"], strict=True):
            p = _state()[t.key]
            raw = p.tensor(t.kind).contiguous().numpy().tobytes()
            chunks.append(raw)
            e["offset"] = sum(len(c) for c in chunks[:-1])
            e["sha256"] = hashlib.sha256(raw).hexdigest()
            digests.append(e["sha256"])
            for f in ("major_dim", "block_rows", "blocks", "tiled"):
                del e[f]
        (d / shard.path).write_bytes(b"".join(chunks))
        root = hashlib.sha256(b"".join(bytes.fromhex(x) for x in digests)).hexdigest()
        doc["shards"][0]["sha256"] = root
        del doc["shards"][0]["checksum"]
        raw_m = json.dumps(doc, indent=1).encode()
        (d / MANIFEST).write_bytes(raw_m)
        marker = json.loads((d / MARKER).read_text())
        marker["manifest_sha256"] = hashlib.sha256(raw_m).hexdigest()
        marker["manifest_size"] = len(raw_m)
        (d / MARKER).write_text(json.dumps(marker))
        shard2 = read_manifest(LocalStorage(tmp_path), 1).shards[0]
        assert shard2.checksum == "sha256" and all(t.block_rows == 0 for t in shard2.tensors)
    s = LocalStorage(tmp_path)
    assert verify(s, 1) == []
    full = _state()
    for r in range(2):
        got = load(s, [0], tp_rank=r, tp_size=2)
        for key, p in got.params.items():
            for k in KINDS:
                assert torch.equal(
                    p.tensor(k), tp_slice(full[key].tensor(k), full[key].tp_dim, r, 2)
                )
    t = read_manifest(s, 1).shards[0].tensors[5]
    _flip(d / read_manifest(s, 1).shards[0].path, t.offset + 8)
    assert t.name in verify(s, 1)[0]
    with pytest.raises(CorruptCheckpointError, match=t.name):
        load(s, [0], tp_rank=0, tp_size=2)


def _rewrite_manifest(d: Path, doc: dict[str, object]) -> None:
    raw_m = json.dumps(doc, indent=1).encode()
    (d / MANIFEST).write_bytes(raw_m)
    marker = json.loads((d / MARKER).read_text())
    marker["manifest_sha256"] = hashlib.sha256(raw_m).hexdigest()
    marker["manifest_size"] = len(raw_m)
    (d / MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("chunk", [1, 4 << 20])
def test_transposed_block_checkpoints_still_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Checkpoints written with blocks but before tiles stored a tensor with TP dim 1 whole,
    as movedim(1, 0) (``tiled`` absent): they still verify and load for every TP degree."""
    monkeypatch.setattr(fetch_mod, "READ_CHUNK", chunk)
    monkeypatch.setattr(reader_mod, "_TRANSPOSE_BYTES", 16 << 10)
    _save(tmp_path)
    d = tmp_path / step_dir(1)
    m = read_manifest(LocalStorage(tmp_path), 1)
    shard = m.shards[0]
    algo = shard.checksum
    doc = json.loads((d / MANIFEST).read_text())
    data = bytearray((d / shard.path).read_bytes())
    full = _state()
    for t, e in zip(shard.tensors, doc["shards"][0]["tensors"], strict=True):
        del e["tiled"]
        if not t.major_dim:
            continue
        raw = full[t.key].tensor(t.kind).movedim(t.major_dim, 0).contiguous().numpy().tobytes()
        data[t.offset : t.offset + t.nbytes] = raw
        row_bytes = t.nbytes // t.shape[t.major_dim]
        step = t.block_rows * row_bytes
        blocks = [
            blocks_mod.digest(algo, memoryview(raw)[i : i + step]) for i in range(0, len(raw), step)
        ]
        e["blocks"] = blocks
        e["sha256"] = blocks_mod.tensor_digest(blocks)
    (d / shard.path).write_bytes(bytes(data))
    digests = [e["sha256"] for e in doc["shards"][0]["tensors"]]
    doc["shards"][0]["sha256"] = hashlib.sha256(
        b"".join(bytes.fromhex(x) for x in digests)
    ).hexdigest()
    _rewrite_manifest(d, doc)
    s = LocalStorage(tmp_path)
    assert not any(t.tiled for t in read_manifest(s, 1).shards[0].tensors)
    assert verify(s, 1) == []
    for tp in (1, 2, 4):
        for r in range(tp):
            for dims in (None, {"0.row": 0}):
                got = load(s, [0], tp_rank=r, tp_size=tp, tp_dims=dims)
                for key, p in got.params.items():
                    dim = (dims or {}).get(key, full[key].tp_dim)
                    for k in KINDS:
                        want = tp_slice(full[key].tensor(k), dim, r, tp)
                        assert torch.equal(p.tensor(k), want), (tp, r, key, k)


def test_tiles_of_one_block_are_read_straight_into_place(tmp_path: Path) -> None:
    """TP = block count: the rank's slice of a tiled tensor is one tile, read into ``into``."""
    _save(tmp_path)
    row = read_manifest(LocalStorage(tmp_path), 1).shards[0].tensors
    t = next(x for x in row if x.name == "0.row.weight")
    assert t.tiled and t.major_dim == 1 and len(t.blocks) == 4
    full = _state()["0.row"]
    dest = {"0.row": full.map(lambda x: torch.zeros(4096, 16))}
    for r in range(4):
        got = load(LocalStorage(tmp_path), [0], tp_rank=r, tp_size=4, into=dest)
        assert torch.equal(got.params["0.row"].weight, tp_slice(full.weight, 1, r, 4))


def test_missing_algorithm_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path)
    algo = read_manifest(LocalStorage(tmp_path), 1).shards[0].checksum
    monkeypatch.delitem(blocks_mod.ALGORITHMS, algo)
    with pytest.raises(CheckpointError, match=algo) as err:
        load(LocalStorage(tmp_path), [0])
    assert not err.value.retryable


def test_load_into_caller_buffers(tmp_path: Path) -> None:
    _save(tmp_path)
    full = _state()
    dest = {
        k: ParamState(
            *(torch.zeros(*tp_slice(p.tensor(kind), p.tp_dim, 1, 2).shape) for kind in KINDS),
            tp_dim=p.tp_dim,
        )
        for k, p in full.items()
    }
    got = load(LocalStorage(tmp_path), [0], tp_rank=1, tp_size=2, into=dest)
    for key, p in got.params.items():
        for k in KINDS:
            assert p.tensor(k) is dest[key].tensor(k)  # the caller's tensors, filled
            assert torch.equal(p.tensor(k), tp_slice(full[key].tensor(k), full[key].tp_dim, 1, 2))
    bad = {"0.col": ParamState(*(torch.zeros(64, 4096) for _ in KINDS), tp_dim=0)}
    with pytest.raises(ReshardError, match=r"into\['0.col'\]"):
        load(LocalStorage(tmp_path), [0], tp_rank=1, tp_size=2, into=bad)


def one_layer_plan() -> Plan:
    """One rank holding layer 0 of the toy model (a Checkpointer's plan in these tests)."""
    return Plan(
        plan_id="one",
        model="toy",
        global_batch_size=1,
        pipelines=(
            Pipeline(
                stages=(
                    Stage(
                        first_layer=0,
                        last_layer=0,
                        replica=ReplicaGroup(gpu_type="cpu", zone="z", tp=1, gpus_per_node=1),
                    ),
                ),
                microbatch_size=1,
                num_microbatches=1,
            ),
        ),
    )


def test_checkpointer_reuses_its_snapshot_buffers(tmp_path: Path) -> None:
    plan = one_layer_plan()
    state = _state()
    ck = Checkpointer(LocalStorage(tmp_path), plan, 0, keep=2)
    ck.save(state, TrainingGlobals(1, 1, {}))
    first = ck._spare[0]["row"].weight
    ck.wait()
    with torch.no_grad():
        for p in state.values():
            for k in KINDS:
                p.tensor(k).add_(1.0)
    ck.save(state, TrainingGlobals(2, 2, {}))
    assert ck._spare[0]["row"].weight is first  # overwritten in place, not reallocated
    saved = state["0.row"].weight.clone()
    with torch.no_grad():
        state["0.row"].weight.add_(5.0)  # training goes on after the snapshot
    ck.close()
    got = load(LocalStorage(tmp_path), [0], step=2)
    assert torch.equal(got.params["0.row"].weight, saved)
    assert torch.equal(got.params["0.col"].exp_avg, _state()["0.col"].exp_avg + 1.0)
    assert verify(LocalStorage(tmp_path), 1) == [] and verify(LocalStorage(tmp_path), 2) == []


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["fresh", "into", "into-strided"])
def test_chunked_reads_give_the_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int, mode: str
) -> None:
    """Many chunks per tensor (one 256 KB block each) and the transposing copy cut into 16 KB
    pieces: every slice still equals the full tensor's, into fresh tensors, contiguous
    destinations and strided ones, with and without a ``tp_dims`` override."""
    monkeypatch.setattr(fetch_mod, "READ_CHUNK", 1)  # one block per read
    monkeypatch.setattr(reader_mod, "_TRANSPOSE_BYTES", 16 << 10)
    _save(tmp_path)
    full = _state()
    # 64 does not split 3 ways: then col/row are read whole (override to None); with TP 2
    # and 4, "row" is cut along dim 0 instead of its stored dim 1 (override, not ranged).
    dims: dict[str, int | None] = (
        {"0.col": None, "0.row": None} if tp == 3 else {"0.row": 0} if tp in (2, 4) else {}
    )
    for r in range(tp):
        into = None
        if mode != "fresh":
            into = {}
            for key, p in full.items():
                dim = dims.get(key, p.tp_dim)
                shape = tp_slice(p.weight, dim, r, tp).shape
                if mode == "into":
                    ts = [torch.zeros(*shape) for _ in KINDS]
                else:  # every other column of a wider tensor: not contiguous
                    ts = [torch.zeros(*shape[:-1], shape[-1] * 2)[..., ::2] for _ in KINDS]
                into[key] = ParamState(*ts, tp_dim=dim)
        got = load(LocalStorage(tmp_path), [0], tp_rank=r, tp_size=tp, tp_dims=dims, into=into)
        for key, p in got.params.items():
            dim = dims.get(key, full[key].tp_dim)
            for k in KINDS:
                want = tp_slice(full[key].tensor(k), dim, r, tp)
                assert torch.equal(p.tensor(k), want), (key, k, r)
                if into is not None:
                    assert p.tensor(k) is into[key].tensor(k)


def test_chunked_read_names_the_bad_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_mod, "READ_CHUNK", 1)
    _save(tmp_path)
    shard = read_manifest(LocalStorage(tmp_path), 1).shards[0]
    row = next(t for t in shard.tensors if t.name == "0.row.exp_avg")
    block_bytes = row.nbytes // len(row.blocks)
    _flip(_shard_path(tmp_path), row.offset + 3 * block_bytes + 5)  # block 3: TP rank 1 of 2
    got = load(LocalStorage(tmp_path), [0], tp_rank=0, tp_size=2)  # does not read it
    assert torch.equal(got.params["0.row"].exp_avg, tp_slice(_state()["0.row"].exp_avg, 1, 0, 2))
    for tp_rank, tp_size in [(1, 2), (0, 1)]:
        with pytest.raises(CorruptCheckpointError, match=rf"{shard.path}.*0\.row\.exp_avg block 3"):
            load(LocalStorage(tmp_path), [0], tp_rank=tp_rank, tp_size=tp_size)


def test_scratch_pool_reuses_and_bounds() -> None:
    pool = ScratchPool(limit=2)
    a = pool.take(100)
    b = pool.take(50)
    pool.give(a)
    assert pool.take(80) is a  # the smallest that fits
    pool.give(a)
    pool.give(b)
    assert pool.take(10) is b
    c = pool.take(1000)  # none of the free ones fits: a is dropped, a new one allocated
    assert c.numel() == 1000 and pool.held_bytes == 0
    taken = threading.Event()

    def third() -> None:
        pool.give(pool.take(1))
        taken.set()

    th = threading.Thread(target=third)
    th.start()
    assert not taken.wait(0.05)  # two out: the third taker waits
    pool.give(c)
    assert taken.wait(5)
    th.join()
    pool.give(b)
