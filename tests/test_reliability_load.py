"""Load (issue #9), the CI-sized run of `bench/load.py`: 8 concurrent progressive requests held for
8 s against the whole stack as separate OS processes (services.launcher.Stack, tiny checkpoint).
Every request must come back whole: no error status, no cut body. The 32 x 60 s run and its
figures are in docs/reliability.md.
"""

from __future__ import annotations

import asyncio

import pytest

from bench.load import body_is_whole, percentile, run_load
from services.launcher import Stack

CONCURRENCY = 8
DURATION_S = 8.0
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with Stack(tiny_checkpoint, 0) as running:
        running.start()
        yield running


def test_body_checks_spot_cut_bodies():
    """The truncation rules of the load generator itself: half samples and short wav headers."""
    assert body_is_whole("pcm", 4096) and not body_is_whole("pcm", 4095)
    assert body_is_whole("wav", 44 + 20) and not body_is_whole("wav", 44 + 21)
    assert not body_is_whole("wav", 30)
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0 and percentile([], 99) is None


def test_concurrent_streams_all_complete(stack):
    """8 concurrent streams for 8 s: zero errors, zero truncated bodies, audio in every body."""
    result = asyncio.run(run_load(stack.url, concurrency=CONCURRENCY, duration_s=DURATION_S,
                                  max_new_tokens=MAX_NEW_TOKENS))
    print("\n" + result.table())
    assert result.errors == 0, result.error_kinds
    assert result.truncated == 0, result.error_kinds
    assert result.requests >= CONCURRENCY
    assert all(o.audio_s > 0 for o in result.outcomes)
    assert result.ttfa_p50_ms is not None and result.throughput > 0
