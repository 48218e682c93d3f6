"""OpenAI request -> llm.v1 call: the sampling options, the prompt(s), and a chat turn's messages,
tools and switches, as common.client takes them.

Guarantees: what the service cannot honour is a GatewayError (400) naming the parameter, never
a silent drop; what it can is passed on unchanged, and the scheduler checks the values (its
refusal becomes a 400 naming the same parameter). Defaults follow vLLM's OpenAI server where
OpenAI's and the llm.v1 API's differ: a completion's max_tokens is 16, and special tokens are
left out of the text.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from common import strict_json
from common.client import SamplingParams
from common.json_schema import describes_an_object
from common.sampling_bounds import MAX_TOP_LOGPROBS
from gateway.errors import bad_param, unsupported
from gateway.protocol import ChatCompletionRequest, CompletionRequest, StructuredOutputs, _Sampling, check_wire_value
from gateway.schema_shape import MAX_NODES, SchemaProblem, TooManySubschemas, check_schema

COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's and vLLM's default for /v1/completions
# What the llm.v1 wire can carry (the scheduler checks the tighter bounds, and names them).
UINT32 = (0, 2 ** 32 - 1)
INT32 = (-2 ** 31, 2 ** 31 - 1)
UINT64 = (0, 2 ** 64 - 1)


def _shown(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def wire_int(value: int | None, param: str, bounds: tuple[int, int]) -> int | None:
    """`value` when the wire's integer type holds it, else a 400 naming `param`."""
    low, high = bounds
    if value is not None and not low <= value <= high:
        raise bad_param(param, f"{param} must be in [{low}, {high}], got {_shown(value)}")
    return value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as strings) as llm.v1's map; the scheduler checks the ids and values."""
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10 or int(key) > UINT32[1]:
            raise bad_param("logit_bias", f"logit_bias keys must be token ids (non-negative integers), "
                                          f"got {key[:24]!r}")
        parsed[int(key)] = value
    return parsed


def _common_options(req: _Sampling) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:
        raise bad_param("stream_options", "stream_options is only allowed with stream: true")
    wire_int(req.seed, "seed", UINT64)
    if req.n is not None and req.n < 1:
        raise bad_param("n", f"n must be at least 1, got {req.n}")
    wire_int(req.n, "n", UINT32)
    wire_int(req.top_k, "top_k", INT32)
    wire_int(req.min_tokens, "min_tokens", UINT32)
    wire_int(req.priority, "priority", INT32)
    for i, token in enumerate(req.stop_token_ids or ()):
        wire_int(token, f"stop_token_ids[{i}]", UINT32)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    options: dict[str, Any] = dict(
        n=req.n, temperature=req.temperature, top_p=req.top_p, seed=req.seed, stop=stop,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, top_k=req.top_k,
        min_p=req.min_p, repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
        ignore_eos=bool(req.ignore_eos), stop_token_ids=list(req.stop_token_ids or ()), priority=req.priority,
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        logit_bias=_logit_bias(req.logit_bias), speculative=req.speculative)
    options.update(_response_format(req))
    return options


def _response_format(req: _Sampling) -> dict[str, Any]:
    fmt = req.response_format
    if req.structured_outputs is not None:
        if fmt is not None and fmt.type != "text":
            raise bad_param("structured_outputs", "set response_format or structured_outputs, not both")
        return _structured_outputs(req.structured_outputs)
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise bad_param("response_format.json_schema", 'response_format.json_schema needs type "json_schema"')
        return {}
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_param("response_format.json_schema.schema",
                        'response_format of type "json_schema" needs json_schema.schema (a JSON schema object)')
    return {"json_schema": _schema(fmt.json_schema.schema_, "response_format.json_schema.schema")}


def _schema(schema: Any, param: str, counted: list[int] | None = None) -> Any:
    """`schema` when it is shaped as a JSON schema, else a 400 naming `param`. Schemas checked with
    one `counted` (a one-item list: the subschemas so far) share MAX_NODES: a request's tools."""
    try:
        nodes = check_schema(schema, counted[0] if counted else 0)
    except TooManySubschemas as problem:
        if not counted or not counted[0]:   # this schema alone
            raise bad_param(param, f"{param} is not a valid JSON schema: {problem}") from None
        raise bad_param(param, f"{param}: the tools' parameters hold more than {MAX_NODES} subschemas together, "
                               "more than the service takes") from None
    except SchemaProblem as problem:
        raise bad_param(param, f"{param} is not a valid JSON schema: {problem}") from None
    if counted:
        counted[0] = nodes
    return schema


