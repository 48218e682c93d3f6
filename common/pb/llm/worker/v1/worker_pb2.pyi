from common.pb.llm.common.v1 import top_logprobs_pb2 as _top_logprobs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_model_len", "block_size", "num_kv_blocks", "rank", "world_size", "device", "attention_backend", "dtype", "instance_id", "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype", "features", "speculative_method", "num_speculative_tokens", "max_held_requests")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    rank: int
    world_size: int
    device: str
    attention_backend: str
    dtype: str
    instance_id: str
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str
    features: _containers.RepeatedCompositeFieldContainer[Feature]
    speculative_method: str
    num_speculative_tokens: int
    max_held_requests: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., dtype: _Optional[str] = ..., instance_id: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., features: _Optional[_Iterable[_Union[Feature, _Mapping]]] = ..., speculative_method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., max_held_requests: _Optional[int] = ...) -> None: ...

class Feature(_message.Message):
    __slots__ = ("name", "available", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    available: bool
    detail: str
    def __init__(self, name: _Optional[str] = ..., available: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "prompt_logprobs", "logit_bias", "constraint", "speculative")
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
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    logit_bias: _containers.ScalarMap[int, float]
    constraint: Constraint
    speculative: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., speculative: _Optional[bool] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_prompt_tokens", "num_computed_tokens", "num_scheduled_tokens", "block_ids", "sampling")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ...) -> None: ...

class CachedRequests(_message.Message):
    __slots__ = ("seq_ids", "multi_token_indices", "multi_token_counts", "new_block_indices", "new_block_counts", "new_block_ids", "draft_indices", "draft_counts")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    MULTI_TOKEN_INDICES_FIELD_NUMBER: _ClassVar[int]
    MULTI_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_INDICES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    multi_token_indices: _containers.RepeatedScalarFieldContainer[int]
    multi_token_counts: _containers.RepeatedScalarFieldContainer[int]
    new_block_indices: _containers.RepeatedScalarFieldContainer[int]
    new_block_counts: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_indices: _containers.RepeatedScalarFieldContainer[int]
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., multi_token_indices: _Optional[_Iterable[int]] = ..., multi_token_counts: _Optional[_Iterable[int]] = ..., new_block_indices: _Optional[_Iterable[int]] = ..., new_block_counts: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., draft_indices: _Optional[_Iterable[int]] = ..., draft_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "finished_seq_ids", "new_requests", "cached", "lease_epoch", "propose_drafts")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached: CachedRequests
    lease_epoch: int
    propose_drafts: bool
    def __init__(self, step_id: _Optional[int] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached: _Optional[_Union[CachedRequests, _Mapping]] = ..., lease_epoch: _Optional[int] = ..., propose_drafts: _Optional[bool] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("prepare_ms", "forward_ms", "total_ms", "device_ms")
    PREPARE_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MS_FIELD_NUMBER: _ClassVar[int]
    prepare_ms: float
    forward_ms: float
    total_ms: float
    device_ms: float
    def __init__(self, prepare_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., device_ms: _Optional[float] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("response", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: StepResponse
    error: StepError
    def __init__(self, response: _Optional[_Union[StepResponse, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("step_id", "code", "message")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    code: str
    message: str
    def __init__(self, step_id: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "token_ids", "logprobs", "timings", "top_logprobs", "prompt_logprobs", "failed", "token_counts", "num_drafts", "verified_drafts")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    timings: StepTimings
    top_logprobs: _top_logprobs_pb2.TopLogprobColumns
    prompt_logprobs: PromptLogprobs
    failed: _containers.RepeatedCompositeFieldContainer[FailedRequest]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    num_drafts: _containers.RepeatedScalarFieldContainer[int]
    verified_drafts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., top_logprobs: _Optional[_Union[_top_logprobs_pb2.TopLogprobColumns, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., failed: _Optional[_Iterable[_Union[FailedRequest, _Mapping]]] = ..., token_counts: _Optional[_Iterable[int]] = ..., num_drafts: _Optional[_Iterable[int]] = ..., verified_drafts: _Optional[_Iterable[int]] = ...) -> None: ...

class FailedRequest(_message.Message):
    __slots__ = ("seq_id", "code", "message", "about_constraint")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ABOUT_CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    code: str
    message: str
    about_constraint: bool
    def __init__(self, seq_id: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ..., about_constraint: _Optional[bool] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_ids", "first_positions", "counts", "logprobs", "top")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    first_positions: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top: _top_logprobs_pb2.TopLogprobColumns
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., first_positions: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top: _Optional[_Union[_top_logprobs_pb2.TopLogprobColumns, _Mapping]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("lease_epoch",)
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_epoch: int
    def __init__(self, lease_epoch: _Optional[int] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("owner", "epoch", "lease_ms")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    epoch: int
    lease_ms: int
    def __init__(self, owner: _Optional[str] = ..., epoch: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("instance_id", "lease_ms")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    lease_ms: int
    def __init__(self, instance_id: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class PrepareGrammarRequest(_message.Message):
    __slots__ = ("constraint", "lease_epoch")
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    constraint: Constraint
    lease_epoch: int
    def __init__(self, constraint: _Optional[_Union[Constraint, _Mapping]] = ..., lease_epoch: _Optional[int] = ...) -> None: ...

class PrepareGrammarResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
