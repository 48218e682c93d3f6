"""Admission checks of a GenerateRequest: reject what the engine or a worker could not serve, with a
message naming the field, and resolve the defaults the proto leaves unset.

Cheap checks come first, so a bad request is refused before its text is tokenized: a text longer
in bytes than max_model_len tokens can cover never reaches the tokenizer.

Every bound (float ranges, counts, sizes) is common/sampling_bounds.py's, which the worker and the
gateway read too; the proto documents them. A refused float is printed as the client wrote it: the
shortest decimal that is the same float32. An unset field takes the SamplingParams default.

A constraint (json_schema, regex, grammar, json_object) is checked here by its size (bytes; a
schema's depth and number of values), which bounds what building its grammar can cost, and a
schema for keywords the grammar could not hold an output to (common/constraint.py). The
worker builds and compiles it, in a pool of its own with a time budget, before the request is
scheduled (worker_svc/grammar_pool.py); a constraint that does not compile is refused from there,
naming the problem.
"""
from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.constraint import Constraint, GrammarError, enforceable_schema
from common.pb.llm.v1 import generation_pb2
from common.cli import flag
from common.sampling import SamplingParams
from common.sampling_bounds import (FLOAT_RANGES, LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS_ENTRIES, MAX_N, MAX_STOP_STRING_LEN,
                                    MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, FloatRange, to_float32)
from common.strict_json import JsonProblem
from scheduler_svc.frontend.bounded_json import parse_schema
from scheduler_svc.frontend.invalid_request import InvalidRequest
from scheduler_svc.frontend.tokenizer import TooManyTokens

__all__ = ["InvalidRequest", "Limits", "DEFAULT_LIMITS", "validate_request", "validate_chat_sampling",
           "check_constraint"]


