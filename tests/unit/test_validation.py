"""validate_request: every refusal names its field, and unset fields resolve to the documented defaults."""
from __future__ import annotations

import json

import math
import re
import struct

import numpy as np
import pytest
from hypothesis import given, strategies as st

from common.pb.llm.v1 import generation_pb2 as pb
from common.sampling import SamplingParams
from scheduler_svc.frontend.validation import (InvalidRequest, Limits, float32_text, validate_chat_sampling,
                                               validate_request)

VOCAB_SIZE = 512
MAX_MODEL_LEN = 128
LIMITS = Limits(max_prompt_bytes=100, max_stop_strings=2, max_stop_string_len=5, max_request_id_len=8,
                max_stop_token_ids=3)


def utf8_tokenize(text: str) -> list[int]:
    """One id per UTF-8 byte: a real tokenizer's contract (text in, ids below vocab out), trivially checkable."""
    return list(text.encode("utf-8"))


def validate(request: pb.GenerateRequest, tokenize=utf8_tokenize):
    return validate_request(request, vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN, tokenize=tokenize, limits=LIMITS)


def request(prompt=None, request_id="", **sampling) -> pb.GenerateRequest:
    prompt = {"token_ids": pb.TokenIds(ids=[1, 2, 3])} if prompt is None else prompt
    return pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling), **prompt)


def test_unset_fields_resolve_to_defaults():
    ids, params = validate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, 8, 9])))
    assert ids == [7, 8, 9]
    assert params == SamplingParams(max_tokens=MAX_MODEL_LEN - 3)


def test_every_field_is_carried_over():
    ids, params = validate(request(
        {"text": "héllo"}, request_id="req-1", temperature=0.5, top_p=0.25, top_k=40, min_p=0.125, seed=2**64 - 1,
        max_tokens=10, min_tokens=2, ignore_eos=True, stop=["\n\n", "END"], stop_token_ids=[0, 511],
        repetition_penalty=1.25, presence_penalty=-2.0, frequency_penalty=2.0, logprobs=True, skip_special_tokens=True,
    ))
    assert ids == list("héllo".encode())
    assert params == SamplingParams(
        temperature=0.5, top_p=0.25, top_k=40, min_p=0.125, seed=2**64 - 1, max_tokens=10, min_tokens=2,
        ignore_eos=True, stop=("\n\n", "END"), stop_token_ids=frozenset({0, 511}), repetition_penalty=1.25,
        presence_penalty=-2.0, frequency_penalty=2.0, logprobs=True, skip_special_tokens=True,
    )


@pytest.mark.parametrize("top_k, resolved", [(-1, 0), (0, 0), (1, 1), (100000, 100000)])
def test_top_k_off_values(top_k, resolved):
    assert validate(request(top_k=top_k))[1].top_k == resolved


@pytest.mark.parametrize("max_tokens, resolved", [(1, 1), (124, 124), (125, 125), (126, 125), (2**32 - 1, 125)])
def test_max_tokens_is_capped_by_the_room_left(max_tokens, resolved):
    assert validate(request(max_tokens=max_tokens))[1].max_tokens == resolved  # 128 - 3 prompt tokens = 125


def test_prompt_one_short_of_the_limit_may_generate_one_token():
    ids, params = validate(request({"token_ids": pb.TokenIds(ids=[5] * (MAX_MODEL_LEN - 1))}))
    assert len(ids) == MAX_MODEL_LEN - 1 and params.max_tokens == 1


