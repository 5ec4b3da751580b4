"""Storage backends for checkpoints: a small interface, a local directory and fsspec (S3).

The checkpoint code needs only whole-object semantics: write an object so that it appears
complete or not at all (or several at once, in parallel, all durable on return), read it or
byte ranges of it through one open handle, list, stat, delete. Local files get that from
write-to-temp + fsync + rename; object stores get it from PUT / multipart-complete and ranged
GETs. Paths are '/'-separated and relative to the backend's root, and stay under it: a path
that is absolute or has a '..' part is refused (:func:`confined`), whoever
built it (a manifest names its shards' paths, and a manifest is data read from storage).

This module must never interpret checkpoint contents; it moves bytes.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sailor.checkpoint.errors import StorageError
from sailor.checkpoint.local_read import LocalReader
from sailor.durable import fsync_dir, make_dirs_durably

__all__ = ["FsspecStorage", "LocalStorage", "RangeReader", "Storage", "confined", "open_storage"]

Chunk = bytes | bytearray | memoryview


def confined(path: str) -> str:
    """``path`` if it stays under a backend's root; else StorageError (not retryable) naming
    it. '' is the root itself."""
    parts = path.split("/")
    if path.startswith("/") or ".." in parts or "\0" in path:
        raise StorageError(
            f"path={path!r}: not a path under the storage root (absolute, a '..' part or a "
            "NUL); checkpoint paths are '/'-separated and relative",
            retryable=False,
        )
    return path


@runtime_checkable
class RangeReader(Protocol):
    """One object opened for range reads; ``read_into`` may be called from several threads."""

    size: int
    """Bytes of the object when it was opened."""

    def read_into(self, buf: memoryview, start: int) -> int:
        """Fill ``buf`` from byte ``start``; returns bytes read (short at the end)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """Whole-object storage rooted at ``url``."""

    url: str

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        """Write an object from chunks; it becomes visible complete or not at all. Returns bytes."""
        ...

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        """Read ``length`` bytes from ``start`` (all to the end if None)."""
        ...

    def write_all(
        self, objects: Sequence[tuple[str, Iterable[Chunk]]], *, workers: int = 4
    ) -> list[int]:
        """Write several objects, up to ``workers`` at a time (each object's chunks are
        consumed on one thread). Each appears complete or not at all; all are durable when
        this returns. If it raises, some objects may exist, none torn. Returns bytes of each."""
        ...

    def read_into(self, path: str, buf: memoryview, start: int = 0) -> int:
        """Fill ``buf`` from ``start``; returns bytes read (short if the object is shorter)."""
        ...

    def open_read(self, path: str) -> RangeReader:
        """Open an object for many range reads; FileNotFoundError if absent."""
        ...

    def size(self, path: str) -> int:
        """Bytes of an object; raises FileNotFoundError if absent."""
        ...

    def exists(self, path: str) -> bool: ...

    def listdir(self, prefix: str = "") -> list[str]:
        """Direct children (names, no slash) of the directory ``prefix``; [] if absent."""
        ...

    def walk(self, prefix: str) -> list[str]:
        """Every object under ``prefix``, as paths relative to the root."""
        ...

    def mtime(self, path: str) -> float:
        """Last-modified Unix time of an object."""
        ...

    def delete(self, prefix: str) -> None:
        """Delete an object or everything under a directory; no error if absent."""
        ...

    def move(self, src: str, dst: str) -> None:
        """Give the object ``src`` the name ``dst`` (replacing an object there);
        FileNotFoundError if ``src`` is absent. Atomic on a file system (a rename: another
        process sees the object under one name, never both or neither); on an object store
        a copy then a delete of ``src``."""
        ...

    def remove_empty(self, prefix: str) -> None:
        """Remove the directory ``prefix`` and the directories under it that hold no object
        (deepest first); one holding an object, even one written meanwhile, stays, and no
        error. Nothing to do where directories do not exist (object stores)."""
        ...


