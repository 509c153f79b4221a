"""The serving benchmarks of issue #8 against a real tiny CPU stack (bench/stack.py in the
background, as the GPU runs use it): batch invariance must hold bit for bit on the CPU exact path,
and the voice-prefix benchmark must run end to end and report its ratio."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from bench import batch_invariance, voice_prefix


@pytest.fixture(scope="module")
def stack_url(tiny_checkpoint, tmp_path_factory):
    url_file = tmp_path_factory.mktemp("bench-stack") / "url"
    process = subprocess.Popen([sys.executable, "-m", "bench.stack", "--checkpoint", str(tiny_checkpoint),
                                "--device", "cpu", "--max-sessions", "4", "--url-file", str(url_file)])
    deadline = time.monotonic() + 240
    try:
        while not url_file.exists():
            assert process.poll() is None, "bench.stack exited before the stack was ready"
            assert time.monotonic() < deadline, "bench.stack: not ready in 240 s"
            time.sleep(0.2)
        yield url_file.read_text().strip()
    finally:
        process.terminate()
        process.wait(60)


def test_same_seed_gives_the_same_audio_alone_and_inside_a_batch(stack_url):
    result = asyncio.run(batch_invariance.run(stack_url, batches=[4], frames=6))
    cases = {c["case"]: c for c in result["cases"]}
    assert cases["alone"]["bytes"] > 0
    assert result["deterministic"], result
    assert result["batch_invariant"], batch_invariance.table(result)


def test_voice_prefix_benchmark_reports_the_ratio(stack_url):
    result = voice_prefix.measure(stack_url, reference_s=3.0, repeats=1, frames=2)
    assert result["ttfa_ms_no_reference"] > 0 and result["ttfa_ms_reference_cached"] > 0
    assert result["voice_prefix_ttfa_ratio"] == pytest.approx(
        result["ttfa_ms_reference_cached"] / result["ttfa_ms_no_reference"])
    assert "ratio cached / no reference" in voice_prefix.table(result)
