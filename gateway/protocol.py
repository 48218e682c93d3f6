"""The request bodies the gateway accepts: OpenAI's /v1/completions and /v1/chat/completions,
plus the sampling extensions vLLM and SGLang users send (top_k, min_p, repetition_penalty, ...).

Every model forbids fields it does not declare: an unknown parameter is a 400 naming it, never
a silent drop; every field takes its own JSON type only (strict: true is no 1, "5" no 5, 2.0 no
integer, as OpenAI's API has it); and every field refuses what the llm.v1 wire cannot carry (a
string with a lone UTF-16 surrogate, a float that is not finite, JSON nested deeper than
MAX_DEPTH) by its name. A declared field that the service cannot honour with a given value (echo,
a non-text content part, ...) is refused in translate.py, which also names it. Value ranges that
the scheduler checks itself (temperature, top_p, penalties, n, ...) are left to it, so there is
one place that knows them; its refusal comes back as a 400 naming the parameter.
"""
from __future__ import annotations

from itertools import chain, compress, repeat
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from common.sampling_bounds import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

MAX_DEPTH = 64   # of the JSON in any one field (schemas, tool arguments, content parts)
_CONTAINERS = (list, tuple, dict)
# A list longer than these is refused at its first item over, and a list's first wrong item
# ends its validation (fail_fast): each item costs the event loop that serves every stream, and
# a wrong one an error record too. The scheduler's own limits are lower (1,024 messages, 128
# tools, 64 KiB of tool-call arguments, 131,072 Detokenize ids), so nothing it serves is refused
# here; the sampling options' lists have the bounds every side shares (common/sampling_bounds.py).
MAX_ITEMS = 1 << 12    # of a list of objects or strings (messages, tools, content parts, prompts)
MAX_IDS = 1 << 18      # of token ids in one request's prompt (one list, or all its lists)
MAX_ARGUMENT_CHARS = 1 << 20   # of a tool call's arguments (JSON parsed by the gateway)


def _bounded(kind: Any, length: int) -> Any:
    return Annotated[kind, Field(max_length=length, fail_fast=True)]


T = TypeVar("T")
Items = Annotated[list[T], Field(max_length=MAX_ITEMS, fail_fast=True)]
Ids = _bounded(list[int], MAX_IDS)


def check_wire_value(value: Any) -> None:
    """Raises ValueError when `value` (any JSON value) holds a string that UTF-8 cannot encode (a
    lone surrogate) or nests deeper than MAX_DEPTH. A level at a time, its items sorted by C code:
    depth costs no Python stack, and no item costs a Python call (a million ids are one pass)."""
    level = [value]
    for depth in range(MAX_DEPTH + 1):
        kinds = set(map(type, level))
        if any(issubclass(kind, str) for kind in kinds):
            _check_strings(level if kinds == {str} else _of_kind(level, str))
        if not any(issubclass(kind, _CONTAINERS) for kind in kinds):
            return   # scalars and models (checked by their own validators) only
        if depth == MAX_DEPTH:
            raise ValueError(f"nests deeper than {MAX_DEPTH} levels")
        containers = level if all(issubclass(kind, _CONTAINERS) for kind in kinds) else _of_kind(level, _CONTAINERS)
        dicts = _of_kind(containers, dict)
        level = list(chain(chain.from_iterable(_of_kind(containers, (list, tuple))), chain.from_iterable(dicts),
                           chain.from_iterable(map(dict.values, dicts))))


def _of_kind(items: list[Any], kind: type | tuple[type, ...]) -> list[Any]:
    """The items that are `kind`s, in order, picked by C code (isinstance mapped, not called)."""
    return list(compress(items, map(isinstance, items, repeat(kind))))


def _check_strings(strings: list[str]) -> None:
    joined = "".join(strings)
    if joined.isascii():
        return
    try:
        joined.encode("utf-8")
    except UnicodeEncodeError:
        for item in strings:   # which one: only when one fails
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"a lone UTF-16 surrogate (U+{ord(item[exc.start]):04X}) at character "
                                 f"{exc.start}, which UTF-8 cannot carry") from None


_SCALARS = frozenset({int, float, bool, type(None)})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False, strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _carried_by_the_wire(cls, value: Any) -> Any:
        kind = type(value)
        if kind is str:   # most fields: a text, checked without the walk (one per field adds up)
            if not value.isascii():
                _check_strings([value])
        elif kind not in _SCALARS:
            check_wire_value(value)
        return value


class StreamOptions(_Strict):
    include_usage: bool | None = None        # one more chunk before [DONE], with the request's usage
    continuous_usage_stats: bool | None = None   # vLLM's: the usage so far on every chunk


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None               # the output always validates: constrained decoding


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: one constraint beyond response_format's JSON."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")   # a JSON schema
    regex: str | None = None
    choice: Items[str] | None = None         # the output is exactly one of these strings
    grammar: str | None = None               # EBNF as xgrammar reads it (root ::= ...)
    json_object: bool | None = None


