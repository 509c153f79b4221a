"""GET /v1/takes/{take_id}: a stored take as JSON, to keep and pass back as `vq_codes` (API.md §2.2)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from gateway import errors
from gateway.dependencies import GatewayState, get_state, no_query, require_api_key

router = APIRouter(prefix="/v1/takes", tags=["takes"], dependencies=[Depends(require_api_key), Depends(no_query)])


@router.get("/{take_id}")
async def get_take(take_id: str, state: GatewayState = Depends(get_state)):
    take = state.takes.get(take_id)
    if take is None:
        raise errors.take_not_found(take_id, None)
    return take.to_json()