def test_a_chat_too_long_for_the_context_is_refused_naming_its_messages():
    """A ChatRequest has no prompt field: its messages render the prompt."""
    with pytest.raises(InvalidRequest) as caught:
        validate_chat_sampling("", pb.SamplingParams(), MAX_MODEL_LEN, vocab_size=512, max_model_len=MAX_MODEL_LEN)
    assert caught.value.field == "messages"
    assert str(caught.value).startswith(f"messages: the rendered prompt has {MAX_MODEL_LEN} tokens")


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0), dict(temperature=100.0), dict(top_p=1.0), dict(min_p=0.0), dict(min_p=1.0),
    dict(repetition_penalty=10.0), dict(repetition_penalty=0.01), dict(presence_penalty=-2.0),
    dict(frequency_penalty=2.0), dict(max_tokens=4, min_tokens=4), dict(stop=["12345", "x"]),
    dict(stop_token_ids=[0, 511, 511]),
])
def test_boundary_values_are_accepted(sampling):
    params = validate(request(**sampling))[1]
    for name, value in sampling.items():
        if name == "stop_token_ids":
            value = frozenset(value)
        elif isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, float):
            value = float(np.float32(value))    # what a proto float field carries
        assert getattr(params, name) == value


def test_stop_token_ids_are_a_set_for_constant_time_checks():
    params = validate(request(stop_token_ids=[5, 9, 5]))[1]
    assert isinstance(params.stop_token_ids, frozenset) and params.stop_token_ids == {5, 9}
    assert isinstance(SamplingParams(stop_token_ids=(1, 2)).stop_token_ids, frozenset)


def test_limits_are_inclusive():
    text = "a" * LIMITS.max_prompt_bytes
    assert validate(request({"text": text}, request_id="x" * LIMITS.max_request_id_len))[0] == list(text.encode())


NAN, INF = math.nan, math.inf