# The characters with a meaning in a regex outside a class (xgrammar reads ECMAScript's syntax);
# re.escape also escapes spaces and "-", which need not be escaped there.
_REGEX_SPECIAL = re.compile(r"[\\^$.|?*+()\[\]{}/]")


def _structured_outputs(so: StructuredOutputs) -> dict[str, Any]:
    given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                               ("grammar", so.grammar), ("json_object", so.json_object or None)) if v is not None}
    if len(given) != 1:
        raise bad_param("structured_outputs", "structured_outputs takes exactly one of json, regex, choice, grammar, "
                                              f"json_object; got {sorted(given) or 'none'}")
    (kind, value), = given.items()
    if kind == "json" and isinstance(value, dict):
        _schema(value, "structured_outputs.json")
    if kind == "choice":
        if not value:
            raise bad_param("structured_outputs.choice", "structured_outputs.choice is empty")
        return {"regex": "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\g<0>", c) for c in value) + ")"}
    return {"json_schema" if kind == "json" else kind: value}


def max_tokens(value: int | None, param: str, minimum: int = 1) -> int | None:
    if value is not None and value < minimum:
        raise bad_param(param, f"{param} must be at least {minimum}, got {value}")
    return wire_int(value, param, UINT32)


def top_count(value: int | None, param: str) -> int | None:
    """A number of top logprobs, 0..20."""
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad_param(param, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {_shown(value)}")
    return value


def completion_sampling(req: CompletionRequest) -> SamplingParams:
    """The llm.v1 sampling of a completion. max_tokens 0 (with echo: the prompt scored, nothing
    generated) asks for one token, which the answer leaves out (`generates_nothing`)."""
    options = _common_options(req)
    if req.suffix:
        raise unsupported("suffix", "Qwen3 has no fill-in-the-middle format")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise unsupported("best_of", "each sample is returned (use n); best_of must be unset or equal to n")
    logprobs = top_count(req.logprobs, "logprobs")
    prompt_logprobs = top_count(req.prompt_logprobs, "prompt_logprobs")
    if logprobs is not None:
        options["logprobs"] = True
    if scores_prompt(req):
        options["prompt_logprobs"] = True
    # One top_logprobs serves the sampled and the prompt tokens: the larger count, cut per use.
    options["top_logprobs"] = max(logprobs or 0, prompt_logprobs or 0) or None
    tokens = max_tokens(req.max_tokens, "max_tokens", minimum=0 if req.echo else 1)
    options["max_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS if tokens is None else max(tokens, 1)
    return SamplingParams(**options)


def scores_prompt(req: CompletionRequest) -> bool:
    """Whether the answer holds the prompt's logprobs (echo with logprobs, or prompt_logprobs)."""
    return req.prompt_logprobs is not None or bool(req.echo and req.logprobs is not None)


def generates_nothing(req: CompletionRequest) -> bool:
    return req.max_tokens == 0


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a request, one Generate call each."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_param("prompt", "prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        return [_token_ids(prompt, "prompt")]
    if any(isinstance(p, list) and not p for p in prompt):
        raise bad_param("prompt", "prompt holds an empty list of token ids")
    return [p if isinstance(p, str) else _token_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]


def _token_ids(ids: list[int], where: str) -> list[int]:
    """Token ids the wire carries (uint32; the scheduler checks them against the vocabulary)."""
    for i, token in enumerate(ids):
        if not UINT32[0] <= token <= UINT32[1]:
            raise bad_param("prompt", f"{where}[{i}] must be a token id in [0, {UINT32[1]}], got {_shown(token)}")
    return list(ids)


@dataclass(frozen=True)
class ChatCall:
    """The arguments of one Chat call."""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: str
    enable_thinking: bool | None
    sampling: SamplingParams
    logprobs: int | None = None         # top logprobs shown per sampled token (None: no logprobs)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (None: none)


def chat_call(req: ChatCompletionRequest) -> ChatCall:
    options = _common_options(req)
    if req.reasoning_effort is not None:
        raise unsupported("reasoning_effort", 'Qwen3 reasons or not: set chat_template_kwargs {"enable_thinking": '
                                              'false} to turn its reasoning off')
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_param("top_logprobs", "top_logprobs needs logprobs: true")
    top = top_count(req.top_logprobs, "top_logprobs") if req.logprobs else None
    prompt_top = top_count(req.prompt_logprobs, "prompt_logprobs")
    if req.logprobs:
        options["logprobs"] = True
    if prompt_top is not None:
        options["prompt_logprobs"] = True
    options["top_logprobs"] = max(top or 0, prompt_top or 0) or None
    if req.max_completion_tokens is not None:
        options["max_tokens"] = max_tokens(req.max_completion_tokens, "max_completion_tokens")
    else:
        options["max_tokens"] = max_tokens(req.max_tokens, "max_tokens")
    if req.skip_special_tokens is False:
        raise unsupported("skip_special_tokens", "a chat turn's text always leaves special tokens out")
    tools, tool_choice = _tools(req)
    return ChatCall(_messages(req), tools, tool_choice, _enable_thinking(req), SamplingParams(**options),
                    (top or 0) if req.logprobs else None, prompt_top)


def _enable_thinking(req: ChatCompletionRequest) -> bool | None:
    kwargs = dict(req.chat_template_kwargs or {})
    thinking = kwargs.pop("enable_thinking", None)
    if kwargs:
        raise unsupported(f"chat_template_kwargs.{sorted(kwargs)[0]}", "the only template switch is enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad_param("chat_template_kwargs.enable_thinking",
                        f"chat_template_kwargs.enable_thinking must be true or false, got {thinking!r}")
    return thinking


def _tools(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], str]:
    tools = req.tools or []
    choice = req.tool_choice
    if choice is None:
        name = "auto" if tools else "none"
    elif isinstance(choice, str):
        name = choice
    else:
        name = choice.function.name
        if name in ("auto", "none", "required"):   # the llm.v1 API would read it as the keyword
            raise unsupported("tool_choice.function.name", f"a tool named {name!r} cannot be chosen by name")
        if name not in {t.function.name for t in tools}:
            raise bad_param("tool_choice", f"tool_choice names {name!r}, which is not in tools")
    if name == "required" and not tools:
        raise bad_param("tool_choice", 'tool_choice "required" needs at least one tool')
    constrained = name not in ("auto", "none")
    if req.parallel_tool_calls is False and name in ("auto", "required"):
        raise unsupported("parallel_tool_calls", 'false is only honoured with tool_choice "none" or a named tool '
                                                 '(one call); with "auto" or "required" the model may call several')
    for i, tool in enumerate(tools):
        if tool.function.strict and not constrained and name != "none":
            raise unsupported(f"tools[{i}].function.strict",
                              'strict arguments need tool_choice "required" or a named tool, which constrain the '
                              'output to calls whose arguments validate; with "auto" they are not constrained')
    counted = [0]   # the tools' schemas share one bound, as the scheduler bounds them together
    specs = [{"name": t.function.name, "description": t.function.description or "",
              "parameters": _parameters(t.function.parameters, f"tools[{i}].function.parameters", counted)}
             for i, t in enumerate(tools)]
    return specs, name


def _parameters(schema: Any, param: str, counted: list[int]) -> Any:
    """A function's parameters: a JSON schema of an object (a call's arguments are one), as OpenAI requires."""
    schema = _schema(schema, param, counted)
    if not describes_an_object(schema):
        raise bad_param(param, f'{param} must be a JSON schema of type "object" (a call\'s arguments are an object), '
                               f"got type {json.dumps(schema['type'])[:100]}")
    return schema


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    if not req.messages:
        raise bad_param("messages", "messages is empty")
    out = []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.name is not None:
            raise unsupported(f"{where}.name", "the chat template has no place for a participant's name")
        for field in ("audio", "function_call"):
            if getattr(m, field) is not None:
                raise unsupported(f"{where}.{field}", "use content and tool_calls")
        if m.refusal:
            raise unsupported(f"{where}.refusal", "the chat template has no place for a refusal")
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": _content(m.content, where)}
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if m.tool_calls:
            message["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(m.tool_calls)]
        out.append(message)
    return out


def _tool_call(call, where: str) -> dict[str, Any]:
    param = f"{where}.function.arguments"
    try:
        arguments = strict_json.loads(call.function.arguments)
        check_wire_value(arguments)
    except strict_json.JsonProblem as exc:     # reads after the name: "not valid JSON: ...", "nested ..."
        raise bad_param(param, f"{param} is {exc}"[:300]) from None
    except ValueError as exc:
        raise bad_param(param, f"{param} is not valid JSON: {exc}"[:300]) from None
    if not isinstance(arguments, dict):
        raise bad_param(param, f"{param} must be a JSON object")
    return {"id": call.id, "function": {"name": call.function.name, "arguments": call.function.arguments}}


def _content(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """A message's text: a string, or text parts joined by newlines (as vLLM joins them)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise unsupported(f"{where}.content[{j}].type", f"content parts of type {kind!r}: the model reads text")
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise bad_param(f"{where}.content[{j}]", f'{where}.content[{j}] must be {{"type": "text", "text": "..."}}')
        texts.append(part["text"])
    return "\n".join(texts)
