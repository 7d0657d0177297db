from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("sid", "mode", "instructions", "replace", "gateway_admits")
    SID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ADMITS_FIELD_NUMBER: _ClassVar[int]
    sid: str
    mode: str
    instructions: str
    replace: bool
    gateway_admits: bool
    def __init__(self, sid: _Optional[str] = ..., mode: _Optional[str] = ..., instructions: _Optional[str] = ..., replace: _Optional[bool] = ..., gateway_admits: _Optional[bool] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("ok", "error", "refused", "admission_cap", "sessions")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_CAP_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    refused: str
    admission_cap: int
    sessions: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., refused: _Optional[str] = ..., admission_cap: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("sid",)
    SID_FIELD_NUMBER: _ClassVar[int]
    sid: str
    def __init__(self, sid: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class SessionInput(_message.Message):
    __slots__ = ("sid", "new_turn", "audio_pcm16", "sample_rate", "text", "cancel", "max_tokens", "clear_audio", "max_output_tokens", "turn_detection")
    SID_FIELD_NUMBER: _ClassVar[int]
    NEW_TURN_FIELD_NUMBER: _ClassVar[int]
    AUDIO_PCM16_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLEAR_AUDIO_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TURN_DETECTION_FIELD_NUMBER: _ClassVar[int]
    sid: str
    new_turn: bool
    audio_pcm16: bytes
    sample_rate: int
    text: str
    cancel: bool
    max_tokens: int
    clear_audio: bool
    max_output_tokens: int
    turn_detection: TurnDetection
    def __init__(self, sid: _Optional[str] = ..., new_turn: _Optional[bool] = ..., audio_pcm16: _Optional[bytes] = ..., sample_rate: _Optional[int] = ..., text: _Optional[str] = ..., cancel: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., clear_audio: _Optional[bool] = ..., max_output_tokens: _Optional[int] = ..., turn_detection: _Optional[_Union[TurnDetection, _Mapping]] = ...) -> None: ...

class TurnDetection(_message.Message):
    __slots__ = ("server_vad", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response", "interrupt_response")
    SERVER_VAD_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PADDING_MS_FIELD_NUMBER: _ClassVar[int]
    SILENCE_DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    CREATE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    INTERRUPT_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    server_vad: bool
    threshold: float
    prefix_padding_ms: int
    silence_duration_ms: int
    create_response: bool
    interrupt_response: bool
    def __init__(self, server_vad: _Optional[bool] = ..., threshold: _Optional[float] = ..., prefix_padding_ms: _Optional[int] = ..., silence_duration_ms: _Optional[int] = ..., create_response: _Optional[bool] = ..., interrupt_response: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("sessions", "tokens_per_tick", "tick", "speech_ahead")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_TICK_FIELD_NUMBER: _ClassVar[int]
    TICK_FIELD_NUMBER: _ClassVar[int]
    SPEECH_AHEAD_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInput]
    tokens_per_tick: int
    tick: int
    speech_ahead: bool
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInput, _Mapping]]] = ..., tokens_per_tick: _Optional[int] = ..., tick: _Optional[int] = ..., speech_ahead: _Optional[bool] = ...) -> None: ...

class SessionOutput(_message.Message):
    __slots__ = ("sid", "tokens", "text", "finished", "error", "preempted", "transcript", "input_dbfs", "input_clipping", "audio_pcm16", "audio_sample_rate", "error_code", "speech_started_ms", "speech_stopped_ms", "cancelled", "input_tokens", "audio_transcript")
    SID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    INPUT_DBFS_FIELD_NUMBER: _ClassVar[int]
    INPUT_CLIPPING_FIELD_NUMBER: _ClassVar[int]
    AUDIO_PCM16_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    SPEECH_STARTED_MS_FIELD_NUMBER: _ClassVar[int]
    SPEECH_STOPPED_MS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    sid: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    error: str
    preempted: bool
    transcript: str
    input_dbfs: float
    input_clipping: float
    audio_pcm16: bytes
    audio_sample_rate: int
    error_code: str
    speech_started_ms: int
    speech_stopped_ms: int
    cancelled: bool
    input_tokens: int
    audio_transcript: str
    def __init__(self, sid: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., error: _Optional[str] = ..., preempted: _Optional[bool] = ..., transcript: _Optional[str] = ..., input_dbfs: _Optional[float] = ..., input_clipping: _Optional[float] = ..., audio_pcm16: _Optional[bytes] = ..., audio_sample_rate: _Optional[int] = ..., error_code: _Optional[str] = ..., speech_started_ms: _Optional[int] = ..., speech_stopped_ms: _Optional[int] = ..., cancelled: _Optional[bool] = ..., input_tokens: _Optional[int] = ..., audio_transcript: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("outputs", "gpu_ms", "in_flight", "frontend_ms", "prefill_ms", "decode_ms", "kv_blocks_used", "kv_blocks_total", "worker_ms", "draining", "speech_only")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    GPU_MS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WORKER_MS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SPEECH_ONLY_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[SessionOutput]
    gpu_ms: float
    in_flight: int
    frontend_ms: float
    prefill_ms: float
    decode_ms: float
    kv_blocks_used: int
    kv_blocks_total: int
    worker_ms: float
    draining: bool
    speech_only: bool
    def __init__(self, outputs: _Optional[_Iterable[_Union[SessionOutput, _Mapping]]] = ..., gpu_ms: _Optional[float] = ..., in_flight: _Optional[int] = ..., frontend_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., worker_ms: _Optional[float] = ..., draining: _Optional[bool] = ..., speech_only: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ready", "model", "budget_ms", "capacity_sessions", "kv_blocks_used", "kv_blocks_total", "sessions", "input_sample_rate", "kv_policy", "max_input_tokens", "max_instruction_tokens", "admission_cap", "draining")
    READY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    INPUT_SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    KV_POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_INSTRUCTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_CAP_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    model: str
    budget_ms: float
    capacity_sessions: int
    kv_blocks_used: int
    kv_blocks_total: int
    sessions: int
    input_sample_rate: int
    kv_policy: str
    max_input_tokens: int
    max_instruction_tokens: int
    admission_cap: int
    draining: bool
    def __init__(self, ready: _Optional[bool] = ..., model: _Optional[str] = ..., budget_ms: _Optional[float] = ..., capacity_sessions: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., sessions: _Optional[int] = ..., input_sample_rate: _Optional[int] = ..., kv_policy: _Optional[str] = ..., max_input_tokens: _Optional[int] = ..., max_instruction_tokens: _Optional[int] = ..., admission_cap: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...
