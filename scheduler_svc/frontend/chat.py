"""Chat requests as prompts: the checkpoint's own chat template, and the constraint a tool_choice implies.

`render_chat` renders the model directory's chat template as transformers'
`apply_chat_template(messages, tools=..., add_generation_prompt=True, enable_thinking=...)` does
(chat_template.py) and tokenizes the rendered text without adding special tokens, so the prompt is exactly the template's
tokens (as `apply_chat_template(tokenize=True)` gives them; a BOS the template wants is in the
template). Messages and tools arrive as plain dataclasses (the server converts the proto) and are
checked here, each problem raised as InvalidRequest naming the field.

What the rendered prompt says about the output, returned with it:
  - `reasoning_open`: the prompt leaves a <think> block open (Qwen3-Thinking-2507's template
    opens it; hybrid Qwen3's does not, and with enable_thinking=False closes an empty one), so the
    output starts inside the reasoning. The output parser (chat_parser.py) starts there.
  - `parse_tool_calls`: tools were rendered into the prompt, so <tool_call> blocks are calls.
  - `constraint`: for tool_choice "required" or a tool's name, an xgrammar structural tag that
    makes the output one or more Qwen3 tool-call blocks (exactly one, of the named tool), each
    `<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>` with ARGS valid under the
    tool's parameters schema; when the prompt leaves room for reasoning, a <think> block first.
tool_choice "none" leaves the tools out of the prompt (the model is not told it has any) and
their blocks stay text; "auto" (or empty) renders them and parses whatever calls the model makes.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from common.constraint import TOOL_ARGUMENTS_MAX_WHITESPACE, Constraint
from common.json_schema import describes_an_object
from common.strict_json import JsonProblem, measure
from scheduler_svc.frontend.bounded_json import parse_json_object
from scheduler_svc.frontend.chat_tokens import escaper_for, tokenize_rendered
from scheduler_svc.frontend.tokenizer import Tokenizer, TooManyTokens
from scheduler_svc.frontend.validation import DEFAULT_LIMITS, InvalidRequest, Limits

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# How Qwen3's template writes a call (and so how the model writes one): the constraint spells
# the same text, so a constrained call renders back into the next prompt unchanged.
_CALL_PREFIX = TOOL_CALL_START + '\n{"name": "'
_CALL_ARGUMENTS = '", "arguments": '
_CALL_SUFFIX = "}\n" + TOOL_CALL_END


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str   # a JSON object


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str = ""
    tool_calls: Sequence[ToolCall] = ()
    tool_call_id: str = ""
    reasoning_content: str | None = None   # an assistant turn's reasoning, when the client kept it


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str = ""
    parameters_json: str = ""   # a JSON schema of the arguments object; empty: any object


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    token_ids: list[int]
    text: str
    reasoning_open: bool
    parse_tool_calls: bool
    constraint: Constraint | None = None


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool] = (),
    tool_choice: str = "auto",
    enable_thinking: bool | None = None,
    *,
    limits: Limits = DEFAULT_LIMITS,
    allow_special_tokens: bool = False,
    max_tokens: int | None = None,
) -> ChatPrompt:
    """The prompt of a chat request. enable_thinking None leaves the template's default. Sizes
    are checked against `limits` before anything is rendered. Special tokens written in the
    client's text are tokenized as text unless `allow_special_tokens` (chat_tokens.py).
    `max_tokens`: a longer prompt raises TooManyTokens (its ids never listed)."""
    if not messages:
        raise InvalidRequest("messages", "messages is empty")
    check_chat_size(messages, tools, limits)
    template_messages = [_message_dict(i, m, limits) for i, m in enumerate(messages)]
    tool_dicts = _tool_dicts(tools, limits)
    _check_tool_names(tools)
    tool_choice = tool_choice or "auto"
    if tool_choice not in ("auto", "none", "required") and tool_choice not in {t.name for t in tools}:
        raise InvalidRequest("tool_choice", f'tool_choice must be "auto", "none", "required" or the name of a tool, '
                                            f"got {tool_choice!r}")
    if tool_choice == "required" and not tools:
        raise InvalidRequest("tool_choice", 'tool_choice "required" needs at least one tool')
    escaper = None if allow_special_tokens else escaper_for(
        tokenizer, _client_strings(template_messages) + _json_strings(tool_dicts))
    if escaper is not None:
        template_messages = [_escaped(m, escaper.escape) for m in template_messages]
        tool_dicts = [_escaped_json(t, escaper.escape) for t in tool_dicts]
    rendered_tools = tool_dicts if tools and tool_choice != "none" else None
    kwargs: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    if tokenizer.chat_template is None:
        raise InvalidRequest("messages", "the model has no chat template (chat_template.jinja or tokenizer_config.json's "
                                         "chat_template): send a prompt to Generate instead")
    try:
        rendered = tokenizer.chat_template.render(template_messages, tools=rendered_tools, **kwargs)
    except Exception as exc:   # noqa: BLE001 - a template raises whatever its author chose (often TemplateError)
        raise InvalidRequest("messages", f"the model's chat template refused these messages: {exc}") from None
    text, token_ids = tokenize_rendered(
        tokenizer, rendered, escaper, lambda t: tokenizer.encode(t, add_special_tokens=False, max_tokens=max_tokens))
    if max_tokens is not None and len(token_ids) > max_tokens:
        raise TooManyTokens(len(token_ids), max_tokens)
    reasoning_open = _leaves_reasoning_open(text)
    constraint = None
    if tool_choice == "required" or (rendered_tools and tool_choice != "auto"):
        chosen = [t for t in tools if tool_choice == "required" or t.name == tool_choice]
        reasoning = "open" if reasoning_open else ("closed" if _closed_reasoning(text) else "optional")
        constraint = tool_call_constraint(chosen, single=tool_choice != "required", reasoning=reasoning)
    return ChatPrompt(
        token_ids=token_ids,
        text=text,
        reasoning_open=reasoning_open,
        parse_tool_calls=rendered_tools is not None,
        constraint=constraint,
    )


def check_chat_counts(num_messages: int, num_tools: int, limits: Limits,
                      tool_calls: Callable[[], int] = lambda: 0) -> None:
    """The counts, checked before a single message is converted: `tool_calls` counts the calls of
    all messages, asked once their number is known to be within its limit."""
    if num_messages > limits.max_chat_messages:
        raise InvalidRequest("messages", f"messages has {num_messages} messages, more than the limit of "
                                         f"{limits.max_chat_messages}")
    if num_tools > limits.max_tools:
        raise InvalidRequest("tools", f"tools has {num_tools} tools, more than the limit of {limits.max_tools}")
    num_calls = tool_calls()
    if num_calls > limits.max_tool_calls:
        raise InvalidRequest("messages", f"messages hold {num_calls} tool calls, more than the limit of "
                                         f"{limits.max_tool_calls}")


def check_chat_size(messages: Sequence[ChatMessage], tools: Sequence[Tool], limits: Limits) -> None:
    """Counts, each tool call's arguments, and all the chat's text together (UTF-8 bytes), before
    anything is parsed or rendered."""
    check_chat_counts(len(messages), len(tools), limits, lambda: sum(len(m.tool_calls) for m in messages))
    total = 0
    for i, message in enumerate(messages):
        for j, call in enumerate(message.tool_calls):
            size = _utf8_len(call.arguments_json)
            if size > limits.max_tool_call_argument_bytes:
                where = f"messages[{i}].tool_calls[{j}].arguments_json"
                raise InvalidRequest(where, f"{where} is {size} bytes, more than the limit of "
                                            f"{limits.max_tool_call_argument_bytes}")
            total += size + _utf8_len(call.name) + _utf8_len(call.id)
        total += sum(_utf8_len(text) for text in (message.role, message.content, message.tool_call_id,
                                                  message.reasoning_content or ""))
        if total > limits.max_prompt_bytes:
            break
    total += sum(_utf8_len(t.name) + _utf8_len(t.description) + _utf8_len(t.parameters_json) for t in tools)
    if total > limits.max_prompt_bytes:
        raise InvalidRequest("messages", f"the messages and tools hold over {limits.max_prompt_bytes} bytes of text, "
                                         f"the limit")


def chat_text_bytes(messages: Sequence[ChatMessage]) -> int:
    """UTF-8 bytes of the messages' text: the rendered prompt holds at least as many."""
    return sum(_utf8_len(m.content) + _utf8_len(m.reasoning_content or "") +
               sum(_utf8_len(c.arguments_json) for c in m.tool_calls) for m in messages)


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8")) if not text.isascii() else len(text)


