"""Strict request parsing for the speech routes (API.md §1.1-§1.3, §2.1).

We parse the body ourselves instead of relying on pydantic, because the contract is stricter than
pydantic's defaults: duplicate keys are errors, unknown fields at any depth are errors with their
path, `null` means "absent", and nothing is coerced (`"1"`, `true` or `2.5` for an integer field is
`invalid_type`). Each field is checked in the order of the spec tables and the first problem wins,
with the exact code, message and `param` of §1.2.

    body = await read_body(request, limit)          # 413 from Content-Length and while reading
    data = parse_json(body) / parse_msgpack(body)   # 400 invalid_json / duplicate_parameter
    req = parse_openai_speech(data, ...) / parse_tts(data, ...)
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack
from fastapi import Request

from gateway import errors
from gateway.errors import ApiError
from gateway.model_info import MODEL_ALIASES, SERVED_MODEL, ModelInfo

MiB = 1024 * 1024
SPEECH_BODY_LIMIT = 1 * MiB
TTS_BODY_LIMIT = 48 * MiB
VOICE_UPLOAD_LIMIT = 11 * MiB
MAX_CLIP_BYTES = 10 * MiB

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
_ANY_RATE = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000)
SAMPLE_RATES = {
    "pcm": _ANY_RATE, "wav": _ANY_RATE, "aac": _ANY_RATE, "flac": _ANY_RATE,
    "mp3": (16000, 22050, 24000, 32000, 44100, 48000),
    "opus": (8000, 12000, 16000, 24000, 48000),
}
LATENCY_FIRST_FRAMES = {"normal": 8, "balanced": 4, "low": 2}
MESSAGE_FRAMES = 8
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
# Parsed requests
# --------------------------------------------------------------------------------------------

@dataclass
class AudioOptions:
    format: str
    sample_rate: int
    mode: str                        # "progressive", "buffered" or "sse"
    speed: float = 1.0
    volume_db: float = 0.0
    mp3_bitrate: int | None = None   # kbit/s (fish clients)
    opus_bitrate: int | None = None  # kbit/s, -1000 = auto (fish clients)


@dataclass
class SamplingOptions:
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None
    chunk_length: int | None = None
    normalize: bool = True
    latency: str = "normal"
    use_memory_cache: bool = True


@dataclass
class ClipSpec:
    """A reference or a history item: transcript plus one audio source (or a take id)."""
    param: str                       # path of the item, e.g. "references[1]"
    speaker: int = 0
    text: str = ""
    audio: bytes | None = None       # file bytes (base64 decoded, data: URL decoded, msgpack bin)
    audio_path: str | None = None    # file:// or http(s):// still to fetch
    vq_codes: list[list[int]] | None = None   # [N][T]
    take_id: str | None = None       # history only
    max_seconds: float = 30.0        # encode limit: 30 s for references, 60 s for history


@dataclass
class SpeechRequest:
    route: str                       # "openai" or "tts"
    model: str
    text: str
    audio: AudioOptions
    sampling: SamplingOptions
    voice: str | None = None         # OpenAI route: lower-cased voice id ("default" if absent)
    instructions: str | None = None
    references: list[ClipSpec] = field(default_factory=list)
    reference_ids: list[tuple[int, str, str]] = field(default_factory=list)  # (speaker, id, param)
    history: list[ClipSpec] = field(default_factory=list)

    @property
    def text_param(self) -> str:
        return "input" if self.route == "openai" else "text"


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


# --------------------------------------------------------------------------------------------
# Shared parts of both routes
# --------------------------------------------------------------------------------------------

def _audio_format(data: dict, key: str, default: str, aac_available: bool) -> str:
    fmt = get_enum(data, key, key, FORMATS) or default
    if fmt == "aac" and not aac_available:
        raise ApiError(400, "unsupported_response_format",
                       "The 'aac' response format needs an AAC encoder, which this build lacks.", key)
    return fmt


def _sample_rate(data: dict, fmt: str, default: int) -> int:
    value = data.get("sample_rate")
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.invalid_type("sample_rate", "an integer", type_name(value))
    allowed = SAMPLE_RATES[fmt]
    if value not in allowed:
        rates = ", ".join(str(r) for r in allowed)
        raise ApiError(400, "invalid_value",
                       f"Invalid value: '{value}'. Supported sample rates for '{fmt}' are: {rates}.",
                       "sample_rate")
    return value


def _sampling(data: dict, latency_default: str) -> SamplingOptions:
    use_cache = get_enum(data, "use_memory_cache", "use_memory_cache", ("on", "off"))
    return SamplingOptions(
        seed=get_int(data, "seed", "seed", 0, 2**32 - 1),
        temperature=get_number(data, "temperature", "temperature", 0.0, 2.0),
        top_p=get_number(data, "top_p", "top_p", 0.01, 1.0),
        top_k=_default(get_int(data, "top_k", "top_k", 0, 4097), 0),
        repetition_penalty=_default(get_number(data, "repetition_penalty", "repetition_penalty", 1.0, 2.0), 1.0),
        max_new_tokens=get_int(data, "max_new_tokens", "max_new_tokens", 1, 4096),
        chunk_length=get_int(data, "chunk_length", "chunk_length", 32, 1000),
        normalize=_default(get_bool(data, "normalize", "normalize"), True),
        latency=get_enum(data, "latency", "latency", tuple(LATENCY_FIRST_FRAMES)) or latency_default,
        use_memory_cache=use_cache != "off",
    )


def _default(value, default):
    return default if value is None else value


_SAMPLING_FIELDS = ("seed", "temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens",
                    "chunk_length", "normalize", "latency")


# --------------------------------------------------------------------------------------------
# POST /v1/audio/speech
# --------------------------------------------------------------------------------------------

_OPENAI_FIELDS = frozenset({"model", "input", "voice", "instructions", "response_format", "speed",
                            "stream_format", "stream", "sample_rate", *_SAMPLING_FIELDS})


def parse_openai_speech(data: dict, *, max_input_chars: int, aac_available: bool,
                        info: ModelInfo | None = None) -> SpeechRequest:
    info = info or ModelInfo()
    check_keys(data, _OPENAI_FIELDS)
    model = check_model(get_str(data, "model", "model"))
    text = get_str(data, "input", "input", required=True, max_len=max_input_chars, blank_ok=False)
    check_text(text, "input", info.num_speakers)
    voice = _openai_voice(data.get("voice"))
    instructions = get_str(data, "instructions", "instructions", max_len=4096)
    if instructions is not None:
        check_text(instructions, "instructions", info.num_speakers)
        instructions = instructions.strip() or None
    fmt = _audio_format(data, "response_format", "mp3", aac_available)
    speed = _default(get_number(data, "speed", "speed", 0.25, 4.0), 1.0)
    stream_format = get_enum(data, "stream_format", "stream_format", ("audio", "sse")) or "audio"
    stream = get_bool(data, "stream", "stream")
    if stream_format == "sse" and fmt == "flac":
        raise errors.conflicting("stream_format", "response_format")
    if stream_format == "sse" and stream is False:
        raise errors.conflicting("stream_format", "stream")
    if stream_format == "sse":
        mode = "sse"
    elif stream is False or fmt == "flac":
        mode = "buffered"
    else:
        mode = "progressive"
    audio = AudioOptions(format=fmt, sample_rate=_sample_rate(data, fmt, 24000), mode=mode, speed=speed)
    return SpeechRequest(route="openai", model=model, text=text, voice=voice, instructions=instructions,
                         audio=audio, sampling=_sampling(data, "balanced"))


def _openai_voice(value) -> str:
    if value is None:
        return "default"
    if isinstance(value, dict):
        check_keys(value, ("id",), "voice")
        voice_id = get_str(value, "id", "voice.id", required=True)
        return check_voice_id(voice_id, "voice.id")
    if not isinstance(value, str):
        raise errors.invalid_type("voice", "a string or an object", type_name(value))
    return check_voice_id(value, "voice")


# --------------------------------------------------------------------------------------------
# POST /v1/tts
# --------------------------------------------------------------------------------------------

_TTS_FIELDS = frozenset({"text", "model", "references", "reference_id", "history", "use_memory_cache",
                         "format", "sample_rate", "streaming", "stream_format", "prosody",
                         "mp3_bitrate", "opus_bitrate", *_SAMPLING_FIELDS})
_CLIP_FIELDS = ("audio", "audio_path", "vq_codes", "text", "speaker")


def parse_tts(data: dict, *, max_text_chars: int, aac_available: bool, info: ModelInfo | None = None,
              header_model: str | None = None) -> SpeechRequest:
    info = info or ModelInfo()
    check_keys(data, _TTS_FIELDS)
    text = get_str(data, "text", "text", required=True, max_len=max_text_chars, blank_ok=False)
    check_text(text, "text", info.num_speakers)
    model = check_model(get_str(data, "model", "model"))
    if header_model is not None:
        check_model(header_model)
    references = _references(data.get("references"), info)
    reference_ids = _reference_ids(data.get("reference_id"), references)
    history = _history(data.get("history"), info)
    sampling = _sampling(data, "normal")
    fmt = _audio_format(data, "format", "wav", aac_available)
    sample_rate = _sample_rate(data, fmt, 48000 if fmt == "opus" else 44100)
    streaming = _default(get_bool(data, "streaming", "streaming"), False)
    stream_format = get_enum(data, "stream_format", "stream_format", ("audio", "sse")) or "audio"
    if stream_format == "sse" and not streaming:
        raise errors.conflicting("stream_format", "streaming")
    if stream_format == "sse" and fmt == "flac":
        raise errors.conflicting("stream_format", "format")
    mode = "sse" if stream_format == "sse" else ("progressive" if streaming and fmt != "flac" else "buffered")
    speed, volume = _prosody(data.get("prosody"))
    audio = AudioOptions(format=fmt, sample_rate=sample_rate, mode=mode, speed=speed, volume_db=volume,
                         mp3_bitrate=get_enum(data, "mp3_bitrate", "mp3_bitrate", (64, 128, 192)),
                         opus_bitrate=get_enum(data, "opus_bitrate", "opus_bitrate", (-1000, 24, 32, 48, 64)))
    return SpeechRequest(route="tts", model=model, text=text, audio=audio, sampling=sampling,
                         references=references, reference_ids=reference_ids, history=history)


def _prosody(value) -> tuple[float, float]:
    if value is None:
        return 1.0, 0.0
    if not isinstance(value, dict):
        raise errors.invalid_type("prosody", "an object", type_name(value))
    check_keys(value, ("speed", "volume"), "prosody")
    speed = _default(get_number(value, "speed", "prosody.speed", 0.25, 4.0), 1.0)
    volume = _default(get_number(value, "volume", "prosody.volume", -20.0, 20.0), 0.0)
    return speed, volume


def _references(value, info: ModelInfo) -> list[ClipSpec]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise errors.invalid_type("references", "an array", type_name(value))
    nested = [isinstance(item, list) for item in value]
    if any(nested) and not all(nested):
        raise errors.invalid_type("references", "a list of references or a list of lists of references",
                                  "a mix of both")
    clips: list[ClipSpec] = []
    if value and all(nested):
        if len(value) > info.num_speakers:
            raise errors.out_of_range("references", 0, info.num_speakers, len(value))
        for speaker, group in enumerate(value):
            for j, item in enumerate(group):
                clips.append(_clip(item, f"references[{speaker}][{j}]", info, allow_speaker=False,
                                   speaker=speaker, max_seconds=30))
    else:
        for i, item in enumerate(value):
            clips.append(_clip(item, f"references[{i}]", info, allow_speaker=True, max_seconds=30))
    per_speaker: dict[int, int] = {}
    for clip in clips:
        per_speaker[clip.speaker] = per_speaker.get(clip.speaker, 0) + 1
    if len(clips) > 32 or any(n > 8 for n in per_speaker.values()):
        worst = max(per_speaker.values())
        raise errors.out_of_range("references", 0, 32 if len(clips) > 32 else 8,
                                  len(clips) if len(clips) > 32 else worst)
    # Prompt order: by speaker, then as given (MODEL.md §8.2); sorted() is stable.
    return sorted(clips, key=lambda c: c.speaker)


def _clip(item, path: str, info: ModelInfo, *, allow_speaker: bool, speaker: int = 0,
          max_seconds: int = 30, text_required: bool = True) -> ClipSpec:
    if not isinstance(item, dict):
        raise errors.invalid_type(path, "an object", type_name(item))
    check_keys(item, _CLIP_FIELDS if allow_speaker else _CLIP_FIELDS[:-1], path)
    # In the caller's key order, so `param` names the second source given.
    sources = [key for key in item if key in ("audio", "audio_path", "vq_codes") and item[key] is not None]
    if not sources:
        raise errors.missing(f"{path}.audio")
    if len(sources) > 1:
        raise errors.conflicting(f"{path}.{sources[1]}", f"{path}.{sources[0]}")
    text = get_str(item, "text", f"{path}.text", required=text_required, max_len=2000)
    if text is not None:
        if text_required and not text.strip():
            raise errors.empty_string(f"{path}.text")
        check_text(text, f"{path}.text", info.num_speakers)
    if allow_speaker:
        speaker = _default(get_int(item, "speaker", f"{path}.speaker", 0, info.num_speakers - 1), 0)
    clip = ClipSpec(param=path, speaker=speaker, text=text or "", max_seconds=max_seconds)
    if sources[0] == "audio":
        clip.audio = _audio_bytes(item["audio"], f"{path}.audio")
    elif sources[0] == "audio_path":
        path_value = get_str(item, "audio_path", f"{path}.audio_path")
        if path_value.startswith("data:"):
            clip.audio = _data_url(path_value, f"{path}.audio_path")
        else:
            clip.audio_path = path_value
    else:
        clip.vq_codes = _vq_codes(item["vq_codes"], f"{path}.vq_codes", info)
    return clip


def _audio_bytes(value, param: str) -> bytes:
    if isinstance(value, (bytes, bytearray)):      # MessagePack clients send raw bytes
        data = bytes(value)
    elif isinstance(value, str):
        data = _data_url(value, param) if value.startswith("data:") else _b64(value, param)
    else:
        raise errors.invalid_type(param, "a string", type_name(value))
    if len(data) > MAX_CLIP_BYTES:
        raise ApiError(400, "audio_too_long",
                       f"Invalid '{param}': the clip is {len(data)} bytes, the limit is {MAX_CLIP_BYTES}.", param)
    return data


def _b64(value: str, param: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "audio_undecodable", f"Invalid '{param}': not valid base64.", param) from None


def _data_url(value: str, param: str) -> bytes:
    header, sep, payload = value.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ApiError(400, "invalid_value",
                       f"Invalid '{param}': expected a 'data:audio/...;base64,' URL.", param)
    data = _b64(payload, param)
    if len(data) > MAX_CLIP_BYTES:
        raise ApiError(400, "audio_too_long",
                       f"Invalid '{param}': the clip is {len(data)} bytes, the limit is {MAX_CLIP_BYTES}.", param)
    return data


def _vq_codes(value, param: str, info: ModelInfo) -> list[list[int]]:
    if not isinstance(value, list):
        raise errors.invalid_type(param, "an array", type_name(value))
    if len(value) != info.num_codebooks:
        raise ApiError(400, "invalid_value",
                       f"Invalid '{param}': expected {info.num_codebooks} codebook lists, got {len(value)}.", param)
    length = None
    for q, row in enumerate(value):
        row_param = f"{param}[{q}]"
        if not isinstance(row, list):
            raise errors.invalid_type(row_param, "an array", type_name(row))
        if length is None:
            length = len(row)
            if length < 1:
                raise ApiError(400, "invalid_value", f"Invalid '{row_param}': expected at least one frame.",
                               row_param)
        elif len(row) != length:
            raise ApiError(400, "invalid_value",
                           f"Invalid '{row_param}': expected {length} frames like codebook 0, got {len(row)}.",
                           row_param)
        limit = info.codebook_limit(q)
        for t, code in enumerate(row):
            if isinstance(code, bool) or not isinstance(code, int):
                raise errors.invalid_type(f"{row_param}[{t}]", "an integer", type_name(code))
            if not 0 <= code < limit:
                raise errors.out_of_range(f"{row_param}[{t}]", 0, limit - 1, code)
    return value


def _reference_ids(value, references: list[ClipSpec]) -> list[tuple[int, str, str]]:
    if value is None:
        return []
    if isinstance(value, str):
        entries = [(0, value, "reference_id")]
    elif isinstance(value, list):
        if len(value) > 16:
            raise errors.out_of_range("reference_id", 0, 16, len(value))
        entries = []
        for i, item in enumerate(value):
            if item is None:
                continue
            if not isinstance(item, str):
                raise errors.invalid_type(f"reference_id[{i}]", "a string or null", type_name(item))
            entries.append((i, item, f"reference_id[{i}]"))
    else:
        raise errors.invalid_type("reference_id", "a string or an array", type_name(value))
    inline_speakers = {clip.speaker for clip in references}
    out = []
    for speaker, voice_id, param in entries:
        voice_id = check_voice_id(voice_id, param)
        if speaker in inline_speakers:
            raise errors.conflicting(param, "references")
        out.append((speaker, voice_id, param))
    return out


def _history(value, info: ModelInfo) -> list[ClipSpec]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise errors.invalid_type("history", "an array", type_name(value))
    if len(value) > 32:
        raise errors.out_of_range("history", 0, 32, len(value))
    items = []
    for i, item in enumerate(value):
        path = f"history[{i}]"
        if isinstance(item, dict) and item.get("take_id") is not None:
            check_keys(item, ("take_id",), path)
            take_id = get_str(item, "take_id", f"{path}.take_id", required=True, blank_ok=False)
            items.append(ClipSpec(param=path, take_id=take_id))
        else:
            items.append(_clip(item, path, info, allow_speaker=True, max_seconds=60))
    return items
