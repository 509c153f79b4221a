from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TowerInfo(_message.Message):
    __slots__ = ("hidden_dim", "hidden_dtype", "codebooks", "max_rows", "max_context_tokens", "max_inflight_steps", "open_sessions", "free_slots", "build", "step_socket", "instance_id", "step_ring", "device_uuid")
    HIDDEN_DIM_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_STEPS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_RING_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    hidden_dim: int
    hidden_dtype: str
    codebooks: int
    max_rows: int
    max_context_tokens: int
    max_inflight_steps: int
    open_sessions: int
    free_slots: int
    build: str
    step_socket: str
    instance_id: str
    step_ring: str
    device_uuid: str
    def __init__(self, hidden_dim: _Optional[int] = ..., hidden_dtype: _Optional[str] = ..., codebooks: _Optional[int] = ..., max_rows: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., max_inflight_steps: _Optional[int] = ..., open_sessions: _Optional[int] = ..., free_slots: _Optional[int] = ..., build: _Optional[str] = ..., step_socket: _Optional[str] = ..., instance_id: _Optional[str] = ..., step_ring: _Optional[str] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class RowEntry(_message.Message):
    __slots__ = ("session_id", "first_row", "n_rows", "draw", "take_index", "frame_index", "seed", "temperature", "top_p", "top_k", "repetition_penalty", "prefix_key", "prefix_rows", "snapshot_key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    N_ROWS_FIELD_NUMBER: _ClassVar[int]
    DRAW_FIELD_NUMBER: _ClassVar[int]
    TAKE_INDEX_FIELD_NUMBER: _ClassVar[int]
    FRAME_INDEX_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ROWS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    first_row: int
    n_rows: int
    draw: bool
    take_index: int
    frame_index: int
    seed: int
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    prefix_key: str
    prefix_rows: int
    snapshot_key: str
    def __init__(self, session_id: _Optional[str] = ..., first_row: _Optional[int] = ..., n_rows: _Optional[int] = ..., draw: _Optional[bool] = ..., take_index: _Optional[int] = ..., frame_index: _Optional[int] = ..., seed: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., prefix_key: _Optional[str] = ..., prefix_rows: _Optional[int] = ..., snapshot_key: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "rows", "hidden", "targets", "release", "trace_context", "handoff_handle", "handoff_rows", "handoff_slots", "handoff_seq", "handoff_code_columns")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_HANDLE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ROWS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_SEQ_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_CODE_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rows: _containers.RepeatedCompositeFieldContainer[RowEntry]
    hidden: bytes
    targets: bytes
    release: _containers.RepeatedScalarFieldContainer[str]
    trace_context: _containers.ScalarMap[str, str]
    handoff_handle: bytes
    handoff_rows: int
    handoff_slots: int
    handoff_seq: int
    handoff_code_columns: int
    def __init__(self, step_id: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[RowEntry, _Mapping]]] = ..., hidden: _Optional[bytes] = ..., targets: _Optional[bytes] = ..., release: _Optional[_Iterable[str]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., handoff_handle: _Optional[bytes] = ..., handoff_rows: _Optional[int] = ..., handoff_slots: _Optional[int] = ..., handoff_seq: _Optional[int] = ..., handoff_code_columns: _Optional[int] = ...) -> None: ...

class RowError(_message.Message):
    __slots__ = ("row_index", "code", "message")
    ROW_INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    row_index: int
    code: int
    message: str
    def __init__(self, row_index: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "codes", "stop", "row_errors", "tower_us", "handoff_ready", "handoff_frames_ready")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    ROW_ERRORS_FIELD_NUMBER: _ClassVar[int]
    TOWER_US_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_READY_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FRAMES_READY_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    codes: bytes
    stop: _containers.RepeatedScalarFieldContainer[bool]
    row_errors: _containers.RepeatedCompositeFieldContainer[RowError]
    tower_us: int
    handoff_ready: bool
    handoff_frames_ready: bool
    def __init__(self, step_id: _Optional[int] = ..., codes: _Optional[bytes] = ..., stop: _Optional[_Iterable[bool]] = ..., row_errors: _Optional[_Iterable[_Union[RowError, _Mapping]]] = ..., tower_us: _Optional[int] = ..., handoff_ready: _Optional[bool] = ..., handoff_frames_ready: _Optional[bool] = ...) -> None: ...
