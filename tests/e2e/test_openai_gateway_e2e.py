"""The OpenAI-compatible gateway as a user meets it: the official `openai` client against a gateway
process in front of the real scheduler and worker (tiny model). Each answer is checked against
the same request sent straight to llm.v1 (common.client), so the test shows the gateway passes
the service's output through unchanged, in both response formats, streamed and not.

One gateway process serves the whole module (it starts in about a second); the scheduler and
worker are the session's shared ones.
"""
from __future__ import annotations

import json
import select
import socket
import time
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

from common.client import Client
from tests.support.gateway import running_gateway

pytestmark = pytest.mark.timeout(600)

API_KEY = "test-gateway-key"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def gateway(services, tmp_path_factory):
    """(base URL, model name) of a gateway process in front of the session's services."""
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with running_gateway(services.scheduler_addr, log, "--api-key", API_KEY, "--max-request-body-mib", "1",
                         "--max-sequences-per-request", "8") as base:
        with Client(services.scheduler_addr) as direct:
            model = direct.model_info().model
        yield base, model


@pytest.fixture(scope="module")
def client(gateway):
    base, _ = gateway
    with openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=240) as c:
        yield c


@pytest.fixture(scope="module")
def model(gateway) -> str:
    return gateway[1]


@pytest.fixture(scope="module")
def direct(services):
    with Client(services.scheduler_addr) as c:
        yield c


def test_models_and_health(gateway, client, model):
    base, _ = gateway
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert client.models.retrieve(model).id == model
    with urllib.request.urlopen(f"{base}/health", timeout=5) as reply:   # no API key needed
        assert reply.status == 200 and json.loads(reply.read())["scheduler"] == "SERVING"


def test_completions_n_samples_with_logprobs_equal_the_llm_v1_answer(client, model, direct):
    request = dict(max_tokens=6, temperature=1.0, seed=7, n=2)
    reply = client.completions.create(model=model, prompt="Once upon a time", logprobs=2, **request)
    want = direct.generate("Once upon a time", **request, top_logprobs=2, skip_special_tokens=True)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [s.text for s in want.samples]
    assert all(c.finish_reason == "length" for c in reply.choices)
    for choice, sample in zip(reply.choices, want.samples):
        assert choice.logprobs.token_logprobs == pytest.approx(sample.logprobs, abs=1e-4)
        assert len(choice.logprobs.tokens) == len(choice.logprobs.top_logprobs) == 6
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
        assert choice.logprobs.text_offset[0] == 0
    # The prompt counts once; the completion tokens of both samples add up.
    assert reply.usage.prompt_tokens == want.usage.prompt_tokens
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_logit_bias_reaches_the_sampler(client, model, direct):
    bias = {"5": 100, "9": -100}
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0.0, logit_bias=bias)
    want = direct.generate("Hello", max_tokens=4, temperature=0.0, logit_bias={5: 100.0, 9: -100.0},
                           skip_special_tokens=True)
    assert want.token_ids == [5] * 4 and reply.choices[0].text == want.text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0.0, logit_bias=bias)
    assert chat.choices[0].message.content == direct.detokenize([5] * 3, skip_special_tokens=True)


def test_streamed_completion_of_a_batch_of_prompts_equals_the_unstreamed_one(client, model):
    request = dict(model=model, prompt=["Hello there", "The sky is"], max_tokens=8, temperature=0.0, stop=["\n\n"])
    whole = client.completions.create(**request)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(**request, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            assert chunk.choices == [] and usage is None   # the last chunk, once
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices} and len(texts) == 2
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage.model_dump() == whole.usage.model_dump()


def test_chat_streamed_and_not_with_logprobs_equals_the_llm_v1_turn(client, model, direct):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=10,
                                           temperature=0.0, logprobs=True, top_logprobs=2)
    want = direct.chat(messages, max_tokens=10, temperature=0.0, skip_special_tokens=True)
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text
    assert (getattr(choice.message, "reasoning_content", None) or "") == want.reasoning
    assert choice.finish_reason == want.finish_reason
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == len(want.token_ids)
    for entry in content:   # greedy: the sampled token is the most likely one
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.token == entry.top_logprobs[0].token and bytes(entry.bytes) == entry.token.encode()

    streamed, roles, finish = "", [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0.0,
                                                stream=True):
        (delta_choice,) = chunk.choices
        roles += [delta_choice.delta.role] if delta_choice.delta.role else []
        streamed += delta_choice.delta.content or ""
        finish = delta_choice.finish_reason or finish
    assert roles == ["assistant"] and streamed == want.text and finish == want.finish_reason


