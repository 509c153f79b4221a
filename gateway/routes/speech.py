"""POST /v1/audio/speech (OpenAI-compatible, API.md §1.3) and POST /v1/tts (native, §2)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request, Response

from gateway.audio import AAC_AVAILABLE, AudioPipeline, content_type
from gateway.dependencies import GatewayState, get_state, request_id, require_api_key
from gateway.errors import ApiError
from gateway.responses import SpeechResponse, wait_disconnect
from gateway.schemas import SpeechRequest, parse_openai_speech, parse_tts
from gateway.validation import (SPEECH_BODY_LIMIT, TTS_BODY_LIMIT, check_query, parse_json, parse_msgpack,
                                read_body, require_media_type)

router = APIRouter(prefix="/v1", tags=["speech"], dependencies=[Depends(require_api_key)])

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


@router.post("/audio/speech")
async def create_speech(request: Request, state: GatewayState = Depends(get_state)):
    check_query(request)
    require_media_type(request, ("application/json",))
    data = parse_json(await read_body(request, SPEECH_BODY_LIMIT))
    speech = parse_openai_speech(data, max_input_chars=state.settings.openai_max_input_chars,
                                 aac_available=AAC_AVAILABLE, info=state.info)
    return await synthesize(request, state, speech)


@router.post("/tts")
async def tts(request: Request, state: GatewayState = Depends(get_state)):
    check_query(request)
    kind = require_media_type(request, ("application/json", *MSGPACK_TYPES))
    body = await read_body(request, TTS_BODY_LIMIT)
    data = parse_json(body) if kind == "application/json" else parse_msgpack(body)
    speech = parse_tts(data, max_text_chars=state.settings.max_text_chars, aac_available=AAC_AVAILABLE,
                       info=state.info, header_model=request.headers.get("model"))
    return await synthesize(request, state, speech)


async def _start_unless_disconnected(request: Request, session) -> bool:
    """Wait for admission (`started`), but give up at once if the client goes away meanwhile
    (the admission queue may hold the request for DRAMA_QUEUE_TIMEOUT_S)."""
    starter = asyncio.create_task(session.start())
    watcher = asyncio.create_task(wait_disconnect(request.receive))
    try:
        await asyncio.wait({starter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if starter.done():
        starter.result()
        return True
    starter.cancel()
    await asyncio.gather(starter, return_exceptions=True)
    await session.aclose(asyncio.CancelledError("client disconnected before admission"))
    return False


async def synthesize(request: Request, state: GatewayState, speech: SpeechRequest) -> SpeechResponse:
    """Prepare, get admitted, then hand the session to the response (headers follow `started`)."""
    if state.orchestrator is None or state.shutting_down:
        raise ApiError(503, "not_ready", "The gateway is not ready: no checkpoint or stages configured.")
    route = request.url.path
    metrics = state.metrics
    job = await state.orchestrator.prepare(speech, request_id(request))
    audio = speech.audio
    pipeline = AudioPipeline(audio.format, audio.sample_rate, streamed=audio.mode != "buffered",
                             volume_db=audio.volume_db, speed=audio.speed, mp3_bitrate=audio.mp3_bitrate,
                             opus_bitrate=audio.opus_bitrate, serial=job.seed)
    session = state.orchestrator.session(job)
    metrics.in_flight.inc(route=route)
    try:
        admitted = await _start_unless_disconnected(request, session)
    except BaseException:
        metrics.in_flight.dec(route=route)
        raise
    if not admitted:
        metrics.in_flight.dec(route=route)
        return Response(status_code=499)         # nobody is listening; logged as 499
    headers = {
        "X-Sample-Rate": str(audio.sample_rate), "X-Channels": "1", "X-Seed": str(job.seed),
        "X-Take-Id": job.take_id, "X-Voice-Id": job.voice_id,
        "Content-Disposition": f'attachment; filename="speech.{audio.format}"', "Cache-Control": "no-store",
    }
    if audio.format in ("pcm", "wav", "flac"):
        headers["X-Bit-Depth"] = "16"
    return SpeechResponse(session, pipeline, audio.mode, headers, content_type(audio.format, audio.sample_rate),
                          chunk_index_in_sse=speech.route == "tts",
                          on_close=lambda: metrics.in_flight.dec(route=route))
