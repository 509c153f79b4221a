"""Shared route dependencies: the app state, the API-key check and query-parameter strictness."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request

from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.model_info import ModelInfo
from gateway.settings import Settings
from gateway.takes import TakeStore
from gateway.voices import VoiceRegistry


@dataclass
class GatewayState:
    """Everything the lifespan builds; routes reach it through `get_state`."""
    settings: Settings
    info: ModelInfo
    voices: VoiceRegistry
    takes: TakeStore
    metrics: GatewayMetrics
    builder: object | None = None          # gateway.prompt.PromptBuilder (None without checkpoint)
    stages: object | None = None           # gateway.stages.Stages
    orchestrator: object | None = None     # gateway.orchestrator.Orchestrator
    shutting_down: bool = False


def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway


def get_settings(request: Request) -> Settings:
    return request.app.state.gateway.settings


def request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "")


def _key_ok(presented: str, keys: list[str]) -> bool:
    # Compare against every key so timing says nothing about which key (or prefix) matched.
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(presented.encode(), key.encode())
    return ok


def check_api_key(request: Request, keys: list[str]) -> None:
    if not keys:
        return              # auth off: any Authorization header (e.g. "Bearer EMPTY") is ignored
    header = request.headers.get("authorization") or ""
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not _key_ok(presented.strip(), keys):
        raise ApiError(401, "invalid_api_key",
                       "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                       headers={"WWW-Authenticate": "Bearer"})


async def require_api_key(request: Request) -> None:
    check_api_key(request, get_settings(request).api_keys)


async def require_api_key_for_ops(request: Request) -> None:
    """/health, /ready and /metrics are open unless DRAMA_METRICS_REQUIRE_AUTH=1."""
    settings = get_settings(request)
    if settings.metrics_require_auth:
        check_api_key(request, settings.api_keys)


async def no_query(request: Request) -> None:
    from gateway.validation import check_query

    check_query(request)
