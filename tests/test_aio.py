"""services/common/aio.py: waits that never lose a cancel."""

import asyncio

import pytest

from services.common import aio


async def test_wait_event_returns_whether_the_event_was_set():
    event = asyncio.Event()
    assert await aio.wait_event(event, 0.01) is False
    event.set()
    assert await aio.wait_event(event, 1.0) is True


async def test_a_cancel_right_after_the_event_is_set_is_not_lost():
    """The race asyncio.wait_for loses before Python 3.12: the event is set and the waiting task
    cancelled in the same tick. A loop over the wait must end with CancelledError."""
    for hops in range(3):
        event = asyncio.Event()

        async def poll_forever():
            while True:
                await aio.wait_event(event, 0.05)
                event.clear()

        task = asyncio.create_task(poll_forever())
        await asyncio.sleep(0.01)            # the task is waiting
        event.set()
        for _ in range(hops):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2.0)


def test_spin_wait_defaults_to_on_for_cuda_only_and_obeys_an_explicit_value():
    assert aio.spin_wait_s(None, "cuda") == aio.SPIN_WAIT_MS_CUDA / 1000 > 0
    assert aio.spin_wait_s(None, "cuda:1") == aio.SPIN_WAIT_MS_CUDA / 1000
    assert aio.spin_wait_s(None, "cpu") == 0.0
    assert aio.spin_wait_s(0.0, "cuda") == 0.0
    assert aio.spin_wait_s(-3.0, "cuda") == 0.0
    assert aio.spin_wait_s(2.5, "cpu") == 0.0025


async def test_a_spinner_ends_when_stopped_and_never_spins_past_its_limit():
    spinner = aio.Spinner(0.05)
    spinner.start()
    await asyncio.sleep(0.01)
    assert not spinner._task.done()   # spinning: the loop is kept busy
    spinner.stop()
    await asyncio.sleep(0.01)
    assert spinner._task.done()
    spinner.start()
    await asyncio.sleep(0.1)          # past max_s: the task ends on its own
    assert spinner._task.done()
    spinner.close()
