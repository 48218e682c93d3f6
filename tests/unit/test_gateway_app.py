"""The gateway's HTTP application over a fake scheduler client (tests/support/fake_scheduler.py):
echo and prompt_logprobs, -inf logprobs as -9999.0, continuous usage, the Responses API's items and
streamed events, /tokenize and /detokenize, and the 400s that name what a client got wrong."""
from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json

import pytest
from fastapi.testclient import TestClient

from common.client import ChatChunk, ToolCall, Usage
from gateway.app import create_app
from gateway.metrics import method_of
from gateway.responses_request import ResponsesRequest, to_chat
from gateway.state import GatewayConfig
from tests.support.fake_scheduler import FakeScheduler

USER = [{"role": "user", "content": "Hi"}]


def strict_json(text: str):
    """json.loads that refuses NaN and the infinities, as a browser's JSON.parse does."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def events(body: str) -> list[dict]:
    """The JSON payloads of a server-sent event stream (without [DONE])."""
    return [strict_json(line[len("data: "):]) for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture
def fake():
    return FakeScheduler()


def http(fake: FakeScheduler, **config) -> TestClient:
    return TestClient(create_app(GatewayConfig("unused", **config), client_factory=lambda: fake),
                      raise_server_exceptions=False)


def post(fake, path, body, **config):
    with http(fake, **config) as client:
        return client.post(path, json=body)


def test_echo_with_logprobs_puts_the_prompt_first_with_a_null_first_logprob(fake):
    reply = post(fake, "/v1/completions", {"prompt": "abc", "echo": True, "logprobs": 2, "max_tokens": 3})
    (choice,) = strict_json(reply.text)["choices"]
    prompt_ids = [10 + ord(c) % 90 for c in "abc"]
    assert ("generate", prompt_ids) in fake.calls   # the text prompt was tokenized, then sent as ids
    assert choice["text"] == "abc<5><6><7>"
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"<{t}>" for t in prompt_ids] + ["<5>", "<6>", "<7>"]
    assert lp["token_logprobs"] == [None, -1.0, -1.0, -0.5, -0.5, -9999.0]
    assert lp["top_logprobs"][0] is None and all(len(t) == 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == [0, 4, 8, 12, 15, 18]


def test_echo_with_max_tokens_0_is_the_prompt_alone(fake):
    reply = strict_json(post(fake, "/v1/completions", {"prompt": [11, 12], "echo": True, "max_tokens": 0,
                                                       "logprobs": 0}).text)
    (choice,) = reply["choices"]
    assert choice["text"] == "<11><12>" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0] and choice["logprobs"]["top_logprobs"] is None
    assert reply["usage"]["completion_tokens"] == 0
    assert post(fake, "/v1/completions", {"prompt": "x", "max_tokens": 0}).json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_in_vllm_format_on_both_endpoints(fake):
    choice = post(fake, "/v1/completions", {"prompt": [11, 12, 13], "prompt_logprobs": 1, "max_tokens": 1}).json()
    first, second, _ = choice["choices"][0]["prompt_logprobs"]
    assert first is None
    assert second == {"12": {"logprob": -1.0, "rank": None, "decoded_token": "<12>"},
                      "20": {"logprob": -9999.0, "rank": 1, "decoded_token": "<20>"}}   # -inf in the fake
    chat = post(fake, "/v1/chat/completions", {"messages": USER, "prompt_logprobs": 2, "max_tokens": 1}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == 12
    assert chat["choices"][0]["logprobs"] is None   # prompt_logprobs alone asks no sampled logprobs


def test_streamed_echo_of_n_samples_echoes_each_choice_first(fake):
    body = post(fake, "/v1/completions", {"prompt": [11, 12], "echo": True, "logprobs": 1, "n": 2, "stream": True,
                                          "stream_options": {"include_usage": True,
                                                             "continuous_usage_stats": True}}).text
    chunks = events(body)
    by_choice: dict[int, list] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        by_choice.setdefault(choice["index"], []).append(choice)
        assert chunk["usage"]["prompt_tokens"] == 2   # continuous: the usage so far on every chunk
    for choices in by_choice.values():
        assert choices[0]["text"] == "<11><12>" and choices[0]["logprobs"]["token_logprobs"] == [None, -1.0]
        assert "".join(c["text"] for c in choices) == "<11><12><5><6><7>"
        assert [o for c in choices for o in c["logprobs"]["text_offset"]] == [0, 4, 8, 11, 14]
    assert set(by_choice) == {0, 1}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_a_minus_infinity_logprob_is_sent_as_minus_9999_streamed_and_not(fake):
    for stream in (False, True):
        for path, body in (("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 3}),
                           ("/v1/completions", {"prompt": "x", "logprobs": 3})):
            text = post(fake, path, {**body, "stream": stream}).text
            assert "Infinity" not in text and "NaN" not in text and "-9999.0" in text
            events(text) if stream else strict_json(text)


def test_the_responses_api_answers_reasoning_message_and_calls_as_items():
    fake = FakeScheduler(reasoning="thinking", tool_calls=[ToolCall("call_1", "f", {"x": 1})])
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    reply = strict_json(post(fake, "/v1/responses", {"input": "Hi", "tools": tools, "max_output_tokens": 3}).text)
    assert [i["type"] for i in reply["output"]] == ["reasoning", "message", "function_call"]
    assert reply["output"][0]["content"] == [{"type": "reasoning_text", "text": "thinking"}]
    assert reply["output"][2]["call_id"] == "call_1" and json.loads(reply["output"][2]["arguments"]) == {"x": 1}
    assert reply["status"] == "completed" and reply["usage"]["output_tokens"] == 3


def test_the_responses_stream_follows_the_spec_event_sequence():
    fake = FakeScheduler(reasoning="hm", tool_calls=[ToolCall("call_1", "f", {})])
    body = post(fake, "/v1/responses", {"input": "Hi", "stream": True}).text
    sent = events(body)
    assert [e["type"] for e in sent] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    assert all(line.startswith("event: ") for line in body.splitlines()[::3] if line)
    assert [i["type"] for i in sent[-1]["response"]["output"]] == ["reasoning", "message", "function_call"]


def test_responses_input_items_become_the_chat_turns():
    call, origins = to_chat(ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}', "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]}]}))
    assert call.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "hm", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "c2", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}, {"role": "assistant", "content": "It is sunny."}]
    assert origins == ["instructions", "input[0]", "input[2]", "input[4]", "input[5]"]


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"), ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 200}]}, "input[0].arguments"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "text", "schema": {"type": "object"}}}}, "text.format.schema"),
    ({"tools": [{"type": "function", "name": "auto"}], "tool_choice": {"type": "function", "name": "auto"}},
     "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"), ({"conversation": "conv_1"}, "conversation"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]}, "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"anyOf": []}}}}, "text.format.schema"),
    ({"input": [{"type": "reasoning", "content": 5}, {"role": "user", "content": "x"}]}, "input[0].content"),
    ({"input": [{"type": "reasoning", "summary": [{"text": 5}]}, {"role": "user", "content": "x"}]},
     "input[0].summary[0].text"),
])
def test_responses_refusals_name_the_responses_parameter(fake, body, param):
    """As the Responses API spells it: text.format holds its schema, tool_choice its name."""
    reply = post(fake, "/v1/responses", {"input": "Hi", **body})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param, error
    assert "json_schema.schema" not in error["message"] and "function.name" not in error["message"], error


def test_tokenize_and_detokenize_as_vllm_has_them(fake):
    with http(fake, api_keys=["k"]) as client:
        assert client.post("/tokenize", json={"prompt": "ab"}).status_code == 401   # the key is needed
        auth = {"Authorization": "Bearer k"}
        got = client.post("/tokenize", json={"prompt": "ab", "return_token_strs": True}, headers=auth).json()
        assert got == {"count": 2, "max_model_len": 4096, "tokens": [17, 18], "token_strs": ["<17>", "<18>"]}
        assert client.post("/detokenize", json={"tokens": [17, 18]}, headers=auth).json() == {"prompt": "<17><18>"}
        refused = client.post("/detokenize", json={"tokens": [2 ** 40]}, headers=auth).json()["error"]
        assert refused["param"] == "tokens[0]"
        beyond = client.post("/detokenize", json={"tokens": [1, 5000]}, headers=auth)   # the scheduler's refusal
        assert beyond.status_code == 400 and beyond.json()["error"]["param"] == "tokens"
        assert client.get("/health").status_code == 200   # probes need no key


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", b"", "prompt"), ("/v1/completions", b"[1, 2]", "prompt"),
    ("/v1/chat/completions", b"", "messages"), ("/v1/responses", b"null", "input"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["a", "\\udfff"]}', "prompt"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"]}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages[0].content"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 4294967296}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "top_k": 1099511627776}', "top_k"),
    ("/v1/completions", b'{"prompt": "a", "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", b'{"prompt": "a", "n": 4294967296}', "n"),
    ("/v1/completions", b'{"prompt": "a", "priority": -2147483649}', "priority"),
    ("/v1/completions", b'{"prompt": "a", "stop_token_ids": [4294967296]}', "stop_token_ids[0]"),
    ("/v1/completions", b'{"prompt": "a", "logit_bias": {"\\u00b2": 1}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "a", "logit_bias": {"\\u2460": 1}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "a", "logprobs": 21}', "logprobs"),
    ("/v1/completions", b'{"prompt": [1, -1]}', "prompt"),
    ("/v1/completions", b'{"prompt": [[1], [18446744073709551616]]}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", '
                             b'"function": {"name": "f", "arguments": "{\\"a\\": NaN}"}}]}]}',
     "messages[0].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
                             b'"json_schema", "json_schema": {"schema": ' + b'{"a": ' * 100 + b'1' + b'}' * 100
                             + b"}}}", "response_format.json_schema.schema"),
    ("/v1/chat/completions", b'{"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", '
                             b'"function": {"name": "f", "arguments": "' + b'[' * 5000 + b'"}}]}]}',
     "messages[0].tool_calls[0].function.arguments"),
])
def test_malformed_requests_are_400_naming_the_parameter(fake, path, raw, param):
    with http(fake) as client:
        reply = client.post(path, content=raw, headers={"content-type": "application/json"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 2.0}, "n"), ("/v1/completions", {"prompt": "a", "seed": "7"}, "seed"),
    ("/v1/completions", {"prompt": "a", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "a", "echo": 1}, "echo"), ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [False]}, "stop_token_ids[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": 0}, "stream"),
    ("/v1/responses", {"input": "x", "max_output_tokens": True}, "max_output_tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens[1]"),
])
def test_a_value_of_another_json_type_is_refused_not_coerced(fake, path, body, param):
    """true is not 1, "7" is not 7 and 2.0 is not an integer, as OpenAI's API has it: coerced, a
    `max_tokens: true` would silently ask for one token."""
    with http(fake) as client:
        reply = client.post(path, json=body)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param, error
    assert fake.calls == []


def test_an_integer_is_a_number():
    with http(FakeScheduler()) as client:
        assert client.post("/v1/completions", json={"prompt": "a", "temperature": 1, "top_p": 1}).status_code == 200


@pytest.mark.parametrize("raw, says", [
    (b"[" * 100000 + b"]" * 100000, "deeper"), (b'{"prompt": "\xff"}', "UTF-8"),
    (b'{"prompt": "a", "seed": 1' + b"0" * 5000 + b"}", "digits"),
])
def test_a_body_the_parser_cannot_read_is_400_saying_why(fake, raw, says):
    with http(fake) as client:
        reply = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["code"] == "invalid_json" and says in error["message"], error


@pytest.mark.parametrize("path, raw, number, param", [
    ("/v1/responses", b'{"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {"a": Infinity}}]}',
     "Infinity", "tools[0].parameters.a"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', "NaN",
     "temperature"),
    ("/v1/completions", b'{"prompt": "a", "top_p": 1e999}', "1e999", "top_p"),
    ("/tokenize", b'{"prompt": "a", "x": [1, {"y": -Infinity}]}', "-Infinity", "x[1].y"),
    # A name UTF-8 cannot carry (a lone surrogate) is quoted as its escape; a long one cut short.
    ("/v1/completions", b'{"prompt": "a", "\\ud800": NaN}', "NaN", "\\ud800"),
    ("/v1/completions", b'{"prompt": "a", "' + b"k" * 5000 + b'": NaN}', "NaN", "k" * 64 + "..."),
])
def test_numbers_json_does_not_have_are_400_naming_them(fake, path, raw, number, param):
    """Python's parser takes NaN, Infinity and 1e999; JSON has none of them, and a reply that echoed
    one (a Responses reply echoes its tools) could not be written."""
    with http(fake) as client:
        reply = client.post(path, content=raw, headers={"content-type": "application/json"})
    error = strict_json(reply.text)["error"]
    assert reply.status_code == 400 and error["code"] == "invalid_json", error
    assert f"the number {number} at {param}" in error["message"] and error["param"] == param, error


@pytest.mark.parametrize("headers, says", [
    ({"content-type": "text/plain"}, "Content-Type"), ({}, "Content-Type"),
    ({"content-type": "application/x-www-form-urlencoded"}, "Content-Type"),
    ({"content-type": "application/json", "content-encoding": "gzip"}, "Content-Encoding"),
])
def test_a_body_sent_as_other_than_plain_json_is_415_naming_the_header(fake, headers, says):
    body = json.dumps({"messages": USER}).encode()
    if "content-encoding" in headers:
        body = gzip.compress(body)
    with http(fake) as client:
        reply = client.post("/v1/chat/completions", content=body, headers=headers)
    error = strict_json(reply.text)["error"]
    assert reply.status_code == 415 and says in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_metrics_labels_come_from_a_fixed_set(fake):
    assert method_of("POST") == "POST" and method_of("BREW") == method_of("X" * 100) == "other"
    with http(fake) as client:
        for i in range(20):
            client.request(f"M{i}", f"/made/up/{i}")
        scrape = client.get("/metrics").text
    assert 'method="other"' in scrape and "M1" not in scrape and "/made/up" not in scrape


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", "/v1/models/fake-qwen3"])
def test_a_get_route_answers_head(fake, path):
    """As GET (uvicorn leaves the body out): uptime monitors probe by HEAD."""
    with http(fake) as client:
        got, head = client.get(path), client.head(path)
    assert head.status_code == got.status_code == 200, head.text
    assert head.headers["content-type"] == got.headers["content-type"]
    assert client.head("/v1/completions").status_code == 405   # a POST route stays one


@pytest.mark.parametrize("argv, refused", [
    (["--host", "0.0.0.0", "--scheduler-auth-token", "t"], True),
    (["--host", "0.0.0.0", "--scheduler-auth-token", "t", "--allow-unauthenticated"], False),
    (["--host", "0.0.0.0", "--scheduler-auth-token", "t", "--api-key", "k"], False),
    (["--host", "127.0.0.1", "--scheduler-auth-token", "t"], False),
    (["--host", "0.0.0.0"], False),   # no token to hand out: the start-up warning only
])
def test_a_gateway_holding_the_schedulers_token_without_keys_beyond_loopback_refuses_to_start(argv, refused):
    from gateway.__main__ import _read_keys, build_parser, exposure_refusal, main

    args = build_parser().parse_args(argv)
    assert (exposure_refusal(args, _read_keys(args)) is not None) == refused
    if refused:
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2


class _Queued(FakeScheduler):
    """A scheduler whose streams wait in its queue (no first chunk) until cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = asyncio.Event()
        self.cancelled = 0

    async def stream(self, *args, **kwargs):
        self.waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        yield   # an async generator, never reached

    stream_chat = stream