REFUSALS = [
    # (request, field, message fragment)
    (pb.GenerateRequest(), "prompt", "prompt is missing: set text or token_ids"),
    (request({"text": ""}), "text", "text is empty"),
    (request({"token_ids": pb.TokenIds()}), "token_ids", "token_ids is empty"),
    (request({"token_ids": pb.TokenIds(ids=[1, 511, 512, 9000])}), "token_ids",
     "token_ids[2] = 512 is out of range: vocab_size is 512"),
    (request({"token_ids": pb.TokenIds(ids=[1] * MAX_MODEL_LEN)}), "prompt",
     "prompt has 128 tokens; max_model_len 128 leaves no room for a generated token"),
    (request({"text": "é" * 51}), "text", "text is 102 bytes, more than the limit of 100"),
    (request(temperature=-0.5), "sampling.temperature", "sampling.temperature must be in [0, 100], got -0.5"),
    (request(temperature=100.5), "sampling.temperature", "sampling.temperature must be in [0, 100], got 100.5"),
    (request(temperature=NAN), "sampling.temperature", "sampling.temperature must be a finite number, got nan"),
    (request(temperature=INF), "sampling.temperature",
     "sampling.temperature must be a finite number, got inf (a 32-bit float: a magnitude past 3.4e38 arrives as one)"),
    (request(top_p=1.5), "sampling.top_p", "sampling.top_p must be in (0, 1], got 1.5"),
    (request(top_p=0.0), "sampling.top_p", "sampling.top_p must be in (0, 1], got 0"),
    (request(top_p=-INF), "sampling.top_p", "sampling.top_p must be a finite number, got -inf"),
    (request(top_k=-2), "sampling.top_k", "sampling.top_k must be -1 or 0 (off) or positive, got -2"),
    (request(min_p=-0.5), "sampling.min_p", "sampling.min_p must be in [0, 1], got -0.5"),
    (request(min_p=1.5), "sampling.min_p", "sampling.min_p must be in [0, 1], got 1.5"),
    (request(min_p=NAN), "sampling.min_p", "sampling.min_p must be a finite number, got nan"),
    (request(max_tokens=0), "sampling.max_tokens", "sampling.max_tokens must be positive when set, got 0"),
    (request(max_tokens=5, min_tokens=6), "sampling.min_tokens",
     "sampling.min_tokens must be <= sampling.max_tokens (5), got 6"),
    (request(repetition_penalty=0.0), "sampling.repetition_penalty",
     "sampling.repetition_penalty must be in [0.01, 10], got 0"),
    (request(repetition_penalty=-1.0), "sampling.repetition_penalty",
     "sampling.repetition_penalty must be in [0.01, 10], got -1"),
    (request(repetition_penalty=10.5), "sampling.repetition_penalty",
     "sampling.repetition_penalty must be in [0.01, 10], got 10.5"),
    (request(repetition_penalty=1e-45), "sampling.repetition_penalty",   # would divide logits to inf
     "sampling.repetition_penalty must be in [0.01, 10], got 1e-45"),
    (request(repetition_penalty=0.00999), "sampling.repetition_penalty",
     "sampling.repetition_penalty must be in [0.01, 10], got 0.00999"),
    # Values just past a bound print as the client wrote them, not rounded onto the bound.
    (request(top_p=1.0000001), "sampling.top_p", "sampling.top_p must be in (0, 1], got 1.0000001"),
    (request(presence_penalty=-2.0000002), "sampling.presence_penalty",
     "sampling.presence_penalty must be in [-2, 2], got -2.0000002"),
    (request(temperature=100.00001), "sampling.temperature",
     "sampling.temperature must be in [0, 100], got 100.00001"),
    (request(min_p=-1e-38), "sampling.min_p", "sampling.min_p must be in [0, 1], got -1e-38"),
    (request(frequency_penalty=3e38), "sampling.frequency_penalty",
     "sampling.frequency_penalty must be in [-2, 2], got 3e+38"),
    (request(repetition_penalty=NAN), "sampling.repetition_penalty",
     "sampling.repetition_penalty must be a finite number, got nan"),
    (request(presence_penalty=2.5), "sampling.presence_penalty", "sampling.presence_penalty must be in [-2, 2], got 2.5"),
    (request(presence_penalty=-2.5), "sampling.presence_penalty",
     "sampling.presence_penalty must be in [-2, 2], got -2.5"),
    (request(frequency_penalty=-3.0), "sampling.frequency_penalty",
     "sampling.frequency_penalty must be in [-2, 2], got -3"),
    (request(frequency_penalty=INF), "sampling.frequency_penalty",
     "sampling.frequency_penalty must be a finite number, got inf"),
    (request(stop=["a", "b", "c"]), "sampling.stop", "sampling.stop has 3 strings, more than the limit of 2"),
    (request(stop=["ok", "123456"]), "sampling.stop", "sampling.stop[1] is 6 characters, more than the limit of 5"),
    (request(stop=[""]), "sampling.stop", "sampling.stop[0] is empty; it would match at once"),
    (request(stop_token_ids=[5, 512, 7]), "sampling.stop_token_ids",
     "sampling.stop_token_ids[1] = 512 is out of range: vocab_size is 512"),
    (request(stop_token_ids=[5, 6, 7, 8]), "sampling.stop_token_ids",
     "sampling.stop_token_ids has 4 ids, more than the limit of 3"),
    (request(request_id="123456789"), "request_id", "request_id is 9 characters, more than the limit of 8"),
    (request(request_id="ab\ncd"), "request_id", "request_id has a control character (U+000A) at index 2"),
    (request(request_id="\x7f"), "request_id", "request_id has a control character (U+007F) at index 0"),
]


@pytest.mark.parametrize("req, field, fragment", REFUSALS, ids=[fragment for _, _, fragment in REFUSALS])
def test_refusal_names_the_field(req, field, fragment):
    with pytest.raises(InvalidRequest, match=re.escape(fragment)) as info:
        validate(req)
    assert info.value.field == field
    assert str(info.value).startswith(field)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("tokenize, fragment", [
    (lambda text: [], "text encodes to no tokens"),
    (lambda text: [3, 600], "text encodes to token id 600 at index 1, out of range: vocab_size is 512"),
    (lambda text: [3] * 200, "prompt has 200 tokens; max_model_len 128"),
])
def test_text_refused_after_tokenizing(tokenize, fragment):
    with pytest.raises(InvalidRequest, match=re.escape(fragment)) as info:
        validate(request({"text": "hi"}), tokenize=tokenize)
    assert str(info.value).startswith(info.value.field)


