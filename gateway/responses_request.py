"""The Responses API's request (POST /v1/responses) and its translation into one chat turn.

`input` is a string or a list of items: messages (input_text / output_text parts), function_call
items of earlier turns, their function_call_output items, and reasoning items; they become the
chat messages the model's template renders (a reasoning item is the next assistant turn's
reasoning, consecutive function calls one assistant turn's tool calls). `instructions` is the
system message. What the gateway cannot honour is a 400 naming the parameter: state kept
between requests (`previous_response_id`, `store`, `conversation`), built-in tools, non-text
inputs. The request then goes through the chat endpoint's translation (translate.chat_call), and
a refusal there names the Responses parameter (max_output_tokens, text.format, input[i], ...).

Function tools' `strict` is honoured under tool_choice "required" or a named tool, which
constrain the calls' arguments; under "auto" the calls are parsed as the model writes them (the
Agents SDK marks every function tool strict).
"""
from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError

from gateway.errors import GatewayError, bad_param, unsupported, validation_error
from gateway.protocol import MAX_ITEMS, ChatCompletionRequest, Items, _Strict
from gateway.translate import ChatCall, chat_call

logger = logging.getLogger(__name__)


class TextFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None             # refused unless "medium" (the model has one length)


class Reasoning(_Strict):
    effort: str | None = None                # "none" or "minimal": thinking off; any other: on
    summary: str | None = None               # refused: there are no summaries, the reasoning itself comes back
    generate_summary: str | None = None


class FunctionTool(_Strict):
    type: str                                # "function"; the built-in tools are refused
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # accepted; events carry no obfuscation


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | Items[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: Items[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    include: Items[str] | None = None
    truncation: Literal["disabled"] | None = None
    metadata: Annotated[dict[str, str], Field(max_length=MAX_ITEMS, fail_fast=True)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None      # accepted: the scheduler's prefix cache needs no key
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    service_tier: str | None = None
    # Unsupported: a clear 400 naming each when set.
    previous_response_id: str | None = None
    store: bool | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: Any = None
    # Extensions, named as vLLM and SGLang name them (as on the chat endpoint).
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = None
    request_id: str | None = None


_STATEFUL = {
    "previous_response_id": "the gateway stores no responses: send the earlier turns as input items",
    "conversation": "the gateway stores no conversations: send the earlier turns as input items",
    "prompt": "the gateway stores no prompt templates",
    "background": "responses are answered while the request is open (stream it for long ones)",
    "max_tool_calls": "the model's calls are returned as it writes them",
    "top_logprobs": "the Responses API's logprobs are not served (the chat endpoint has them)",
    "context_management": "the gateway keeps no context between requests",
}
_KNOWN_INCLUDES = {"reasoning.encrypted_content"}   # accepted: there is nothing encrypted to include


def _refuse_unsupported(req: ResponsesRequest) -> None:
    for name, why in _STATEFUL.items():
        if getattr(req, name) not in (None, False, 0):
            raise unsupported(name, why)
    if req.stream_options is not None and not req.stream:
        raise bad_param("stream_options", "stream_options is only allowed with stream: true")
    if req.store:
        raise unsupported("store", "the gateway stores no responses; set store to false or leave it out")
    for i, item in enumerate(req.include or ()):
        if item not in _KNOWN_INCLUDES:
            raise unsupported(f"include[{i}]", f"{item!r} cannot be included")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise unsupported("text.verbosity", "the model has one verbosity")
    if req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary):
        raise unsupported("reasoning.summary", "there are no summaries: reasoning items hold the reasoning itself")
    for i, tool in enumerate(req.tools or ()):
        if tool.type != "function":
            raise unsupported(f"tools[{i}].type", f"built-in tools ({tool.type!r}) are not served; "
                                                  "only function tools are")
        if not tool.name:
            raise bad_param(f"tools[{i}].name", f"tools[{i}].name is required")


def _text(content: Any, where: str, key: str = "content") -> str:
    """A message's text (or a function_call_output's, `key` "output"): a string, or its text parts
    joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(f"{where}.{key}", f"{where}.{key} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise unsupported(f"{where}.{key}[{j}].type", f"content parts of type {kind!r}: the model reads text")
        if not isinstance(part.get("text"), str):
            raise bad_param(f"{where}.{key}[{j}].text", f"{where}.{key}[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_param(f"{where}.{key}", f"{where}.{key} must be a string")
    return value


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its content's (else its summary's) parts' texts, joined."""
    key = "content" if item.get("content") else "summary"
    parts = item.get(key) or []
    if not isinstance(parts, list):
        raise bad_param(f"{where}.{key}", f"{where}.{key} must be a list of parts")
    texts = []
    for j, part in enumerate(parts):
        text = part.get("text", "") if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise bad_param(f"{where}.{key}[{j}].text", f"{where}.{key}[{j}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


def _messages(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The chat messages of a request, and the Responses parameter each came from (for errors)."""
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    reasoning: list[str] = []   # a reasoning item's text, for the assistant turn it precedes

    def add(message: dict[str, Any], where: str) -> None:
        if message["role"] == "assistant" and reasoning:
            message["reasoning_content"] = reasoning.pop()
        reasoning.clear()   # a turn that reasoned and wrote nothing: not the next turn's reasoning
        messages.append(message)
        origins.append(where)

    if req.instructions:
        add({"role": "system", "content": req.instructions}, "instructions")
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        where = f"input[{i}]" if isinstance(req.input, list) else "input"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_param(f"{where}.role", f"{where}.role must be user, system, developer or assistant")
            add({"role": role, "content": _text(item.get("content"), where)}, where)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if not messages or messages[-1]["role"] != "assistant":   # consecutive calls: one turn's
                add({"role": "assistant", "content": None}, where)
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            add({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                 "content": output if isinstance(output, str) else _text(output, where, "output")}, where)
        elif kind == "reasoning":
            reasoning[:] = [_reasoning_text(item, where)]
        else:
            raise unsupported(f"{where}.type", f"input items of type {kind!r} are not served (messages, "
                                               "function_call, function_call_output and reasoning are)")
    if not messages:
        raise bad_param("input", "input is empty")
    return messages, origins


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if isinstance(choice, NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """The chat's response_format; a schema is text.format.schema here, checked under that name."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return None
    if fmt.type == "json_schema" and fmt.schema_ is None:
        raise bad_param("text.format.schema", 'text.format of type "json_schema" needs schema (a JSON schema object)')
    if fmt.type != "json_schema" and fmt.schema_ is not None:
        raise bad_param("text.format.schema", 'text.format.schema needs type "json_schema"')
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}


def _enable_thinking(req: ResponsesRequest) -> dict[str, Any] | None:
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is None:
        return None
    return {"enable_thinking": effort not in ("none", "minimal")}


def to_chat(req: ResponsesRequest) -> tuple[ChatCall, list[str]]:
    """The chat turn a Responses request asks for, and the Responses parameter of each of its
    messages (`renamed` turns a later refusal's param back); a refusal names the parameter."""
    _refuse_unsupported(req)
    messages, origins = _messages(req)
    constrained = isinstance(req.tool_choice, NamedFunction) or req.tool_choice == "required"
    tools = [{"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": t.parameters,
        "strict": t.strict if constrained else None}} for t in req.tools or ()]
    chat = {"messages": messages, "max_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "tools": tools or None, "tool_choice": _tool_choice(req),
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req),
            "chat_template_kwargs": _enable_thinking(req), "seed": req.seed, "top_k": req.top_k, "min_p": req.min_p,
            "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty, "priority": req.priority}
    try:
        call = chat_call(ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None}))
    except GatewayError as error:
        raise renamed(error, origins) from None
    except ValidationError as exc:
        raise renamed(validation_error(RequestValidationError(exc.errors())), origins) from None
    return call, origins