def _client_strings(template_messages: list[dict[str, Any]]) -> list[str]:
    strings: list[str] = []
    for message in template_messages:
        _escaped(message, lambda text, keep=(): strings.append(text) or text)
    return strings


# The template reads an assistant turn's reasoning out of its content between these (Qwen3's
# template drops it from earlier turns): there they are left for it to find, as transformers does.
_REASONING_TAGS = ("<think>", "</think>")


def _escaped(message: dict[str, Any], escape) -> dict[str, Any]:
    """The message dict with `escape` applied to every string the client wrote in it."""
    out = dict(message)
    for key in ("content", "reasoning_content", "tool_call_id"):
        if isinstance(out.get(key), str):
            keep = _REASONING_TAGS if key == "content" and out.get("role") == "assistant" else ()
            out[key] = escape(out[key], keep)
    if "tool_calls" in out:
        out["tool_calls"] = [{**call, "id": escape(call["id"]),
                              "function": {name: escape(value) for name, value in call["function"].items()}}
                             for call in out["tool_calls"]]
    return out


def _json_strings(value: Any) -> list[str]:
    """Every string in a parsed JSON value (a tool's dict), keys included."""
    strings: list[str] = []
    _escaped_json(value, lambda text: strings.append(text) or text)
    return strings


def _escaped_json(value: Any, escape) -> Any:
    """`value` (parsed JSON, nested at most max_json_depth) with `escape` applied to every string."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {escape(key): _escaped_json(item, escape) for key, item in value.items()}
    if isinstance(value, list):
        return [_escaped_json(item, escape) for item in value]
    return value


def warm_up_chat(tokenizer: Tokenizer) -> None:
    """Renders a chat once, at start-up: the first render compiles the chat template (a tenth of
    a second and more), which a first Chat would otherwise do on the event loop."""
    try:
        render_chat(tokenizer, [ChatMessage("user", "Hi")])
    except InvalidRequest as e:     # a model without a chat template: Chat is refused, naming why
        log.info("no chat: %s", e)


def tool_call_constraint(tools: Sequence[Tool], *, single: bool, reasoning: str = "closed") -> Constraint:
    """A structural tag whose outputs are Qwen3 tool calls of `tools` (exactly one when `single`,
    else one or more separated by newlines), arguments valid under each tool's schema.
    `reasoning`: "closed" (no reasoning block: the prompt closed it), "open" (the prompt opened
    it: any text up to </think> first), "optional" (hybrid Qwen3 with thinking on: the model writes
    <think>...</think> itself, so the block is allowed first)."""
    if not tools:
        raise ValueError("a tool-call constraint needs at least one tool")
    tags = [{
        "type": "tag",
        # The name as a JSON string's content, so the call parses back to it whatever it holds.
        "begin": _CALL_PREFIX + json.dumps(tool.name, ensure_ascii=False)[1:-1] + _CALL_ARGUMENTS,
        "content": {"type": "json_schema", "json_schema": _parameters(tool),
                    "max_whitespace_cnt": TOOL_ARGUMENTS_MAX_WHITESPACE},
        "end": _CALL_SUFFIX,
    } for tool in tools]
    calls: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                             "at_least_one": True, "stop_after_first": single}
    if reasoning != "closed":
        think = {"type": "tag", "begin": THINK_START if reasoning == "optional" else "",
                 "content": {"type": "any_text", "excludes": [THINK_START, THINK_END]}, "end": THINK_END}
        block: dict[str, Any] = {"type": "sequence", "elements": [think, {"type": "const_string", "value": "\n\n"}]}
        if reasoning == "optional":
            block = {"type": "optional", "content": block}
        calls = {"type": "sequence", "elements": [block, calls]}
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": calls}))


def _message_dict(index: int, message: ChatMessage, limits: Limits) -> dict[str, Any]:
    where = f"messages[{index}]"
    if message.role not in ROLES:
        raise InvalidRequest(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got {message.role!r}")
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidRequest(f"{where}.tool_calls", f"{where}.tool_calls: only assistant messages make tool calls")
        out["tool_calls"] = [_tool_call_dict(f"{where}.tool_calls[{j}]", call, limits)
                             for j, call in enumerate(message.tool_calls)]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None and message.role == "assistant":
        out["reasoning_content"] = message.reasoning_content
    return out


def _tool_call_dict(where: str, call: ToolCall, limits: Limits) -> dict[str, Any]:
    if not call.name:
        raise InvalidRequest(f"{where}.name", f"{where}.name is empty")
    # Checked, then passed as the string: the template writes it as given, so the prompt holds the
    # model's earlier output as it was (and the prefix cache still matches it).
    _json_object(f"{where}.arguments_json", call.arguments_json or "{}", limits)
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json or "{}"}}


def _tool_dicts(tools: Sequence[Tool], limits: Limits) -> list[dict[str, Any]]:
    """The tools as the template takes them; their parameters schemas hold at most
    max_json_schema_nodes values together (they make one grammar when a call is required)."""
    dicts, nodes = [], 0
    for i, tool in enumerate(tools):
        dicts.append(_tool_dict(i, tool, limits))
        nodes += measure(dicts[-1]["function"]["parameters"])[1]
        if nodes > limits.max_json_schema_nodes:
            raise InvalidRequest("tools", f"tools' parameters hold {nodes} JSON values, more than the limit of "
                                          f"{limits.max_json_schema_nodes}")
    return dicts


def _tool_dict(index: int, tool: Tool, limits: Limits) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not tool.name:
        raise InvalidRequest(f"{where}.name", f"{where}.name is empty")
    marker = next((m for m in (TOOL_CALL_START, TOOL_CALL_END) if m in tool.name), None)
    if marker is not None:      # a call of it would end (or open) its block mid-name
        raise InvalidRequest(f"{where}.name", f"{where}.name must not hold {marker!r}, which delimits a tool call")
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = _parameters(tool, limits, where)
    return {"type": "function", "function": function}


def _parameters(tool: Tool, limits: Limits = DEFAULT_LIMITS, where: str = "tool") -> dict[str, Any]:
    """The tool's parameters schema. A call's arguments are a JSON object, so a schema typed otherwise is
    refused, as OpenAI refuses it: a call constrained to it would write arguments no call parses."""
    if not tool.parameters_json:
        return {"type": "object", "properties": {}}
    field = f"{where}.parameters_json"
    schema = _json_object(field, tool.parameters_json, limits)
    if not describes_an_object(schema):
        raise InvalidRequest(field, f'{field} must describe an object (type "object"): a call\'s arguments are '
                                    f"one, got type {json.dumps(schema['type'])[:100]}")
    return schema


def _json_object(where: str, text: str, limits: Limits) -> dict[str, Any]:
    try:
        return parse_json_object(text, max_depth=limits.max_json_depth)
    except JsonProblem as exc:
        raise InvalidRequest(where, f"{where} {_is(exc)}") from None


def _is(problem: JsonProblem) -> str:
    """The problem as it reads after a field's name ("is not valid JSON: ...", "must be ...")."""
    text = str(problem)
    return text if text.startswith(("must ", "has ")) else f"is {text}"


def _check_tool_names(tools: Sequence[Tool]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise InvalidRequest(f"tools[{i}].name", f"tools[{i}].name {tool.name!r} is given twice")
        seen.add(tool.name)


def _generation_prompt(text: str) -> str:
    """The rendered text of the turn the model is to write (after the last turn start)."""
    at = text.rfind("<|im_start|>")
    return text if at == -1 else text[at:]


def _leaves_reasoning_open(text: str) -> bool:
    tail = _generation_prompt(text)
    return tail.rfind(THINK_START) > tail.rfind(THINK_END)


def _closed_reasoning(text: str) -> bool:
    return THINK_END in _generation_prompt(text)
