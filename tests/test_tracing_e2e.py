"""One request, one trace: spans from the gateway and all three stages share the trace id the
gateway reports in X-Trace-Id (API.md §3.6). Everything runs in this process, so one in-memory
exporter sees the spans of every stage."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.telemetry import setup_telemetry
from test_gateway_e2e import MAX_NEW, Stack


@pytest.fixture(scope="module")
def traced_stack(tiny_checkpoint):
    exporter = InMemorySpanExporter()
    setup_telemetry("drama-test", span_processor=SimpleSpanProcessor(exporter))
    stack = Stack(tiny_checkpoint)
    stack.handles[0].scheduler.step_span_sample = 1.0     # every backbone step gets a span
    yield stack, exporter
    stack.close()


def test_one_trace_holds_gateway_and_every_stage(traced_stack):
    stack, exporter = traced_stack
    exporter.clear()
    response = stack.http.post("/v1/audio/speech", json={
        "input": "One trace for every stage.", "voice": "alloy", "response_format": "pcm",
        "seed": 7, "max_new_tokens": MAX_NEW})
    assert response.status_code == 200, response.text
    trace_id = int(response.headers["x-trace-id"], 16)

    # Stage spans end on their own threads, a moment after the last byte reached the client.
    def finished():
        return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]

    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not (
            {"text_to_speech drama-3", "prefill"} <= {s.name for s in finished()}
            and any("Codec/Decode" in s.name for s in finished())
            and any("Backbone/Generate" in s.name for s in finished())):
        time.sleep(0.05)
    spans = finished()
    names = {s.name for s in spans}

    assert "text_to_speech drama-3" in names                                          # gateway
    assert any(s.kind.name == "SERVER" and "Backbone/Generate" in s.name for s in spans)  # backbone
    assert "prefill" in names
    assert any(s.kind.name == "SERVER" and "Codec/Decode" in s.name for s in spans)    # codec
    internal = next(s for s in spans if s.name == "text_to_speech drama-3")
    events = {e.name for e in internal.events}
    assert {"admitted", "first_frame", "first_audio_byte"} <= events

    # Steps serve many sessions, so a sampled `backbone.step` span is its own trace, linked to the
    # session spans of its rows; the tower's `tower.step` joins that step's trace (API.md §3.6).
    session_span_ids = {s.context.span_id for s in spans}

    def linked_steps_and_towers():
        everything = exporter.get_finished_spans()
        steps = [s for s in everything if s.name == "backbone.step"
                 and any(link.context.span_id in session_span_ids for link in s.links)]
        step_traces = {s.context.trace_id for s in steps}
        return steps, [s for s in everything if s.name == "tower.step" and s.context.trace_id in step_traces]

    deadline = time.monotonic() + 5.0
    steps, towers = linked_steps_and_towers()
    while time.monotonic() < deadline and not (steps and towers):
        time.sleep(0.05)
        steps, towers = linked_steps_and_towers()
    assert steps, "no sampled backbone.step links to this request"
    assert towers, "no tower.step joined a sampled step's trace"
