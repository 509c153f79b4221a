"""Nothing lost (issue #9): requests of which 30 % are abandoned by the client at random points
(before the status line, or after some body bytes) against the whole stack as separate OS
processes. Afterwards every stage reports zero open sessions and its cache slots back at the start
value (GetInfo), every request that was not cancelled came back whole, and no process grew
(RSS). CI runs 100 requests; the 1000-request run is `python -m bench.load --requests 1000`
(docs/reliability.md).
"""

from __future__ import annotations

import pytest

from bench.load import nothing_lost, print_nothing_lost
from services.launcher import Stack

REQUESTS = 100
CANCEL_FRACTION = 0.3
CONCURRENCY = 8
MAX_NEW_TOKENS = 6
RSS_GROWTH_LIMIT_MB = 40      # allocator noise on 100 short requests stays well below this


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DRAMA_MAX_ROWS", "16")
        env.setenv("DRAMA_MAX_CONTEXT_TOKENS", "2048")
        with Stack(tiny_checkpoint, 0) as running:
            running.start()
            yield running


def test_cancelled_requests_leave_nothing_behind(stack):
    """100 requests, 30 % cancelled: no session left open, slots back, RSS stable."""
    report = nothing_lost(stack, requests=REQUESTS, cancel_fraction=CANCEL_FRACTION,
                          concurrency=CONCURRENCY, max_new_tokens=MAX_NEW_TOKENS)
    print()
    print_nothing_lost(report)
    result = report["result"]
    assert not result.failed
    assert result.cancelled_before_body + result.cancelled_mid_body == round(CANCEL_FRACTION * REQUESTS)
    assert result.cancelled_mid_body > 0 and result.cancelled_before_body > 0
    assert report["start"]["backbone.open_sessions"] == 0 and report["start"]["tower.open_sessions"] == 0
    assert report["after"] == report["start"]
    for name, before in report["rss_before_mb"].items():
        assert report["rss_after_mb"][name] - before < RSS_GROWTH_LIMIT_MB, (name, before, report["rss_after_mb"])
