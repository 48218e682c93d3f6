"""Structured output through the real processes: the tiny model's every output under a constraint
parses and validates (30 random JSON schemas greedy and sampled, 20 regexes, an EBNF grammar,
json_object), bad constraints are INVALID_ARGUMENT, and free requests sampled beside constrained
ones get exactly the tokens they get alone."""
from __future__ import annotations

import ast
import json
import re

import grpc
import jsonschema
import pytest
import regex

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from tests.support.client import generate, generate_many
from tests.support.constraint_cases import ARITHMETIC, REGEXES, random_schemas, whitespace_run

pytestmark = pytest.mark.timeout(300)

EOS_TEXTS = ("<|im_end|>", "<|endoftext|>")   # the tiny checkpoint's EOS tokens, in the text unless skipped


def constrained_text(completion) -> str:
    """The constrained text: the output less the EOS token that ended it."""
    assert completion.finish_reason == generation_pb2.FINISH_REASON_STOP, completion
    assert completion.matched_stop in EOS_TEXTS
    return completion.text.removesuffix(completion.matched_stop)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_thirty_random_schemas_give_compact_json_that_validates(services, temperature):
    schemas = random_schemas(seed=17, count=30)
    with services.channel() as ch:
        outputs = generate_many(ch, [dict(text=f"Record {i}:", json_schema=json.dumps(schema), max_tokens=400,
                                          temperature=temperature, seed=i) for i, schema in enumerate(schemas)])
    for schema, out in zip(schemas, outputs):
        text = constrained_text(out)
        jsonschema.validate(json.loads(text), schema, cls=jsonschema.Draft202012Validator)
        assert whitespace_run(text) == 0, f"not compact: {text!r}"


def test_twenty_regexes_fullmatch(services):
    assert len(REGEXES) == 20
    with services.channel() as ch:
        sampled = generate_many(ch, [dict(text=f"R{i}", regex=r, max_tokens=200, temperature=1.0, seed=i)
                                     for i, r in enumerate(REGEXES)])
        greedy = generate_many(ch, [dict(text=f"R{i}", regex=r, max_tokens=200, temperature=0.0)
                                    for i, r in enumerate(REGEXES)])
    for pattern, out in zip(REGEXES, sampled):
        assert re.fullmatch(pattern, constrained_text(out), flags=re.ASCII), (pattern, out.text)
    for pattern, out in zip(REGEXES, greedy):
        if out.finish_reason == generation_pb2.FINISH_REASON_LENGTH:
            # Greedy decoding may repeat one token for ever where the regex allows it (y+, \d+):
            # then max_tokens cuts it, and what it wrote is still the start of a match.
            assert "+" in pattern and regex.fullmatch(pattern, out.text, flags=regex.ASCII, partial=True)
        else:
            assert re.fullmatch(pattern, constrained_text(out), flags=re.ASCII), (pattern, out.text)


def test_an_ebnf_grammar_and_json_object(services):
    with services.channel() as ch:
        expressions = generate_many(ch, [dict(text="Compute:", grammar=ARITHMETIC, max_tokens=200, temperature=1.0,
                                              seed=i) for i in range(6)])
        objects = generate_many(ch, [dict(text="An object:", json_object=True, max_tokens=300, temperature=1.0, seed=i)
                                     for i in range(4)])
    for out in expressions:
        ast.parse(constrained_text(out), mode="eval")   # a syntax error is a grammar violation
    for out in objects:
        if out.finish_reason == generation_pb2.FINISH_REASON_STOP:   # free-form strings may run to the limit
            text = constrained_text(out)
            assert isinstance(json.loads(text), dict) and whitespace_run(text) == 0


@pytest.mark.parametrize("field, value, problem", [
    ("json_schema", '{"type": ', "not valid JSON"),
    ("json_schema", '{"type": "foo"}', 'Unsupported type "foo"'),
    ("regex", "(ab", "Regex parsing error at position 4"),
    ("grammar", "root ::= undefined_rule", 'Rule "undefined_rule" is not defined'),
    ("grammar", "", "empty"),
])
def test_a_bad_constraint_is_invalid_argument_naming_the_problem(services, field, value, problem):
    with services.channel() as ch, pytest.raises(grpc.RpcError) as caught:
        generate(ch, text="Hello", max_tokens=4, **{field: value})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"sampling.{field} is invalid: ")
    assert problem in caught.value.details()


