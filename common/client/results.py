"""What the clients return: plain, frozen dataclasses (no protobuf), and RequestError for a failed call."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import grpc

FinishReason = Literal["stop", "length", "abort", "tool_calls"]

# The most likely tokens at one position, most likely first: (token ids, logprobs).
TopLogprobs = tuple[list[int], list[float]]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int    # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class CompletionChunk:
    """One message of a stream: what is new since the previous one of its sample."""
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None          # one per token id, when requested
    finish_reason: FinishReason | None    # set on the sample's last chunk only
    usage: Usage | None                   # set on the sample's last chunk only
    index: int = 0                        # the sample (n)
    top_logprobs: list[TopLogprobs] | None = None   # one per token id, when requested
    matched_stop: str | None = None       # on the last chunk: the stop string or stop token that ended it
    prompt_logprobs: list[float] | None = None      # in sample 0's first chunk, when requested
    prompt_top_logprobs: list[TopLogprobs] | None = None


@dataclass(frozen=True)
class Completion:
    """A whole request's output (sample 0's, when it asked for n > 1: `samples` has all of them)."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[float] | None = None   # one per token id, when requested
    top_logprobs: list[TopLogprobs] | None = None
    matched_stop: str | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None
    index: int = 0
    samples: list["Completion"] = field(default_factory=list)   # every sample, by index, when n > 1


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]             # the call's arguments, parsed


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is the JSON schema of its arguments object."""
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None


@dataclass(frozen=True)
class ChatChunk:
    """One message of a chat stream: content, reasoning and complete tool calls new in it."""
    request_id: str
    text: str
    reasoning: str
    tool_calls: list[ToolCall]
    token_ids: list[int]
    finish_reason: FinishReason | None    # "tool_calls" when the turn stopped after calls
    usage: Usage | None
    index: int = 0
    matched_stop: str | None = None
    logprobs: list[float] | None = None   # one per token id (reasoning and tool-call tokens too), when requested
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[float] | None = None      # of the rendered prompt, in sample 0's first chunk
    prompt_top_logprobs: list[TopLogprobs] | None = None


@dataclass(frozen=True)
class ChatCompletion:
    """A whole chat turn (sample 0's, when n > 1: `samples` has all of them)."""
    request_id: str
    text: str
    reasoning: str
    tool_calls: list[ToolCall]
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    index: int = 0
    samples: list["ChatCompletion"] = field(default_factory=list)
    logprobs: list[float] | None = None   # one per token id, when requested
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None


@dataclass(frozen=True)
class WorkerGroupInfo:
    addresses: list[str]                  # one per tensor-parallel rank, rank 0 first
    healthy: bool
    device: str
    attention_backend: str
    tensor_parallel_size: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_running: int
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    kv_cache_dtype: str = ""              # "bfloat16", "float32", "float8_e4m3fn"


@dataclass(frozen=True)
class ModelInfo:
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_kv_blocks: int
    worker_groups: list[WorkerGroupInfo] = field(default_factory=list)
    speculative_method: str = ""          # ngram, eagle3 or draft; empty: off
    num_speculative_tokens: int = 0       # the most drafts a request verifies in one step


class RequestError(Exception):
    """A call failed; `code` is the gRPC status name, `message` the server's explanation."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> "RequestError":
        code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code.name if code is not None else "UNKNOWN", details or "")
