"""Each request is its own trace (API.md §1.7), also on a keep-alive connection after a big body.

Regression: under uvicorn, a request body over 64 KiB (a voice upload) made uvicorn pause reading
and resume it from inside the request, and asyncio then ran the connection's later reads, and so
the later requests' tasks, in that request's context, with its SERVER span current: every later
request on the connection answered with the upload's X-Trace-Id and was recorded as an INTERNAL
child in the upload's trace (gateway/app.py GatewayApp says why). FastAPI's TestClient opens no
sockets and cannot show this, so these tests use the real gateway under uvicorn
(test_gateway_e2e.Stack) and one keep-alive httpx client, and read the spans back from an
in-memory exporter.
"""

from __future__ import annotations

import io
import time

import httpx
import msgpack
import numpy as np
import pytest
import soundfile as sf
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common.telemetry import setup_telemetry
from test_gateway_e2e import MAX_NEW, Stack

PAUSE_AT = 65536                 # uvicorn's HIGH_WATER_LIMIT: a bigger body pauses reading
SPEECH = {"model": "drama-3", "input": "Hello there.", "voice": "alloy", "response_format": "pcm",
          "seed": 3, "max_new_tokens": MAX_NEW}


@pytest.fixture(scope="module")
def traced_stack(tiny_checkpoint):
    """The stages and the gateway under uvicorn, with an in-memory span exporter (as in test_tracing_e2e)."""
    exporter = InMemorySpanExporter()
    setup_telemetry("drama-test", span_processor=SimpleSpanProcessor(exporter))
    stack = Stack(tiny_checkpoint)
    yield stack, exporter
    stack.close()


def _wav(seconds: float, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


class OneConnection(httpx.Client):
    """An httpx client that notes the local port of the connection behind each response, while the
    connection is open: all the same port means all on one keep-alive connection."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.ports: list[int] = []

    def send(self, request, **kwargs):
        response = super().send(request, **kwargs)
        self.ports.append(response.extensions["network_stream"].get_extra_info("client_addr")[1])
        return response


def _trace(response: httpx.Response) -> int:
    return int(response.headers["x-trace-id"], 16)


def _spans_of(exporter, trace_id: int, wanted: set[str], timeout: float = 5.0):
    """The finished spans of one trace, once every name in `wanted` is among them (stage spans end
    on their own threads, a moment after the client has the last byte)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        if wanted <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def _assert_own_root(spans, server_name: str) -> None:
    """The request's HTTP span is a SERVER span without a parent: the request started its trace."""
    servers = [s for s in spans if s.name == server_name]
    assert servers, f"no {server_name!r} span in {sorted({s.name for s in spans})}"
    for span in servers:
        assert span.kind.name == "SERVER", f"{server_name} recorded as {span.kind.name} (a child of another request)"
        assert span.parent is None, f"{server_name} has a parent span"


def test_requests_after_a_voice_upload_start_their_own_trace(traced_stack):
    stack, exporter = traced_stack
    exporter.clear()
    clip = _wav(3.0)
    assert len(clip) > PAUSE_AT, "the clip must be big enough to make uvicorn pause reading"
    with OneConnection(base_url=stack.url, timeout=120) as client:
        before = client.post("/v1/audio/speech", json=SPEECH)
        upload = client.post("/v1/audio/voices", data={"name": "isolation-voice", "consent": "consent-1",
                                                       "ref_text": "A steady tone."},
                             files={"audio_sample": ("clip.wav", clip, "audio/wav")})
        after = [client.post("/v1/audio/speech", json=SPEECH) for _ in range(2)]
    responses = [before, upload, *after]
    for response in responses:
        assert response.status_code == 200, response.text
    assert len(set(client.ports)) == 1, f"the requests must share one keep-alive connection: {client.ports}"
    traces = [_trace(r) for r in responses]
    assert len(set(traces)) == len(traces), f"requests share a trace: {[format(t, '032x') for t in traces]}"

    for response in (before, *after):
        spans = _spans_of(exporter, _trace(response), {"POST /v1/audio/speech", "text_to_speech drama-3"})
        _assert_own_root(spans, "POST /v1/audio/speech")
        assert "text_to_speech drama-3" in {s.name for s in spans}       # the synthesis joined its own trace
    # Nothing of the later requests landed in the upload's trace: it holds the upload's span only.
    upload_spans = _spans_of(exporter, _trace(upload), {"POST /v1/audio/voices"})
    _assert_own_root(upload_spans, "POST /v1/audio/voices")
    assert {s.name for s in upload_spans} == {"POST /v1/audio/voices"}
    assert stack.http.delete("/v1/audio/voices/isolation-voice").status_code == 200


# Every route that reads a body goes through the same uvicorn flow control, successful or not:
# the body is read whole before it is parsed (400), or refused while it arrives (413 chunked), or
# refused from Content-Length while uvicorn keeps reading it to keep the connection (413).
BIG_BODIES = {
    "tts msgpack, 400": dict(url="/v1/tts", content=msgpack.packb({"text": "x" * 200_000}),
                             headers={"content-type": "application/msgpack"}, status=400),
    "speech json, 400": dict(url="/v1/audio/speech", content=b'{"voice": "alloy", "input": "' + b"x" * 200_000 + b'"}',
                             headers={"content-type": "application/json"}, status=400),
    "speech chunked, 413": dict(url="/v1/audio/speech", content=iter([b"{" + b" " * (2 << 20)]),
                                headers={"content-type": "application/json"}, status=413),
    "speech content-length, 413": dict(url="/v1/audio/speech", content=b"{" + b" " * (2 << 20),
                                       headers={"content-type": "application/json"}, status=413),
}


@pytest.mark.parametrize("case", list(BIG_BODIES))
def test_requests_after_a_big_body_start_their_own_trace(traced_stack, case):
    stack, exporter = traced_stack
    big = dict(BIG_BODIES[case])
    status = big.pop("status")
    exporter.clear()
    with OneConnection(base_url=stack.url, timeout=60) as client:
        first = client.get("/v1/models")
        trigger = client.post(big.pop("url"), **big)
        later = [client.get("/v1/models") for _ in range(2)]
    assert trigger.status_code == status, trigger.text
    responses = [first, trigger, *later]
    assert len(set(client.ports)) == 1, f"the requests must share one keep-alive connection: {client.ports}"
    traces = [_trace(r) for r in responses]
    assert len(set(traces)) == len(traces), f"requests share a trace: {[format(t, '032x') for t in traces]}"
    for response in later:
        _assert_own_root(_spans_of(exporter, _trace(response), {"GET /v1/models"}), "GET /v1/models")
