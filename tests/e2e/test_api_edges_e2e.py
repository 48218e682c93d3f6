"""Edges of the public API found by a reliability hunt, through the real processes: what a model may
write inside a <tool_call> block that Python's json module reads but a client could not (or that
it cannot read at all), JSON schemas that no value validates against, and a stop string matched in
the text released when a sample ends.

The model's text is forced with a regex or grammar constraint on the Chat request (which applies to
the whole output while tool_choice "auto" still parses the calls), so each case is exact whatever
the tiny model's random weights would write. The documented contract: a call's arguments_json is a
JSON object; a malformed block stays text; structured output's JSON parses with `json.loads`.
"""
from __future__ import annotations

import json

import grpc
import pytest

from common.pb.llm.v1 import generation_pb2 as pb
from common.pb.llm.v1 import generation_pb2_grpc
from tests.support.client import generate

pytestmark = pytest.mark.timeout(300)

TOOL = pb.Tool(name="f", parameters_json='{"type": "object", "properties": {"a": {}}}')


def _chat(channel: grpc.Channel, sampling: pb.SamplingParams, tools=(TOOL,), tool_choice: str = ""
          ) -> tuple[str, list[pb.ToolCall], int]:
    """(text, tool calls, finish_reason) of a one-sample chat turn run to its end."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="call f")], tools=list(tools),
                             tool_choice=tool_choice, enable_thinking=False, sampling=sampling)
    text, calls, finish = "", [], 0
    for msg in stub.Chat(request, timeout=240):
        text += msg.text
        calls += msg.tool_calls
        finish = msg.finish_reason or finish
    return text, calls, finish


def _forced(body: str, max_tokens: int = 200, **sampling) -> pb.SamplingParams:
    """Greedy sampling whose whole output is `<tool_call>` + body + `</tool_call>`."""
    regex = "".join("\\" + c if c in r"\.^$|?*+()[]{}" else c for c in body)
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                             regex=f"<tool_call>{regex}</tool_call>", **sampling)


@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e999"])
def test_a_tool_call_whose_arguments_hold_a_number_json_lacks_stays_text(services, number):
    """Python's json reads NaN, Infinity and 1e999 (as inf) and writes them back as NaN/Infinity: an
    arguments_json no JSON parser takes, which the next turn's request would be refused for."""
    body = f'\n{{"name": "f", "arguments": {{"a": {number}}}}}\n'
    with services.channel() as ch:
        text, calls, finish = _chat(ch, _forced(body))
    assert calls == []
    assert text == f"<tool_call>{body}</tool_call>"
    assert finish == pb.FINISH_REASON_STOP


def test_a_tool_call_nested_past_the_parsers_recursion_stays_text(services):
    """A block of 1,100 nested arrays: json.loads raises RecursionError, which ended the stream with
    INVALID_ARGUMENT ("the request is nested too deeply") after its tokens were streamed."""
    body = "[" * 1100
    with services.channel() as ch:
        text, calls, finish = _chat(ch, _forced(body, max_tokens=1200))
    assert (text, calls, finish) == (f"<tool_call>{body}</tool_call>", [], pb.FINISH_REASON_STOP)


def test_a_tool_call_with_an_integer_too_long_to_convert_stays_text(services):
    """An integer of over 4,300 digits: json.loads raises ValueError (Python's int conversion
    limit), which ended the stream with INTERNAL. The tiny vocabulary's "00" token, biased up,
    writes two digits a step."""
    double_zero = 295
    prefix = '\n{"name": "f", "arguments": {"a": 1'
    grammar = (f'root ::= "<tool_call>" {json.dumps(prefix)} zeros "}}}}\\n</tool_call>"\n'
               f'zeros ::= "00"{{2160}}')
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=2300, grammar=grammar, logit_bias={double_zero: 100.0})
    with services.channel() as ch:
        text, calls, finish = _chat(ch, sampling)
    assert calls == []
    assert text == f"<tool_call>{prefix}{'0' * 4320}}}}}\n</tool_call>"
    assert finish == pb.FINISH_REASON_STOP


def test_a_lone_surrogate_in_a_tool_calls_arguments_is_kept_as_its_escape(services):
    """JSON's \\ud800 escape reads as a lone surrogate, which UTF-8 (and so the response's proto
    string) cannot carry: the call failed with INTERNAL (UnicodeEncodeError). Its arguments come
    back with the escape, the same JSON value, which the next turn takes as the assistant's call."""
    body = '\n{"name": "f", "arguments": {"a": "\\ud800", "b": "é"}}\n'
    with services.channel() as ch:
        text, calls, finish = _chat(ch, _forced(body))
        assert text == "" and finish == pb.FINISH_REASON_TOOL_CALLS
        [call] = calls
        assert call.name == "f"
        assert json.loads(call.arguments_json) == {"a": "\ud800", "b": "é"}
        assert "\\ud800" in call.arguments_json and "é" in call.arguments_json
        stub = generation_pb2_grpc.GenerationStub(ch)
        follow_up = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="call f"),
                                             pb.ChatMessage(role="assistant", tool_calls=[call]),
                                             pb.ChatMessage(role="tool", content="ok", tool_call_id=call.id)],
                                   tools=[TOOL], sampling=pb.SamplingParams(max_tokens=2))
        assert list(stub.Chat(follow_up, timeout=60))[-1].finish_reason


def test_a_tool_call_whose_name_is_a_lone_surrogate_stays_text(services):
    body = '\n{"name": "\\udc00", "arguments": {}}\n'
    with services.channel() as ch:
        text, calls, finish = _chat(ch, _forced(body))
    assert (text, calls, finish) == (f"<tool_call>{body}</tool_call>", [], pb.FINISH_REASON_STOP)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]},   # wrote {"a":}
    {"oneOf": []},                                                               # wrote "" (no JSON)
    {"type": []},                                                                # wrote any value
])
def test_a_json_schema_no_value_validates_against_is_invalid_argument(services, schema):
    stub_sampling = pb.SamplingParams(max_tokens=8, json_schema=json.dumps(schema))
    with services.channel() as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(text="Hi", sampling=stub_sampling), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.json_schema" in refused.value.details()
    assert "no output can validate" in refused.value.details()


def test_a_tool_whose_parameters_no_value_validates_against_is_invalid_argument(services):
    tool = pb.Tool(name="g", parameters_json='{"type": "object", "properties": {"a": {"anyOf": []}}, '
                                             '"required": ["a"]}')
    with services.channel() as ch:
        with pytest.raises(grpc.RpcError) as refused:
            _chat(ch, pb.SamplingParams(max_tokens=40), tools=[tool], tool_choice="g")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("tools ")
    assert "no output can validate" in refused.value.details()


def test_a_stop_string_in_the_text_held_back_at_the_end_stops_the_sample(services):
    """Lone UTF-8 lead bytes are held back by the detokenizer until the sample ends, then released
    as U+FFFD: a stop string matching there cut the text and was reported in matched_stop, with
    finish_reason LENGTH, where the same match one token earlier is STOP."""
    lead_byte = 97    # the tiny tokenizer's tokens 97.. are single bytes of multi-byte characters
    with services.channel() as ch:
        out = generate(ch, text="Hi", max_tokens=3, temperature=0.0, logit_bias={lead_byte: 100.0},
                       stop=["\ufffd"])
    assert out.token_ids == [lead_byte] * 3
    assert (out.text, out.matched_stop) == ("", "\ufffd")
    assert out.finish_reason == pb.FINISH_REASON_STOP
