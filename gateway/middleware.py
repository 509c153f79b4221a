"""Pure ASGI middleware: request ids, X-Trace-Id and the request counter (API.md §1.1, §1.7).

It runs inside the OpenTelemetry ASGI middleware, so the current span is the SERVER span whose
trace id goes into X-Trace-Id. (Pure ASGI rather than BaseHTTPMiddleware, which would buffer
streaming bodies and hide client disconnects.)
"""

from __future__ import annotations

import secrets

from opentelemetry import trace

from gateway.validation import REQUEST_ID_RE


class RequestContextMiddleware:
    def __init__(self, app, metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client_id = None
        for key, value in scope.get("headers", ()):
            if key == b"x-request-id":
                client_id = value.decode("latin-1")
        request_id = client_id if client_id and REQUEST_ID_RE.match(client_id) else f"req_{secrets.token_hex(16)}"
        scope.setdefault("state", {})["request_id"] = request_id
        span_context = trace.get_current_span().get_span_context()
        trace_id = format(span_context.trace_id, "032x") if span_context.is_valid else secrets.token_hex(16)
        status = {"code": 500}

        async def send_with_ids(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k not in (b"x-request-id", b"x-trace-id")]
                headers += [(b"x-request-id", request_id.encode()), (b"x-trace-id", trace_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_ids)
        finally:
            route = scope.get("route")
            self.metrics.http_requests.inc(route=getattr(route, "path", "unmatched"), status=str(status["code"]))
