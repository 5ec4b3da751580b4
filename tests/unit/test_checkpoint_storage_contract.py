"""One contract, every storage backend: a local directory and S3 (moto's server on loopback).

The S3 case needs ``moto[server]`` and ``s3fs``; it is skipped (with the reason) where they are
not installed. Besides the raw object semantics, the contract includes a full checkpoint round
trip (save, commit, list, load resharded, verify, detect corruption, gc) on the backend.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from sailor.checkpoint import (
    CorruptCheckpointError,
    LocalStorage,
    ParamState,
    Storage,
    StorageError,
    TrainingGlobals,
    collect,
    committed_steps,
    load,
    open_storage,
    save_full,
    verify,
)
from sailor.checkpoint.format import step_dir
from sailor.checkpoint.prune import apply_seen_prune, seen_below
from sailor.checkpoint.unrecorded import committed_markers, drop_commit
from sailor.localnet import free_port


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("s3fs", reason="s3fs not installed")
    server_mod = pytest.importorskip("moto.server", reason="moto[server] not installed")
    port = free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


_bucket_counter = iter(range(10**6))


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return open_storage(tmp_path / "ckpt")
    bucket, opts = _new_bucket(request.getfixturevalue("s3_endpoint"))
    return open_storage(f"s3://{bucket}/job", **opts)


def _new_bucket(endpoint: str) -> tuple[str, dict[str, object]]:
    """A fresh bucket on the moto server, and the storage options that reach it."""
    opts = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }
    bucket = f"ckpt-{next(_bucket_counter)}"
    boto3 = pytest.importorskip("boto3")
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    ).create_bucket(Bucket=bucket)
    return bucket, opts


def test_objects_round_trip(storage: Storage) -> None:
    n = storage.write("a/b/x.bin", [b"hello ", memoryview(b"world")])
    assert n == 11
    assert storage.exists("a/b/x.bin")
    assert not storage.exists("a/b/y.bin")
    assert storage.size("a/b/x.bin") == 11
    assert storage.read("a/b/x.bin") == b"hello world"
    assert storage.read("a/b/x.bin", 6, 3) == b"wor"
    buf = bytearray(5)
    assert storage.read_into("a/b/x.bin", memoryview(buf), 6) == 5
    assert bytes(buf) == b"world"
    assert storage.mtime("a/b/x.bin") > 0
    with pytest.raises(FileNotFoundError):
        storage.size("nope")


def test_listing_and_delete(storage: Storage) -> None:
    for p in ["s1/a", "s1/sub/b", "s2/c", "top"]:
        storage.write(p, [b"x"])
    assert storage.listdir("") == ["s1", "s2", "top"]
    assert storage.listdir("s1") == ["a", "sub"]
    assert storage.listdir("missing") == []
    assert storage.walk("s1") == ["s1/a", "s1/sub/b"]
    storage.delete("s1")
    storage.delete("top")
    storage.delete("never-existed")
    assert storage.listdir("") == ["s2"]


def test_move_and_remove_empty(storage: Storage) -> None:
    """``move`` renames one object (replacing one there; FileNotFoundError if absent);
    ``remove_empty`` removes directories holding nothing and leaves the rest."""
    storage.write("s/a", [b"one"])
    storage.write("s/b", [b"two"])
    storage.move("s/a", "s/.a.hidden")
    assert not storage.exists("s/a") and storage.read("s/.a.hidden") == b"one"
    storage.move("s/.a.hidden", "s/b")
    assert storage.read("s/b") == b"one" and storage.walk("s") == ["s/b"]
    with pytest.raises(FileNotFoundError):
        storage.move("s/missing", "s/x")
    assert not storage.exists("s/x")
    storage.move("s/b", "t/deeper/b")  # into a directory not made yet
    storage.move("t/deeper/b", "s/b")
    storage.write("e/sub/x", [b"x"])
    storage.delete("e/sub/x")
    storage.remove_empty("s")
    storage.remove_empty("e")
    storage.remove_empty("t")
    storage.remove_empty("never-existed")
    assert storage.listdir("") == ["s"] and storage.read("s/b") == b"one"
    storage.delete("s/b")
    storage.remove_empty("s")
    assert storage.listdir("") == []


def test_a_write_into_a_directory_removed_meanwhile_succeeds(tmp_path: Path) -> None:
    """A step directory emptied and removed (``remove_empty``) between a writer making it
    and opening its file there: the write makes it again instead of failing."""
    s = open_storage(tmp_path)
    assert isinstance(s, LocalStorage)
    real = s._mkdirs
    calls = iter(range(10**6))

    def mkdirs_then_removed(d: Path) -> None:
        real(d)
        if next(calls) % 2 == 0:  # every other making: the retry's stays
            s.remove_empty(str(d.relative_to(tmp_path)))  # another process's, right then

    s._mkdirs = mkdirs_then_removed  # type: ignore[method-assign]
    assert s.write("step/obj", [b"x"]) == 1
    assert s.write_all([("fresh/a", [b"a"]), ("fresh/b", [b"b"])]) == [1, 1]
    assert s.walk("step") == ["step/obj"] and s.walk("fresh") == ["fresh/a", "fresh/b"]


def test_write_overwrites_whole_object(storage: Storage) -> None:
    storage.write("o", [b"a" * 100])
    storage.write("o", [b"b" * 10])
    assert storage.read("o") == b"b" * 10


def test_failed_write_leaves_nothing_visible(storage: Storage) -> None:
    def chunks() -> Iterator[bytes]:
        yield b"partial" * 1000
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError):
        storage.write("d/obj", chunks())
    assert not storage.exists("d/obj")
    assert [p for p in storage.walk("d") if p.endswith("obj")] == []


def test_write_all_and_ranged_reads(storage: Storage) -> None:
    blobs = {f"w/obj{i}": bytes(range(256)) * (i + 1) * 64 for i in range(5)}
    sizes = storage.write_all([(p, [b[:100], memoryview(b)[100:]]) for p, b in blobs.items()])
    assert sizes == [len(b) for b in blobs.values()]
    assert storage.walk("w") == sorted(blobs)
    reader = storage.open_read("w/obj4")
    try:
        data = blobs["w/obj4"]
        assert reader.size == len(data)
        # Ranges read concurrently through one handle, the last one short.
        starts = list(range(0, len(data), 4000))
        bufs = [bytearray(4096) for _ in starts]
        with ThreadPoolExecutor(4) as pool:
            got = list(
                pool.map(
                    lambda i: reader.read_into(memoryview(bufs[i]), starts[i]), range(len(starts))
                )
            )
        for start, buf, n in zip(starts, bufs, got, strict=True):
            assert n == min(4096, len(data) - start)
            assert bytes(buf[:n]) == data[start : start + n]
    finally:
        reader.close()
    with pytest.raises(FileNotFoundError):
        storage.open_read("w/missing")


def test_large_unaligned_range_reads(storage: Storage) -> None:
    """Reads of 1-16 MB at unaligned offsets (locally these go around the page cache with
    O_DIRECT, through an aligned buffer), concurrently, including a short one at the end."""
    data = torch.randint(0, 256, (9 << 20,), generator=torch.Generator().manual_seed(1))
    raw = data.to(torch.uint8).numpy().tobytes()
    storage.write("big/obj", [raw])
    reader = storage.open_read("big/obj")
    try:
        ranges = [
            (0, 1 << 20),
            (4097, 3 << 20),
            (12345, (2 << 20) + 3),
            (len(raw) - (1 << 20) - 7, 2 << 20),
        ]

        def one(r: tuple[int, int]) -> tuple[int, bytes]:
            buf = bytearray(r[1])
            n = reader.read_into(memoryview(buf), r[0])
            return n, bytes(buf[:n])

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, ranges))
        for (start, length), (n, b) in zip(ranges, got, strict=True):
            assert n == min(length, len(raw) - start)
            assert b == raw[start : start + n]
    finally:
        reader.close()


def test_local_reader_falls_back_when_direct_io_is_refused(tmp_path: Path) -> None:
    from sailor.checkpoint.local_read import LocalReader

    raw = bytes(range(256)) * (8 << 12)  # 8 MB
    (tmp_path / "obj").write_bytes(raw)
    reader = LocalReader(tmp_path / "obj")
    if reader._dfd < 0:
        reader.close()
        pytest.skip("this file system refuses O_DIRECT at open: nothing to fall back from")

    def refuse(buf: memoryview, start: int) -> int:
        raise OSError(22, "Invalid argument")  # what a file system without O_DIRECT says

    reader._direct = refuse  # type: ignore[method-assign]
    reader._residency = None  # the file was just written: pretend it is not cached
    try:
        buf = bytearray(2 << 20)
        assert reader.read_into(memoryview(buf), 1001) == len(buf)
        assert bytes(buf) == raw[1001 : 1001 + len(buf)]
        assert reader._dfd == -1  # buffered from now on
    finally:
        reader.close()


def test_local_reader_sees_what_the_page_cache_holds(tmp_path: Path) -> None:
    from sailor.checkpoint.local_read import LocalReader

    path = tmp_path / "obj"
    path.write_bytes(bytes(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    reader = LocalReader(path)
    try:
        if reader._residency is None or not reader._residency._addr:
            pytest.skip("no O_DIRECT or no mincore here")
        assert not reader._residency.cached(0, 2 << 20)  # evicted: read around the cache
        buf = bytearray(2 << 20)
        reader._buffered(memoryview(buf), 0)  # now the first 2 MB are cached
        assert reader._residency.cached(4096, 1 << 20)
    finally:
        reader.close()


def test_failed_write_all_leaves_that_object_invisible(storage: Storage) -> None:
    def bad() -> Iterator[bytes]:
        yield b"partial" * 1000
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError):
        storage.write_all([("f/good", [b"fine"]), ("f/bad", bad())])
    assert not storage.exists("f/bad")
    # Nothing torn is visible: whatever exists under f/ is a complete object.
    for path in storage.walk("f"):
        assert path == "f/good" and storage.read(path) == b"fine"


def _state(seed: int) -> dict[str, ParamState]:
    g = torch.Generator().manual_seed(seed)

    def p(*shape: int, tp_dim: int | None) -> ParamState:
        return ParamState(*(torch.randn(*shape, generator=g) for _ in range(3)), tp_dim=tp_dim)

    return {
        "0.embed.weight": p(16, 8, tp_dim=0),
        "1.fc.weight": p(12, 8, tp_dim=0),
        "1.fc.bias": p(12, tp_dim=0),
        "1.out.weight": p(8, 12, tp_dim=1),
        "1.norm.weight": p(8, tp_dim=None),
        "2.head.weight": p(16, 8, tp_dim=0),
    }


def test_checkpoint_round_trip(storage: Storage) -> None:
    full = _state(0)
    for step in (3, 6):
        save_full(
            storage,
            full,
            TrainingGlobals(step, step * 8, {"lr": 0.1, "seed": 7}),
            model="toy",
            num_layers=3,
            save_id=f"s{step}",
            keep=1,
        )
    assert committed_steps(storage) == [6]
    got = load(storage, [1], tp_rank=1, tp_size=2)
    assert set(got.params) == {"1.fc.weight", "1.fc.bias", "1.out.weight", "1.norm.weight"}
    assert torch.equal(got.params["1.fc.weight"].exp_avg, full["1.fc.weight"].exp_avg[6:])
    assert torch.equal(got.params["1.out.weight"].weight, full["1.out.weight"].weight[:, 6:])
    assert torch.equal(got.params["1.norm.weight"].exp_avg_sq, full["1.norm.weight"].exp_avg_sq)
    assert got.globals == TrainingGlobals(6, 48, {"lr": 0.1, "seed": 7})
    assert verify(storage, 6) == []

    # A truncated shard is named by verify and refused by load.
    shard = got.manifest.shard_of(1).path
    path = f"{step_dir(6)}/{shard}"
    storage.write(path, [storage.read(path)[:-4]])
    problems = verify(storage, 6)
    assert len(problems) == 1 and shard in problems[0] and "size" in problems[0]
    with pytest.raises(CorruptCheckpointError, match=shard):
        load(storage, [1])
    assert load(storage, [0, 2]).params.keys() == {"0.embed.weight", "2.head.weight"}

    # Debris of a save that never committed is invisible, then collected.
    storage.write(f"{step_dir(9)}/layer-00000-x.bin", [b"junk"])
    assert committed_steps(storage) == [6]
    assert collect(storage) == [f"{step_dir(9)}/"]
    assert storage.listdir("") == [step_dir(6)]


def test_an_object_another_process_wrote_is_seen_after_a_listing(s3_endpoint: str) -> None:
    """s3fs caches a directory listing: a committer that listed a step directory and then
    polled for the other writers' parts saw none of them (``exists`` answered from it)."""
    bucket, opts = _new_bucket(s3_endpoint)
    a = open_storage(f"s3://{bucket}/job", **opts)
    b = open_storage(f"s3://{bucket}/job", **opts)  # another rank's process
    a.write("step-1/part-0.json", [b"x"])
    assert a.walk("step-1") == ["step-1/part-0.json"]  # a listing a now holds
    b.write("step-1/part-1.json", [b"y"])
    assert a.exists("step-1/part-1.json")


