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


# The spin wait's default on a CUDA device, ms: a frame's step is ~2-3 ms at each stage, so the
# next message is due well inside it. On the H200 under MPS (docs/perf.md, session 22) a
# single-stream frame went 6.55 / 6.45 -> 5.98 / 6.31 ms with it (the hop into the tower 0.47 ->
# 0.27-0.37 ms, the hop back 0.57 -> 0.47-0.50). Off on the CPU: there the stages share a few
# cores, and a spinning loop takes them from the compute.
SPIN_WAIT_MS_CUDA = 10.0


def spin_wait_s(spin_wait_ms: float | None, device: str) -> float:
    """The spin wait in seconds: `spin_wait_ms` if given (0 or less: off), else
    SPIN_WAIT_MS_CUDA on a CUDA device and 0 elsewhere."""
    if spin_wait_ms is None:
        spin_wait_ms = SPIN_WAIT_MS_CUDA if device.startswith("cuda") else 0.0
    return max(0.0, spin_wait_ms) / 1000


class Spinner:
    """Keeps this thread's event loop busy (a task looping on asyncio.sleep(0)) from start() until
    stop() or `max_s` later: while it spins, the loop never sleeps in epoll, so a message that
    arrives meanwhile (grpc's poller thread hands it over through a socket the loop watches)
    runs on the loop's next turn instead of after the loop thread wakes up. A stage starts one when a message
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
