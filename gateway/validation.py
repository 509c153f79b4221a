"""Strict request parsing (API.md §1.1-§1.2): body limits, JSON and MessagePack without duplicate
keys, and field readers that never coerce.

We parse bodies ourselves instead of relying on pydantic, because the contract is stricter than
pydantic's defaults: duplicate keys are errors, unknown fields at any depth are errors with their
path, `null` means "absent", and nothing is coerced (`"1"`, `true` or `2.5` for an integer field is
`invalid_type`). Each reader raises the exact code, message and `param` of §1.2.

    body = await read_body(request, limit)          # 413 from Content-Length and while reading
    data = parse_json(body) / parse_msgpack(body)   # 400 invalid_json / duplicate_parameter
    value = get_int(data, "seed", "seed", 0, 2**32 - 1)

The speech request schemas built from these readers are in `gateway/schemas.py`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgpack
from fastapi import Request

from gateway import errors
from gateway.errors import ApiError
from gateway.model_info import MODEL_ALIASES, SERVED_MODEL

MiB = 1024 * 1024
SPEECH_BODY_LIMIT = 1 * MiB
TTS_BODY_LIMIT = 48 * MiB
VOICE_UPLOAD_LIMIT = 11 * MiB
MAX_CLIP_BYTES = 10 * MiB

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage",
                 "shimmer", "verse", "marin", "cedar")
VOICE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
SPEAKER_TAG_RE = re.compile(r"<\|speaker:(\d+)\|>")
# Special tokens of MODEL.md §8.1 other than speaker tags: refused in caller text (they would
# forge turns or audio rows).
_FORBIDDEN_TOKEN_RE = re.compile(
    r"<\|(?:endoftext|pad|im_start|im_end|phoneme_start|phoneme_end|text|voice|interleave|"
    r"audio_start|audio_end|audio_pad|semantic:\d+)\|>")


# --------------------------------------------------------------------------------------------
# Body reading and decoding
# --------------------------------------------------------------------------------------------

def media_type(request: Request) -> str:
    return (request.headers.get("content-type") or "").split(";")[0].strip().lower()


def require_media_type(request: Request, allowed: tuple[str, ...]) -> str:
    got = media_type(request)
    if got not in allowed:
        raise errors.unsupported_media_type(" or ".join(allowed), request.headers.get("content-type"))
    return got


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) anything over `limit` bytes before and while reading."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise errors.too_large(limit)
        except ValueError:
            raise ApiError(400, "invalid_value", "Invalid Content-Length header.") from None
    parts, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise errors.too_large(limit)
        parts.append(piece)
    return b"".join(parts)


class _Pairs(list):
    """An object's key/value pairs in order, so duplicates can be reported with their path."""


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def parse_json(body: bytes) -> dict:
    try:
        raw = json.loads(body.decode("utf-8"), object_pairs_hook=_Pairs, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError):
        raise errors.invalid_json() from None
    return _top_object(_to_plain(raw, ""))


def parse_msgpack(body: bytes) -> dict:
    try:
        raw = msgpack.unpackb(body, raw=False, object_pairs_hook=_Pairs, strict_map_key=True,
                              max_bin_len=TTS_BODY_LIMIT, max_str_len=TTS_BODY_LIMIT)
    except Exception:  # msgpack raises several unrelated types for malformed input
        raise ApiError(400, "invalid_json", "We could not parse the MessagePack body of your request.") from None
    return _top_object(_to_plain(raw, ""))


def _top_object(value) -> dict:
    if not isinstance(value, dict):
        raise ApiError(400, "invalid_type",
                       f"Invalid type for request body: expected an object, but got {type_name(value)} instead.")
    return value


def _to_plain(value, path: str):
    if isinstance(value, _Pairs):
        out: dict = {}
        for key, item in value:
            if not isinstance(key, str):
                raise ApiError(400, "invalid_type", "Object keys must be strings.", path or None)
            child = _join(path, key)
            if key in out:
                raise ApiError(400, "duplicate_parameter", f"Duplicate parameter supplied: {child}", child)
            out[key] = _to_plain(item, child)
        return out
    if isinstance(value, list):
        return [_to_plain(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return [_to_plain(item, f"{path}[{i}]") for i, item in enumerate(value)]
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# --------------------------------------------------------------------------------------------
# Field readers: each returns the value or None (absent / null) and raises the §1.2 error.
# --------------------------------------------------------------------------------------------

def type_name(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (bytes, bytearray)):
        return "binary data"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


def check_keys(obj: dict, allowed, path: str = "") -> None:
    for key in obj:
        if key not in allowed:
            raise errors.unknown(_join(path, key))


def check_query(request: Request, allowed=()) -> None:
    for key in request.query_params.keys():
        if key not in allowed:
            raise errors.unknown(key)


def get_str(obj: dict, key: str, param: str, *, required=False, max_len=None, min_len=0,
            blank_ok=True) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise errors.missing(param)
        return None
    if not isinstance(value, str):
        raise errors.invalid_type(param, "a string", type_name(value))
    if max_len is not None and len(value) > max_len:
        raise errors.too_long(param, max_len, len(value))
    if not blank_ok and not value.strip():
        raise errors.empty_string(param)
    if len(value) < min_len:
        raise errors.empty_string(param)
    return value


def get_bool(obj: dict, key: str, param: str) -> bool | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise errors.invalid_type(param, "a boolean", type_name(value))
    return value


def get_int(obj: dict, key: str, param: str, low: int, high: int) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.invalid_type(param, "an integer", type_name(value))
    if not low <= value <= high:
        raise errors.out_of_range(param, low, high, value)
    return value


def get_number(obj: dict, key: str, param: str, low: float, high: float) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise errors.invalid_type(param, "a number", type_name(value))
    if not low <= value <= high:
        raise errors.out_of_range(param, low, high, value)
    return float(value)


def get_enum(obj: dict, key: str, param: str, choices) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    expected = "a string" if isinstance(choices[0], str) else "an integer"
    if isinstance(value, bool) or type(value) is not type(choices[0]):
        raise errors.invalid_type(param, expected, type_name(value))
    if value not in choices:
        raise errors.invalid_value(param, value, choices)
    return value


def check_text(text: str, param: str, num_speakers: int = 16) -> None:
    """Speaker tags in range and no other special token (API.md §1.3, §2.1)."""
    for match in SPEAKER_TAG_RE.finditer(text):
        if int(match.group(1)) >= num_speakers:
            raise ApiError(400, "invalid_value",
                           f"Invalid speaker tag '{match.group(0)}': speaker index must be between 0 and "
                           f"{num_speakers - 1}.", param)
    forbidden = _FORBIDDEN_TOKEN_RE.search(text)
    if forbidden:
        raise ApiError(400, "invalid_value",
                       f"Invalid special token '{forbidden.group(0)}' in '{param}': only speaker tags "
                       "<|speaker:N|> are allowed in text.", param)


def check_model(model: str | None, param: str = "model") -> str:
    if model is None:
        return SERVED_MODEL
    if model.lower() not in MODEL_ALIASES:
        raise errors.model_not_found(model)
    return SERVED_MODEL


def check_voice_id(value: str, param: str) -> str:
    if not 1 <= len(value) <= 64:
        raise ApiError(400, "invalid_value",
                       f"Invalid '{param}': a voice id has 1 to 64 characters, got {len(value)}.", param)
    if not VOICE_ID_RE.match(value):
        raise ApiError(400, "invalid_value",
                       f"Invalid value: '{value}'. A voice id matches ^[A-Za-z0-9][A-Za-z0-9_.-]*$.", param)
    return value.lower()