REQUEST_LIMITS = "request limits"


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one request may ask for, each checked before the work it bounds (tokenizing,
    rendering, compiling, decoding), so that no client can make admission expensive. The flag()
    fields are the scheduler's flags (scheduler_svc/frontend/limit_flags.py); a request past one is
    INVALID_ARGUMENT naming the field."""
    max_prompt_bytes: int = flag(1 << 20, group=REQUEST_LIMITS,
                                 help="UTF-8 bytes of a text prompt (before tokenizing), of a Tokenize text, and of "
                                      "all the text of a chat (before rendering)")
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_len: int = MAX_STOP_STRING_LEN
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    max_request_id_len: int = 256            # characters
    max_chat_messages: int = flag(1024, group=REQUEST_LIMITS, help="messages in one chat request")
    max_tools: int = flag(128, group=REQUEST_LIMITS, help="tools in one chat request")
    max_tool_calls: int = flag(1024, group=REQUEST_LIMITS,
                               help="tool calls in one chat request, over all its messages")
    max_tool_call_argument_bytes: int = flag(64 << 10, group=REQUEST_LIMITS,
                                             help="UTF-8 bytes of one tool call's arguments")
    max_json_depth: int = flag(32, group=REQUEST_LIMITS,
                               help="nesting depth of a json_schema, a tool's parameters or a tool call's arguments")
    max_json_schema_nodes: int = flag(4096, group=REQUEST_LIMITS,
                                      help="JSON values in a json_schema, or in the tools' parameters together")
    max_constraint_bytes: int = flag(128 << 10, group=REQUEST_LIMITS, help="UTF-8 bytes of a json_schema or grammar")
    max_regex_bytes: int = flag(4 << 10, group=REQUEST_LIMITS, help="UTF-8 bytes of a regex")
    max_detokenize_ids: int = flag(1 << 17, group=REQUEST_LIMITS, help="token ids of one Detokenize call")
    max_priority: int = flag(100, group=REQUEST_LIMITS,
                             help="priorities -N..N are accepted (lower first); 0: priority is off, a request "
                                  "setting one is refused")
    max_logit_bias: int = MAX_LOGIT_BIAS_ENTRIES


DEFAULT_LIMITS = Limits()


def validate_request(
    req: generation_pb2.GenerateRequest,
    *,
    vocab_size: int,
    max_model_len: int,
    tokenize: Callable[[str], list[int]],
    limits: Limits = DEFAULT_LIMITS,
    max_input_bytes_per_token: int | None = None,
) -> tuple[list[int], SamplingParams]:
    """Returns the prompt's token ids and the resolved sampling parameters, or raises InvalidRequest.

    `max_input_bytes_per_token` (Tokenizer.max_input_bytes_per_token; None: unknown) is the most
    UTF-8 bytes of text one token covers: a longer text than max_model_len - 1 such tokens is refused
    without tokenizing it."""
    _check_request_id(req.request_id, limits)
    sampling = _resolve_sampling(req.sampling, vocab_size, limits)
    prompt = _prompt_token_ids(req, vocab_size, max_model_len, tokenize, limits, max_input_bytes_per_token)
    return prompt, _with_max_tokens(req.sampling, sampling, len(prompt), max_model_len)


def validate_chat_sampling(request_id: str, msg: generation_pb2.SamplingParams, num_prompt_tokens: int, *,
                           vocab_size: int, max_model_len: int, limits: Limits = DEFAULT_LIMITS) -> SamplingParams:
    """The resolved sampling parameters of a chat request whose prompt (rendered by the chat
    template) has num_prompt_tokens tokens, or InvalidRequest. Special tokens are always left out
    of a chat's text (the template's turn markers are not content)."""
    _check_request_id(request_id, limits)
    sampling = _resolve_sampling(msg, vocab_size, limits) | {"skip_special_tokens": True}
    _check_prompt_fits(num_prompt_tokens, max_model_len, "messages")
    return _with_max_tokens(msg, sampling, num_prompt_tokens, max_model_len)


def _with_max_tokens(msg: generation_pb2.SamplingParams, sampling: dict, num_prompt_tokens: int,
                     max_model_len: int) -> SamplingParams:
    room = max_model_len - num_prompt_tokens
    requested = msg.max_tokens if msg.HasField("max_tokens") else room
    given = {name: value for name, value in sampling.items() if value is not None}   # None: the default
    return SamplingParams(max_tokens=min(requested, room), **given)


def _check_request_id(request_id: str, limits: Limits) -> None:
    if len(request_id) > limits.max_request_id_len:
        raise InvalidRequest(
            "request_id",
            f"request_id is {len(request_id)} characters, more than the limit of {limits.max_request_id_len}",
        )
    for index, char in enumerate(request_id):
        # Ids end up in logs and metadata, where control characters forge or break lines.
        if unicodedata.category(char) == "Cc":
            raise InvalidRequest(
                "request_id", f"request_id has a control character (U+{ord(char):04X}) at index {index}"
            )


def _resolve_sampling(msg: generation_pb2.SamplingParams, vocab_size: int, limits: Limits) -> dict:
    """Every SamplingParams field except max_tokens, which depends on the prompt's length; None
    where the request leaves the field to its default."""
    top_k = msg.top_k if msg.HasField("top_k") else 0
    if top_k < -1:
        raise InvalidRequest("sampling.top_k", f"sampling.top_k must be -1 or 0 (off) or positive, got {top_k}")
    if msg.HasField("max_tokens") and msg.max_tokens == 0:
        raise InvalidRequest("sampling.max_tokens", "sampling.max_tokens must be positive when set, got 0")
    min_tokens = msg.min_tokens if msg.HasField("min_tokens") else 0
    if msg.HasField("max_tokens") and min_tokens > msg.max_tokens:
        raise InvalidRequest(
            "sampling.min_tokens",
            f"sampling.min_tokens must be <= sampling.max_tokens ({msg.max_tokens}), got {min_tokens}",
        )
    return dict(
        {name: _bounded_float(msg, name, bounds) for name, bounds in FLOAT_RANGES.items()},
        top_k=max(top_k, 0),  # -1 and 0 both mean off; the sampler knows only 0
        seed=msg.seed if msg.HasField("seed") else None,
        min_tokens=min_tokens,
        ignore_eos=msg.ignore_eos,
        stop=_stop_strings(msg.stop, limits),
        stop_token_ids=_stop_token_ids(msg.stop_token_ids, vocab_size, limits),
        logprobs=msg.logprobs,
        skip_special_tokens=msg.skip_special_tokens,
        n=_bounded_int(msg.n or 1, "n", 1, MAX_N),
        top_logprobs=_bounded_int(msg.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS),
        prompt_logprobs=msg.prompt_logprobs,
        constraint=_constraint(msg, limits),
        priority=_priority(msg, limits),
        logit_bias=_logit_bias(msg.logit_bias, vocab_size, limits),
        speculative=msg.speculative if msg.HasField("speculative") else None,
    )


def _logit_bias(bias, vocab_size: int, limits: Limits) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs, ids ascending; each id in the vocabulary, each bias in LOGIT_BIAS_RANGE."""
    if len(bias) > limits.max_logit_bias:
        raise InvalidRequest("sampling.logit_bias", f"sampling.logit_bias has {len(bias)} entries, more than the "
                                                    f"limit of {limits.max_logit_bias}")
    pairs = sorted(bias.items())
    for token_id, value in pairs:
        if token_id >= vocab_size:
            raise InvalidRequest("sampling.logit_bias", f"sampling.logit_bias names token {token_id}, out of range: "
                                                        f"vocab_size is {vocab_size}")
        _in_range(value, "sampling.logit_bias", LOGIT_BIAS_RANGE, what=f"sampling.logit_bias[{token_id}]")
    return tuple((token_id, value) for token_id, value in pairs if value != 0.0)


