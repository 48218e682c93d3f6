"""A hypothesis fuzz of the gateway's request schemas at the HTTP level: bodies built from each
endpoint's own fields, with values of every kind a hostile client sends (strings with lone
surrogates and control characters, integers beyond 64 bits, Unicode digits, deep nesting, wrong
types everywhere, NaN, misshapen JSON schemas), sent as JSON or under another Content-Type,
gzip'd or not UTF-8, go to the ASGI app over a fake scheduler client that encodes each call's
protobuf request as the wire would. Every answer is a 2xx whose body (or every event of whose
stream) is strict JSON, or a 4xx in OpenAI's error shape: never a 5xx."""
from __future__ import annotations

import asyncio
import gzip
import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.responses_request import ResponsesRequest
from gateway.state import GatewayConfig
from gateway.tokenize import DetokenizeRequest, TokenizeRequest
from tests.support.fake_scheduler import FakeScheduler

ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
             "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}

hostile_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["\ud800", "a\udfffb", "\x00\x1b[31m", "²", "①", "٣", "<|im_start|>system", "", " " * 3]),
)
hostile_int = st.one_of(st.integers(-3, 30), st.sampled_from([2 ** 31, 2 ** 32, -2 ** 31 - 1, 2 ** 63, 2 ** 64,
                                                                -2 ** 64, 10 ** 30]))
scalars = st.one_of(st.none(), st.booleans(), hostile_int, st.floats(allow_nan=True, allow_infinity=True),
                    hostile_text)


def nested(depth: int):
    """A JSON value nested `depth` levels (deeper than any bound the gateway keeps)."""
    value: object = 1
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(hostile_text, inner, max_size=3)),
                      max_leaves=8) | st.integers(60, 300).map(nested)

messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]), "content": values | hostile_text},
    optional={"tool_calls": st.lists(st.fixed_dictionaries({"id": hostile_text, "type": st.just("function"),
                                                            "function": st.fixed_dictionaries({
                                                                "name": hostile_text,
                                                                "arguments": hostile_text | st.just("[" * 3000)})}),
                                     max_size=2),
              "tool_call_id": hostile_text}), max_size=3)

schemas = st.one_of(values, st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["object", "string", "bogus", 5, ["string", "null"], []]) | values,
    "properties": st.dictionaries(hostile_text, values | st.just({"type": "integer"}), max_size=2),
    "required": st.lists(hostile_text, max_size=2) | values, "items": values, "anyOf": st.lists(values, max_size=2),
    "minLength": hostile_int, "maximum": scalars}))
tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": hostile_text}, optional={"parameters": schemas, "strict": st.booleans()})}), max_size=2)

# Token ids, a few beyond what the wire's uint32 carries.
token_ids = st.lists(st.integers(0, 30) | st.sampled_from([-1, 2 ** 32, 2 ** 64, -2 ** 64]), min_size=1, max_size=4)

typical = {
    "prompt": st.one_of(hostile_text, st.lists(hostile_text, max_size=3), token_ids, st.lists(token_ids, max_size=2)),
    "tools": tools,
    "response_format": st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": st.just("x"), "schema": schemas})}),
    "messages": messages,
    "input": st.one_of(hostile_text, st.lists(st.dictionaries(
        st.sampled_from(["type", "role", "content", "call_id", "name", "arguments", "output"]),
        st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "user"]) | values,
        max_size=5), max_size=3), st.lists(st.fixed_dictionaries(
            {"type": st.just("reasoning")}, optional={"content": values, "summary": values}), max_size=2)),
    "tokens": st.lists(hostile_int, max_size=4),
    "logit_bias": st.dictionaries(hostile_text | st.integers(0, 2 ** 40).map(str), scalars, max_size=3),
    "stream": st.booleans(),
    "stop": st.one_of(hostile_text, st.lists(hostile_text, max_size=3)),
}


plausible = st.one_of(st.none(), st.booleans(), st.integers(0, 20), st.floats(0, 2), st.text(max_size=5))
VALID = {"/v1/completions": {"prompt": "Hi", "max_tokens": 2}, "/tokenize": {"prompt": "Hi"},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
         "/v1/responses": {"input": "Hi", "max_output_tokens": 2}, "/detokenize": {"tokens": [1, 2]}}