class _Sampling(_Strict):
    """What both endpoints share."""
    model: str | None = None                 # unset: the served model
    n: int | None = None                     # 1..16
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | _bounded(list[str], MAX_STOP_STRINGS) | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: _bounded(dict[str, float], MAX_LOGIT_BIAS_ENTRIES) | None = None   # token id (as a string) -> bias in [-100, 100]
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # An end-user id for the caller's own abuse tracking (OpenAI's meaning): logged, not used.
    user: str | None = None
    # Extensions, named as vLLM and SGLang name them.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: _bounded(list[int], MAX_STOP_TOKEN_IDS) | None = None
    skip_special_tokens: bool | None = None
    priority: int | None = None              # lower is served first
    speculative: bool | None = None          # false: kept out of speculative decoding
    structured_outputs: StructuredOutputs | None = None
    request_id: str | None = None            # the id the scheduler logs it under (unset: a fresh one)


def _prompt_form(value: Any) -> str | None:
    """Which form of prompt `value` is, by its first item: pydantic validates that form alone."""
    if isinstance(value, str):
        return "str"
    if not isinstance(value, list):
        return None
    first = value[0] if value else 0
    return "list[str]" if isinstance(first, str) else "list[list[int]]" if isinstance(first, list) else "list[int]"


Prompt = Annotated[Union[Annotated[str, Tag("str")], Annotated[Items[str], Tag("list[str]")],
                         Annotated[Ids, Tag("list[int]")], Annotated[Items[Ids], Tag("list[list[int]]")]],
                   Discriminator(_prompt_form, custom_error_type="prompt_type", custom_error_message=(
                       "must be a string, a list of strings, a list of token ids or a list of lists of token ids"))]


class CompletionRequest(_Sampling):
    # A text, a list of texts (a batch: choice index = prompt index * n + sample), token ids, or
    # a list of token-id lists.
    prompt: Prompt
    logprobs: int | None = None              # 0..20: the sampled token's logprob and this many top ones
    echo: bool | None = None                 # the prompt, then the completion (and its logprobs, with logprobs)
    prompt_logprobs: int | None = None       # vLLM's: 0..20 top logprobs of each prompt token
    best_of: int | None = None               # accepted when equal to n
    suffix: str | None = None                # refused unless empty

    @field_validator("prompt", mode="after")
    @classmethod
    def _ids_in_all(cls, prompt: Any) -> Any:
        if prompt and isinstance(prompt[0], list) and (total := sum(map(len, prompt))) > MAX_IDS:
            raise ValueError(f"holds {total} token ids in all, more than {MAX_IDS}")
        return prompt


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    # Unset or null: the function takes no arguments (an empty object), as OpenAI reads it.
    parameters: dict[str, Any] | None = Field(default=None, validate_default=True)
    strict: bool | None = None

    @field_validator("parameters", mode="after")
    @classmethod
    def _unset_is_no_arguments(cls, parameters: dict[str, Any] | None) -> dict[str, Any]:
        return {"type": "object", "properties": {}} if parameters is None else parameters


class ToolDef(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: Annotated[str, Field(max_length=MAX_ARGUMENT_CHARS)]   # a JSON object, as text


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Items[dict[str, Any]] | None = None   # a text or text parts
    name: str | None = None                  # refused: the chat template has no place for it
    tool_calls: Items[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None     # an earlier assistant turn's reasoning (vLLM's name)
    reasoning: str | None = None             # the same, under the newer name
    # What an assistant message of a previous response carries, so that clients can send it back
    # as they got it; refused when set to anything but null.
    refusal: str | None = None
    annotations: Items[Any] | None = None
    audio: Any = None
    function_call: Any = None


class ChatCompletionRequest(_Sampling):
    messages: Items[ChatMessageIn]
    max_completion_tokens: int | None = None   # OpenAI's newer name of max_tokens; wins when both are set
    logprobs: bool | None = None
    top_logprobs: int | None = None          # 0..20, with logprobs
    prompt_logprobs: int | None = None       # vLLM's: 0..20 top logprobs of each rendered prompt token
    tools: Items[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # The template's switches (vLLM and SGLang): {"enable_thinking": false} turns Qwen3's
    # reasoning off. Other keys are refused.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None      # refused: Qwen3's switch is chat_template_kwargs.enable_thinking

    @field_validator("messages", mode="before")
    @classmethod
    def _tool_calls_in_all(cls, messages: Any) -> Any:
        """At most MAX_ITEMS tool calls in all the messages, counted before any is read: each list
        is bounded, but each call costs a validation and a parse of its arguments, so as many
        messages of as many calls each held the event loop for seconds."""
        if isinstance(messages, list) and len(messages) <= MAX_ITEMS:
            sizes = [len(calls) for m in messages if isinstance(m, dict) and isinstance(calls := m.get("tool_calls"), list)]
            total = sum(sizes)
            # A list over MAX_ITEMS alone is refused by its own bound, which names it.
            if total > MAX_ITEMS and max(sizes) <= MAX_ITEMS:
                raise ValueError(f"the messages hold {total} tool calls in all, more than {MAX_ITEMS}")
        return messages
