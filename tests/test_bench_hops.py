"""bench/hops.py on the CPU: an echo server in its own process and a client, each case's hop
time measured (the H200 numbers come from the lead)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_hops_bench_runs_every_case():
    path = Path(__file__).resolve().parents[1] / "bench" / "hops.py"
    spec = importlib.util.spec_from_file_location("bench_hops", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--rounds", "30", "--compute-ms", "0.5"])
    assert [r["case"] for r in results] == list(bench.CASES)
    for r in results:
        # wall time less both computes: positive, and far below a round's compute if it were not subtracted
        assert 0 < r["median_ms"] < 50, r


def test_hops_bench_carries_a_prompts_rows_over_the_lane():
    """--rows: a request of many hidden rows (a chunk's prompt) round-trips over gRPC and over
    the lane, where it goes through the connection's shared memory."""
    path = Path(__file__).resolve().parents[1] / "bench" / "hops.py"
    spec = importlib.util.spec_from_file_location("bench_hops", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--rounds", "10", "--cases", "bare", "lane-bare", "--rows", "1", "134"])
    assert [(r["case"], r["rows"]) for r in results] == [("bare", 1), ("lane-bare", 1), ("bare", 134),
                                                          ("lane-bare", 134)]
    assert all(0 < r["median_ms"] < 200 for r in results), results