@pytest.mark.parametrize(
    "path",
    [
        "../outside.bin",
        "step-000000001/../../outside.bin",
        "/nonexistent-sailor-test/x.bin",
        "a/..",
        "..",
    ],
)
def test_a_path_out_of_the_root_is_refused(storage: Storage, path: str) -> None:
    """Paths come from manifests too (data read back from storage): one that leaves the root
    is refused by name, whatever the call, before the backend is asked."""
    for call in (
        lambda: storage.read(path),
        lambda: storage.size(path),
        lambda: storage.exists(path),
        lambda: storage.open_read(path),
        lambda: storage.write(path, [b"x"]),
        lambda: storage.delete(path),
    ):
        with pytest.raises(StorageError, match=r"not a path under the storage root") as exc:
            call()
        assert repr(path) in str(exc.value) and not exc.value.retryable


def test_deletions_by_what_was_seen(storage: Storage) -> None:
    """A commit given up on (``unrecorded.drop_commit``) and the steps below a prune point
    (``prune.apply_seen_prune``) go by what was seen, on every backend: all of the commit
    seen, nothing of the step committed again since."""
    g = TrainingGlobals(1, 1, {})
    for step in (1, 2, 3):
        g = TrainingGlobals(step, step, {})
        save_full(storage, _state(step), g, model="m", num_layers=3, save_id=f"s{step}")
    markers = committed_markers(storage)
    below = seen_below(storage, 3)
    save_full(storage, _state(9), TrainingGlobals(2, 2, {}), model="m", num_layers=3, save_id="b")
    assert drop_commit(storage, 2, markers[2]) is False  # committed again since: left whole
    assert apply_seen_prune(storage, below, below_step=3, committed_step=3) == [f"{step_dir(1)}/"]
    assert storage.walk(step_dir(1)) == [] and committed_steps(storage) == [2, 3]
    assert verify(storage, 2) == []
    assert drop_commit(storage, 2, committed_markers(storage)[2]) is True
    assert committed_steps(storage) == [3]
    # that commit's files only: the earlier save of the step left its own (gc's debris)
    left = storage.walk(step_dir(2))
    assert left and all("s2" in f.rsplit("/", 1)[-1] for f in left), left
