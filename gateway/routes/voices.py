"""GET/POST/DELETE /v1/audio/voices (API.md §1.5)."""

from __future__ import annotations

from email.parser import BytesParser
from email.policy import HTTP

from fastapi import APIRouter, Depends, Request

from gateway import errors
from gateway.dependencies import GatewayState, get_state, no_query, require_api_key
from gateway.errors import ApiError
from gateway.validation import (MAX_CLIP_BYTES, VOICE_UPLOAD_LIMIT, check_model, check_query, check_voice_id,
                                read_body, require_media_type)

router = APIRouter(prefix="/v1/audio/voices", tags=["voices"], dependencies=[Depends(require_api_key)])

UPLOAD_FIELDS = ("name", "audio_sample", "consent", "ref_text", "speaker_description")


@router.get("")
async def list_voices(request: Request, state: GatewayState = Depends(get_state)):
    check_query(request, ("model",))
    model = request.query_params.get("model")
    if model is not None:
        check_model(model)
    return {"object": "list", "voices": [v.to_json() for v in state.voices.list()], "default_voice": "default"}


@router.get("/{voice_id}", dependencies=[Depends(no_query)])
async def get_voice(voice_id: str, state: GatewayState = Depends(get_state)):
    voice = state.voices.get(voice_id)
    if voice is None:
        raise errors.voice_not_found(voice_id, None, status=404)
    return voice.to_json()


@router.delete("/{voice_id}", dependencies=[Depends(no_query)])
async def delete_voice(voice_id: str, state: GatewayState = Depends(get_state)):
    voice = state.voices.delete(voice_id)
    return {"object": "audio.voice.deleted", "id": voice.id, "deleted": True}


@router.post("", dependencies=[Depends(no_query)])
async def create_voice(request: Request, state: GatewayState = Depends(get_state)):
    require_media_type(request, ("multipart/form-data",))
    body = await read_body(request, VOICE_UPLOAD_LIMIT)
    fields, files = parse_multipart(body, request.headers.get("content-type", ""))
    for key in fields:
        if key == "audio_sample":
            raise errors.invalid_type("audio_sample", "a file", "a string")
    for key in files:
        if key != "audio_sample":
            raise errors.invalid_type(key, "a string", "a file")
    name = _text(fields, "name", 64, required=True)
    voice_name = name
    check_voice_id(name, "name")
    if "audio_sample" not in files:
        raise errors.missing("audio_sample")
    filename, audio = files["audio_sample"]
    if len(audio) > MAX_CLIP_BYTES:
        raise ApiError(400, "audio_too_long",
                       f"Invalid 'audio_sample': the file is {len(audio)} bytes, the limit is {MAX_CLIP_BYTES}.",
                       "audio_sample")
    consent = _text(fields, "consent", 256, required=True)
    ref_text = _text(fields, "ref_text", 2000, required=True)
    from gateway.validation import check_text

    check_text(ref_text, "ref_text")
    description = _text(fields, "speaker_description", 500, required=False)
    voice = state.voices.add(name=voice_name, audio=audio, filename=filename, consent=consent,
                             transcript=ref_text, speaker_description=description)
    return voice.to_json()


def _text(fields: dict, key: str, max_len: int, required: bool) -> str | None:
    value = fields.get(key)
    if value is None or (not value.strip() and required):
        if required:
            raise errors.missing(key) if value is None else errors.empty_string(key)
        return None
    if len(value) > max_len:
        raise errors.too_long(key, max_len, len(value))
    return value


def parse_multipart(body: bytes, content_type: str) -> tuple[dict[str, str], dict[str, tuple[str | None, bytes]]]:
    """multipart/form-data -> (text fields, files) with the strictness of §1.1 (unknown and
    duplicate fields refused). The stdlib email parser does the MIME work (no python-multipart)."""
    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        raise ApiError(400, "invalid_value", "Could not parse the multipart/form-data body.")
    fields: dict[str, str] = {}
    files: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name is None:
            raise ApiError(400, "invalid_value", "A multipart part has no field name.")
        if name not in UPLOAD_FIELDS:
            raise errors.unknown(name)
        if name in fields or name in files:
            raise ApiError(400, "duplicate_parameter", f"Duplicate parameter supplied: {name}", name)
        payload = part.get_payload(decode=True) or b""
        filename = part.get_filename()
        if filename is not None:
            files[name] = (filename, payload)
        else:
            try:
                fields[name] = payload.decode(part.get_content_charset() or "utf-8")
            except (UnicodeDecodeError, LookupError):
                raise errors.invalid_type(name, "a string", "binary data") from None
    return fields, files
