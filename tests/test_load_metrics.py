"""The load generator's stream metrics (issue #8): the playback deficit of a stream played in real
time from its first byte, and the sweep table."""

from __future__ import annotations

import pytest

from bench.load import LoadResult, playback_deficit, sweep_table


def test_a_stream_ahead_of_real_time_has_no_deficit():
    # 0.5 s of audio at once, then 0.5 s more every 0.4 s: always ahead of the player.
    arrivals = [(0.0, 0.5), (0.4, 1.0), (0.8, 1.5), (1.2, 2.0)]
    assert playback_deficit(arrivals) == 0.0


def test_the_deficit_is_the_worst_wait_before_a_piece():
    # 0.2 s of audio, then nothing until 1.0 s: the player waited 0.8 s; later pieces on time.
    arrivals = [(0.0, 0.2), (1.0, 1.2), (1.1, 2.5)]
    assert playback_deficit(arrivals) == pytest.approx(0.8)
    # A second of buffering before playback starts hides it.
    assert playback_deficit(arrivals, buffer_s=1.0) == 0.0


def test_sweep_table_has_one_row_per_level():
    def result(c):
        return LoadResult(concurrency=c, duration_s=1, wall_s=1, requests=c, ok=c, errors=0, truncated=0,
                          error_kinds={}, ttfa_p50_ms=10.0, ttfa_p99_ms=20.0, e2e_p50_ms=1.0,
                          e2e_p99_ms=2.0, audio_s=1.0, throughput=1.0, requests_per_s=1.0,
                          underrun_max_s=0.0, streams_without_underrun=c, rtf_p50=0.5)
    table = sweep_table([result(1), result(8)])
    rows = [line for line in table.splitlines() if line.startswith("| 1 ") or line.startswith("| 8 ")]
    assert len(rows) == 2 and "8 / 8" in rows[1]
