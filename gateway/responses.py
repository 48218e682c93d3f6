"""POST /v1/responses: OpenAI's Responses API over one llm.v1 Chat call.

The answer's `output` is the turn's items in order: a reasoning item (when the model reasoned),
a message of output_text, and one function_call item per tool call. A turn cut by
max_output_tokens is `incomplete` with incomplete_details.reason "max_output_tokens".

Streamed, the events follow the spec's sequence, each numbered (sequence_number):
response.created, response.in_progress; per item response.output_item.added, then its content
(response.content_part.added, response.output_text.delta ... response.output_text.done,
response.content_part.done; reasoning_text events alike; function_call_arguments delta and
done), response.output_item.done; then response.completed (or response.incomplete). A failure
after the headers, or a scheduler stream that ends before its finish, is an `error` event followed
by response.failed, whose output holds what the deltas sent. Every event is `event: TYPE` + `data: {...}`.
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

from common.client import ChatChunk, ChatCompletion, RequestError, ToolCall, Usage
from common.logging_setup import request_context
from gateway import outputs
from gateway.json_body import StrictJSONRoute
from gateway.errors import from_request_error
from gateway.responses_request import ResponsesRequest, renamed, to_chat
from gateway.state import Gateway, gateway_of
from gateway.streaming import EventStream, opened, stream_failure, unless_disconnected

logger = logging.getLogger(__name__)

ROUTE = "/v1/responses"
router = APIRouter(route_class=StrictJSONRoute)


@router.post(ROUTE)
async def post_responses(req: ResponsesRequest, request: Request):
    return outputs.whole(await responses(gateway_of(request), req, request))


async def responses(gateway: Gateway, req: ResponsesRequest, request: Request):
    call, origins = to_chat(req)
    model = await gateway.check_model(req.model)
    rid = req.request_id or uuid.uuid4().hex
    shell = _shell(req, rid, model)
    kwargs = dict(tools=call.tools, tool_choice=call.tool_choice, enable_thinking=call.enable_thinking, request_id=rid)
    try:
        with request_context(rid):
            if req.stream:
                chunks = await opened(request, gateway.client.stream_chat(call.messages, call.sampling, **kwargs))
                return EventStream(_events(gateway, chunks, shell, rid))
            result: ChatCompletion = await unless_disconnected(
                request, gateway.client.chat(call.messages, call.sampling, **kwargs))
    except RequestError as exc:
        raise renamed(from_request_error(exc), origins) from None
    usage = outputs.UsageTotal()
    usage.add(result.usage, first_sample=True)
    gateway.metrics.count_usage(ROUTE, usage)
    items = _items(rid, result.reasoning, result.text, result.tool_calls, result.finish_reason)
    return _finished(shell, items, result.finish_reason, result.usage)


def _shell(req: ResponsesRequest, rid: str, model: str) -> dict[str, Any]:
    """The response object before its output: what the request set, as OpenAI echoes it."""
    choice = req.tool_choice
    return {
        "id": f"resp_{rid}", "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": model, "output": [], "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p,
        "tools": [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools or ()],
        "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": req.text.format.model_dump(exclude_none=True, by_alias=True)
                 if req.text is not None and req.text.format is not None else {"type": "text"}},
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "previous_response_id": None, "store": False, "truncation": "disabled", "background": False,
        "metadata": req.metadata or {}, "user": req.user, "usage": None,
    }


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _finished(shell: dict[str, Any], items: list[dict[str, Any]], finish_reason: str | None,
              usage: Usage | None) -> dict[str, Any]:
    cut = finish_reason == "length"
    return {**shell, "status": "incomplete" if cut else "completed", "output": items,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "usage": _usage(usage)}


def _reasoning_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(rid: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments, ensure_ascii=False), "status": "completed"}


def _items(rid: str, reasoning: str, text: str, calls: list[ToolCall], finish_reason: str) -> list[dict[str, Any]]:
    status = "incomplete" if finish_reason == "length" else "completed"
    items = [_reasoning_item(rid, reasoning, status)] if reasoning else []
    if text or not calls:
        items.append(_message_item(rid, text, status))
    return items + [_call_item(c) for c in calls]


class _EventWriter:
    """Numbers the events of one stream and keeps its items as they are built."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: str | None = None        # "reasoning" or "message": the item receiving deltas
        self.open_rid = rid                 # what its id is made of
        self.text = ""
        self.opened = {"reasoning": 0, "message": 0}

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return outputs.sse(payload, event=kind)

    def start(self, kind: str) -> list[str]:
        """Opens a reasoning or message item (closing the open one). Text after a tool call is a
        second message item: its id is the first's with a suffix, as each item's id is its own."""
        events = self.close("completed")
        self.open_rid = self.rid if not self.opened[kind] else f"{self.rid}_{self.opened[kind]}"
        self.opened[kind] += 1
        item = self._item(kind, "", "in_progress")
        item["content"] = []
        self.items.append(item)
        self.open, self.text = kind, ""
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part("")
        index = len(self.items) - 1
        return events + [self.event("response.output_item.added", output_index=index, item=item),
                         self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                    content_index=0, part=part)]

    def _item(self, kind: str, text: str, status: str) -> dict[str, Any]:
        """The open item (of `kind`) as it stands."""
        return _reasoning_item(self.open_rid, text, status) if kind == "reasoning" else \
            _message_item(self.open_rid, text, status)

    def delta(self, kind: str, text: str) -> list[str]:
        events = self.start(kind) if self.open != kind else []
        self.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self.event(name, item_id=self.items[-1]["id"], output_index=len(self.items) - 1,
                                    content_index=0, delta=text, **extra)]

    def close(self, status: str) -> list[str]:
        if self.open is None:
            return []
        kind, self.open = self.open, None
        index = len(self.items) - 1
        item = self._item(kind, self.text, status)
        self.items[index] = item
        part = item["content"][0]
        done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
        return [self.event(done, item_id=item["id"], output_index=index, content_index=0, text=self.text),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def cut(self) -> list[dict[str, Any]]:
        """The items so far, the open one holding the text its deltas sent (a failed response's output)."""
        if self.open is None:
            return self.items
        return [*self.items[:-1], self._item(self.open, self.text, "incomplete")]

    def call(self, call: ToolCall) -> list[str]:
        events = self.close("completed")
        item = _call_item(call)
        self.items.append(item)
        index = len(self.items) - 1
        return events + [
            self.event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                "status": "in_progress"}),
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=item["arguments"]),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=item)]


