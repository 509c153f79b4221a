"""The two speech request schemas, parsed strictly (API.md §1.3 `POST /v1/audio/speech`, §2.1
`POST /v1/tts`) with the readers of `gateway/validation.py`:

    req = parse_openai_speech(data, ...) / parse_tts(data, ...)   # -> SpeechRequest or ApiError

Fields are checked in the order of the spec tables and the first problem wins.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field

from gateway import errors
from gateway.errors import ApiError
from gateway.model_info import ModelInfo
from gateway.validation import (MAX_CLIP_BYTES, check_keys, check_model, check_text, check_voice_id, get_bool,
                                get_enum, get_int, get_number, get_str, type_name)

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
_ANY_RATE = (8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000)
SAMPLE_RATES = {
    "pcm": _ANY_RATE, "wav": _ANY_RATE, "aac": _ANY_RATE, "flac": _ANY_RATE,
    "mp3": (16000, 22050, 24000, 32000, 44100, 48000),
    "opus": (8000, 12000, 16000, 24000, 48000),
}
LATENCY_FIRST_FRAMES = {"normal": 8, "balanced": 4, "low": 2}
MESSAGE_FRAMES = 8

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

# fish-audio-sdk (1.3) sends three generation fields of Fish's hosted API by default; they are
# checked and honoured as far as this model has the concept (see `_fish_generation_fields`).
_FISH_SDK_FIELDS = ("min_chunk_length", "condition_on_previous_chunks", "early_stop_threshold")
_TTS_FIELDS = frozenset({"text", "model", "references", "reference_id", "history", "use_memory_cache",
                         "format", "sample_rate", "streaming", "stream_format", "prosody",
                         "mp3_bitrate", "opus_bitrate", *_SAMPLING_FIELDS, *_FISH_SDK_FIELDS})
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
    _fish_generation_fields(data)
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


def _fish_generation_fields(data: dict) -> None:
    """Fish's `min_chunk_length`, `condition_on_previous_chunks` and `early_stop_threshold`.

    Each chunk here is conditioned on the previous one (MODEL.md §8.3), so `true` (the SDK's
    default) is what we do and `false` is refused rather than ignored. A request is one sequence,
    so the batch early-stop threshold has nothing to apply to, and the tag-aware chunker only
    makes a chunk shorter than `chunk_length` at a text boundary; both are range-checked only.
    """
    get_int(data, "min_chunk_length", "min_chunk_length", 0, 1000)
    get_number(data, "early_stop_threshold", "early_stop_threshold", 0.0, 1.0)
    if get_bool(data, "condition_on_previous_chunks", "condition_on_previous_chunks") is False:
        raise ApiError(400, "invalid_value", "Invalid 'condition_on_previous_chunks': only true is supported; "
                       "every text chunk is conditioned on the previous one.", "condition_on_previous_chunks")


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