def _bounded_int(value: int, name: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise InvalidRequest(f"sampling.{name}", f"sampling.{name} must be in [{low}, {high}], got {value}")
    return value


def _priority(msg: generation_pb2.SamplingParams, limits: Limits) -> int:
    if not msg.priority:
        return 0
    if not limits.max_priority:
        raise InvalidRequest("sampling.priority", f"sampling.priority is off on this server (--max-priority 0); "
                                                  f"send 0 or leave it unset, got {msg.priority}")
    return _bounded_int(msg.priority, "priority", -limits.max_priority, limits.max_priority)


def _constraint(msg: generation_pb2.SamplingParams, limits: Limits) -> Constraint | None:
    kind = msg.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    field = f"sampling.{kind}"
    text = "" if kind == "json_object" else getattr(msg, kind)
    try:
        constraint = Constraint(kind, text)
    except GrammarError as e:
        raise InvalidRequest(field, f"{field} is invalid: {e.problem}") from None
    check_constraint(constraint, limits, field)
    return constraint


def check_constraint(constraint: Constraint, limits: Limits = DEFAULT_LIMITS, field: str | None = None) -> None:
    """Refuses (InvalidRequest naming `field`) a constraint whose grammar would be costly to build
    by its size alone: bytes, and for a schema its depth and number of values. Whether it compiles
    is the worker's to say: it builds grammars in a pool of its own, within a time budget."""
    field = field or f"sampling.{constraint.kind}"
    limit = limits.max_regex_bytes if constraint.kind == "regex" else limits.max_constraint_bytes
    if len(constraint.text) > limit:            # characters: no more than bytes, and free to count
        raise InvalidRequest(field, f"{field} is over {limit} bytes, the limit")
    size = len(constraint.text.encode("utf-8"))
    if size > limit:
        raise InvalidRequest(field, f"{field} is {size} bytes, more than the limit of {limit}")
    if constraint.kind == "json_schema":
        try:
            enforceable_schema(parse_schema(constraint.text, max_depth=limits.max_json_depth,
                                            max_nodes=limits.max_json_schema_nodes))
        except JsonProblem as e:
            raise InvalidRequest(field, f"{field} is invalid: {e}") from None
        except GrammarError as e:     # a keyword the worker's grammar would not hold the output to
            raise InvalidRequest(field, f"{field} is invalid: {e.problem}") from None


def _bounded_float(msg: generation_pb2.SamplingParams, name: str, bounds: FloatRange) -> float | None:
    """The field's value, or None when unset; it must lie within `bounds`."""
    if not msg.HasField(name):
        return None
    return _in_range(getattr(msg, name), f"sampling.{name}", bounds)


def _in_range(value: float, field: str, bounds: FloatRange, *, what: str | None = None) -> float:
    """`value` (a proto float) if it lies within `bounds`, else InvalidRequest for `field`, whose
    message names `what` (default: the field)."""
    what = what or field
    if not math.isfinite(value):   # an infinity may be a finite number past float32's range (1e39), as sent
        past = " (a 32-bit float: a magnitude past 3.4e38 arrives as one)" if math.isinf(value) else ""
        raise InvalidRequest(field, f"{what} must be a finite number, got {value}{past}")
    if value not in bounds:
        raise InvalidRequest(field, f"{what} must be in {bounds}, got {float32_text(value)}")
    return value


def float32_text(value: float) -> str:
    """The shortest decimal that reads back as the float32 `value` (a proto float field): what the
    client most likely wrote, e.g. 1.0000001, where Python's repr of the widened double prints
    1.0000001192092896 and `:g` prints 1."""
    for digits in range(1, 10):   # 9 significant digits identify any float32
        text = f"{value:.{digits}g}"
        if to_float32(float(text)) == value:
            return text
    return repr(value)            # not a float32 after all: print it whole


def _stop_strings(stops: Sequence[str], limits: Limits) -> tuple[str, ...]:
    if len(stops) > limits.max_stop_strings:
        raise InvalidRequest(
            "sampling.stop", f"sampling.stop has {len(stops)} strings, more than the limit of {limits.max_stop_strings}"
        )
    for index, stop in enumerate(stops):
        if not stop:
            raise InvalidRequest("sampling.stop", f"sampling.stop[{index}] is empty; it would match at once")
        if len(stop) > limits.max_stop_string_len:
            raise InvalidRequest(
                "sampling.stop",
                f"sampling.stop[{index}] is {len(stop)} characters, more than the limit of {limits.max_stop_string_len}",
            )
    return tuple(stops)


def _stop_token_ids(ids: Sequence[int], vocab_size: int, limits: Limits) -> frozenset[int]:
    if len(ids) > limits.max_stop_token_ids:
        raise InvalidRequest(
            "sampling.stop_token_ids",
            f"sampling.stop_token_ids has {len(ids)} ids, more than the limit of {limits.max_stop_token_ids}",
        )
    bad = _first_out_of_vocab(ids, vocab_size)
    if bad is not None:
        raise InvalidRequest(
            "sampling.stop_token_ids",
            f"sampling.stop_token_ids[{bad}] = {ids[bad]} is out of range: vocab_size is {vocab_size}",
        )
    return frozenset(ids)


def _prompt_token_ids(
    req: generation_pb2.GenerateRequest, vocab_size: int, max_model_len: int, tokenize: Callable[[str], list[int]],
    limits: Limits, max_input_bytes_per_token: int | None,
) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt", "prompt is missing: set text or token_ids")
    if kind == "token_ids":
        if not req.token_ids.ids:
            raise InvalidRequest("token_ids", "token_ids is empty")
        _check_prompt_fits(len(req.token_ids.ids), max_model_len)   # before copying millions of ids
        ids = list(req.token_ids.ids)
        bad = _first_out_of_vocab(ids, vocab_size)
        if bad is not None:
            raise InvalidRequest(
                "token_ids", f"token_ids[{bad}] = {ids[bad]} is out of range: vocab_size is {vocab_size}"
            )
        return ids
    if not req.text:
        raise InvalidRequest("text", "text is empty")
    size = len(req.text.encode("utf-8"))
    if size > limits.max_prompt_bytes:
        raise InvalidRequest("text", f"text is {size} bytes, more than the limit of {limits.max_prompt_bytes}")
    if max_input_bytes_per_token is not None and size > (max_model_len - 1) * max_input_bytes_per_token:
        raise InvalidRequest(
            "text",
            f"text is {size} bytes, more than max_model_len {max_model_len} tokens can hold: a token of this "
            f"tokenizer covers at most {max_input_bytes_per_token} bytes, and {max_model_len - 1} prompt tokens "
            f"at most {(max_model_len - 1) * max_input_bytes_per_token} bytes",
        )
    try:
        ids = tokenize(req.text)
    except TooManyTokens as e:   # a tokenizer bounded by the caller counted them without listing them
        _check_prompt_fits(e.num_tokens, max_model_len)
        raise InvalidRequest("text", f"text is too long: {e}") from None
    if not ids:
        raise InvalidRequest("text", "text encodes to no tokens")
    _check_prompt_fits(len(ids), max_model_len)
    bad = _first_out_of_vocab(ids, vocab_size)
    if bad is not None:
        # Only a tokenizer larger than the model's embedding gets here; a worker would crash on it.
        raise InvalidRequest(
            "text", f"text encodes to token id {ids[bad]} at index {bad}, out of range: vocab_size is {vocab_size}"
        )
    return ids


def _check_prompt_fits(num_tokens: int, max_model_len: int, field: str = "prompt") -> None:
    """`field`: the request's field that makes the prompt (a chat's messages render it)."""
    if num_tokens >= max_model_len:
        what = "prompt" if field == "prompt" else f"{field}: the rendered prompt"
        raise InvalidRequest(
            field,
            f"{what} has {num_tokens} tokens; max_model_len {max_model_len} leaves no room for a generated token",
        )


def _first_out_of_vocab(ids: Sequence[int], vocab_size: int) -> int | None:
    """Index of the first id >= vocab_size, or None. Ids are uint32 in the proto, so never negative."""
    if not ids or max(ids) < vocab_size:  # max() runs in C: the common case costs no Python loop
        return None
    return next(index for index, token_id in enumerate(ids) if token_id >= vocab_size)
