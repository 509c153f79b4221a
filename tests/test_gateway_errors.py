"""gRPC failures -> HTTP (API.md §3.2 table), by failure injection: a stand-in backbone that fails
Generate the way the real one would, in front of the real gateway. (The stand-in never produces
audio; the real stages are exercised in test_gateway_e2e.py.)"""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from fastapi.testclient import TestClient

from drama.backbone.v1 import backbone_pb2, backbone_pb2_grpc
from gateway.app import create_app
from gateway.settings import Settings


class FailingBackbone(backbone_pb2_grpc.BackboneServicer):
    """Answers each Generate with the next (status, drama code, param) of `script`."""

    def __init__(self):
        self.script: list[tuple[grpc.StatusCode, str | None, str | None]] = []
        self.calls = 0
        self.metadata: dict[str, str] = {}

    def Generate(self, request, context):
        self.calls += 1
        self.metadata = dict(context.invocation_metadata())
        code, drama_code, param = self.script.pop(0)
        metadata = []
        if drama_code:
            metadata.append(("drama-error-code", drama_code))
        if param:
            metadata.append(("drama-error-param", param))
        context.set_trailing_metadata(metadata)
        context.abort(code, f"injected {code.name}")

    def GetInfo(self, request, context):
        return backbone_pb2.BackboneInfo(tower_ready=False)


@pytest.fixture(scope="module")
def backbone():
    servicer = FailingBackbone()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    backbone_pb2_grpc.add_BackboneServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.addr = f"127.0.0.1:{port}"
    yield servicer
    server.stop(0)


@pytest.fixture(scope="module")
def client(tiny_checkpoint, backbone):
    settings = Settings(checkpoint=tiny_checkpoint, backbone_addr=backbone.addr, codec_addr=backbone.addr)
    with TestClient(create_app(settings)) as c:
        yield c


def speak(client, backbone, *script):
    backbone.script, backbone.calls = list(script), 0
    response = client.post("/v1/audio/speech", json={"input": "Hello.", "voice": "alloy"})
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return response, body["error"]


S = grpc.StatusCode


def test_queue_full_is_503_with_retry_after(client, backbone):
    response, error = speak(client, backbone, (S.RESOURCE_EXHAUSTED, "queue_full", None))
    assert response.status_code == 503 and error["code"] == "server_overloaded"
    assert response.headers["retry-after"] == "1" and response.headers["retry-after-ms"] == "1000"


def test_message_size_exhaustion_is_500(client, backbone):
    response, error = speak(client, backbone, (S.RESOURCE_EXHAUSTED, None, None))
    assert response.status_code == 500 and error["code"] == "internal_error" and error["type"] == "server_error"
    assert response.headers["x-should-retry"] == "false"


def test_out_of_range_is_context_length_exceeded_with_param(client, backbone):
    response, error = speak(client, backbone, (S.OUT_OF_RANGE, None, "history"))
    assert response.status_code == 400 and (error["code"], error["param"]) == ("context_length_exceeded", "history")


def test_invalid_argument_keeps_the_stage_code_with_the_callers_param(client, backbone):
    response, error = speak(client, backbone, (S.INVALID_ARGUMENT, "invalid_value", "sampling.top_p"))
    assert response.status_code == 400 and (error["code"], error["param"]) == ("invalid_value", "top_p")
    response, error = speak(client, backbone, (S.INVALID_ARGUMENT, None, "chunks[0].user_turn"))
    assert (error["code"], error["param"]) == ("invalid_value", "input")


def test_unavailable_is_retried_once(client, backbone):
    response, error = speak(client, backbone, (S.UNAVAILABLE, None, None), (S.INVALID_ARGUMENT, "empty_string", "text"))
    assert backbone.calls == 2 and response.status_code == 400 and error["code"] == "empty_string"
    response, error = speak(client, backbone, (S.UNAVAILABLE, "not_ready", None), (S.UNAVAILABLE, "not_ready", None))
    assert backbone.calls == 2 and response.status_code == 503 and error["code"] == "not_ready"
    response, error = speak(client, backbone, (S.UNAVAILABLE, None, None), (S.UNAVAILABLE, None, None))
    assert response.status_code == 503 and error["code"] == "upstream_unavailable"


@pytest.mark.parametrize("status,http,code", [
    (S.DEADLINE_EXCEEDED, 504, "timeout"), (S.NOT_FOUND, 503, "upstream_unavailable"),
    (S.ALREADY_EXISTS, 500, "internal_error"), (S.INTERNAL, 500, "internal_error"),
    (S.UNKNOWN, 500, "internal_error"),
])
def test_status_table(client, backbone, status, http, code):
    response, error = speak(client, backbone, (status, None, None))
    assert backbone.calls == 1 and (response.status_code, error["code"]) == (http, code)


def test_ready_reports_tower_from_backbone_info(client):
    body = client.get("/ready").json()
    assert body["status"] == "not_ready" and body["stages"]["tower"] == "NOT_SERVING"
    assert body["stages"]["backbone"] == "UNKNOWN"          # this stand-in serves no health service


def test_spans_and_traceparent(client, backbone):
    """SERVER span -> `text_to_speech drama-3` (INTERNAL) -> backbone.Generate client span, whose
    context reaches the backbone as `traceparent` (API.md §3.6)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.common.telemetry import setup_telemetry

    exporter = InMemorySpanExporter()
    setup_telemetry("drama-gateway", span_processor=SimpleSpanProcessor(exporter))
    response, _ = speak(client, backbone, (S.INVALID_ARGUMENT, "invalid_value", "text"))
    spans = {span.name: span for span in exporter.get_finished_spans()}
    internal = spans["text_to_speech drama-3"]
    server = next(s for s in spans.values() if s.kind.name == "SERVER" and "/v1/audio/speech" in s.name)
    generate = next(s for s in spans.values() if s.kind.name == "CLIENT" and "Generate" in s.name)
    assert internal.parent.span_id == server.context.span_id
    assert generate.parent.span_id == internal.context.span_id
    assert internal.status.status_code.name == "ERROR"
    assert internal.attributes["gen_ai.operation.name"] == "text_to_speech"
    assert internal.attributes["gen_ai.request.model"] == "drama-3" and internal.attributes["drama.voice.id"] == "alloy"
    assert "drama.text" not in internal.attributes                     # content only with DRAMA_TRACE_CONTENT=1
    trace_id = format(internal.context.trace_id, "032x")
    assert response.headers["x-trace-id"] == trace_id
    assert backbone.metadata["traceparent"].split("-")[1] == trace_id
