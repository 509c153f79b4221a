"""bench/e2e.py: the whole staged stack with random weights (--random-weights tiny) on CPU, one
small run end to end, plus its pure helpers and the stage entry points' --random-weights flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import e2e
from services.common import random_weights

ROOT = Path(__file__).resolve().parents[1]


def test_make_text_has_the_word_count_and_is_stable():
    for words in (1, 20, 200):
        text = e2e.make_text(words)
        assert len(text.split()) == words
        assert text.endswith(".")
        assert text == e2e.make_text(words)


def test_frames_default_to_the_words_spoken():
    """Each request asks for as many frames as its words take spoken (bench.e2e.FRAMES_PER_WORD,
    8: a 200-word request is 1600 frames, ~74 s), unless --frames says otherwise."""
    assert e2e.parse_args(["--words", "20", "200"]).frames == [160, 1600]
    assert e2e.parse_args(["--words", "20", "60", "--frames", "6", "12"]).frames == [6, 12]


def test_plan_frames_shrinks_only_past_the_budget():
    warmup = e2e.Spoken(words=20, chunks=1, max_new_tokens=8, frames=8, audio_s=0.37, ttfa_ms=1000,
                        wall_ms=1800, steady_ms_per_frame=100)
    # predicted: 1 + 9 chunk prefills of 1 s, then 500 frames of 0.1 s = 60 s
    assert e2e.plan_frames([100, 400], [1, 9], warmup, None) == ([100, 400], None)
    assert e2e.plan_frames([100, 400], [1, 9], warmup, 60.0) == ([100, 400], None)
    frames, note = e2e.plan_frames([100, 400], [1, 9], warmup, 35.0)
    assert frames == [50, 200] and "reduced" in note
    assert e2e.plan_frames([100, 400], [1, 9], warmup, 5.0)[0] == [8, 8]      # never below 8


def test_random_weights_flag_and_env(monkeypatch):
    from services.codec.__main__ import parse_args as codec_args
    from services.tower.__main__ import parse_args as tower_args

    monkeypatch.delenv("DRAMA_CHECKPOINT", raising=False)
    assert tower_args(["--random-weights", "tiny"]).random_weights == "tiny"
    monkeypatch.setenv(random_weights.ENV, "full")
    assert codec_args([]).random_weights == "full"
    monkeypatch.delenv(random_weights.ENV)
    with pytest.raises(SystemExit):
        codec_args([])                                       # neither a checkpoint nor a preset


def test_backbone_random_weights_gets_the_preset_config(monkeypatch):
    from services.backbone.__main__ import parse_args_and_preset
    from services.common.config import load_config

    monkeypatch.delenv("DRAMA_CHECKPOINT", raising=False)
    settings, preset = parse_args_and_preset(["--random-weights", "full"])
    assert preset == "full"
    assert load_config(settings.checkpoint) == random_weights.preset_config("full")


def test_random_codec_stage_is_seeded_and_decodes():
    first = random_weights.random_codec_stage("tiny", "cpu", seed=3)
    second = random_weights.random_codec_stage("tiny", "cpu", seed=3)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    codes = torch.zeros(1, first.num_codebooks, 2, dtype=torch.int64)
    with torch.inference_mode():
        pcm = first.decode(codes)
    assert pcm.shape[-1] == 2 * first.frame_samples and torch.isfinite(pcm).all()


def test_e2e_tiny_cpu_table_and_json(tmp_path):
    """About 30 s on 2 idle cores: 60 words instead of 200 keep the long request to 3 text chunks."""
    out_json, out_md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench.e2e", "--preset", "tiny", "--device", "cpu", "--words", "20", "60",
         "--frames", "6", "12", "--micro-steps", "2", "--micro-context", "8",
         "--json", str(out_json), "--markdown", str(out_md)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    table = done.stdout[done.stdout.index("| metric | value |"):]
    for row in ("TTFA, 20 words", "RTF, 60 words", "backbone step, batch 1", "codec 4-frame chunk",
                "gRPC/IPC", "start to ready, backbone", "TTFA phases, 20 words"):
        assert row in table, row
    assert table.strip() in out_md.read_text()

    result = json.loads(out_json.read_text())
    for key in ("rtf_single", "ttfa_ms_20w", "ttfa_ms_200w", "backbone_step_ms_b1", "tower_step_ms_b1",
                "codec_chunk_ms_4f"):
        assert result[key] > 0, key
    assert result["transformers_step_ms_b1"] is None            # the peer is full size on CUDA only
    assert set(result["start_to_ready_s"]) == {"codec", "tower", "backbone", "gateway"}
    long = result["requests"]["long"]
    assert long["chunks"] > 1                                    # 60 words span several text chunks
    assert 0 < long["frames"] <= long["chunks"] * long["max_new_tokens_per_chunk"]
    assert all(len(r["codes_sha256"]) == 64 and len(r["pcm_sha256"]) == 64 for r in result["requests"].values())
    assert result["micro_errors"] == {}
    assert result["tower_step_stream"] == "lane"                 # the stages share this host
    # the gateway's milestones of the 20-word request, in order, ending at the first byte
    phases = result["requests"]["short"]["phases_ms"]
    assert list(phases) == list(e2e.PHASES), phases
    assert all(a <= b for a, b in zip(phases.values(), list(phases.values())[1:])), phases


def test_tower_stream_is_read_from_the_backbones_last_connect():
    lines = ["x", "... tower 127.0.0.1:5 connected (...), Step stream over gRPC",
             "... tower 127.0.0.1:5 connected (...), Step stream over the lane /tmp/d/tower-5.sock", "y"]
    assert e2e.tower_stream(lines) == "lane"
    assert e2e.tower_stream(lines[:2]) == "grpc"
    assert e2e.tower_stream(["no connect yet"]) is None
    handoff = lines[2] + " (large requests through its shared memory), decode steps' rows through GPU memory"
    assert e2e.tower_stream([handoff]) == "lane, rows through GPU memory"
    assert e2e.tower_stream([handoff + " and their frames back"]) == "lane, rows and frames through GPU memory"
