"""The bytes of an object collective: plain data in a tagged JSON, never a pickle.

The ranks of one job run on different machines, and one of them may be hostile
(``docs/operations.md``): unpickling what a peer sends lets that peer run any code on the
receiver (a pickle names the callables it wants called). What the object collectives
carry is plain data (hosts, save ids, steps, flags, a plan's JSON, timings), so they carry
it as JSON, which names no code at all. JSON has no tuples, bytes or non-string keys; a
JSON object is therefore always a tag with exactly one key:

* ``None``, ``bool``, ``int``, ``float`` (NaN and infinities too), ``str``, ``list``: as
  JSON writes them;
* ``tuple``: ``{"tuple": [...]}``; ``bytes``: ``{"bytes": "<base64>"}``;
  ``dict``: ``{"dict": [[key, value], ...]}`` (keys of any of these types).

Only these exact types are sent (a subclass, an enum, a NumPy scalar or a class raises
``TypeError`` on the sender, naming its type and where it is), so what a rank receives is
what its peer had. Bytes that do not decode to these raise :class:`PeerObjectError`,
naming the sending rank: the sender is at fault, not the receiver. A receiver checks the
shape of what it reads with :func:`expect` (a wrong shape from a peer is that peer's fault
too, not an ``IndexError`` charged to the receiver).
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

__all__ = ["PeerObjectError", "decode", "encode", "expect"]

_Json = None | bool | int | float | str | list["_Json"] | dict[str, "_Json"]


class PeerObjectError(ValueError):
    """A peer's object collective bytes that are not an encoded object (:func:`decode`), or
    a peer that could not send its object: the sending rank's fault (``origin="peer"`` on
    the receiver, ``megatron_patch.errors.classify``). ``rank``: the sender's (global) rank."""

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def encode(obj: Any) -> bytes:
    """``obj``'s bytes; ``TypeError`` naming the first value of a type outside the scheme."""
    return json.dumps(_plain(obj, "obj"), separators=(",", ":")).encode()


def _plain(obj: Any, where: str) -> _Json:
    t = type(obj)
    if obj is None or t in (bool, int, float, str):
        return obj  # type: ignore[no-any-return]
    if t is list:
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if t is tuple:
        return {"tuple": [_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if t is bytes:
        return {"bytes": base64.b64encode(obj).decode()}
    if t is dict:
        return {
            "dict": [
                [_plain(k, f"{where} key"), _plain(v, f"{where}[{k!r}]")] for k, v in obj.items()
            ]
        }
    raise TypeError(
        f"{where}: an object collective sends None, bool, int, float, str, bytes, list, "
        f"tuple and dict only, not {t.__module__}.{t.__qualname__}"
    )


def decode(raw: bytes, rank: int) -> Any:
    """The object of rank ``rank``'s bytes ``raw``; :class:`PeerObjectError` naming the rank
    and what is wrong (not JSON, an unknown tag, a malformed one) if they do not decode."""
    try:
        parsed = json.loads(raw.decode())
        return _value(parsed)
    except PeerObjectError as exc:
        raise PeerObjectError(
            f"rank {rank} sent an object that does not decode: {exc}", rank=rank
        ) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise PeerObjectError(
            f"rank {rank} sent an object that does not decode: {type(exc).__name__}: "
            f"{str(exc)[:200]} (first bytes {raw[:40]!r})",
            rank=rank,
        ) from None


def _value(v: _Json) -> Any:
    if v is None or type(v) in (bool, int, float, str):
        return v
    if isinstance(v, list):
        return [_value(x) for x in v]
    assert isinstance(v, dict)
    if len(v) != 1:
        raise PeerObjectError(f"a tag with keys {sorted(v)[:5]} (exactly one expected)", rank=-1)
    ((tag, body),) = v.items()
    if tag == "tuple" and isinstance(body, list):
        return tuple(_value(x) for x in body)
    if tag == "bytes" and isinstance(body, str):
        try:
            return base64.b64decode(body, validate=True)
        except binascii.Error as exc:
            raise PeerObjectError(f"bytes that are not base64 ({exc})", rank=-1) from None
    if tag == "dict" and isinstance(body, list):
        out: dict[Any, Any] = {}
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise PeerObjectError(
                    f"a dict entry {str(pair)[:80]} (a [key, value] pair expected)", rank=-1
                )
            key = _value(pair[0])
            try:
                hash(key)
            except TypeError:
                raise PeerObjectError(f"an unhashable dict key {str(key)[:80]}", rank=-1) from None
            out[key] = _value(pair[1])
        return out
    raise PeerObjectError(
        f"type tag {str(tag)[:80]!r} with a {type(body).__name__} (tags: tuple, bytes, dict)",
        rank=-1,
    )


Shape = Any
"""What :func:`expect` checks: a type (exactly that type: ``int`` is not ``bool``), ``None``,
a tuple of shapes (a tuple of that length, each element of its shape), or a frozenset of
shapes (any one of them)."""


def _conforms(value: Any, shape: Shape) -> bool:
    if shape is None:
        return value is None
    if isinstance(shape, type):
        return type(value) is shape
    if isinstance(shape, frozenset):
        return any(_conforms(value, s) for s in shape)
    return (
        type(value) is tuple
        and len(value) == len(shape)
        and all(_conforms(v, s) for v, s in zip(value, shape, strict=True))
    )


def _describe(shape: Shape) -> str:
    if shape is None:
        return "None"
    if isinstance(shape, type):
        return shape.__name__
    if isinstance(shape, frozenset):
        return " | ".join(sorted(_describe(s) for s in shape))
    return "(" + ", ".join(_describe(s) for s in shape) + ")"


def expect(value: Any, shape: Shape, rank: int, what: str) -> Any:
    """``value`` (rank ``rank``'s object) if it has ``shape``, else :class:`PeerObjectError`
    naming the rank, ``what`` it should be, the shape and the value."""
    if _conforms(value, shape):
        return value
    raise PeerObjectError(
        f"rank {rank} sent {str(value)[:200]} as {what}: {_describe(shape)} expected", rank=rank
    )
