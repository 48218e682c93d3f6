"""Edges of the OpenAI gateway found by a reliability hunt, each against a gateway process in front
of the session's real scheduler and worker (tiny model):

- the gateway's own work per request is bounded across a request's lists, not only per list: the
  tools' parameters schemas share one bound of subschemas (the scheduler bounds them together too),
  and so do the tool calls of all messages. Without that, one request of many tools or many
  messages' tool calls (a few MiB, within the body's byte and value bounds) held the event loop
  that writes every other client's stream for seconds before the scheduler refused it;
- a refusal names the request's parameter as the client spelled it, never a pydantic class name
  or another field's name, and a batch's refusal of one of its prompts says which.
"""
from __future__ import annotations

import httpx
import pytest

from gateway.protocol import MAX_ITEMS
from gateway.schema_shape import MAX_NODES
from tests.support.gateway import running_gateway

pytestmark = pytest.mark.timeout(300)

USER = {"role": "user", "content": "Hi"}


@pytest.fixture(scope="module")
def base(services, tmp_path_factory):
    """The base URL of a gateway process in front of the session's services."""
    log = tmp_path_factory.mktemp("gateway-edges") / "gateway.log"
    with running_gateway(services.scheduler_addr, log) as url:
        yield url


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, timeout=120) as client:
        yield client


def error_of(reply: httpx.Response, status: int = 400) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _tool(i: int, properties: int) -> dict:
    schema = {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(properties)}}
    return {"type": "function", "function": {"name": f"f{i}", "parameters": schema}}


def test_the_tools_schemas_share_one_bound_of_subschemas(http):
    # 128 tools (the scheduler's default bound), each well within MAX_NODES, over it together.
    per_tool = MAX_NODES // 128 + 8
    tools = [_tool(i, per_tool) for i in range(128)]
    error = error_of(http.post("/v1/chat/completions", json={"messages": [USER], "tools": tools, "max_tokens": 1}))
    assert error["code"] == "invalid_parameter", error   # the gateway's refusal, before its work grew with them
    assert error["param"].startswith("tools[") and error["param"].endswith("].function.parameters"), error
    assert f"more than {MAX_NODES} subschemas" in error["message"]
    # The Responses API's tools are the same tools.
    flat = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
            for t in tools]
    error = error_of(http.post("/v1/responses", json={"input": "Hi", "tools": flat, "max_output_tokens": 1}))
    assert error["code"] == "invalid_parameter" and error["param"].startswith("tools["), error
    # Within the bound together, they are served as before.
    few = [_tool(i, 4) for i in range(3)]
    reply = http.post("/v1/chat/completions", json={"messages": [USER], "tools": few, "max_tokens": 2})
    assert reply.status_code == 200, reply.text


def test_the_tool_calls_of_all_messages_share_one_bound(http):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    each = MAX_ITEMS // 2 + 1      # each message's list within MAX_ITEMS, both together over it
    turn = {"role": "assistant", "content": None, "tool_calls": [call] * each}
    error = error_of(http.post("/v1/chat/completions", json={"messages": [USER, turn, USER, turn], "max_tokens": 1}))
    assert error["code"] == "invalid_parameter", error
    assert error["param"] == "messages" and f"more than {MAX_ITEMS}" in error["message"], error
    # A few calls are served as before.
    few = {"role": "assistant", "content": None, "tool_calls": [call] * 2}
    reply = http.post("/v1/chat/completions", json={"messages": [USER, few, {"role": "tool", "content": "ok",
                                                                              "tool_call_id": "c1"}],
                                                    "max_tokens": 2})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("choice", [{}, {"type": "function"}, {"name": "f"}, {"type": 5, "name": "f"}])
def test_a_misshapen_responses_tool_choice_is_named_as_sent(http, choice):
    error = error_of(http.post("/v1/responses", json={"input": "Hi", "tool_choice": choice}))
    assert error["param"] is not None and error["param"].startswith("tool_choice"), error
    assert "NamedFunction" not in error["param"] + error["message"], error


def test_a_function_call_output_of_the_wrong_type_names_its_output(http):
    item = {"type": "function_call_output", "call_id": "c1", "output": 5}
    error = error_of(http.post("/v1/responses", json={"input": [item]}))
    assert error["param"] == "input[0].output", error


def test_the_schedulers_refusal_of_a_call_or_tool_names_the_field_as_each_api_spells_it(http):
    """The scheduler names the llm.v1 fields (tools[1].name, messages[1].tool_calls[0].name): the chat
    endpoint nests them under `function`, and a Responses function_call item has them at its top."""
    call = {"id": "c1", "type": "function", "function": {"name": "", "arguments": "{}"}}
    error = error_of(http.post("/v1/chat/completions", json={
        "messages": [USER, {"role": "assistant", "content": None, "tool_calls": [call]}], "max_tokens": 1}))
    assert error["param"] == "messages[1].tool_calls[0].function.name", error
    assert error["message"].startswith("messages[1].tool_calls[0].function.name "), error
    item = {"type": "function_call", "call_id": "c1", "name": "", "arguments": "{}"}
    error = error_of(http.post("/v1/responses", json={"input": [USER, item], "max_output_tokens": 1}))
    assert error["param"] == "input[1].name" and error["message"].startswith("input[1].name "), error
    twice = [{"type": "function", "function": {"name": "f"}}] * 2
    error = error_of(http.post("/v1/chat/completions", json={"messages": [USER], "tools": twice, "max_tokens": 1}))
    assert error["param"] == "tools[1].function.name", error
    flat = [{"type": "function", "name": "f"}] * 2
    error = error_of(http.post("/v1/responses", json={"input": "Hi", "tools": flat, "max_output_tokens": 1}))
    assert error["param"] == "tools[1].name", error


@pytest.mark.parametrize("body", [
    {"prompt": [[5, 6], [5, 10 ** 6]]}, {"prompt": [[5, 6], [5, 10 ** 6]], "echo": True, "logprobs": 1},
    {"prompt": ["Hi", ""]}, {"prompt": [[5, 10 ** 6], [5, 6]], "stream": True},
    {"prompt": ["Hi", "x y " * 3000], "echo": True},
])
def test_a_refused_prompt_of_a_batch_is_named_by_its_index(http, body):
    """A batch's refusal of one prompt (a token id past the vocabulary, an empty or too long prompt)
    says which prompt; the scheduler's own message (token_ids[1] = ...) does not. (A stream's
    refusal is one prompt 0's: another prompt's may come after prompt 0's first chunk, as an event.)"""
    error = error_of(http.post("/v1/completions", json={**body, "max_tokens": 1}))
    index = 0 if body["prompt"][0] == [5, 10 ** 6] else 1
    assert error["param"] == "prompt" and error["message"].startswith(f"prompt[{index}]: "), error
    # One prompt is the prompt: its refusal is the scheduler's message as it was.
    error = error_of(http.post("/v1/completions", json={"prompt": [5, 10 ** 6], "max_tokens": 1}))
    assert error["param"] == "prompt" and error["message"].startswith("token_ids[1] = 1000000 is out of range"), error