class LocalStorage:
    """A directory on a local or shared file system."""

    def __init__(self, root: str | Path, fsync: bool = True) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)

    def _p(self, path: str) -> Path:
        return self.root / confined(path) if path else self.root

    def _mkdirs(self, d: Path) -> None:
        """Create ``d`` and its missing parents; with fsync, each new directory's entry is
        made durable in its parent (a committed step must not vanish with its directory
        after a power loss)."""
        if d.is_dir():
            return
        if self.fsync:
            make_dirs_durably(d, sync=_fsync_dir)
        else:
            d.mkdir(parents=True, exist_ok=True)

    def _create(self, tmp: Path) -> io.FileIO:
        """``tmp`` opened for writing, its directory made again if it went since
        ``_mkdirs`` (``remove_empty`` of another process: a step directory emptied by the
        deletion of a save given up on, while this one is about to write into it)."""
        for _ in range(3):
            try:
                return tmp.open("wb", buffering=0)
            except FileNotFoundError:
                self._mkdirs(tmp.parent)
        return tmp.open("wb", buffering=0)

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        dst = self._p(path)
        self._mkdirs(dst.parent)
        # A temp name in the same directory, so the rename is atomic; gc removes leftovers.
        tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
        n = 0
        try:
            with self._create(tmp) as f:
                for c in chunks:
                    n += _write_fully(f, c)
                if self.fsync:
                    os.fsync(f.fileno())
            tmp.replace(dst)
            if self.fsync:
                _fsync_dir(dst.parent)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StorageError(f"cannot write {dst}: {exc}", retryable=True) from exc
        return n

    def write_all(
        self, objects: Sequence[tuple[str, Iterable[Chunk]]], *, workers: int = 4
    ) -> list[int]:
        # Temp files written and fsync'd on parallel threads (the page-cache copies, the
        # callers' chunk generators and the flushes overlap), then renamed, then each
        # directory fsync'd once, instead of a write-fsync-rename-fsync round per file.
        # 8 files of 37 MB: 0.26 s one after the other with an fsync each, 0.18-0.24 s this
        # way; one plain 0.3 GB file: 0.18-0.22 s (this VM's ext4 disk, same run).
        todo = [(self._p(path), chunks) for path, chunks in objects]
        tmps: list[Path | None] = [None] * len(todo)

        for d in sorted({dst.parent for dst, _c in todo}):
            self._mkdirs(d)

        def one(i: int) -> int:
            dst, chunks = todo[i]
            tmp = dst.with_name(f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
            tmps[i] = tmp
            try:
                with self._create(tmp) as f:
                    n = sum(_write_fully(f, c) for c in chunks)
                    if self.fsync:
                        os.fsync(f.fileno())
            except OSError as exc:
                raise StorageError(f"cannot write {dst}: {exc}", retryable=True) from exc
            return n

        try:
            with ThreadPoolExecutor(max(1, min(workers, len(todo))), "ckpt-write") as pool:
                sizes = list(pool.map(one, range(len(todo))))
            for i, (dst, _chunks) in enumerate(todo):
                tmp, tmps[i] = tmps[i], None
                if tmp is not None:
                    try:
                        tmp.replace(dst)
                    except OSError as exc:
                        tmps[i] = tmp
                        raise StorageError(f"cannot write {dst}: {exc}", retryable=True) from exc
        except BaseException:
            for tmp in tmps:
                if tmp is not None:
                    with contextlib.suppress(OSError):
                        tmp.unlink()
            raise
        if self.fsync:
            for d in sorted({dst.parent for dst, _c in todo}):
                _fsync_dir(d)
        return sizes

    def open_read(self, path: str) -> RangeReader:
        return LocalReader(self._p(path))

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        with self._p(path).open("rb") as f:
            f.seek(start)
            return f.read() if length is None else f.read(length)

    def read_into(self, path: str, buf: memoryview, start: int = 0) -> int:
        with self._p(path).open("rb", buffering=0) as f:
            f.seek(start)
            got = 0
            while got < len(buf):
                n = f.readinto(buf[got:])
                if not n:
                    break
                got += n
            return got

    def size(self, path: str) -> int:
        return self._p(path).stat().st_size

    def exists(self, path: str) -> bool:
        return self._p(path).exists()

    def listdir(self, prefix: str = "") -> list[str]:
        p = self._p(prefix)
        return sorted(c.name for c in p.iterdir()) if p.is_dir() else []

    def walk(self, prefix: str) -> list[str]:
        p = self._p(prefix)
        if p.is_file():
            return [prefix]
        if not p.is_dir():
            return []
        return sorted(str(f.relative_to(self.root)) for f in p.rglob("*") if f.is_file())

    def mtime(self, path: str) -> float:
        return self._p(path).stat().st_mtime

    def delete(self, prefix: str) -> None:
        p = self._p(prefix)
        if p.is_dir():
            _rmtree(p)
        else:
            try:
                p.unlink()
            except FileNotFoundError:
                return
            except OSError as exc:
                raise StorageError(f"cannot delete {p}: {exc}", retryable=True) from exc
        if self.fsync and p.parent.is_dir():
            # durable before what follows (a commit marker is deleted before its shards)
            _fsync_dir(p.parent)

    def move(self, src: str, dst: str) -> None:
        s, d = self._p(src), self._p(dst)
        if not s.is_file():
            raise FileNotFoundError(f"{s}: no such object")
        self._mkdirs(d.parent)
        try:
            s.replace(d)  # FileNotFoundError as is: gone since (the caller's "absent")
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise StorageError(f"cannot move {s} to {d}: {exc}", retryable=True) from exc
        if self.fsync:
            _fsync_dir(d.parent)

    def remove_empty(self, prefix: str) -> None:
        p = self._p(prefix)
        if not p.is_dir():
            return
        try:
            dirs = [q for q in p.rglob("*") if q.is_dir()]
        except OSError:  # changed under the listing (a writer, another deleter)
            dirs = []
        for q in [*sorted(dirs, key=lambda q: -len(q.parts)), p]:
            try:
                q.rmdir()  # fails on a directory holding anything: atomic against writers
            except OSError:
                continue
        if self.fsync and p.parent.is_dir():
            _fsync_dir(p.parent)


class FsspecStorage:
    """Any fsspec file system, e.g. ``s3://bucket/prefix`` through s3fs.

    Objects are written with one streamed PUT (multipart above fsspec's block size), which
    the store makes visible only when complete, so no temp-and-rename is needed.
    """

    def __init__(self, url: str, **options: Any) -> None:
        import fsspec  # deferred: only object-storage users need it

        self.url = url.rstrip("/")
        fs, root = fsspec.core.url_to_fs(self.url, **options)
        self.fs = fs
        self.root = root.rstrip("/")

    def _p(self, path: str) -> str:
        return f"{self.root}/{confined(path)}" if path else self.root

    def write(self, path: str, chunks: Iterable[Chunk]) -> int:
        n = 0
        f = self.fs.open(self._p(path), "wb")
        try:
            for c in chunks:
                f.write(c)
                n += len(c)
        except BaseException:
            # Not ``with``: leaving a ``with`` block on an exception would close() the file,
            # which *completes* the upload and publishes a torn object. discard() aborts it.
            f.discard()
            f.closed = True  # or __del__ would close() and upload what is buffered
            raise
        try:
            f.close()
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot write {self.url}/{path}: {exc}", retryable=True) from exc
        return n

    def write_all(
        self, objects: Sequence[tuple[str, Iterable[Chunk]]], *, workers: int = 4
    ) -> list[int]:
        # Each object is its own PUT (visible only when complete), so parallel uploads need
        # nothing more; durable once the store acknowledged them.
        with ThreadPoolExecutor(max(1, min(workers, len(objects))), "ckpt-put") as pool:
            return list(pool.map(lambda o: self.write(o[0], o[1]), objects))

    def open_read(self, path: str) -> RangeReader:
        return _FsspecReader(self, path, self.size(path))

    def read(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        end = None if length is None else start + length
        data: bytes = self.fs.cat_file(self._p(path), start=start, end=end)
        return data

    def read_into(self, path: str, buf: memoryview, start: int = 0) -> int:
        data = self.read(path, start, len(buf))
        buf[: len(data)] = data
        return len(data)

    def size(self, path: str) -> int:
        return int(self.fs.size(self._p(path)))

    def exists(self, path: str) -> bool:
        # another process may have written it since this one listed its directory: s3fs
        # answers from that listing (a committer polling for parts would never see them)
        p = self._p(path)
        self.fs.invalidate_cache(p)
        return bool(self.fs.exists(p))

    def listdir(self, prefix: str = "") -> list[str]:
        try:
            names = self.fs.ls(self._p(prefix), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        base = self._p(prefix).rstrip("/") + "/"
        return sorted({n[len(base) :].split("/")[0] for n in names if n.startswith(base)} - {""})

    def walk(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self._p(prefix))
        except FileNotFoundError:
            return []
        cut = len(self.root) + 1
        return sorted(f[cut:] for f in found)

    def mtime(self, path: str) -> float:
        info = self.fs.info(self._p(path))
        m = info.get("LastModified") or info.get("mtime") or info.get("created") or 0.0
        return float(m.timestamp()) if hasattr(m, "timestamp") else float(m)

    def delete(self, prefix: str) -> None:
        files = self.walk(prefix)
        if files:
            self.fs.rm([self._p(f) for f in files])
        self.fs.invalidate_cache()

    def move(self, src: str, dst: str) -> None:
        s = self._p(src)
        self.fs.invalidate_cache(s)
        if not self.fs.exists(s):
            raise FileNotFoundError(f"{self.url}/{src}")
        # a server-side copy, then a delete: no atomic rename on an object store
        self.fs.mv(s, self._p(dst))
        self.fs.invalidate_cache()

    def remove_empty(self, prefix: str) -> None:
        pass  # no directories: a prefix goes with its last object


class _FsspecReader:
    """Range reads of one object: each ``read_into`` is one ranged GET (``Range: bytes=a-b``),
    issued concurrently when called from several threads; the size is taken once (HEAD)."""

    def __init__(self, storage: FsspecStorage, path: str, size: int) -> None:
        self._storage = storage
        self._path = path
        self.size = size

    def read_into(self, buf: memoryview, start: int) -> int:
        n = max(0, min(len(buf), self.size - start))
        if n == 0:
            return 0
        return self._storage.read_into(self._path, buf[:n], start)

    def close(self) -> None:
        pass


def open_storage(url: str | Path, **options: Any) -> Storage:
    """A backend for a plain path / file:// URL (local) or any other fsspec URL."""
    s = str(url)
    if s.startswith("file://"):
        return LocalStorage(s[len("file://") :], **options)
    if "://" not in s:
        return LocalStorage(s, **options)
    return FsspecStorage(s, **options)


def _write_fully(f: Any, c: Chunk) -> int:
    # An unbuffered write may be short (Linux caps one write at 2 GiB - 4 KiB): loop.
    mv = memoryview(c).cast("B")
    done = 0
    while done < len(mv):
        done += f.write(mv[done:])
    return done


def _fsync_dir(d: Path) -> None:
    """Make the entries of directory ``d`` durable (a rename, a new file or subdirectory,
    a deletion; :func:`sailor.durable.fsync_dir`): skipped where the file system does not
    support it (``FSYNC_UNSUPPORTED``), a ``StorageError`` for any other failure: swallowing
    an EIO would report a step committed whose marker may live only in the page cache."""
    try:
        fsync_dir(d, skip_unsupported=True)
    except OSError as exc:
        # os.open's error names the directory, os.fsync's does not
        what = "open directory {} to fsync it" if exc.filename is not None else "fsync directory {}"
        raise StorageError(f"cannot {what.format(d)}: {exc}", retryable=True) from exc


def _rmtree(p: Path) -> None:
    """Delete the directory ``p`` and everything in it; a ``StorageError`` naming the paths
    that could not be deleted (the first few), after deleting what could be. An entry gone
    meanwhile (another deleter) is no failure."""
    failed: list[str] = []

    def failure(path: str, exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            failed.append(f"{path}: {exc}")

    if sys.version_info >= (3, 12):
        shutil.rmtree(p, onexc=lambda _f, path, exc: failure(path, exc))
    else:
        shutil.rmtree(p, onerror=lambda _f, path, info: failure(path, info[1]))
    if failed:
        more = f" (and {len(failed) - 3} more)" if len(failed) > 3 else ""
        raise StorageError(f"cannot delete {p}: {'; '.join(failed[:3])}{more}", retryable=True)