def _post_and_leave(fake, path: str, body: dict, *, leave_on=(), after_bodies: int | None = None, probe=None):
    """POSTs `body` to the gateway app over ASGI, as a server would, `fake` its scheduler. The client leaves
    (http.disconnect) once an event of `leave_on` is set, or once `after_bodies` body messages came back. The
    messages sent back, and `probe()` taken as the app returns (inside the loop: asyncio.run's shutdown
    closes every async generator left, and would hide one the gateway left open)."""
    from gateway.state import Gateway

    app = create_app(GatewayConfig("unused"), client_factory=lambda: fake)
    app.state.gateway = Gateway(GatewayConfig("unused"), client=fake)
    sent = []

    async def run():
        bodies = asyncio.Event()
        messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            waits = [asyncio.ensure_future(e.wait()) for e in (*leave_on, bodies)]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if after_bodies is not None and message["type"] == "http.response.body" and len(sent) > after_bodies:
                bodies.set()

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "client": ("t", 1), "server": ("t", 80)}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return probe() if probe else None

    return sent, asyncio.run(run())


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Hi", "stream": True}), ("/v1/completions", {"prompt": ["a", "b"], "stream": True}),
    ("/v1/chat/completions", {"messages": USER, "stream": True}), ("/v1/responses", {"input": "Hi", "stream": True}),
])
def test_a_client_that_leaves_before_the_first_chunk_cancels_the_queued_stream(path, body):
    fake = _Queued()
    sent, _ = _post_and_leave(fake, path, body, leave_on=(fake.waiting,))
    assert fake.cancelled == (2 if body.get("prompt") == ["a", "b"] else 1)
    assert sent[0]["status"] == 499   # no 200 stream was started for a client that is gone


