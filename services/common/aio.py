"""asyncio helpers shared by the stages (no gRPC, no torch)."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until `event` is set or `timeout_s` passes; True if it is set. Not asyncio.wait_for:
    before Python 3.12 it returns normally when a cancel arrives just after the event was set,
    and the cancel is lost; a task looping on it (a scheduler's lane, the codec's batcher) then
    never ends and whoever closes it waits forever (a CI test hung so in teardown).
    asyncio.wait always lets the cancel through."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait([waiter], timeout=timeout_s)
    finally:
        waiter.cancel()
    return event.is_set()