def test_oversized_text_is_refused_before_tokenizing():
    def tokenize(text):
        raise AssertionError("tokenized a text over the byte limit")
    with pytest.raises(InvalidRequest, match="more than the limit of 100"):
        validate(request({"text": "x" * 101}), tokenize=tokenize)


def test_bad_sampling_is_refused_before_tokenizing():
    def tokenize(text):
        raise AssertionError("tokenized a request with bad sampling parameters")
    with pytest.raises(InvalidRequest, match="sampling.top_p"):
        validate(request({"text": "hi"}, top_p=2.0), tokenize=tokenize)


def test_default_limits_apply_when_none_are_given():
    stops = ["s"] * (Limits().max_stop_strings + 1)
    with pytest.raises(InvalidRequest, match=f"more than the limit of {Limits().max_stop_strings}"):
        validate_request(request(stop=stops), vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN, tokenize=utf8_tokenize)


def test_default_stop_token_id_limit():
    ids = list(range(Limits().max_stop_token_ids + 1))
    with pytest.raises(InvalidRequest, match=f"has {len(ids)} ids, more than the limit of {len(ids) - 1}"):
        validate_request(request(stop_token_ids=ids), vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN,
                         tokenize=utf8_tokenize)
    assert len(validate_request(request(stop_token_ids=ids[:-1]), vocab_size=VOCAB_SIZE,
                                max_model_len=MAX_MODEL_LEN, tokenize=utf8_tokenize)[1].stop_token_ids) == len(ids) - 1


def test_overlong_token_ids_are_refused_by_their_count_first():
    # Counting is free; copying and range-checking millions of ids is not.
    req = request({"token_ids": pb.TokenIds(ids=[1] * 999 + [9000])})
    with pytest.raises(InvalidRequest, match="prompt has 1000 tokens; max_model_len 128"):
        validate(req)


def no_tokenizing(text):
    raise AssertionError("tokenized a text too long for the context")


