"""The gateway's work per request is bounded before it is done: the event loop that parses one
request writes every other client's stream, so a body's lists are refused at their first item
over a bound (and at their first wrong item), and its strings are checked without Python work per
item. Each refusal is a 400 naming the field, and the scheduler is never asked."""
from __future__ import annotations

import gc
import json
import sys

import pydantic
import pytest
from fastapi.testclient import TestClient

from common.sampling_bounds import MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from gateway import completions
from gateway.app import create_app
from gateway.protocol import MAX_ARGUMENT_CHARS, MAX_IDS, MAX_ITEMS, ChatCompletionRequest, check_wire_value
from gateway.state import GatewayConfig
from gateway.tokenize import DetokenizeRequest
from tests.support.fake_scheduler import FakeScheduler

USER = {"role": "user", "content": "Hi"}


def profile_events(fn) -> int:
    """How many Python-level calls (and C calls made from Python) `fn()` makes. The cyclic garbage
    collector is off meanwhile: a collection would run whatever finalizers earlier tests left."""
    count = 0

    def hook(_frame, _event, _arg):
        nonlocal count
        count += 1
    gc.collect()
    gc.disable()
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return count


def test_checking_a_wide_value_makes_no_call_per_item():
    def value(width: int):
        return {"a": ["token"] * width, "b": [list(range(width)), {"c": ["é", 1.5] * width}], "d": [[]] * width}
    assert profile_events(lambda: check_wire_value(value(100_000))) == profile_events(lambda: check_wire_value(value(3)))


@pytest.mark.parametrize("value", [
    ["ok"] * 1000 + ["x\ud800"], {"k": [1, 2, {"é": ["\udfffz"]}]}, {"\ud800": 1}, [1.5, None, True, "a\udc00"],
])
def test_a_lone_surrogate_anywhere_in_a_value_is_found(value):
    with pytest.raises(ValueError, match="lone UTF-16 surrogate"):
        check_wire_value(value)


def test_nesting_is_bounded_at_the_same_depth():
    value: object = 1
    for _ in range(64):
        value = [value]
    check_wire_value(value)
    with pytest.raises(ValueError, match="nests deeper than 64"):
        check_wire_value({"a": value})