def test_an_unknown_model_is_404_naming_it_without_echoing_a_name_of_any_size(fake):
    with http(fake) as client:
        short = client.post("/v1/completions", json={"prompt": "a", "model": "gpt-x"}).json()["error"]
        huge = client.post("/v1/completions", json={"prompt": "a", "model": "\x00" * 100_000})
    assert short["param"] == "model" and "'gpt-x'" in short["message"]
    assert huge.status_code == 404 and huge.json()["error"]["param"] == "model" and len(huge.text) < 1000


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": None}}]}),
    ("/v1/responses", {"input": "Hi", "tools": [{"type": "function", "name": "f"}]}),
])
def test_a_function_without_parameters_takes_no_arguments(path, body):
    """OpenAI's `parameters` is optional: a function without it has an empty parameter list."""
    seen = []

    class Recording(FakeScheduler):
        async def stream_chat(self, messages, sampling=None, *, tools=(), **kwargs):
            seen.extend(tools)
            async for chunk in super().stream_chat(messages, sampling, tools=tools, **kwargs):
                yield chunk
    with http(Recording()) as client:
        reply = client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    assert [tool["parameters"] for tool in seen] == [{"type": "object", "properties": {}}]


@pytest.mark.parametrize("raw, param, says", [
    (b'{"prompt": "x", "a\\ud800b": 1}', None, "a field name in the request body holds a lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": '
     b'{"name": "\\ud800"}}}', "tool_choice", "lone UTF-16 surrogate"),
    (b'{"messages": [{"role": "user", "content": "x"}], "stop": ["x", 5]}', "stop", "valid string"),
])
def test_a_refusal_says_what_is_wrong_with_the_value_sent(fake, raw, param, says):
    """Of a union's complaints, the one about the member the value matched furthest is told."""
    path = "/v1/completions" if raw.startswith(b'{"prompt"') else "/v1/chat/completions"
    with http(fake) as client:
        reply = client.post(path, content=raw, headers={"content-type": "application/json"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and says in error["message"], error


class _Unfinished(FakeScheduler):
    """A scheduler stream that ends (status OK) before its sample's finish: after a piece of text
    (`text`), or at once."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    async def stream_chat(self, messages, sampling=None, **kwargs):
        if self.text:
            yield ChatChunk("r", self.text, "", [], [5], None, None, 0)


@pytest.mark.parametrize("text", ["partial", ""])
def test_a_stream_that_ends_without_its_finish_ends_with_its_failure(text):
    """The unstreamed answer to such a stream is a 500 (the client's accumulator refuses it); streamed,
    the Responses events ended after the last delta (or after response.in_progress) with no terminal
    event, and a chat stream sent [DONE] as if its choice had finished."""
    sent = events(post(_Unfinished(text), "/v1/responses", {"input": "Hi", "stream": True}).text)
    assert [e["type"] for e in sent[-2:]] == ["error", "response.failed"], [e["type"] for e in sent]
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    failed = sent[-1]["response"]
    assert failed["status"] == "failed" and "without a finish reason" in failed["error"]["message"]
    # The output holds what was streamed, as the deltas said it.
    assert [part["text"] for item in failed["output"] for part in item["content"]] == ([text] if text else [])
    chunks = events(post(_Unfinished(text), "/v1/chat/completions", {"messages": USER, "stream": True}).text)
    assert chunks[-1]["error"]["code"] == "internal", chunks


def test_streamed_responses_items_have_distinct_ids_when_text_follows_a_call():
    """The chat parser lets content follow a tool call (text, call, text): streamed, that is a second
    message item, which had the first one's id (msg_<id> twice in one response's output)."""
    class TextAroundACall(FakeScheduler):
        async def stream_chat(self, messages, sampling=None, **kwargs):
            yield ChatChunk("r", "before", "", [], [5], None, None, 0)
            yield ChatChunk("r", "", "", [ToolCall("call_1", "f", {})], [6], None, None, 0)
            yield ChatChunk("r", "after", "", [], [7], "stop", Usage(3, 3, 0), 0)

    sent = events(post(TextAroundACall(), "/v1/responses", {"input": "Hi", "stream": True}).text)
    output = sent[-1]["response"]["output"]
    assert [i["type"] for i in output] == ["message", "function_call", "message"]
    ids = [i["id"] for i in output]
    assert len(set(ids)) == 3, ids
    # Every event names the item it is about by that item's id.
    added = [e["item"]["id"] for e in sent if e["type"] == "response.output_item.added"]
    assert added == ids
    assert {e["item_id"] for e in sent if e["type"] == "response.output_text.delta"} == {ids[0], ids[2]}


def test_a_reasoning_item_is_its_own_turns_reasoning_only():
    """A reasoning item belongs to the assistant turn it precedes; one whose turn wrote nothing else (a
    user message follows it) was carried on to the next assistant turn, whose rendered <think> block
    then held another turn's reasoning."""
    call, _ = to_chat(ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "a"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "first turn's"}]},
        {"role": "user", "content": "b"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}))
    assert [m["role"] for m in call.messages] == ["user", "user", "assistant", "tool"]
    assert "reasoning_content" not in call.messages[2], call.messages[2]


