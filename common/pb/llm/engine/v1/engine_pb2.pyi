from common.pb.llm.common.v1 import top_logprobs_pb2 as _top_logprobs_pb2
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
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class AttachRequest(_message.Message):
    __slots__ = ("frontend_id",)
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    frontend_id: int
    def __init__(self, frontend_id: _Optional[int] = ...) -> None: ...

class CoreStatus(_message.Message):
    __slots__ = ("accepting", "reason", "max_model_len", "features")
    ACCEPTING_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    accepting: bool
    reason: str
    max_model_len: int
    features: _containers.RepeatedCompositeFieldContainer[Feature]
    def __init__(self, accepting: _Optional[bool] = ..., reason: _Optional[str] = ..., max_model_len: _Optional[int] = ..., features: _Optional[_Iterable[_Union[Feature, _Mapping]]] = ...) -> None: ...

class Feature(_message.Message):
    __slots__ = ("name", "available", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    available: bool
    detail: str
    def __init__(self, name: _Optional[str] = ..., available: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class CoreEvent(_message.Message):
    __slots__ = ("status", "outputs")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    status: CoreStatus
    outputs: StepOutputs
    def __init__(self, status: _Optional[_Union[CoreStatus, _Mapping]] = ..., outputs: _Optional[_Union[StepOutputs, _Mapping]] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("seq_ids", "token_ids", "logprobs", "finished", "top_logprobs", "prompt_logprobs")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finished: _containers.RepeatedCompositeFieldContainer[FinishedRequest]
    top_logprobs: _top_logprobs_pb2.TopLogprobColumns
    prompt_logprobs: PromptLogprobs
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finished: _Optional[_Iterable[_Union[FinishedRequest, _Mapping]]] = ..., top_logprobs: _Optional[_Union[_top_logprobs_pb2.TopLogprobColumns, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_ids", "counts", "logprobs", "top")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top: _top_logprobs_pb2.TopLogprobColumns
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top: _Optional[_Union[_top_logprobs_pb2.TopLogprobColumns, _Mapping]] = ...) -> None: ...

class FinishedRequest(_message.Message):
    __slots__ = ("seq_id", "reason", "num_output_tokens", "num_cached_prompt_tokens", "error_code", "error_message", "error_about_constraint")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_ABOUT_CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    reason: FinishReason
    num_output_tokens: int
    num_cached_prompt_tokens: int
    error_code: str
    error_message: str
    error_about_constraint: bool
    def __init__(self, seq_id: _Optional[int] = ..., reason: _Optional[_Union[FinishReason, str]] = ..., num_output_tokens: _Optional[int] = ..., num_cached_prompt_tokens: _Optional[int] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., error_about_constraint: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "ignore_eos", "stop_token_ids", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "prompt_logprobs", "constraint", "priority", "logit_bias", "speculative")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    constraint: Constraint
    priority: int
    logit_bias: _containers.ScalarMap[int, float]
    speculative: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., priority: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., speculative: _Optional[bool] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("seq_id", "request_id", "prompt_token_ids", "sampling", "sample_index")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    sample_index: int
    def __init__(self, seq_id: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., sample_index: _Optional[int] = ...) -> None: ...

class AddRequestsRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ...) -> None: ...

class AddResult(_message.Message):
    __slots__ = ("code", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OK: _ClassVar[AddResult.Code]
        ALREADY_EXISTS: _ClassVar[AddResult.Code]
        RESOURCE_EXHAUSTED: _ClassVar[AddResult.Code]
        UNAVAILABLE: _ClassVar[AddResult.Code]
        INVALID_ARGUMENT: _ClassVar[AddResult.Code]
    OK: AddResult.Code
    ALREADY_EXISTS: AddResult.Code
    RESOURCE_EXHAUSTED: AddResult.Code
    UNAVAILABLE: AddResult.Code
    INVALID_ARGUMENT: AddResult.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: AddResult.Code
    message: str
    def __init__(self, code: _Optional[_Union[AddResult.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...

class AddRequestsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AddResult]
    def __init__(self, results: _Optional[_Iterable[_Union[AddResult, _Mapping]]] = ...) -> None: ...

class AbortRequestsRequest(_message.Message):
    __slots__ = ("seq_ids", "reason", "notify", "request_id")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NOTIFY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: FinishReason
    notify: bool
    request_id: str
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[_Union[FinishReason, str]] = ..., notify: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class AbortRequestsResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PauseRequestsRequest(_message.Message):
    __slots__ = ("pause_seq_ids", "resume_seq_ids")
    PAUSE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    pause_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pause_seq_ids: _Optional[_Iterable[int]] = ..., resume_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PauseRequestsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerGroupState(_message.Message):
    __slots__ = ("addresses", "healthy", "num_kv_blocks", "num_free_kv_blocks", "num_running", "num_waiting", "device", "attention_backend", "num_preemptions", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "block_size", "max_model_len", "num_paused", "kv_cache_dtype", "speculative_method", "num_speculative_tokens")
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_PAUSED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    healthy: bool
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_running: int
    num_waiting: int
    device: str
    attention_backend: str
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    block_size: int
    max_model_len: int
    num_paused: int
    kv_cache_dtype: str
    speculative_method: str
    num_speculative_tokens: int
    def __init__(self, addresses: _Optional[_Iterable[str]] = ..., healthy: _Optional[bool] = ..., num_kv_blocks: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., num_preemptions: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_paused: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., speculative_method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...

class CoreInfo(_message.Message):
    __slots__ = ("status", "groups")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    status: CoreStatus
    groups: _containers.RepeatedCompositeFieldContainer[WorkerGroupState]
    def __init__(self, status: _Optional[_Union[CoreStatus, _Mapping]] = ..., groups: _Optional[_Iterable[_Union[WorkerGroupState, _Mapping]]] = ...) -> None: ...

class FrontendReport(_message.Message):
    __slots__ = ("rejected",)
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    rejected: _containers.ScalarMap[str, int]
    def __init__(self, rejected: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
