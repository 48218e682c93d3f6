"""POST /v1/chat/completions: one llm.v1 Chat call, streamed as server-sent events or answered
whole. A turn's choices are its n samples; reasoning comes as `reasoning_content`, tool calls
whole (each in one delta when streamed, indexed within its choice); a stream that ends before each
choice's finish ends with an error event, as the unstreamed answer is refused. vLLM's `prompt_logprobs` is
the response's (the first chunk's, streamed): the gateway does not see the rendered prompt's
token ids, so each position lists its top prompt_logprobs tokens, the prompt token among them
only when it is one of them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from common.client import ChatChunk, ChatCompletion, RequestError, ToolCall
from common.logging_setup import request_context
from gateway import outputs
from gateway.json_body import StrictJSONRoute
from gateway.protocol import ChatCompletionRequest
from gateway.state import Gateway, gateway_of
from gateway.streaming import EventStream, choice_events, opened, unless_disconnected
from gateway.translate import ChatCall, chat_call

logger = logging.getLogger(__name__)

ROUTE = "/v1/chat/completions"
router = APIRouter(route_class=StrictJSONRoute)


@router.post(ROUTE)
async def post_chat_completions(req: ChatCompletionRequest, request: Request):
    return outputs.whole(await chat_completions(gateway_of(request), req, request))


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


async def chat_completions(gateway: Gateway, req: ChatCompletionRequest, request: Request):
    call = chat_call(req)
    model = await gateway.check_model(req.model)
    rid = req.request_id or uuid.uuid4().hex
    base = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": model}
    kwargs = dict(tools=call.tools, tool_choice=call.tool_choice, enable_thinking=call.enable_thinking, request_id=rid)
    with request_context(rid):
        if req.stream:
            stream = gateway.client.stream_chat(call.messages, call.sampling, **kwargs)
            items = await opened(request, outputs.merge([stream]))
            return EventStream(choice_events(lambda usage: _chat_choices(gateway, items, call, usage),
                                             {**base, "object": "chat.completion.chunk"}, req.stream_options,
                                             lambda usage: gateway.metrics.count_usage(ROUTE, usage)))
        result: ChatCompletion = await unless_disconnected(
            request, gateway.client.chat(call.messages, call.sampling, **kwargs))
    usage = outputs.UsageTotal()
    choices = []
    for sample in result.samples or [result]:
        usage.add(sample.usage, first_sample=sample.index == 0)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": sample.text if sample.text or not sample.tool_calls else None,
                                   "reasoning_content": sample.reasoning or None,
                                   "tool_calls": [tool_call_json(c) for c in sample.tool_calls]}
        choice: dict[str, Any] = {"index": sample.index, "message": message, "logprobs": None,
                                  "finish_reason": sample.finish_reason}
        if call.logprobs is not None:
            choice["logprobs"] = await _chat_logprobs(gateway, sample, call.logprobs)
        choices.append(choice)
    gateway.metrics.count_usage(ROUTE, usage)
    answer = {**base, "choices": choices, "usage": usage.to_json()}
    if call.prompt_logprobs is not None:
        answer["prompt_logprobs"] = await _prompt_logprobs(gateway, result, call.prompt_logprobs)
    return answer


async def _chat_logprobs(gateway: Gateway, sample: ChatChunk | ChatCompletion, count: int) -> dict[str, Any]:
    tops = outputs.cut_tops(sample.top_logprobs, count)
    texts = await gateway.token_texts.texts(outputs.token_ids_of(sample.token_ids, tops))
    return outputs.chat_logprobs(sample.token_ids, sample.logprobs or [], tops, texts)


async def _prompt_logprobs(gateway: Gateway, first: ChatChunk | ChatCompletion,
                           count: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs of the rendered prompt (sample 0's first chunk holds them)."""
    tops = outputs.cut_tops(first.prompt_top_logprobs, count)
    texts = await gateway.token_texts.texts(outputs.token_ids_of((), tops))
    return outputs.prompt_logprobs(None, first.prompt_logprobs or [], tops, count, texts)


async def _chat_choices(gateway: Gateway, items: AsyncIterator[tuple[int, ChatChunk]], call: ChatCall,
                        usage: outputs.UsageTotal) -> AsyncIterator[dict[str, Any]]:
    """The choices of a stream. `items` is closed however this ends (as completions' _streamed_choices):
    a client that leaves while a choice waits for its tokens' texts cancels this generator there, and
    `items`, left suspended, would keep its gRPC stream running until the garbage collector found it."""
    calls_so_far: dict[int, int] = {}   # choice index -> tool calls sent (each delta's tool_calls[].index)
    finished = set()
    async with contextlib.aclosing(items):
        async for _, chunk in items:
            i = chunk.index
            if i not in calls_so_far:   # a choice's first chunk names the role, as OpenAI's do
                calls_so_far[i] = 0
                first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                if i == 0 and call.prompt_logprobs is not None:
                    first["prompt_logprobs"] = await _prompt_logprobs(gateway, chunk, call.prompt_logprobs)
                yield first
            delta: dict[str, Any] = {}
            if chunk.text:
                delta["content"] = chunk.text
            if chunk.reasoning:
                delta["reasoning_content"] = chunk.reasoning
            if chunk.tool_calls:
                delta["tool_calls"] = [{"index": calls_so_far[i] + k, **tool_call_json(c)}
                                       for k, c in enumerate(chunk.tool_calls)]
                calls_so_far[i] += len(chunk.tool_calls)
            choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": None, "finish_reason": chunk.finish_reason}
            if call.logprobs is not None and chunk.token_ids:
                choice["logprobs"] = await _chat_logprobs(gateway, chunk, call.logprobs)
            usage.streamed_tokens += len(chunk.token_ids)
            if chunk.usage is not None:
                usage.add(chunk.usage, first_sample=i == 0)
            if chunk.finish_reason is not None:
                finished.add(i)
            if delta or chunk.finish_reason is not None or choice["logprobs"] is not None:
                yield choice
    if len(finished) < (call.sampling.n or 1):   # as the unstreamed answer's accumulator refuses it
        raise RequestError("INTERNAL", "the stream ended without a finish reason")
