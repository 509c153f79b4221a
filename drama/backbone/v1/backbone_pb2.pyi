from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    STOP: _ClassVar[FinishReason]
    LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
STOP: FinishReason
LENGTH: FinishReason

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackboneInfo(_message.Message):
    __slots__ = ("model_id", "max_rows", "max_queue", "max_context_tokens", "max_speakers", "tower_ready", "open_sessions", "free_slots", "build", "codebooks", "queued_sessions", "tower_transport")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEAKERS_FIELD_NUMBER: _ClassVar[int]
    TOWER_READY_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOWER_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    max_rows: int
    max_queue: int
    max_context_tokens: int
    max_speakers: int
    tower_ready: bool
    open_sessions: int
    free_slots: int
    build: str
    codebooks: int
    queued_sessions: int
    tower_transport: str
    def __init__(self, model_id: _Optional[str] = ..., max_rows: _Optional[int] = ..., max_queue: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., max_speakers: _Optional[int] = ..., tower_ready: _Optional[bool] = ..., open_sessions: _Optional[int] = ..., free_slots: _Optional[int] = ..., build: _Optional[str] = ..., codebooks: _Optional[int] = ..., queued_sessions: _Optional[int] = ..., tower_transport: _Optional[str] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("tokens", "codes")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    tokens: bytes
    codes: bytes
    def __init__(self, tokens: _Optional[bytes] = ..., codes: _Optional[bytes] = ...) -> None: ...

class HistoryTake(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("user_turn",)
    USER_TURN_FIELD_NUMBER: _ClassVar[int]
    user_turn: bytes
    def __init__(self, user_turn: _Optional[bytes] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_new_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    seed: int
    max_new_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class Emit(_message.Message):
    __slots__ = ("first_message_frames", "message_frames")
    FIRST_MESSAGE_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FRAMES_FIELD_NUMBER: _ClassVar[int]
    first_message_frames: int
    message_frames: int
    def __init__(self, first_message_frames: _Optional[int] = ..., message_frames: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "model", "system", "history", "chunks", "assistant_open", "assistant_close", "sampling", "emit", "queue_timeout_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_OPEN_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_CLOSE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EMIT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    system: _containers.RepeatedCompositeFieldContainer[Segment]
    history: _containers.RepeatedCompositeFieldContainer[HistoryTake]
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    assistant_open: bytes
    assistant_close: bytes
    sampling: Sampling
    emit: Emit
    queue_timeout_ms: int
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., system: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., history: _Optional[_Iterable[_Union[HistoryTake, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., assistant_open: _Optional[bytes] = ..., assistant_close: _Optional[bytes] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., emit: _Optional[_Union[Emit, _Mapping]] = ..., queue_timeout_ms: _Optional[int] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("queue_wait_ms", "prompt_text_tokens", "prompt_audio_frames")
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_AUDIO_FRAMES_FIELD_NUMBER: _ClassVar[int]
    queue_wait_ms: int
    prompt_text_tokens: int
    prompt_audio_frames: int
    def __init__(self, queue_wait_ms: _Optional[int] = ..., prompt_text_tokens: _Optional[int] = ..., prompt_audio_frames: _Optional[int] = ...) -> None: ...

class Frames(_message.Message):
    __slots__ = ("chunk_index", "first_frame_index", "n_frames", "codes")
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    N_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    chunk_index: int
    first_frame_index: int
    n_frames: int
    codes: bytes
    def __init__(self, chunk_index: _Optional[int] = ..., first_frame_index: _Optional[int] = ..., n_frames: _Optional[int] = ..., codes: _Optional[bytes] = ...) -> None: ...

class ChunkEnd(_message.Message):
    __slots__ = ("chunk_index", "n_frames", "finish_reason")
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    N_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    chunk_index: int
    n_frames: int
    finish_reason: FinishReason
    def __init__(self, chunk_index: _Optional[int] = ..., n_frames: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("text_tokens", "audio_tokens", "output_tokens")
    TEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text_tokens: int
    audio_tokens: int
    output_tokens: int
    def __init__(self, text_tokens: _Optional[int] = ..., audio_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("started", "frames", "chunk_end", "usage")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_END_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    started: Started
    frames: Frames
    chunk_end: ChunkEnd
    usage: Usage
    def __init__(self, started: _Optional[_Union[Started, _Mapping]] = ..., frames: _Optional[_Union[Frames, _Mapping]] = ..., chunk_end: _Optional[_Union[ChunkEnd, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...
