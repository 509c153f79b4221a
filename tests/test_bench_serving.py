"""The serving benchmarks of issue #8 against a real tiny CPU stack (bench/stack.py in the
background, as the GPU runs use it): batch invariance (the take's codes and the PCM) must hold bit
for bit on the CPU exact path, and the voice-prefix benchmark must run end to end and report its
ratio."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from bench import batch_invariance, stage_metrics, voice_prefix
from bench.load import run_load
from bench.stack import background
from services.common import telemetry


@pytest.fixture(scope="module")
def stack_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-stack-logs")


@pytest.fixture(scope="module")
def stack_url(tiny_checkpoint, stack_logs):
    # The stages print their metric exports (one JSON line each) every 300 ms, as the GPU runs do.
    env = {**os.environ, "OTEL_METRICS_EXPORTER": "console", "OTEL_METRIC_EXPORT_INTERVAL": "300"}
    with background(["--checkpoint", str(tiny_checkpoint), "--device", "cpu", "--max-sessions", "4",
                     "--log-dir", str(stack_logs)], env=env, timeout_s=240) as url:
        yield url


def test_same_seed_gives_the_same_codes_and_audio_alone_and_inside_a_batch(stack_url):
    result = asyncio.run(batch_invariance.run(stack_url, batches=[4], frames=6))
    cases = {c["case"]: c for c in result["cases"]}
    assert cases["alone"]["bytes"] > 0 and cases["alone"]["frames"] > 0
    assert result["deterministic"], result
    for c in result["cases"]:
        assert c["codes_equal"] and c["first_differing_frame"] is None, batch_invariance.table(result)
        assert c["pcm_equal"], batch_invariance.table(result)
    assert result["batch_invariant"] and result["pcm_invariant"], batch_invariance.table(result)
    assert "codes equal to alone" in batch_invariance.table(result)


def test_batch_invariance_compares_codes_frame_by_frame():
    """The codes comparison the GPU verdict rests on: a take that differs in one code, or ends
    early, is not equal, and the first differing frame is named; the table says NO."""
    alone = batch_invariance.Take(b"pcm", [[1, 2, 3, 4], [5, 6, 7, 8]])
    same = batch_invariance.Take(b"other pcm", [[1, 2, 3, 4], [5, 6, 7, 8]])
    late = batch_invariance.Take(b"pcm", [[1, 2, 3, 4], [5, 6, 7, 9]])
    short = batch_invariance.Take(b"pcm", [[1, 2], [5, 6]])
    assert batch_invariance.first_difference(same.codes, alone.codes) is None
    assert batch_invariance.first_difference(late.codes, alone.codes) == 3
    assert batch_invariance.first_difference(short.codes, alone.codes) == 2
    cases = [batch_invariance.case(name, 2, take, alone)
             for name, take in (("alone", alone), ("same codes", same), ("late", late), ("short", short))]
    assert [c["codes_equal"] for c in cases] == [True, True, False, False]
    assert [c["pcm_equal"] for c in cases] == [True, False, True, True]
    result = {"cases": cases, **batch_invariance.verdict(cases)}
    assert not result["deterministic"] and not result["batch_invariant"] and not result["pcm_invariant"]
    text = batch_invariance.table(result)
    assert "| late | 2 | 4 |" in text and "| NO | 3 |" in text and "batch_invariant (codes): false" in text


def test_voice_prefix_benchmark_reports_the_ratio(stack_url):
    result = voice_prefix.measure(stack_url, reference_s=3.0, repeats=1, frames=2)
    assert result["ttfa_ms_no_reference"] > 0 and result["ttfa_ms_reference_cached"] > 0
    assert result["voice_prefix_ttfa_ratio"] == pytest.approx(
        result["ttfa_ms_reference_cached"] / result["ttfa_ms_no_reference"])
    assert "ratio cached / no reference" in voice_prefix.table(result)
    for case in ("no_reference", "cached"):        # the gateway's milestones of those requests
        assert list(result["phases_ms"][case]) == ["admitted", "first_frames", "first_pcm", "first_byte"]


def test_stage_metrics_show_each_stage_busy_during_a_load(stack_url, stack_logs):
    result = asyncio.run(run_load(stack_url, concurrency=2, duration_s=2.0, max_new_tokens=4, formats=("pcm",)))
    assert result.ok >= 2 and result.errors == 0
    time.sleep(1.0)                                 # one more export after the last step
    series = stage_metrics.read_logs(stack_logs)
    rows = stage_metrics.summarise(series, [("load", result.started_unix, result.ended_unix + 0.9)])
    row = rows[0]
    for stage in ("backbone", "tower", "codec"):
        figures = row[stage]
        assert figures is not None and figures["steps"] > 0, (stage, row)
        assert figures["mean_ms"] > 0 and 0 < figures["busy"] <= 1.5, (stage, figures)
    assert row["backbone"]["mean_batch"] >= 1 and row["codec"]["mean_batch"] >= 1
    assert "busy" in stage_metrics.table(rows)
    # the backbone's first-audio milestones, read apart by phase, in order
    phases = stage_metrics.read_logs(stack_logs, split_by=stage_metrics.PHASE_SERIES)
    milestones = stage_metrics.phase_rows(phases, [("load", 0.0, result.ended_unix + 0.9)])[0]
    means = [milestones[p]["mean_ms"] for p in ("admitted", "prompt_sent", "first_frame", "first_message")]
    assert all(m is not None for m in means) and means == sorted(means), milestones
    assert "first_frame" in stage_metrics.phase_table([milestones])


@pytest.mark.parametrize("value, endpoint, expected", [
    (None, None, set()),                     # no collector: nothing exported anywhere
    (None, "http://collector:4317", {"otlp"}),
    ("console", None, {"console"}),
    ("otlp, console", None, {"otlp", "console"}),
    ("none", "http://collector:4317", set()),
    ("prometheus,console", None, {"console"}),   # unsupported names are ignored (with a warning)
])
def test_exporters_follow_the_standard_environment(monkeypatch, value, endpoint, expected):
    for name in ("OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    if value is not None:
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", value)
    if endpoint is not None:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    assert telemetry.exporters("metrics") == expected