class _Endless(FakeScheduler):
    """A scheduler whose streams go on until closed (counted in `open`), and whose token texts
    never come: a client waiting for them can only leave. It keeps every stream it made, so that
    no stream is closed by the garbage collector, only by the gateway."""

    def __init__(self) -> None:
        super().__init__()
        self.texting = asyncio.Event()
        self.open = 0
        self.made = []

    def stream(self, prompt, sampling=None, **kwargs):
        self.made.append(self._endless(prompt, sampling))
        return self.made[-1]

    async def _endless(self, prompt, sampling):
        self.open += 1
        try:
            first = self._chunks(list(prompt) if not isinstance(prompt, str) else None, sampling)[0]
            while True:
                yield first
                await asyncio.sleep(0.01)
        finally:
            self.open -= 1

    def stream_chat(self, messages, sampling=None, **kwargs):
        self.made.append(self._endless_chat(messages, sampling, **kwargs))
        return self.made[-1]

    async def _endless_chat(self, messages, sampling, **kwargs):
        self.open += 1
        try:
            first = await anext(FakeScheduler.stream_chat(self, messages, sampling, **kwargs))
            first = dataclasses.replace(first, finish_reason=None)
            while True:
                yield first
                await asyncio.sleep(0.01)
        finally:
            self.open -= 1

    async def token_texts(self, token_ids, **kwargs):
        self.texting.set()
        await asyncio.Event().wait()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [11, 12], "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": [11, 12], "prompt_logprobs": 1}), ("/v1/completions", {"prompt": "Hi", "logprobs": 0}),
    ("/v1/completions", {"prompt": [[11], [12]], "logprobs": 2}),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True}),
    ("/v1/chat/completions", {"messages": USER}), ("/v1/responses", {"input": "Hi"}),
])
def test_a_client_that_leaves_a_stream_closes_the_schedulers(path, body):
    """A streamed choice's logprobs wait for the tokens' texts (a Detokenize call); a client that
    leaves then, or between two events, ends the scheduler's streams at once, not when they are
    garbage-collected (they ran on to max_tokens: completions and chat with logprobs did)."""
    fake = _Endless()
    sent, still_open = _post_and_leave(fake, path, {**body, "stream": True}, leave_on=(fake.texting,), after_bodies=3,
                                       probe=lambda: fake.open)
    assert still_open == 0
    assert sent[0]["status"] == 200


