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


class Spinner:
    """Keeps this thread's event loop busy (a task looping on asyncio.sleep(0)) from start() until
    stop() or `max_s` later: while it spins, the loop never sleeps in epoll, so a message that
    arrives meanwhile (grpc's poller thread hands it over with call_soon_threadsafe) runs on the
    loop's next turn instead of after the loop thread wakes up. A stage starts one when a message
    is due within milliseconds (the tower's next request, the backbone's next frame) and stops it
    when the message is in. It costs a CPU core while it spins, never longer than `max_s`.

    Why (bench/hops.py, 2-core dev box, session 21): a round trip of the Tower.Step messages takes
    0.23 ms back to back, 0.72 ms when each side computes 2.5 ms in between, 0.48 ms when the
    waiting side's loop spins instead of sleeping."""

    def __init__(self, max_s: float):
        self.max_s = max_s
        self._until = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._until = loop.time() + self.max_s
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._spin(), name="spinner")

    def stop(self) -> None:
        self._until = 0.0

    def close(self) -> None:
        self.stop()
        if self._task is not None:
            self._task.cancel()

    async def _spin(self) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < self._until:
            await asyncio.sleep(0)