def test_reasoning_content_and_n_samples(client, model, direct):
    """The regex makes the tiny model think and then answer, so both parts are known."""
    constraint = {"regex": r"<think>\nhmm [a-z]{1,4}\n</think>\n\nok [a-z]{1,4}"}
    messages = [{"role": "user", "content": "Think first."}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=40, n=2, temperature=1.0,
                                           seed=3, extra_body={"structured_outputs": constraint})
    want = direct.chat(messages, max_tokens=40, n=2, temperature=1.0, seed=3, skip_special_tokens=True,
                       regex=constraint["regex"])
    assert [c.index for c in reply.choices] == [0, 1]
    for choice, sample in zip(reply.choices, want.samples):
        assert choice.message.reasoning_content == sample.reasoning and sample.reasoning.startswith("hmm ")
        assert choice.message.content == sample.text and sample.text.startswith("ok ")
    deltas: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=40, n=2, temperature=1.0,
                                                seed=3, stream=True, extra_body={"structured_outputs": constraint}):
        for c in chunk.choices:
            got = deltas.setdefault(c.index, {"reasoning": "", "content": ""})
            got["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            got["content"] += c.delta.content or ""
    assert deltas == {s.index: {"reasoning": s.reasoning, "content": s.text} for s in want.samples}


def test_json_schema_and_json_object_response_formats(client, model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A person, as JSON."}], max_tokens=60, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    assert reply.choices[0].finish_reason == "stop"
    reply = client.completions.create(model=model, prompt="JSON:", max_tokens=40, temperature=0.0,
                                      extra_body={"response_format": {"type": "json_object"}})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].text), dict)
    else:   # cut by max_tokens: still the start of an object
        assert reply.choices[0].text.lstrip().startswith("{")


def test_tool_call_with_tool_choice_required_and_named(client, model):
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0.0)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    # Named, streamed: each call comes whole in one delta, indexed within the choice.
    calls = []
    finish = None
    for chunk in client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=120, temperature=0.0, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}):
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert [c.index for c in calls] == [0] and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    assert finish == "tool_calls"

    # The call goes back as an assistant turn, its result as a tool message: a valid conversation.
    call = choice.message.tool_calls[0]
    follow = client.chat.completions.create(model=model, max_tokens=4, temperature=0.0, messages=[
        *messages, choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'}])
    assert follow.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs, param", [
    (dict(top_p=1.5), "top_p"),                                    # refused by the scheduler
    (dict(presence_penalty=5), "presence_penalty"),
    (dict(logit_bias={"5": 101.0}), "logit_bias"),                 # out of [-100, 100]
    (dict(logit_bias={"100000000": 1.0}), "logit_bias"),           # not a token of the model
    (dict(extra_body={"best_of_luck": 1}), "best_of_luck"),        # unknown
    (dict(logprobs=False, top_logprobs=2), "top_logprobs"),
    (dict(reasoning_effort="high"), "reasoning_effort"),
    (dict(tool_choice="required"), "tool_choice"),                 # without tools
])
def test_bad_parameters_are_400_naming_the_parameter(client, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       **kwargs)
    assert caught.value.status_code == 400 and caught.value.param == param, caught.value.body


def test_errors_have_their_http_status_and_a_refused_stream_is_refused_before_it_starts(gateway, client, model):
    with pytest.raises(openai.BadRequestError) as caught:   # not a 200 stream with an error inside
        client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=-1, stream=True)
    assert caught.value.param == "temperature" and caught.value.code == "invalid_argument"
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert caught.value.code == "model_not_found"
    base, _ = gateway
    with openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0) as intruder:
        with pytest.raises(openai.AuthenticationError):
            intruder.models.list()
    with pytest.raises(openai.BadRequestError) as caught:   # longer than the model's context
        client.completions.create(model=model, prompt=list(range(3, 5000)), max_tokens=2)
    assert caught.value.code == "invalid_argument"


