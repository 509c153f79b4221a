"""Liveness, readiness and metrics (API.md §1.7)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse

from gateway.dependencies import GatewayState, get_state, no_query, require_api_key_for_ops

router = APIRouter(tags=["health"], dependencies=[Depends(require_api_key_for_ops), Depends(no_query)])

STAGES = ("backbone", "tower", "codec")


@router.get("/health")
@router.get("/v1/health")
async def health():
    return {"status": "ok"}


@router.get("/ready")
async def ready(state: GatewayState = Depends(get_state)):
    if state.shutting_down or state.stages is None:
        stages = {name: "UNKNOWN" for name in STAGES}
        return JSONResponse({"status": "not_ready", "stages": stages}, status_code=503)
    stages = await state.stages.readiness(timeout=1.0)
    ok = all(v == "SERVING" for v in stages.values()) and state.voices.loaded and state.builder is not None
    return JSONResponse({"status": "ready" if ok else "not_ready", "stages": stages},
                        status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(state: GatewayState = Depends(get_state)):
    return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
