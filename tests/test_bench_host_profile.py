"""bench/host_profile.py: the py-spy raw-sample summary (no py-spy needed here)."""

from __future__ import annotations

from bench import host_profile


def test_summary_per_thread_and_function(tmp_path):
    raw = tmp_path / "backbone.txt"
    raw.write_text(
        "thread (11): MainThread;BaseEventLoop._run_once (base_events.py:1);Handle._run (events.py:2);"
        "parse_job (server.py:10);_token_rows (server.py:60) 30\n"
        "thread (11): MainThread;BaseEventLoop._run_once (base_events.py:1);Handle._run (events.py:2);"
        "parse_job (server.py:12) 10\n"
        "thread (12): engine_0;Thread.run (threading.py:9);step (engine.py:5);step (engine.py:7) 60\n"
        "garbage line without a count\n")
    # 1000 Hz over 2 requests: a sample is 1 ms, so ms per request = samples / 2
    summary = host_profile.summarise(raw, rate=1000, requests=2, top=10, wall_s=0.4)
    assert summary["threads_ms_per_request"] == {"engine_0": 30.0, "MainThread": 20.0}
    assert summary["gil_share_of_wall"] == 0.25               # 100 samples of 1 ms over 0.4 s
    functions = summary["functions_ms_per_request"]
    assert functions["step (engine.py)"] == 30.0             # counted once per sample, not per frame
    assert functions["parse_job (server.py)"] == 20.0         # two lines, one function
    assert functions["_token_rows (server.py)"] == 15.0
    assert functions["Handle._run (events.py)"] == 20.0
    assert "Thread.run (threading.py)" not in functions       # plumbing is left out
    assert "BaseEventLoop._run_once (base_events.py)" not in functions


def test_missing_file_is_an_empty_summary(tmp_path):
    summary = host_profile.summarise(tmp_path / "none.txt", rate=100, requests=1, top=5, wall_s=1.0)
    assert summary == {"threads_ms_per_request": {}, "gil_share_of_wall": 0.0, "functions_ms_per_request": {}}
