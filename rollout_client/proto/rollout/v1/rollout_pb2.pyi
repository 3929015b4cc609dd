from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogprobMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROB_MODE_UNSPECIFIED: _ClassVar[LogprobMode]
    LOGPROB_MODE_RAW: _ClassVar[LogprobMode]
    LOGPROB_MODE_PROCESSED: _ClassVar[LogprobMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_WAIT: _ClassVar[PauseMode]
    PAUSE_MODE_KEEP: _ClassVar[PauseMode]

class KvCache(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_UNSPECIFIED: _ClassVar[KvCache]
    KV_CACHE_RECOMPUTE: _ClassVar[KvCache]
    KV_CACHE_KEEP: _ClassVar[KvCache]

class WeightsFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHTS_FORMAT_UNSPECIFIED: _ClassVar[WeightsFormat]
    WEIGHTS_FORMAT_SAFETENSORS: _ClassVar[WeightsFormat]
    WEIGHTS_FORMAT_ORBAX: _ClassVar[WeightsFormat]
LOGPROB_MODE_UNSPECIFIED: LogprobMode
LOGPROB_MODE_RAW: LogprobMode
LOGPROB_MODE_PROCESSED: LogprobMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_WAIT: PauseMode
PAUSE_MODE_KEEP: PauseMode
KV_CACHE_UNSPECIFIED: KvCache
KV_CACHE_RECOMPUTE: KvCache
KV_CACHE_KEEP: KvCache
WEIGHTS_FORMAT_UNSPECIFIED: WeightsFormat
WEIGHTS_FORMAT_SAFETENSORS: WeightsFormat
WEIGHTS_FORMAT_ORBAX: WeightsFormat

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop_token_ids", "seed", "stop_strings")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int
    stop_token_ids: TokenIdList
    seed: int
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Union[TokenIdList, _Mapping]] = ..., seed: _Optional[int] = ..., stop_strings: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIdList(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "num_samples", "sample_indices", "logprob_mode", "min_policy_version", "stream_chunk_tokens", "heartbeat_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDICES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_MODE_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STREAM_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: bytes
    sampling: SamplingParams
    num_samples: int
    sample_indices: _containers.RepeatedScalarFieldContainer[int]
    logprob_mode: LogprobMode
    min_policy_version: int
    stream_chunk_tokens: int
    heartbeat_s: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_samples: _Optional[int] = ..., sample_indices: _Optional[_Iterable[int]] = ..., logprob_mode: _Optional[_Union[LogprobMode, str]] = ..., min_policy_version: _Optional[int] = ..., stream_chunk_tokens: _Optional[int] = ..., heartbeat_s: _Optional[float] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("start", "end", "policy_version")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    policy_version: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "generate_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    GENERATE_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    generate_s: float
    def __init__(self, queue_s: _Optional[float] = ..., generate_s: _Optional[float] = ...) -> None: ...

class SampleChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "version_spans")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    logprobs: bytes
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    def __init__(self, token_ids: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ...) -> None: ...

class SampleResult(_message.Message):
    __slots__ = ("token_ids", "logprobs", "version_spans", "finish_reason", "prompt_tokens", "completion_tokens", "timings", "sampling")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    logprobs: bytes
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    sampling: SamplingParams
    def __init__(self, token_ids: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("sample_index", "chunk", "final", "heartbeat")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    chunk: SampleChunk
    final: SampleResult
    heartbeat: Heartbeat
    def __init__(self, sample_index: _Optional[int] = ..., chunk: _Optional[_Union[SampleChunk, _Mapping]] = ..., final: _Optional[_Union[SampleResult, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("policy_version", "vocab_size", "eos_token_ids", "model_config_hash", "dtype", "max_seq_len", "paused", "compiled_programs")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    COMPILED_PROGRAMS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_config_hash: str
    dtype: str
    max_seq_len: int
    paused: bool
    compiled_programs: int
    def __init__(self, policy_version: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., model_config_hash: _Optional[str] = ..., dtype: _Optional[str] = ..., max_seq_len: _Optional[int] = ..., paused: _Optional[bool] = ..., compiled_programs: _Optional[int] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode", "kv_cache")
    MODE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    kv_cache: KvCache
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ..., kv_cache: _Optional[_Union[KvCache, str]] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("policy_version", "path", "format")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    path: str
    format: WeightsFormat
    def __init__(self, policy_version: _Optional[int] = ..., path: _Optional[str] = ..., format: _Optional[_Union[WeightsFormat, str]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class WeightsHeader(_message.Message):
    __slots__ = ("policy_version", "num_tensors")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    num_tensors: int
    def __init__(self, policy_version: _Optional[int] = ..., num_tensors: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("header", "tensor")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    tensor: TensorChunk
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., tensor: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...