def _scrape(base: str) -> dict[tuple[str, tuple], float]:
    """The gateway's /metrics (no API key needed) as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as reply:
        assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_statuses_latency_and_tokens(gateway, client, model):
    base, _ = gateway
    before = _scrape(base)
    whole = client.completions.create(model=model, prompt="Hello there", max_tokens=5, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    streamed = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0.0, stream=True,
                                                   stream_options={"include_usage": True}))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=-1)
    with openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0) as intruder:
        with pytest.raises(openai.AuthenticationError):
            intruder.models.list()
    after = _scrape(base)

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    completions, chat = "/v1/completions", "/v1/chat/completions"
    assert delta("llm_gateway_http_requests_total", route=completions, method="POST", status="200") == 1
    assert delta("llm_gateway_http_requests_total", route=completions, method="POST", status="400") == 1
    assert delta("llm_gateway_http_requests_total", route=chat, method="POST", status="200") == 1
    assert delta("llm_gateway_http_requests_total", route="/v1/models", method="GET", status="401") == 1
    # Every answered request was timed to its first and last byte; none is left in progress.
    assert delta("llm_gateway_http_request_duration_seconds_count", route=completions) == 2
    assert delta("llm_gateway_http_time_to_first_byte_seconds_count", route=chat) == 1
    assert after[("llm_gateway_http_requests_in_progress", (("route", chat),))] == 0
    # Tokens as the responses' usage reported them.
    chat_usage = streamed[-1].usage
    assert delta("llm_gateway_completion_tokens_total", route=completions) == whole.usage.completion_tokens == 5
    assert delta("llm_gateway_prompt_tokens_total", route=completions) == whole.usage.prompt_tokens
    assert delta("llm_gateway_completion_tokens_total", route=chat) == chat_usage.completion_tokens
    assert delta("llm_gateway_prompt_tokens_total", route=chat) == chat_usage.prompt_tokens


def _refused_body(host: str, port: int, body: bytes, chunked: bool) -> tuple[int, dict]:
    """Sends `body` until the gateway answers (it may answer, and close, before the body is all
    sent: a write then fails, and the answer is still read); returns the status and error."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\n")
    head += b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"Content-Length: %d\r\n\r\n" % len(body)
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(head)
        pieces = [b"%x\r\n%s\r\n" % (len(body[i:i + 65536]), body[i:i + 65536]) for i in range(0, len(body), 65536)]
        for piece in pieces if chunked else ():   # by Content-Length the answer comes without the body
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(piece)
            except OSError:
                break
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < _length(reply):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.partition(b"\r\n\r\n")[2])["error"]


def _length(reply: bytes) -> int:
    for line in reply.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


def test_a_body_over_the_limit_is_413_and_a_batch_over_the_limit_400(gateway, client, model):
    """--max-request-body-mib 1 and --max-sequences-per-request 8 in this module's gateway."""
    base, _ = gateway
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": "x" * (3 << 19), "max_tokens": 1}).encode()   # 1.5 MiB
    for chunked in (False, True):   # refused by its Content-Length, or while a chunked body is read
        status, error = _refused_body(host, int(port), body, chunked)
        assert status == 413 and error["code"] == "request_too_large", (chunked, error)
        assert "more than the gateway's limit of 1048576" in error["message"]
    for prompts, n in ((["Hi"] * 9, 1), (["Hi"] * 3, 3)):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=model, prompt=prompts, n=n, max_tokens=1)
        assert caught.value.param == "prompt" and f"{len(prompts)} x {n}" in caught.value.message
    # Within the limits the gateway serves as before.
    assert len(client.completions.create(model=model, prompt=["Hi"] * 4, n=2, max_tokens=1).choices) == 8