def test_text_longer_than_the_context_can_hold_is_refused_before_tokenizing():
    # 127 prompt tokens of at most 2 bytes hold 254 bytes: 255 cannot fit, whatever the tokenizer does.
    limits = Limits(max_prompt_bytes=1000)
    long_text = "ab" * 127 + "c"
    with pytest.raises(InvalidRequest, match=re.escape(
            "text is 255 bytes, more than max_model_len 128 tokens can hold: a token of this tokenizer covers "
            "at most 2 bytes, and 127 prompt tokens at most 254 bytes")) as info:
        validate_request(request({"text": long_text}), vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN,
                         tokenize=no_tokenizing, limits=limits, max_input_bytes_per_token=2)
    assert info.value.field == "text"
    pairs = lambda text: [1] * ((len(text) + 1) // 2)   # noqa: E731  a tokenizer of two bytes a token
    ids, _ = validate_request(request({"text": long_text[:-1]}), vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN,
                              tokenize=pairs, limits=limits, max_input_bytes_per_token=2)
    assert len(ids) == 127
    # Without a bound (a tokenizer that can drop text) only the byte limit applies.
    with pytest.raises(InvalidRequest, match="prompt has 128 tokens"):
        validate_request(request({"text": long_text}), vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN,
                         tokenize=pairs, limits=limits, max_input_bytes_per_token=None)


@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_float32_text_is_the_shortest_decimal_of_the_same_float32(value):
    text = float32_text(value)
    assert struct.unpack("<f", struct.pack("<f", float(text)))[0] == value
    # numpy's float32 repr is the shortest round-tripping decimal (Dragon4): the same digits.
    digits = lambda t: len(t.lower().split("e")[0].lstrip("-").replace(".", "").strip("0"))  # noqa: E731
    assert digits(text) == digits(np.format_float_scientific(np.float32(value), unique=True)) or value == 0


def test_logit_bias_is_bounded_sorted_and_drops_zeros():
    _, params = validate(request(logit_bias={9: 2.0, 3: -100.0, 4: 0.0, 7: 100.0}))
    assert params.logit_bias == ((3, -100.0), (7, 100.0), (9, 2.0))
    for bias, fragment in (({512: 1.0}, "names token 512, out of range: vocab_size is 512"),
                           ({3: 100.00001}, "sampling.logit_bias[3] must be in [-100, 100], got 100.00001"),
                           ({3: -1e9}, "got -1e+09"), ({3: math.nan}, "got nan"),
                           ({t: 1.0 for t in range(Limits().max_logit_bias + 1)}, "1025 entries, more than the limit")):
        with pytest.raises(InvalidRequest) as caught:
            validate(request(logit_bias=bias))
        assert caught.value.field == "sampling.logit_bias" and fragment in str(caught.value), caught.value


def nested_arrays(depth: int) -> str:
    schema = '{"type": "string"}'
    for _ in range(depth):
        schema = '{"type": "array", "items": ' + schema + "}"
    return schema


@pytest.mark.parametrize("sampling, field, problem", [
    (dict(json_schema=nested_arrays(40)), "sampling.json_schema", "nested 41 levels deep, more than the limit of 32"),
    (dict(json_schema="[" * 60_000 + "]" * 60_000), "sampling.json_schema", "nested"),
    (dict(json_schema='{"type": "object", "properties": {' + ", ".join(f'"p{i}": {{"type": "string"}}'
                                                                          for i in range(3000)) + "}}"),
     "sampling.json_schema", "JSON values, more than the limit of 4096"),
    (dict(json_schema='{"type": '), "sampling.json_schema", "sampling.json_schema is invalid: not valid JSON"),
    (dict(regex="a" * 5000), "sampling.regex", "over 4096 bytes"),
    (dict(grammar="x" * (200 << 10)), "sampling.grammar", "over 131072 bytes"),
    (dict(regex=""), "sampling.regex", "sampling.regex is invalid: empty"),
])
def test_a_constraint_too_large_to_build_cheaply_is_refused_by_its_size(sampling, field, problem):
    with pytest.raises(InvalidRequest) as caught:
        validate_request(request(**sampling), vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN, tokenize=utf8_tokenize)
    assert caught.value.field == field and problem in str(caught.value)


@pytest.mark.parametrize("schema, problem", [
    ({"allOf": [{"type": "integer"}, {"maximum": 9}]}, "'allOf' at # is not supported"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
     "'uniqueItems' at #/properties/a is not supported"),
    ({"type": "integer", "not": {"const": 3}}, "'not' at # is not supported"),
    ({"$ref": "https://example.com/schema.json"}, "'$ref' at # is not supported"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "requires property 'a'"),
])
def test_a_schema_whose_output_could_not_be_held_to_it_is_refused_naming_the_keyword(schema, problem):
    with pytest.raises(InvalidRequest) as caught:
        validate(request(json_schema=json.dumps(schema)))
    assert caught.value.field == "sampling.json_schema" and problem in str(caught.value)


def test_a_constraint_within_the_limits_passes_unbuilt():
    """The frontend parses and measures a constraint; the worker builds it (and refuses a bad one)."""
    _, params = validate(request(json_schema=nested_arrays(20)))
    assert params.constraint.kind == "json_schema"
    _, params = validate(request(regex="(a*a*a*)*b"))
    assert params.constraint.text == "(a*a*a*)*b"


@pytest.mark.parametrize("priority, ok", [(0, True), (-100, True), (100, True), (-101, False), (1000, False),
                                          (-1000, False)])
def test_priority_is_bounded_by_max_priority(priority, ok):
    if ok:
        assert validate(request(priority=priority))[1].priority == priority
        return
    with pytest.raises(InvalidRequest, match=r"sampling.priority must be in \[-100, 100\]") as caught:
        validate(request(priority=priority))
    assert caught.value.field == "sampling.priority"


def test_with_max_priority_0_priority_is_off():
    off = Limits(max_priority=0)
    assert validate_request(request(priority=0), vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN,
                            tokenize=utf8_tokenize, limits=off)[1].priority == 0
    with pytest.raises(InvalidRequest, match="priority is off on this server"):
        validate_request(request(priority=-1), vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN,
                         tokenize=utf8_tokenize, limits=off)
