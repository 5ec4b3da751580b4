"""TensorBoard event files, written (and read back) without TensorFlow or ``tensorboard``.

An event file is a sequence of TFRecords (``tensorflow/core/lib/io/record_writer.cc``)::

    uint64 length | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)

little-endian, where ``masked(crc) = ((crc >> 15) | (crc << 17)) + 0xA282EAD8 (mod 2**32)``
and CRC-32C is the Castagnoli polynomial. Each record's data is a protobuf ``Event``
(``tensorflow/core/util/event.proto``): ``wall_time`` (field 1, double), ``step`` (2, int64)
and either ``file_version`` (3, the first record: ``"brain.Event:2"``) or ``summary`` (5), a
``Summary`` whose repeated ``value`` (1) holds ``tag`` (1, string) and ``simple_value``
(2, float). That is all a scalar needs, and TensorBoard reads it like TensorFlow's own
files; the file name only has to contain ``tfevents``.

The writer is for one process (rank 0 logs the run's metrics); :func:`read_events` checks
both CRCs of every record and refuses a corrupt or truncated file naming the byte offset.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

__all__ = ["EventFileWriter", "ScalarEvent", "crc32c", "masked_crc32c", "read_events"]

_FILE_VERSION = b"brain.Event:2"


def _crc_table() -> list[int]:
    poly = 0x82F63B78  # Castagnoli, reflected
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C of ``data`` (``crc32c(b"123456789") == 0xE3069283``)."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf encodes it (two's complement, 10 bytes if < 0)
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field_no: int, wire: int) -> bytes:
    return _varint(field_no << 3 | wire)


def _len_field(field_no: int, payload: bytes) -> bytes:
    return _key(field_no, 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    return _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step) + body


def _scalar_summary(values: dict[str, float]) -> bytes:
    summary = b"".join(
        _len_field(1, _len_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", v))
        for tag, v in values.items()
    )
    return _len_field(5, summary)


def _record(data: bytes) -> bytes:
    head = struct.pack("<Q", len(data))
    return (
        head
        + struct.pack("<I", masked_crc32c(head))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


class EventFileWriter:
    """Appends scalar events to a new ``events.out.tfevents.*`` file in ``logdir``."""

    def __init__(self, logdir: Path | str, suffix: str = "") -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}{suffix}"
        self.path = self.logdir / name
        self._f: BinaryIO | None = self.path.open("ab")
        self._write(_event(now, 0, _len_field(3, _FILE_VERSION)))
        self.flush()

    def _write(self, data: bytes) -> None:
        if self._f is None:
            raise ValueError(f"{self.path}: writer is closed")
        self._f.write(_record(data))

    def add_scalars(
        self, step: int, values: Mapping[str, float | None], wall_time: float | None = None
    ) -> None:
        """One event with a scalar per tag (``None`` values are left out)."""
        vals = {k: float(v) for k, v in values.items() if v is not None}
        if vals:
            self._write(
                _event(time.time() if wall_time is None else wall_time, step, _scalar_summary(vals))
            )

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


@dataclass
class ScalarEvent:
    """One event as read back: its time, step, file version (first event) and scalars."""

    wall_time: float
    step: int
    file_version: str | None = None
    scalars: dict[str, float] = field(default_factory=dict)


class _CorruptError(ValueError):
    pass


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        if i >= len(buf):
            raise _CorruptError("varint runs past the end")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int, int | bytes]]:
    out: list[tuple[int, int, int | bytes]] = []
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        no, wire = key >> 3, key & 7
        val: int | bytes
        if wire == 0:
            val, i = _read_varint(buf, i)
        elif wire == 1:
            val, i = buf[i : i + 8], i + 8
        elif wire == 5:
            val, i = buf[i : i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            val, i = buf[i : i + n], i + n
        else:
            raise _CorruptError(f"wire type {wire} not supported")
        if i > len(buf):
            raise _CorruptError(f"field {no} runs past the end")
        out.append((no, wire, val))
    return out


def _decode_event(data: bytes) -> ScalarEvent:
    ev = ScalarEvent(wall_time=0.0, step=0)
    for no, _, val in _fields(data):
        if no == 1 and isinstance(val, bytes):
            (ev.wall_time,) = struct.unpack("<d", val)
        elif no == 2 and isinstance(val, int):
            ev.step = val - (1 << 64) if val >= 1 << 63 else val
        elif no == 3 and isinstance(val, bytes):
            ev.file_version = val.decode()
        elif no == 5 and isinstance(val, bytes):
            for vno, _, value in _fields(val):
                if vno != 1 or not isinstance(value, bytes):
                    continue
                tag, x = None, None
                for fno, _, fv in _fields(value):
                    if fno == 1 and isinstance(fv, bytes):
                        tag = fv.decode()
                    elif fno == 2 and isinstance(fv, bytes):
                        (x,) = struct.unpack("<f", fv)
                if tag is not None and x is not None:
                    ev.scalars[tag] = x
    return ev


def read_events(path: Path | str) -> list[ScalarEvent]:
    """Every event of a file, CRCs checked; a bad record is refused naming its byte offset."""
    data = Path(path).read_bytes()
    out: list[ScalarEvent] = []
    off = 0
    while off < len(data):
        if off + 12 > len(data):
            raise ValueError(f"{path}: at byte {off}: truncated record header")
        head = data[off : off + 8]
        (n,) = struct.unpack("<Q", head)
        (crc,) = struct.unpack("<I", data[off + 8 : off + 12])
        if crc != masked_crc32c(head):
            raise ValueError(f"{path}: at byte {off}: length CRC mismatch")
        end = off + 12 + n + 4
        if end > len(data):
            raise ValueError(f"{path}: at byte {off}: record of {n} bytes is truncated")
        body = data[off + 12 : off + 12 + n]
        (crc,) = struct.unpack("<I", data[end - 4 : end])
        if crc != masked_crc32c(body):
            raise ValueError(f"{path}: at byte {off + 12}: data CRC mismatch")
        try:
            out.append(_decode_event(body))
        except (_CorruptError, struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: at byte {off + 12}: bad Event: {exc}") from exc
        off = end
    return out