async def _events(gateway: Gateway, chunks: AsyncIterator[ChatChunk], shell: dict[str, Any],
                  rid: str) -> AsyncIterator[str]:
    writer = _EventWriter(rid)
    yield writer.event("response.created", response=shell)
    yield writer.event("response.in_progress", response=shell)
    usage = outputs.UsageTotal()
    try:
        async with contextlib.aclosing(chunks):   # closed when left (a client gone), not when garbage-collected
            async for chunk in chunks:
                for event in _chunk_events(writer, chunk):
                    yield event
                if chunk.finish_reason is not None:
                    usage.add(chunk.usage, first_sample=True)
                    status = "incomplete" if chunk.finish_reason == "length" else "completed"
                    for event in writer.close(status):
                        yield event
                    if not writer.items or all(i["type"] == "reasoning" for i in writer.items):
                        for event in [*writer.start("message"), *writer.close(status)]:   # an empty answer
                            yield event
                    final = _finished(shell, writer.items, chunk.finish_reason, chunk.usage)
                    yield writer.event(f"response.{final['status']}", response=final)
                    return
        # As the unstreamed answer's accumulator refuses it: the events end with what failed.
        raise RequestError("INTERNAL", "the stream ended without a finish reason")
    except Exception as exc:  # noqa: BLE001 - the headers are sent: the stream's last events say what failed
        error = stream_failure(exc)["error"]
        yield writer.event("error", code=error["code"], message=error["message"], param=error["param"])
        yield writer.event("response.failed", response={**shell, "status": "failed", "output": writer.cut(),
                                                        "error": {"code": error["code"], "message": error["message"]}})
    finally:
        gateway.metrics.count_usage(ROUTE, usage)


def _chunk_events(writer: _EventWriter, chunk: ChatChunk) -> list[str]:
    events = []
    if chunk.reasoning:
        events += writer.delta("reasoning", chunk.reasoning)
    if chunk.text:
        events += writer.delta("message", chunk.text)
    for call in chunk.tool_calls:
        events += writer.call(call)
    return events