@pytest.mark.parametrize("sampling", [dict(ignore_eos=True, max_tokens=6), dict(min_tokens=4, max_tokens=8),
                                      dict(ignore_eos=True, max_tokens=5, n=3, logprobs=True)],
                         ids=["ignore_eos", "min_tokens", "n=3 with logprobs"])
def test_a_constrained_request_that_goes_on_past_its_grammar_s_end_completes(services, sampling):
    """Past its end a grammar allows only the stop tokens (which ignore_eos and min_tokens then
    pass over), until max_tokens."""
    with services.channel() as ch:
        out = generate(ch, text="Answer:", regex="yes|no", temperature=1.0, seed=2, **sampling)
    for sample in out.samples:
        assert re.match(r"(yes|no)(<\|im_end\|>|<\|endoftext\|>)+$", sample.text), sample.text
        assert sample.finish_reason in (generation_pb2.FINISH_REASON_STOP, generation_pb2.FINISH_REASON_LENGTH)
        assert sample.usage.completion_tokens == len(sample.token_ids) >= 4


@pytest.mark.parametrize("schema, problem", [
    ({"allOf": [{"type": "integer"}, {"maximum": 9}]}, "'allOf' at # is not supported"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' at # is not supported"),
])
def test_a_schema_keyword_the_output_could_not_be_held_to_is_invalid_argument(services, schema, problem):
    tool = generation_pb2.Tool(name="f", parameters_json=json.dumps(
        {"type": "object", "properties": {"a": schema}, "required": ["a"]}))
    request = generation_pb2.ChatRequest(messages=[generation_pb2.ChatMessage(role="user", content="Hi")],
                                         tools=[tool], tool_choice="f")
    with services.channel() as ch:
        with pytest.raises(grpc.RpcError) as caught:
            generate(ch, text="Hello", max_tokens=4, json_schema=json.dumps(schema))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == f"sampling.json_schema is invalid: {problem}: structured output could " \
                                         f"not hold the output to it"
        with pytest.raises(grpc.RpcError) as caught:      # refused where the worker builds the tool calls' grammar
            list(generation_pb2_grpc.GenerationStub(ch).Chat(request, timeout=30))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("tools is invalid: ") and "/properties/a" in caught.value.details()


def test_a_tool_whose_parameters_cannot_constrain_a_call_is_invalid_argument(services):
    request = generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(role="user", content="Hi")],
        tools=[generation_pb2.Tool(name="f", parameters_json='{"type": "object", "properties": {"a": {"type": "x"}}}')],
        tool_choice="required")
    with services.channel() as ch, pytest.raises(grpc.RpcError) as caught:
        list(generation_pb2_grpc.GenerationStub(ch).Chat(request, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'Unsupported type "x"' in caught.value.details()


def test_free_requests_beside_constrained_ones_get_the_tokens_they_get_alone(services):
    free = [dict(text="Once upon a time", temperature=0.0, max_tokens=40, ignore_eos=True),
            dict(text="The quick brown fox", temperature=1.0, seed=3, max_tokens=40, ignore_eos=True),
            dict(text="Simple is better", temperature=0.7, top_p=0.9, seed=4, max_tokens=40, ignore_eos=True)]
    schema = json.dumps(random_schemas(seed=5, count=1)[0])
    constrained = [dict(text=f"JSON {i}:", json_schema=schema, temperature=1.0, seed=i, max_tokens=200)
                   for i in range(4)] + [dict(text="R", regex=REGEXES[i], max_tokens=60) for i in range(4)]
    with services.channel() as ch:
        alone = generate_many(ch, free)
        mixed = generate_many(ch, constrained[:4] + free + constrained[4:])
    assert [out.token_ids for out in mixed[4:7]] == [out.token_ids for out in alone]