_CHAT_TO_RESPONSES = {"max_tokens": "max_output_tokens", "response_format": "text.format",
                      "chat_template_kwargs": "reasoning", "messages": "input"}
# Fields the chat request nests one level deeper than the Responses request has them.
_NESTED = (("response_format.json_schema.", "text.format."), ("tool_choice.function.", "tool_choice."))
_MESSAGE_PARAM = re.compile(r"^messages\[(\d+)\]")
_TOOL_PARAM = re.compile(r"^tools\[(\d+)\]\.function")
_CALL_PARAM = re.compile(r"^\.tool_calls\[\d+\]\.function")


def renamed(error: GatewayError, origins: list[str]) -> GatewayError:
    """A chat endpoint's refusal with the Responses parameter it is about."""
    param = error.param
    if param is None:
        return error
    if match := _MESSAGE_PARAM.match(param):
        index = int(match.group(1))
        rest = _CALL_PARAM.sub("", param[match.end():])   # a function_call item's own fields
        param = (origins[index] if index < len(origins) else "input") + rest
    elif match := _TOOL_PARAM.match(param):
        param = f"tools[{match.group(1)}]" + param[match.end():]
    elif nested := next(((chat, ours) for chat, ours in _NESTED if param.startswith(chat)), None):
        param = nested[1] + param.removeprefix(nested[0])
    else:
        head, dot, rest = param.partition(".")
        param = _CHAT_TO_RESPONSES.get(head, head) + dot + rest
    message = error.message.replace(error.param, param) if error.param in error.message else error.message
    return GatewayError(error.status, message, param, error.code)
