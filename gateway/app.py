"""The FastAPI app (STYLE.md: "bigger applications"): this file only builds the app, its lifespan
and middleware, and includes the routers.

    app = create_app(Settings.from_env())
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.dependencies import GatewayState
from gateway.errors import install_exception_handlers
from gateway.metrics import GatewayMetrics
from gateway.middleware import RequestContextMiddleware
from gateway.model_info import ModelInfo
from gateway.routes import health, models, playground, speech, takes, voices
from gateway.settings import Settings
from gateway.takes import TakeStore
from gateway.voices import VoiceRegistry

log = logging.getLogger("gateway")


class GatewayApp(FastAPI):
    """FastAPI, except that every HTTP request starts from an empty `contextvars.Context`.

    Each request must be its own trace (API.md §1.7), but under uvicorn on the asyncio loop a
    request can start inside the context of an earlier request on the same keep-alive connection
    (CPython #140947, uvicorn #2167): uvicorn makes each request's task from the connection's read
    callback, so the task copies that callback's context, and asyncio's selector transport
    re-registers the read callback, with a copy of the *caller's* context, whenever
    `transport.resume_reading()` is called. uvicorn calls it from inside the request task: in
    `receive()` once a body over 64 KiB has paused reading (a voice upload, a big /v1/tts or
    /v1/audio/speech body), and in the `send()` that completes a response after reading was
    paused (a 413 while the body is still arriving), where it also starts a pipelined request's
    task. OpenTelemetry's SERVER span is current there, so every later request on the connection
    saw a current span, and the ASGI instrumentation made it an INTERNAL child of that span, in
    that trace (X-Trace-Id included).

    Running the app in a task of its own with a fresh context, outside the instrumentation
    middleware, cuts that inheritance for every route, body size and server; nothing of the
    connection's context is needed (the trace parent, if any, comes from `traceparent`). Recent
    uvicorn has the same as an opt-in flag (--reset-contextvars), not on by default and absent from
    older versions, so the gateway does it itself. Lifespan runs as before, in the server's context.
    """

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        # Awaiting the task directly (not shielded) passes a cancellation of this request on to it.
        await asyncio.create_task(super().__call__(scope, receive, send), context=contextvars.Context())


def build_state(settings: Settings, metrics: GatewayMetrics) -> GatewayState:
    """Everything that needs no network: model info, prompt builder, voices, takes."""
    info, builder = ModelInfo(), None
    if settings.checkpoint is not None:
        from gateway.prompt import PromptBuilder

        info = ModelInfo.from_checkpoint(settings.checkpoint)
        builder = PromptBuilder.from_checkpoint(settings.checkpoint)
    else:
        log.warning("no checkpoint configured (DRAMA_CHECKPOINT): speech routes answer 503 not_ready")
    voices = VoiceRegistry(settings.voices_dir, settings.voice_store_dir, max_voices=settings.max_voices,
                           aliases=settings.voice_aliases)
    takes = TakeStore(settings.take_store_mb, settings.take_ttl_s)
    return GatewayState(settings=settings, info=info, voices=voices, takes=takes, metrics=metrics, builder=builder)


@asynccontextmanager
async def lifespan(app: FastAPI):
    from gateway.orchestrator import Orchestrator
    from gateway.stages import Stages

    settings: Settings = app.state.settings
    state = build_state(settings, app.state.metrics)
    state.stages = Stages(settings.backbone_addr, settings.codec_addr)
    if state.builder is not None:
        state.orchestrator = Orchestrator(settings, state.info, state.stages, state.builder, state.voices,
                                          state.takes, state.metrics)
    app.state.gateway = state
    log.info("gateway up: backbone %s, codec %s", settings.backbone_addr, settings.codec_addr)
    try:
        yield
    finally:
        state.shutting_down = True
        await state.stages.close()


def _setup_tracing(app: FastAPI) -> None:
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    from services.common.telemetry import setup_telemetry

    setup_telemetry("drama-gateway")

    # No span per ASGI send/receive: a long audio stream would make thousands of them.
    FastAPIInstrumentor.instrument_app(app, excluded_urls="/health,/v1/health,/metrics",
                                       exclude_spans=["send", "receive"])


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    app = GatewayApp(title="dramaturg gateway", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = GatewayMetrics()
    install_exception_handlers(app)
    app.add_middleware(RequestContextMiddleware, metrics=app.state.metrics)
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id", "x-trace-id", "x-seed",
                                                                 "x-take-id", "x-sample-rate"])
    for module in (speech, voices, models, takes, health, playground):
        app.include_router(module.router)
    _setup_tracing(app)
    return app
