"""The gateway's pure parts, without processes: gRPC status -> HTTP status, OpenAI parameters ->
llm.v1 arguments (and the 400s naming what the API lacks), pydantic's complaints as one named
parameter, the merge of several streams, and the token-text cache."""
from __future__ import annotations

import asyncio

import pydantic
import pytest
from fastapi.exceptions import RequestValidationError

from common.client import RequestError
from gateway import outputs
from gateway.errors import validation_error as _validation_error
from gateway.errors import GatewayError, from_request_error
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.token_text import TokenTexts
from gateway.translate import chat_call, completion_prompts, completion_sampling

USER = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("code, status, kind", [
    ("INVALID_ARGUMENT", 400, "invalid_request_error"), ("RESOURCE_EXHAUSTED", 429, "rate_limit_error"),
    ("UNAVAILABLE", 503, "service_unavailable_error"), ("DEADLINE_EXCEEDED", 504, "timeout_error"),
    ("UNAUTHENTICATED", 401, "authentication_error"), ("PERMISSION_DENIED", 403, "permission_error"),
    ("NOT_FOUND", 404, "not_found_error"), ("INTERNAL", 500, "server_error"), ("UNKNOWN", 500, "server_error"),
])
def test_grpc_status_maps_to_http_status_with_openai_error_body(code, status, kind):
    error = from_request_error(RequestError(code, "something went wrong"))
    assert error.status == status
    assert error.body() == {"error": {"message": "something went wrong", "type": kind, "param": None,
                                      "code": code.lower()}}


@pytest.mark.parametrize("message, param", [
    ("sampling.top_p must be in (0, 1], got 1.5", "top_p"),
    ("sampling.json_schema is not a valid schema: ...", "response_format"),
    ("text is longer than the model's context", "prompt"),
    ("messages[2].tool_call_id names no earlier call", "messages[2].tool_call_id"),
    ("the prompt is too long", None),
    ("request_id has a control character (U+000A) at index 1", "request_id"),
    ("sampling.regex is invalid: Regex parsing error at position 2", "structured_outputs"),
    ("messages: the rendered prompt has 5000 tokens; max_model_len 4096 leaves no room", "messages"),
    # the scheduler's refusals of a chat's totals (scheduler_svc/frontend/chat.py)
    ("tools' parameters hold 5000 JSON values, more than the limit of 4096", "tools"),
    ("tools has 129 tools, more than the limit of 128", "tools"),
    ("messages hold 5000 tool calls, more than the limit of 4096", "messages"),
    # the llm.v1 fields of a chat's tools and calls, as the chat endpoint spells them
    ("messages[1].tool_calls[0].name is empty", "messages[1].tool_calls[0].function.name"),
    ("messages[1].tool_calls[2].arguments_json is 70000 bytes, more than the limit of 65536",
     "messages[1].tool_calls[2].function.arguments"),
    ("messages[1].tool_calls: only assistant messages make tool calls", "messages[1].tool_calls"),
    ("tools[3].name must not hold '<tool_call>', which delimits a tool call", "tools[3].function.name"),
    ("tools[1].name 'f' is given twice", "tools[1].function.name"),
    ("tools[0].parameters_json is not valid JSON: ...", "tools[0].function.parameters"),
])
def test_a_scheduler_refusal_names_the_openai_parameter(message, param):
    assert from_request_error(RequestError("INVALID_ARGUMENT", message)).param == param


def test_a_conflict_names_the_request_id():
    error = from_request_error(RequestError("ALREADY_EXISTS", "request_id 'x' is already in flight"))
    assert (error.status, error.param) == (409, "request_id")