@st.composite
def bodies(draw):
    """A valid body of one endpoint with a few of its fields set to what a fuzzer sends."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    fields = sorted(set(ENDPOINTS[path].model_fields) - {"model"})   # another model is a plain 404
    chosen = draw(st.lists(st.sampled_from(fields), max_size=3, unique=True))
    body = dict(VALID[path])
    for name in chosen:
        alias = ENDPOINTS[path].model_fields[name].alias or name
        kind = draw(st.sampled_from(["typical", "plausible", "hostile"]))
        if kind == "typical" and name in typical:
            body[alias] = draw(typical[name])
        else:
            body[alias] = draw(plausible if kind == "plausible" else values)
    if draw(st.integers(0, 9)) == 0:   # now and then, not an object at all
        body = draw(values)
    return path, body


# How the body travels: JSON as it should, or under another Content-Type, compressed, cut in the
# middle of a UTF-8 character, or with a byte that is no UTF-8 at all.
WIRE = ["json", "json", "json", "json", "charset", "text/plain", "no type", "gzip", "latin-1 byte", "cut"]


def on_the_wire(body: bytes, how: str) -> tuple[bytes, dict[str, str]]:
    headers = {"content-type": "application/json"}
    if how == "charset":
        headers["content-type"] = "application/json; charset=utf-8"
    elif how == "text/plain":
        headers["content-type"] = "text/plain"
    elif how == "no type":
        headers = {}
    elif how == "gzip":
        body, headers["content-encoding"] = gzip.compress(body), "gzip"
    elif how == "latin-1 byte":
        body = body[:len(body) // 2] + b"\xe9" + body[len(body) // 2:]
    elif how == "cut":
        body = (body + "é".encode())[:-1]
    return body, headers


class AppClient:
    """Posts to the ASGI app on one event loop of its own: TestClient's hop to its portal thread and
    back took half of each request's CPU (6.5 ms of it). An exception the app lets out is a 500."""

    def __init__(self, app) -> None:
        self.loop = asyncio.new_event_loop()
        self.lifespan = app.router.lifespan_context(app)
        self.loop.run_until_complete(self.lifespan.__aenter__())
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self.http = httpx.AsyncClient(transport=transport, base_url="http://testserver")

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.loop.run_until_complete(self.http.post(path, **kwargs))

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.run_until_complete(self.lifespan.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture(scope="module")
def client():
    c = AppClient(create_app(GatewayConfig("unused", max_sequences_per_request=8), client_factory=FakeScheduler))
    yield c
    c.close()


def strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


@st.composite
def shaped_bodies(draw):
    """A valid body with one field of a shape of its own (token-id prompts, tools and their schemas,
    a response format's schema, reasoning items) fuzzed: the plain fuzz seldom draws those."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/responses"]))
    if path == "/v1/completions":
        return path, {**VALID[path], "prompt": draw(token_ids | st.lists(token_ids, min_size=1, max_size=2))}
    if path == "/v1/responses":
        field = draw(st.sampled_from(["input", "tools"]))
        value = draw(typical["input"]) if field == "input" else [
            {"type": "function", "name": "f", "parameters": draw(schemas)}]
        return path, {**VALID[path], field: value}
    field = draw(st.sampled_from(["tools", "response_format"]))
    return path, {**VALID[path], field: draw(typical[field])}


def answers_in_openai_shape(client, path: str, body, how: str = "json") -> None:
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")   # lone surrogates as JSON escapes
    raw, headers = on_the_wire(raw, how)
    reply = client.post(path, content=raw, headers=headers)
    event(f"{path} {reply.status_code // 100}xx")
    assert reply.status_code < 500, (path, body, reply.text[:500])
    if reply.status_code >= 400:
        error = strict(reply.text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    elif reply.headers["content-type"].startswith("text/event-stream"):
        for line in reply.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                sent = strict(line[len("data: "):])
                assert "error" not in sent or sent["error"]["code"] != "internal", sent
    else:
        strict(reply.text)


FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                      HealthCheck.data_too_large])


@settings(FUZZ, max_examples=300)
@given(request=bodies(), how=st.sampled_from(WIRE))
def test_every_request_is_answered_2xx_or_4xx_in_openai_shape(client, request, how):
    answers_in_openai_shape(client, *request, how)


@settings(FUZZ, max_examples=60)
@given(request=shaped_bodies())
def test_fields_of_their_own_shape_are_answered_2xx_or_4xx_in_openai_shape(client, request):
    answers_in_openai_shape(client, *request)
