"""bench/timeline.py against a real tiny CPU stack of its own: one request's points, read back from
the spans every stage exported, must come out in the order causality gives them across the four
processes (a message is received after it is sent), with the client's first byte last. Each request
is two text chunks, so the chunk-boundary table has one boundary per request."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from bench import timeline


def test_one_request_through_the_stages_in_causal_order(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    # the backbone's prefill lane, as on CUDA (off by default on the CPU): each chunk's prompt is a
    # lane step, whose span must carry its `computed` event for the chunk-boundary table
    monkeypatch.setenv("DRAMA_PREFILL_LANE", "1")
    out = tmp_path / "timeline.json"
    assert timeline.main(["--checkpoint", str(tiny_checkpoint), "--requests", "3", "--skip", "1",
                          "--words", "40", "--frames", "16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 2 and len(result["client_ttfa_ms"]) == 2
    at = {p["point"]: p["mean_ms"] for p in result["points"]}
    assert at["gateway: speech received"] == 0.0
    order = ["gateway: Generate sent", "backbone: Generate received", "backbone: first_audio.admitted",
             "backbone: first_audio.prompt_computed", "backbone: first_audio.prompt_sent",
             "tower: step 1 starts", "tower: step 1 ends", "backbone: first_audio.first_frame",
             "backbone: first_audio.first_message", "gateway: first_frame", "codec: first_frames",
             "codec: first_pcm", "gateway: first_pcm", "gateway: first_audio_byte"]
    missing = [name for name in order if name not in at]
    assert not missing, (missing, sorted(at))
    times = [at[name] for name in order]
    assert times == sorted(times), dict(zip(order, times))
    assert all(p["requests"] == 2 for p in result["points"] if p["point"] in order)
    printed = capsys.readouterr().out
    assert "| ms from arrival (mean) |" in printed and "| a decode frame's part |" in printed

    # the hand-off table: every traced single-row step after a session's third, with its tower step
    # and the session's next step; each cut is causal, except that the Step write may return after
    # the tower has already started (so only send + wire together must be positive)
    hops = result["hops_ms"]
    assert list(hops) == list(timeline.HOPS)
    frames = len(hops[timeline.HOPS[0]])
    assert frames >= 3 and all(len(v) == frames for v in hops.values()), {k: len(v) for k, v in hops.items()}
    compute, send, wire, tower, back, schedule = hops.values()
    for i in range(frames):
        assert compute[i] > 0 and send[i] + wire[i] > 0 and tower[i] > 0 and back[i] > 0 and schedule[i] >= 0

    # the chunk boundaries: one per request (40 words are two chunks of the tiny preset's 128 code
    # points), each from the last frame of chunk 1 routed to chunk 2's first decode step
    boundaries, rows = result["chunk_boundaries_ms"], result["chunk_boundary_rows"]
    assert list(boundaries) == list(timeline.CHUNK_PARTS)
    assert len(rows) == 3 and all(len(v) == 3 for v in boundaries.values()), (rows, boundaries)
    # chunk 2's prompt: chunk 1's take (its text and its 8 frames) and chunk 2's own text
    assert all(r > 8 for r in rows), rows
    opened, compute, send, wire, tower, back, schedule = boundaries.values()
    for i in range(3):
        assert opened[i] >= 0 and compute[i] > 0 and send[i] + wire[i] > 0 and tower[i] > 0 and back[i] > 0
    assert "| a chunk boundary's part |" in printed


def test_steady_hops_of_a_device_handoff_step():
    """A step sent before its wait (the device hand-off: `sent` before `computed`) has no send or
    wire of its own; the tower's part runs from `computed` to the tower step's end."""
    from bench.timeline import HOPS, steady_hops

    def at(ms: float) -> str:
        return datetime.fromtimestamp(1_700_000_000 + ms / 1000, tz=timezone.utc).isoformat()

    def step(trace: str, start: float, sent: float, computed: float, end: float) -> dict:
        return {"name": "backbone.step", "attributes": {"drama.batch.rows": 1},
                "links": [{"context": {"trace_id": "session"}}], "context": {"trace_id": trace},
                "start_time": at(start), "end_time": at(end),
                "events": [{"name": "sent", "timestamp": at(sent)}, {"name": "computed", "timestamp": at(computed)}]}

    spans = {"backbone": [step("a", 0.0, 0.1, 2.5, 4.6), step("b", 4.8, 4.9, 7.3, 9.4)],
             "tower": [{"name": "tower.step", "context": {"trace_id": "a"}, "start_time": at(0.3),
                        "end_time": at(4.3)}]}
    hops = steady_hops(spans, skip_steps=0)
    got = [round(hops[name][0], 3) for name in HOPS]
    assert got == [2.5, 0.0, 0.0, 1.8, 0.3, 0.2]


def test_steady_hops_leave_out_frames_with_a_chained_step():
    """A frame whose next step was chained on it, or a chained step's own frame, has no host hops
    (scheduler._plan_chained): steady_hops leaves both out and keeps the rest."""
    from bench.timeline import HOPS, steady_hops

    def at(ms: float) -> str:
        return datetime.fromtimestamp(1_700_000_000 + ms / 1000, tz=timezone.utc).isoformat()

    def step(trace: str, start: float, chained: bool) -> dict:
        return {"name": "backbone.step", "attributes": {"drama.batch.rows": 1, "drama.step.chained": chained},
                "links": [{"context": {"trace_id": "session"}}], "context": {"trace_id": trace},
                "start_time": at(start), "end_time": at(start + 4.6),
                "events": [{"name": "computed", "timestamp": at(start + 2.5)},
                           {"name": "sent", "timestamp": at(start + 2.6)}]}

    spans = {"backbone": [step("a", 0.0, False), step("b", 4.8, False), step("c", 9.6, True), step("d", 12.0, True)],
             "tower": [{"name": "tower.step", "context": {"trace_id": t}, "start_time": at(s + 2.8),
                        "end_time": at(s + 4.4)} for t, s in (("a", 0.0), ("b", 4.8), ("c", 9.6))]}
    hops = steady_hops(spans, skip_steps=0)
    assert [len(hops[name]) for name in HOPS] == [1] * len(HOPS)      # a (b's step is not chained) only
