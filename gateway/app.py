"""The FastAPI app (STYLE.md: "bigger applications"): this file only builds the app, its lifespan
and middleware, and includes the routers.

    app = create_app(Settings.from_env())
"""

from __future__ import annotations

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
    try:
        from services.common.telemetry import setup_telemetry
    except ImportError:  # TODO: drop once services.common.telemetry is everywhere
        setup_telemetry = None
    if setup_telemetry is not None:
        setup_telemetry("drama-gateway")
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    # No span per ASGI send/receive: a long audio stream would make thousands of them.
    FastAPIInstrumentor.instrument_app(app, excluded_urls="/health,/v1/health,/metrics",
                                       exclude_spans=["send", "receive"])


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    app = FastAPI(title="dramaturg gateway", version="0.1.0", lifespan=lifespan)
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
