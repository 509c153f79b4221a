from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CodecInfo(_message.Message):
    __slots__ = ("sample_rate", "codebooks", "codebook_size", "frame_rate_hz", "hop_length", "max_encode_seconds", "open_sessions", "build", "semantic_codebook_size")
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    CODEBOOK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FRAME_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    HOP_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_ENCODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    SEMANTIC_CODEBOOK_SIZE_FIELD_NUMBER: _ClassVar[int]
    sample_rate: int
    codebooks: int
    codebook_size: int
    frame_rate_hz: float
    hop_length: int
    max_encode_seconds: float
    open_sessions: int
    build: str
    semantic_codebook_size: int
    def __init__(self, sample_rate: _Optional[int] = ..., codebooks: _Optional[int] = ..., codebook_size: _Optional[int] = ..., frame_rate_hz: _Optional[float] = ..., hop_length: _Optional[int] = ..., max_encode_seconds: _Optional[float] = ..., open_sessions: _Optional[int] = ..., build: _Optional[str] = ..., semantic_codebook_size: _Optional[int] = ...) -> None: ...

class Pcm(_message.Message):
    __slots__ = ("samples", "sample_rate")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    samples: bytes
    sample_rate: int
    def __init__(self, samples: _Optional[bytes] = ..., sample_rate: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("audio_file", "pcm", "min_seconds", "max_seconds")
    AUDIO_FILE_FIELD_NUMBER: _ClassVar[int]
    PCM_FIELD_NUMBER: _ClassVar[int]
    MIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    audio_file: bytes
    pcm: Pcm
    min_seconds: float
    max_seconds: float
    def __init__(self, audio_file: _Optional[bytes] = ..., pcm: _Optional[_Union[Pcm, _Mapping]] = ..., min_seconds: _Optional[float] = ..., max_seconds: _Optional[float] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("codes", "n_frames", "duration_s", "sha256", "codebooks")
    CODES_FIELD_NUMBER: _ClassVar[int]
    N_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    codes: bytes
    n_frames: int
    duration_s: float
    sha256: str
    codebooks: int
    def __init__(self, codes: _Optional[bytes] = ..., n_frames: _Optional[int] = ..., duration_s: _Optional[float] = ..., sha256: _Optional[str] = ..., codebooks: _Optional[int] = ...) -> None: ...

class DecodeStart(_message.Message):
    __slots__ = ("session_id", "first_chunk_frames")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    first_chunk_frames: int
    def __init__(self, session_id: _Optional[str] = ..., first_chunk_frames: _Optional[int] = ...) -> None: ...

class DecodeFrames(_message.Message):
    __slots__ = ("first_frame_index", "n_frames", "codes")
    FIRST_FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    N_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    first_frame_index: int
    n_frames: int
    codes: bytes
    def __init__(self, first_frame_index: _Optional[int] = ..., n_frames: _Optional[int] = ..., codes: _Optional[bytes] = ...) -> None: ...

class DecodeEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("start", "frames", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: DecodeStart
    frames: DecodeFrames
    end: DecodeEnd
    def __init__(self, start: _Optional[_Union[DecodeStart, _Mapping]] = ..., frames: _Optional[_Union[DecodeFrames, _Mapping]] = ..., end: _Optional[_Union[DecodeEnd, _Mapping]] = ...) -> None: ...

class PcmChunk(_message.Message):
    __slots__ = ("first_sample_index", "samples")
    FIRST_SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    first_sample_index: int
    samples: bytes
    def __init__(self, first_sample_index: _Optional[int] = ..., samples: _Optional[bytes] = ...) -> None: ...

class DecodeDone(_message.Message):
    __slots__ = ("total_samples",)
    TOTAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    total_samples: int
    def __init__(self, total_samples: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("pcm", "done")
    PCM_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    pcm: PcmChunk
    done: DecodeDone
    def __init__(self, pcm: _Optional[_Union[PcmChunk, _Mapping]] = ..., done: _Optional[_Union[DecodeDone, _Mapping]] = ...) -> None: ...