def test_an_unstreamed_batch_lets_the_event_loop_run_between_its_choices():
    """A batch's answer is built and encoded a choice at a time, the event loop running between
    choices: built whole, a loglikelihood batch of 16 prompts of 4,000 tokens with 20 top logprobs
    (120 MB of JSON) held the loop that writes every other client's stream for 7 s."""
    from gateway.state import Gateway

    prompts = 16
    ticks = 0
    seen: dict[str, int] = {}

    class Counting(FakeScheduler):
        async def generate(self, *args, **kwargs):
            result = await super().generate(*args, **kwargs)
            seen["generated"] = ticks   # the last prompt's
            return result

    fake = Counting()
    app = create_app(GatewayConfig("unused"), client_factory=lambda: fake)
    app.state.gateway = Gateway(GatewayConfig("unused"), client=fake)
    body = {"prompt": [[11, 12]] * prompts, "max_tokens": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 2}
    sent = []

    async def run() -> None:
        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.Event().wait()

        async def send(message):
            seen.setdefault("answered", ticks)
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "client": ("t", 1), "server": ("t", 80)}
        ticker = asyncio.ensure_future(tick())
        await asyncio.wait_for(app(scope, receive, send), 10)
        ticker.cancel()

    asyncio.run(run())
    assert sent[0]["status"] == 200
    answer = strict_json(b"".join(m.get("body", b"") for m in sent[1:]).decode())
    assert [c["index"] for c in answer["choices"]] == list(range(prompts))
    assert answer["choices"][0]["prompt_logprobs"][1]["12"]["logprob"] == -1.0
    assert seen["answered"] - seen["generated"] >= prompts
