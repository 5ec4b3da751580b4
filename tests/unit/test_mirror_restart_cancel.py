"""A mirror's restart passes its caller's cancellation on (no servers: the restart's wait
for its old watch is what is tested; the mirror over a real etcd is
tests/integration/test_runtime_contract.py and test_runtime_failures.py)."""

from __future__ import annotations

import asyncio

from sailor.coordination.mirror import PrefixMirror


class _NoStore:
    """Never reached: a restart whose caller was cancelled reads nothing."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the store was used ({name}) after the caller's cancel")


async def test_a_cancel_while_the_old_watch_ends_is_not_swallowed() -> None:
    """The restart cancels its old watch and waits for it. A cancel of the caller (the
    controller's check task, closing) arriving meanwhile was swallowed with the watch's own
    end (``suppress(BaseException)``): the restart went on to re-read etcd and start a new
    watch."""
    mirror = PrefixMirror(_NoStore(), "/sailor/t/nodes/")  # type: ignore[arg-type]

    async def slow_to_end() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)  # a watch that takes a moment to end
            raise

    mirror._watch = asyncio.create_task(slow_to_end())
    await asyncio.sleep(0)
    restart = asyncio.create_task(mirror._restart())
    await asyncio.sleep(0.05)  # inside the restart's wait for the old watch
    restart.cancel()
    done, _ = await asyncio.wait({restart}, timeout=2.0)
    assert done and restart.cancelled()
