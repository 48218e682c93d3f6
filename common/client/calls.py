"""Every RPC the clients make, built once for both: its llm.v1 request from the method's arguments,
and how each reply becomes a plain result (common/client/results.py). `Client` and `AsyncClient`
only send a call and hand back what its `decode` makes of the replies.

Adding an RPC: a function here that returns its `Call`, and a thin method on both clients.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from common.client.results import (ChatChunk, CompletionChunk, FinishReason, ModelInfo, Tool, ToolCall, TopLogprobs,
                                   Usage, WorkerGroupInfo)
from common.client.sampling import SamplingParams
from common.pb.llm.v1 import generation_pb2 as pb

GENERATION = "llm.v1.Generation"
HEALTH = "grpc.health.v1.Health"

Prompt = str | Sequence[int]
ChatMessage = dict[str, Any]   # {"role": ..., "content": ..., "tool_calls": [...], "tool_call_id": ...}

_FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


@dataclass(frozen=True)
class Call:
    """One RPC: which method, its request, and `decode`, which makes its reply (of a stream: each
    reply) into the method's result. A stream's `params` say how its chunks fold."""
    method: str
    request: Message
    decode: Callable[[Any], Any]
    service: str = GENERATION
    params: SamplingParams | None = None


def generate(prompt: Prompt, params: SamplingParams, request_id: str) -> Call:
    request = pb.GenerateRequest(request_id=request_id, sampling=params.to_proto())
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be a str or a sequence of token ids, not bytes")
    else:
        request.token_ids.ids.extend(prompt)
    return Call("Generate", request, lambda message: _chunk(message, params), params=params)


def chat(messages: Sequence[ChatMessage], params: SamplingParams, *, tools: Sequence[Tool | dict[str, Any]],
         tool_choice: str, enable_thinking: bool | None, request_id: str) -> Call:
    """A ChatRequest from OpenAI-style messages (tool calls as {"id", "name", "arguments"} or
    {"id", "function": {"name", "arguments"}}, arguments a dict or its JSON text) and tools
    (Tool, or {"name", "description", "parameters"} dicts, optionally under "function")."""
    request = pb.ChatRequest(request_id=request_id, tool_choice=tool_choice, sampling=params.to_proto())
    for message in messages:
        msg = request.messages.add(role=message["role"], content=message.get("content") or "",
                                   tool_call_id=message.get("tool_call_id", ""))
        if message.get("reasoning_content") is not None:
            msg.reasoning_content = message["reasoning_content"]
        for call in message.get("tool_calls") or ():
            function = call.get("function", call)
            arguments = function.get("arguments", {})
            msg.tool_calls.add(id=call.get("id", ""), name=function["name"],
                               arguments_json=arguments if isinstance(arguments, str) else json.dumps(arguments))
    for tool in tools:
        if isinstance(tool, dict):
            tool = tool.get("function", tool)
            tool = Tool(tool["name"], tool.get("description", ""), tool.get("parameters"))
        request.tools.add(name=tool.name, description=tool.description,
                          parameters_json=json.dumps(tool.parameters) if tool.parameters is not None else "")
    if enable_thinking is not None:
        request.enable_thinking = enable_thinking
    return Call("Chat", request, lambda message: _chat_chunk(message, params), params=params)


def tokenize(text: str, add_special_tokens: bool) -> Call:
    return Call("Tokenize", pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                lambda reply: list(reply.token_ids))


def detokenize(token_ids: Sequence[int], skip_special_tokens: bool, each_token: bool) -> Call:
    """The text of `token_ids`, or with each_token the text of each on its own."""
    request = pb.DetokenizeRequest(token_ids=token_ids, each_token=each_token, skip_special_tokens=skip_special_tokens)
    return Call("Detokenize", request, lambda reply: list(reply.token_texts) if each_token else reply.text)


def abort(request_id: str) -> Call:
    return Call("Abort", pb.AbortRequest(request_id=request_id), lambda reply: reply.found)


def model_info() -> Call:
    return Call("GetModelInfo", pb.GetModelInfoRequest(), _model_info)


def health(service: str) -> Call:
    """grpc.health.v1's answer for `service`: SERVING, NOT_SERVING or SERVICE_UNKNOWN."""
    return Call("Check", health_pb2.HealthCheckRequest(service=service),
                lambda reply: health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), service=HEALTH)


def _usage(usage: pb.Usage) -> Usage:
    return Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens)


def _tops(tops) -> list[TopLogprobs]:
    return [(list(t.token_ids), list(t.logprobs)) for t in tops]


def _chunk(message: pb.GenerateResponse, params: SamplingParams) -> CompletionChunk:
    finished = message.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    want_top = bool(params.top_logprobs)
    prompt = params.prompt_logprobs and len(message.prompt_logprobs) > 0   # in sample 0's first message
    return CompletionChunk(
        request_id=message.request_id,
        text=message.text,
        token_ids=list(message.token_ids),
        logprobs=list(message.logprobs) if params.logprobs or want_top else None,
        finish_reason=_FINISH_REASONS.get(message.finish_reason) if finished else None,
        usage=_usage(message.usage) if message.HasField("usage") else None,
        index=message.index,
        top_logprobs=_tops(message.top_logprobs) if want_top else None,
        matched_stop=message.matched_stop or None if finished else None,
        prompt_logprobs=list(message.prompt_logprobs) if prompt else None,
        prompt_top_logprobs=_tops(message.prompt_top_logprobs) if prompt and want_top else None,
    )


def _chat_chunk(message: pb.ChatResponse, params: SamplingParams) -> ChatChunk:
    finished = message.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    want_top = bool(params.top_logprobs)
    prompt = params.prompt_logprobs and len(message.prompt_logprobs) > 0   # in sample 0's first message
    return ChatChunk(
        request_id=message.request_id, text=message.text, reasoning=message.reasoning_text,
        tool_calls=[ToolCall(c.id, c.name, json.loads(c.arguments_json)) for c in message.tool_calls],
        token_ids=list(message.token_ids),
        finish_reason=_FINISH_REASONS.get(message.finish_reason) if finished else None,
        usage=_usage(message.usage) if message.HasField("usage") else None,
        index=message.index, matched_stop=message.matched_stop or None if finished else None,
        logprobs=list(message.logprobs) if params.logprobs or want_top else None,
        top_logprobs=_tops(message.top_logprobs) if want_top else None,
        prompt_logprobs=list(message.prompt_logprobs) if prompt else None,
        prompt_top_logprobs=_tops(message.prompt_top_logprobs) if prompt and want_top else None)


def _model_info(info: pb.ModelInfo) -> ModelInfo:
    groups = [WorkerGroupInfo(
        addresses=list(g.addresses), healthy=g.healthy, device=g.device, attention_backend=g.attention_backend,
        tensor_parallel_size=g.tensor_parallel_size, num_kv_blocks=g.num_kv_blocks,
        num_free_kv_blocks=g.num_free_kv_blocks, num_running=g.num_running, num_preemptions=g.num_preemptions,
        prefix_cache_queried_tokens=g.prefix_cache_queried_tokens, prefix_cache_hit_tokens=g.prefix_cache_hit_tokens,
        kv_cache_dtype=g.kv_cache_dtype,
    ) for g in info.worker_groups]
    return ModelInfo(info.model, info.max_model_len, info.vocab_size, list(info.eos_token_ids), info.block_size,
                     info.num_kv_blocks, groups, info.speculative_method, info.num_speculative_tokens)