def test_a_body_of_too_many_json_values_is_413_before_it_is_parsed(gateway, client, model):
    """Under 1 MiB, but 560,000 JSON values: refused as it arrives, by --max-request-json-values."""
    base, _ = gateway
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": "x", "user": [[]] * 280_000}, separators=(",", ":")).encode()
    status, error = _refused_body(host, int(port), body, chunked=True)   # sent until refused
    assert status == 413 and error["code"] == "request_too_large" and "--max-request-json-values" in error["message"]
    assert client.completions.create(model=model, prompt="Hi", max_tokens=1).choices   # served as before


def test_a_chat_longer_than_the_context_names_messages_or_input(client, model):
    """The scheduler refuses a rendered prompt too long for the context naming the chat's messages."""
    long = "x y " * 3000
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": long}], max_tokens=2)
    assert chat.value.param == "messages" and "the rendered prompt has" in chat.value.message
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(model=model, input=long, max_output_tokens=2)
    assert responses.value.param == "input" and "the rendered prompt has" in responses.value.message


def _running(direct) -> int:
    return sum(g.num_running for g in direct.model_info().worker_groups)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_the_request(gateway, model, direct, stream):
    base, _ = gateway
    host, port = base.removeprefix("http://").split(":")
    request_id = f"gateway-disconnect-{stream}"
    body = json.dumps({"model": model, "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True, "stream": stream,
                       "request_id": request_id}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        if stream:
            received = b""
            while received.count(b"data: ") < 3:   # the stream is running
                received += sock.recv(65536)
            assert received.startswith(b"HTTP/1.1 200")
        else:
            deadline = time.monotonic() + 10
            while _running(direct) == 0:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.05)
    # 3000 tokens take the tiny model far longer than this: the request is gone because it was cancelled.
    deadline = time.monotonic() + 10
    while _running(direct) > 0:
        assert time.monotonic() < deadline, "the request still runs after its client left"
        time.sleep(0.1)
    assert not direct.abort(request_id)   # the scheduler no longer knows it


def _closed_by_server(sock: socket.socket, within: float = 60.0) -> bytes:
    """What the gateway sent before it closed `sock` (fails if it keeps it open `within` s)."""
    sock.settimeout(within)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def _complete(base: str, headers: dict[str, str]) -> int:
    request = urllib.request.Request(f"{base}/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
                                     {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status
    except urllib.error.HTTPError as refused:
        assert set(json.loads(refused.read())["error"]) == {"message", "type", "param", "code"}
        return refused.code


def test_stalled_connections_are_closed_and_bounded_while_others_are_served(services, tmp_path):
    """Connections that send nothing, half their headers, or part of their body are closed by the
    gateway's deadlines; beyond --max-connections a request is refused with 503; a well-behaved
    request is served meanwhile, and again once the stalled connections are gone."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with running_gateway(services.scheduler_addr, tmp_path / "gateway.log", "--api-key", API_KEY,
                         "--header-timeout-s", "2", "--body-timeout-s", "2", "--max-connections", "8") as base:
        host, port = base.removeprefix("http://").split(":")
        stalled = [socket.create_connection((host, int(port))) for _ in range(6)]
        stalled[1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # headers never end
        stalled[2].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{")
        for sock in stalled[3:]:   # one byte of headers: a trickle does not restart the deadline
            sock.sendall(b"G")
        assert _complete(base, auth) == 200   # served while they stall
        crowd = [socket.create_connection((host, int(port))) for _ in range(4)]   # 10 open, more than 8
        assert _complete(base, auth) == 503
        sent = [_closed_by_server(sock) for sock in stalled + crowd]
        assert sent[0] == sent[1] == b"" and sent[2].startswith(b"HTTP/1.1 408")
        assert b'"code":"request_timeout"' in sent[2]
        assert _complete(base, auth) == 200
        for sock in stalled + crowd:
            sock.close()
        with socket.create_connection((host, int(port))) as garbage:   # not HTTP: 400 in OpenAI's shape too
            garbage.sendall(b"\x16\x03\x01 not http\r\n\r\n")
            reply = _closed_by_server(garbage)
        assert reply.startswith(b"HTTP/1.1 400") and b'"code":"invalid_http"' in reply
