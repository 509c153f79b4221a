"""GET /v1/models and GET /v1/models/{id} (API.md §1.6): the served model only; aliases are
accepted by the speech routes but not listed."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends

from gateway import errors
from gateway.audio import AAC_AVAILABLE
from gateway.dependencies import GatewayState, get_state, no_query, require_api_key
from gateway.model_info import SERVED_MODEL
from gateway.schemas import FORMATS

router = APIRouter(prefix="/v1/models", tags=["models"], dependencies=[Depends(require_api_key), Depends(no_query)])
_CREATED = int(time.time())


def model_object(state: GatewayState) -> dict:
    return {"id": SERVED_MODEL, "object": "model", "created": _CREATED, "owned_by": "fishaudio",
            "sample_rate": state.info.sample_rate,
            "response_formats": [f for f in FORMATS if f != "aac" or AAC_AVAILABLE],
            "max_input_chars": state.settings.openai_max_input_chars,
            "max_text_chars": state.settings.max_text_chars}


@router.get("")
async def list_models(state: GatewayState = Depends(get_state)):
    return {"object": "list", "data": [model_object(state)]}


@router.get("/{model_id:path}")
async def get_model(model_id: str, state: GatewayState = Depends(get_state)):
    if model_id != SERVED_MODEL:
        raise errors.model_not_found(model_id)
    return model_object(state)