def refused(build, body) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        build(body)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("extra, param", [
    ({"suffix": "x"}, "suffix"), ({"best_of": 3, "n": 2}, "best_of"),
    ({"logit_bias": {"x1": 2.0}}, "logit_bias"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"seed": -1}, "seed"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"logprobs": -1}, "logprobs"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"properties": {"a": {"type": "text"}}}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"json": {"required": "a"}}}, "structured_outputs.json"),
])
def test_completion_parameters_the_api_lacks_are_refused_by_name(extra, param):
    body = CompletionRequest.model_validate({"prompt": "Hi", **extra})
    assert refused(completion_sampling, body).param == param


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [TOOL], "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": [{**TOOL, "function": {**TOOL["function"], "strict": True}}]}, "tools[0].function.strict"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"skip_special_tokens": False}, "skip_special_tokens"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "Hi", "name": "bob"}]}, "messages[0].name"),
    ({"messages": []}, "messages"),
    ({"tools": [{**TOOL, "function": {"name": "f", "parameters": {"type": "bogus"}}}]}, "tools[0].function.parameters"),
    # a call's arguments are an object: a forced call of a string-typed tool wrote arguments no call parses
    ({"tools": [TOOL, {**TOOL, "function": {"name": "g", "parameters": {"type": "string"}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{**TOOL, "function": {"name": "f", "parameters": {"type": ["object", "null"]}}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOL, {**TOOL, "function": {"name": "g", "parameters": {"properties": {"x": {"maxLength": -1}}}}}],
      "tool_choice": "none"}, "tools[1].function.parameters"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_chat_parameters_the_api_lacks_are_refused_by_name(extra, param):
    body = ChatCompletionRequest.model_validate({"messages": USER, **extra})
    assert refused(chat_call, body).param == param


def test_chat_call_passes_what_the_api_has():
    call = chat_call(ChatCompletionRequest.model_validate({
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}},
        "max_tokens": 5, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3, "stop": "END",
        "temperature": 0.5, "seed": 9, "n": 2, "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}}))
    assert call.messages == [
        {"role": "system", "content": "a\nb"},
        {"role": "assistant", "content": "", "reasoning_content": "r",
         "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    assert call.tool_choice == "f" and call.tools == [{"name": "f", "description": "", "parameters": {"type": "object"}}]
    assert call.enable_thinking is False
    s = call.sampling
    assert (s.max_tokens, s.logprobs, s.top_logprobs, list(s.stop), s.temperature, s.seed, s.n) == \
        (7, True, 3, ["END"], 0.5, 9, 2)
    assert s.json_schema == {"type": "object"} and s.skip_special_tokens


def test_completion_defaults_and_prompts():
    s = completion_sampling(CompletionRequest.model_validate({"prompt": "Hi", "logprobs": 0}))
    assert s.max_tokens == 16 and s.logprobs and s.top_logprobs is None   # OpenAI's default of 16 tokens
    assert completion_prompts(CompletionRequest.model_validate({"prompt": [1, 2]})) == [[1, 2]]
    assert completion_prompts(CompletionRequest.model_validate({"prompt": [[1], [2, 3]]})) == [[1], [2, 3]]
    assert completion_prompts(CompletionRequest.model_validate({"prompt": ["a", "b"]})) == ["a", "b"]
    choice = completion_sampling(CompletionRequest.model_validate(
        {"prompt": "Hi", "structured_outputs": {"choice": ["a.b c", "(x)"]}}))
    assert choice.regex == r"(a\.b c|\(x\))"


def validation_error(model, body) -> GatewayError:
    with pytest.raises(pydantic.ValidationError) as caught:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()]
    return _validation_error(RequestValidationError(errors))


def test_pydantic_complaints_become_one_named_parameter():
    unknown = validation_error(CompletionRequest, {"prompt": "Hi", "best_of_luck": 1})
    assert (unknown.param, unknown.code) == ("best_of_luck", "unknown_parameter")
    missing = validation_error(ChatCompletionRequest, {})
    assert (missing.param, missing.code) == ("messages", "missing_parameter")
    nested = validation_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert nested.param == "messages[0].content"
    role = validation_error(ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]})
    assert role.param == "messages[0].role" and role.status == 400


def test_usage_counts_a_prompt_once_per_prompt():
    from common.client import Usage
    total = outputs.UsageTotal()
    total.add(Usage(10, 4, 0), first_sample=True)
    total.add(Usage(10, 5, 8), first_sample=False)
    total.add(Usage(3, 2, 0), first_sample=True)
    assert total.to_json() == {"prompt_tokens": 13, "completion_tokens": 11, "total_tokens": 24,
                               "prompt_tokens_details": {"cached_tokens": 0}}


def test_logprobs_formats():
    texts = {1: "a", 2: "bc", 3: "é"}
    chat = outputs.chat_logprobs([1, 3], [-0.1, -0.2], [([1, 2], [-0.1, -2.0]), ([3, 1], [-0.2, -3.0])], texts)
    assert chat["content"][1] == {"token": "é", "logprob": -0.2, "bytes": [195, 169], "top_logprobs": [
        {"token": "é", "logprob": -0.2, "bytes": [195, 169]}, {"token": "a", "logprob": -3.0, "bytes": [97]}]}
    completion = outputs.completion_logprobs([2, 1], [-0.5, -0.6], None, texts, text_offset=4)
    assert completion == {"tokens": ["bc", "a"], "token_logprobs": [-0.5, -0.6], "top_logprobs": None,
                          "text_offset": [4, 6]}


async def _items(values, fail=None, delay=0.0):
    for v in values:
        await asyncio.sleep(delay)
        yield v
    if fail:
        raise fail


def test_merge_interleaves_streams_and_a_failure_cancels_the_others():
    async def run():
        got = [x async for x in outputs.merge([_items("ab"), _items("xyz")])]
        assert sorted(got) == [(0, "a"), (0, "b"), (1, "x"), (1, "y"), (1, "z")]
        assert [v for i, v in got if i == 1] == ["x", "y", "z"]   # each stream keeps its order
        closed = asyncio.Event()

        async def endless():
            try:
                while True:
                    await asyncio.sleep(0.01)
                    yield "tick"
            finally:
                closed.set()

        with pytest.raises(RequestError):
            async for _ in outputs.merge([endless(), _items("", fail=RequestError("UNAVAILABLE", "gone"))]):
                pass
        await asyncio.wait_for(closed.wait(), 1)   # the endless stream was cancelled
    asyncio.run(run())


def test_token_texts_asks_once_per_token_even_when_requests_overlap():
    calls = []

    class FakeClient:
        async def token_texts(self, ids, skip_special_tokens):
            calls.append(sorted(ids))
            await asyncio.sleep(0.01)
            if 13 in ids:
                raise RequestError("UNAVAILABLE", "gone")
            return [f"<{i}>" for i in ids]

    async def run():
        cache = TokenTexts(FakeClient())
        first, second = await asyncio.gather(cache.texts([1, 2]), cache.texts([2, 3, 4]))
        assert first == {1: "<1>", 2: "<2>"} and second == {2: "<2>", 3: "<3>", 4: "<4>"}
        assert await cache.texts([1, 3]) == {1: "<1>", 3: "<3>"}   # known: no call
        # A failed call fails its request; one that waited on it fetches the ids itself.
        failing = asyncio.ensure_future(cache.texts([13, 5]))
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(cache.texts([5, 6]))
        with pytest.raises(RequestError):
            await failing
        assert await waiting == {5: "<5>", 6: "<6>"}
        # A request cancelled while it waits leaves the shared call running for the others.
        cancelled = asyncio.ensure_future(cache.texts([7, 8]))
        await asyncio.sleep(0)
        other = asyncio.ensure_future(cache.texts([8]))
        await asyncio.sleep(0)
        cancelled.cancel()
        assert await other == {8: "<8>"}
    asyncio.run(run())
    # One call per request for what nobody had asked yet (2 is asked once, by the first).
    assert calls == [[1, 2], [3, 4], [5, 13], [6], [5], [7, 8]]


def test_metrics_route_labels_are_bounded_and_a_handler_that_raised_counts_as_500():
    from gateway.metrics import GatewayMetrics, HttpMetrics, route_of

    assert route_of("/v1/chat/completions") == "/v1/chat/completions"
    assert route_of("/v1/models/Qwen/Qwen3-0.6B") == "/v1/models/{model}"
    assert {route_of(f"/probe/{i}") for i in range(100)} == {"other"}   # a client cannot grow the labels

    async def broken(scope, receive, send):
        raise RuntimeError("boom")

    async def answer(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def sent(message):
        pass

    metrics = GatewayMetrics()
    with pytest.raises(RuntimeError):
        asyncio.run(HttpMetrics(broken, metrics)({"type": "http", "path": "/v1/completions", "method": "POST"},
                                                 None, sent))
    asyncio.run(HttpMetrics(answer, metrics)({"type": "http", "path": "/x", "method": "GET"}, None, sent))
    value = metrics.registry.get_sample_value
    assert value("llm_gateway_http_requests_total", {"route": "/v1/completions", "method": "POST", "status": "500"}) == 1
    assert value("llm_gateway_http_requests_total", {"route": "other", "method": "GET", "status": "204"}) == 1
    assert value("llm_gateway_http_requests_in_progress", {"route": "/v1/completions"}) == 0
    # An empty body is no first byte.
    assert value("llm_gateway_http_time_to_first_byte_seconds_count", {"route": "other"}) in (None, 0)


def test_a_refusal_of_a_chats_messages_names_the_responses_input():
    from gateway.responses_request import renamed
    refusal = from_request_error(RequestError("INVALID_ARGUMENT", "messages: the rendered prompt has 5000 tokens; "
                                                                  "max_model_len 4096 leaves no room"))
    error = renamed(refusal, ["input"])
    assert error.param == "input" and error.message.startswith("input: the rendered prompt has 5000 tokens")


@pytest.mark.parametrize("message, param, says", [
    ("messages[1].tool_calls[0].name is empty", "input[1].name", "input[1].name is empty"),
    ("tools[2].name 'f' is given twice", "tools[2].name", "tools[2].name 'f' is given twice"),
])
def test_a_refusal_of_a_chats_call_or_tool_names_the_responses_item_field(message, param, says):
    from gateway.responses_request import renamed
    error = renamed(from_request_error(RequestError("INVALID_ARGUMENT", message)), ["input[0]", "input[1]"])
    assert (error.param, error.message) == (param, says)


def test_an_events_data_is_one_line_for_every_line_splitter():
    """JSON leaves U+0085, U+2028 and U+2029 as they are; str.splitlines() (httpx's iter_lines) breaks
    lines at them. An event's data escapes them: the same JSON value, on one line."""
    import json

    text = "a\x85b\u2028c\u2029d\ne\u00e9"
    lines = outputs.sse({"text": text}, event="delta").splitlines()
    assert lines == ["event: delta", 'data: {"text":"a\\u0085b\\u2028c\\u2029d\\ne\u00e9"}', ""]
    assert json.loads(lines[1].removeprefix("data: ")) == {"text": text}