def _call(name: str, arguments: str) -> dict:
    return {"id": "1", "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL = {"type": "function", "function": {"name": "f"}}
OVER_LONG = {
    "messages": ("/v1/chat/completions", {"messages": [USER] * (MAX_ITEMS + 1)}, "messages"),
    "tools": ("/v1/chat/completions", {"messages": [USER], "tools": [TOOL] * (MAX_ITEMS + 1)}, "tools"),
    "tool calls": ("/v1/chat/completions", {"messages": [
        {"role": "assistant", "tool_calls": [_call("f", "{}")] * (MAX_ITEMS + 1)}]}, "messages[0].tool_calls"),
    "content parts": ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": ""}] * (MAX_ITEMS + 1)}]}, "messages[0].content"),
    "tool-call arguments": ("/v1/chat/completions", {"messages": [
        {"role": "assistant", "tool_calls": [_call("f", " " * (MAX_ARGUMENT_CHARS + 1))]}]},
        "messages[0].tool_calls[0].function.arguments"),
    "stop strings": ("/v1/chat/completions", {"messages": [USER], "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    "stop token ids": ("/v1/completions", {"prompt": "x", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)},
                       "stop_token_ids"),
    "logit_bias": ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in
                                                                       range(MAX_LOGIT_BIAS_ENTRIES + 1)}},
                   "logit_bias"),
    "prompts": ("/v1/completions", {"prompt": ["x"] * (MAX_ITEMS + 1)}, "prompt"),
    "prompt ids": ("/v1/completions", {"prompt": [1] * (MAX_IDS + 1)}, "prompt"),
    "ids of all prompts": ("/v1/completions", {"prompt": [[1] * (MAX_IDS // 2 + 1)] * 2}, "prompt"),
    "detokenize ids": ("/detokenize", {"tokens": [1] * (MAX_IDS + 1)}, "tokens"),
    "responses input": ("/v1/responses", {"input": [USER] * (MAX_ITEMS + 1)}, "input"),
    "responses metadata": ("/v1/responses", {"input": "x", "metadata": {str(i): "" for i in range(MAX_ITEMS + 1)}},
                           "metadata"),
}


@pytest.mark.parametrize("path, body, param", OVER_LONG.values(), ids=OVER_LONG.keys())
def test_an_over_long_list_is_refused_by_name_before_the_scheduler_is_asked(path, body, param):
    fake = FakeScheduler()
    with TestClient(create_app(GatewayConfig("unused"), client_factory=lambda: fake)) as client:
        reply = client.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert fake.calls == []


def test_a_list_ends_its_validation_at_its_first_wrong_item():
    with pytest.raises(pydantic.ValidationError) as ids:
        DetokenizeRequest.model_validate({"tokens": ["x"] * 10_000})
    assert ids.value.error_count() == 1
    with pytest.raises(pydantic.ValidationError) as messages:
        ChatCompletionRequest.model_validate({"messages": [{"role": "robot"}] * 10_000})
    assert messages.value.error_count() == 1


def test_a_list_over_its_bound_is_refused_with_the_bound_named():
    fake = FakeScheduler()
    with TestClient(create_app(GatewayConfig("unused"), client_factory=lambda: fake)) as client:
        stop = client.post("/v1/completions", json={"prompt": "x", "stop": ["x"] * (MAX_STOP_STRINGS + 1)})
    assert f"at most {MAX_STOP_STRINGS}" in stop.json()["error"]["message"]


def test_prompts_are_counted_before_they_are_read(monkeypatch):
    def unread(_req):
        raise AssertionError("the prompts were read before they were counted")
    monkeypatch.setattr(completions, "completion_prompts", unread)
    fake = FakeScheduler()
    with TestClient(create_app(GatewayConfig("unused", max_sequences_per_request=4),
                               client_factory=lambda: fake)) as client:
        reply = client.post("/v1/completions", json={"prompt": [[1, 2]] * 5})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "prompt" and "5 x 1" in reply.json()["error"]["message"]


WHOLE_ANSWERS = [("/v1/completions", {"prompt": "Hi", "logprobs": 2}), ("/v1/chat/completions", {"messages": [USER]}),
                 ("/v1/responses", {"input": "Hi"}), ("/tokenize", {"prompt": "Hi", "return_token_strs": True}),
                 ("/detokenize", {"tokens": [17, 18]})]


@pytest.mark.parametrize("path, body", WHOLE_ANSWERS, ids=[path for path, _ in WHOLE_ANSWERS])
def test_a_whole_answer_is_not_walked_value_by_value_before_it_is_encoded(monkeypatch, path, body):
    """FastAPI's jsonable_encoder visits every value of an answer in Python (seconds for a million
    token ids, on the loop that writes every stream); json.dumps alone encodes what the
    endpoints build."""
    import fastapi.routing

    def walked(*_args, **_kwargs):
        raise AssertionError("the answer was walked by jsonable_encoder")
    monkeypatch.setattr(fastapi.routing, "jsonable_encoder", walked)
    fake = FakeScheduler()
    with TestClient(create_app(GatewayConfig("unused"), client_factory=lambda: fake),
                    raise_server_exceptions=False) as client:
        reply = client.post(path, json=body)
    assert reply.status_code == 200, reply.text


def test_a_body_of_more_json_values_than_the_bound_is_refused_before_it_is_parsed(monkeypatch):
    """Parsing costs by values, not bytes: 2 MiB of [[1], [1], ...] take the event loop longer than 8 MiB of text."""
    import gateway.json_body

    real_loads = gateway.json_body.loads
    parsed = []
    monkeypatch.setattr(gateway.json_body, "loads", lambda body: parsed.append(len(body)) or real_loads(body))
    fake = FakeScheduler()
    with TestClient(create_app(GatewayConfig("unused", max_request_values=1000), client_factory=lambda: fake)) as client:
        many = client.post("/v1/completions", json={"prompt": "x", "user": [[1]] * 1001})
        text = client.post("/v1/completions", json={"prompt": "x" * 100_000, "max_tokens": 2})
        ids = client.post("/detokenize", json={"tokens": [1] * 990})
    assert many.status_code == 413 and many.json()["error"]["code"] == "request_too_large"
    assert "--max-request-json-values" in many.json()["error"]["message"]
    assert text.status_code == 200 and ids.status_code == 200
    assert len(parsed) == 2   # the refused body was never parsed


def test_a_large_body_is_parsed_apart_from_the_event_loop_and_a_small_one_on_it(monkeypatch):
    """The event loop writes every other stream: a body past PARSE_APART_BYTES is parsed on a
    worker thread (CPython hands the loop the interpreter back every 5 ms), a small one inline."""
    import threading

    import gateway.json_body

    real_loads = gateway.json_body.loads
    threads = []
    monkeypatch.setattr(gateway.json_body, "loads",
                        lambda body: threads.append(threading.get_ident()) or real_loads(body))
    fake = FakeScheduler()
    large = "x" * (gateway.json_body.PARSE_APART_BYTES + 1)
    with TestClient(create_app(GatewayConfig("unused"), client_factory=lambda: fake)) as client:
        small = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        # A handler on the loop's thread, to tell it apart from the parser's.
        loop_thread = client.portal.call(lambda: threading.get_ident())
        big = client.post("/v1/completions", json={"prompt": large, "max_tokens": 2})
        broken = client.post("/v1/completions", content=b'{"prompt": "' + large.encode() + b'", ]',
                             headers={"content-type": "application/json"})
    assert small.status_code == big.status_code == 200, (small.text, big.text)
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json", broken.text
    assert threads[0] == loop_thread and threads[1] != loop_thread and threads[2] != loop_thread


@pytest.fixture
def tuned_for_parsing():
    """The gateway process's interpreter settings (gateway/__main__.py), undone after the test."""
    import gc

    from gateway.__main__ import tune_for_parsing
    threshold, digits = gc.get_threshold(), sys.get_int_max_str_digits()
    tune_for_parsing()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        sys.set_int_max_str_digits(digits)
        gc.unfreeze()


def test_parsing_a_body_of_many_objects_runs_few_collections(tuned_for_parsing):
    """A body's parse makes an object per JSON array and object; the gateway's collector runs once
    per GC_THRESHOLD[0] of them, not every 700 (each run of an older generation walks the heap)."""
    import gc

    from gateway.__main__ import GC_THRESHOLD
    from gateway.json_body import loads

    body = json.dumps({"user": [{"a": []}] * 100_000}).encode()
    runs = []

    def count(phase, _info):
        if phase == "start":
            runs.append(phase)
    gc.callbacks.append(count)
    try:
        loads(body)
    finally:
        gc.callbacks.remove(count)
    assert len(runs) <= 200_000 // GC_THRESHOLD[0] + 1


def test_an_integer_of_hundreds_of_digits_is_refused_before_it_is_converted(tuned_for_parsing):
    """Converting digits to an integer takes time quadratic in their number."""
    fake = FakeScheduler()
    with TestClient(create_app(GatewayConfig("unused"), client_factory=lambda: fake)) as client:
        reply = client.post("/v1/completions", content=b'{"prompt": "x", "seed": ' + b"9" * 700 + b"}",
                            headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "more digits than the parser allows" in reply.json()["error"]["message"]
