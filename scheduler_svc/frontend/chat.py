"""Chat requests as prompts: the checkpoint's own chat template, and the constraint a tool_choice implies.

`render_chat` applies the model directory's chat template through transformers'
`apply_chat_template(messages, tools=..., add_generation_prompt=True, enable_thinking=...)` and
tokenizes the rendered text without adding special tokens, so the prompt is exactly the template's
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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.constraint import TOOL_ARGUMENTS_MAX_WHITESPACE, Constraint
from scheduler_svc.frontend.tokenizer import Tokenizer
from scheduler_svc.frontend.validation import InvalidRequest

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
) -> ChatPrompt:
    """The prompt of a chat request. enable_thinking None leaves the template's default."""
    if not messages:
        raise InvalidRequest("messages", "messages is empty")
    template_messages = [_message_dict(i, m) for i, m in enumerate(messages)]
    tool_dicts = [_tool_dict(i, t) for i, t in enumerate(tools)]
    _check_tool_names(tools)
    tool_choice = tool_choice or "auto"
    if tool_choice not in ("auto", "none", "required") and tool_choice not in {t.name for t in tools}:
        raise InvalidRequest("tool_choice", f'tool_choice must be "auto", "none", "required" or the name of a tool, '
                                            f"got {tool_choice!r}")
    if tool_choice == "required" and not tools:
        raise InvalidRequest("tool_choice", 'tool_choice "required" needs at least one tool')
    rendered_tools = tool_dicts if tools and tool_choice != "none" else None
    kwargs: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    try:
        text = tokenizer.hf.apply_chat_template(template_messages, tools=rendered_tools, add_generation_prompt=True,
                                                tokenize=False, **kwargs)
    except Exception as exc:   # noqa: BLE001 - a template raises whatever its author chose (often TemplateError)
        raise InvalidRequest("messages", f"the model's chat template refused these messages: {exc}") from None
    reasoning_open = _leaves_reasoning_open(text)
    constraint = None
    if tool_choice == "required" or (rendered_tools and tool_choice != "auto"):
        chosen = [t for t in tools if tool_choice == "required" or t.name == tool_choice]
        reasoning = "open" if reasoning_open else ("closed" if _closed_reasoning(text) else "optional")
        constraint = tool_call_constraint(chosen, single=tool_choice != "required", reasoning=reasoning)
    return ChatPrompt(
        token_ids=tokenizer.encode(text, add_special_tokens=False),
        text=text,
        reasoning_open=reasoning_open,
        parse_tool_calls=rendered_tools is not None,
        constraint=constraint,
    )


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
        "begin": _CALL_PREFIX + tool.name + _CALL_ARGUMENTS,
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


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    where = f"messages[{index}]"
    if message.role not in ROLES:
        raise InvalidRequest(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got {message.role!r}")
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidRequest(f"{where}.tool_calls", f"{where}.tool_calls: only assistant messages make tool calls")
        out["tool_calls"] = [_tool_call_dict(f"{where}.tool_calls[{j}]", call) for j, call in enumerate(message.tool_calls)]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None and message.role == "assistant":
        out["reasoning_content"] = message.reasoning_content
    return out


def _tool_call_dict(where: str, call: ToolCall) -> dict[str, Any]:
    if not call.name:
        raise InvalidRequest(f"{where}.name", f"{where}.name is empty")
    # Checked, then passed as the string: the template writes it as given, so the prompt holds the
    # model's earlier output as it was (and the prefix cache still matches it).
    _json_object(f"{where}.arguments_json", call.arguments_json or "{}")
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json or "{}"}}


def _tool_dict(index: int, tool: Tool) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not tool.name:
        raise InvalidRequest(f"{where}.name", f"{where}.name is empty")
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    function["parameters"] = _parameters(tool, where)
    return {"type": "function", "function": function}


def _parameters(tool: Tool, where: str = "tool") -> dict[str, Any]:
    if not tool.parameters_json:
        return {"type": "object", "properties": {}}
    return _json_object(f"{where}.parameters_json", tool.parameters_json)


def _json_object(where: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(where, f"{where} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(where, f"{where} must be a JSON object, got {type(value).__name__}")
    return value


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
