"""Lines of a worker's output pipe, whatever the worker writes.

``async for line in stream`` raises once a line outgrows the reader's buffer (64 KiB: a
``\\r`` progress bar, a huge warning), and the task reading it dies. Nothing drains the pipe
after that: once it is full the worker blocks on its next write and training stops without
a failure. :func:`lines` hands such a line over in pieces of at most the buffer's size and
goes on reading to the end of the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

__all__ = ["lines"]


async def lines(stream: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """Each line of ``stream`` (with its newline), a line longer than the reader's limit
    in pieces, and the last bytes without a newline, until the end of the stream."""
    while True:
        try:
            line = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:  # the end: what came after the last \n
            if exc.partial:
                yield exc.partial
            return
        except asyncio.LimitOverrunError as exc:  # a line longer than the buffer
            yield await stream.read(max(1, exc.consumed))
            continue
        yield line
