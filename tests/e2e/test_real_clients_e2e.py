"""Third-party clients, pinned in requirements-dev.txt, against a real gateway in front of the real
scheduler and worker (tiny model): the openai client (chat, completions with echo, responses plain
and streamed, parse), langchain-openai (invoke, stream, with_structured_output, bind_tools), the
OpenAI Agents SDK (an agent with one function tool, over the Responses API), lm-evaluation-harness
(local-completions: loglikelihood and generate_until on tasks in tests/support/lm_eval_tasks, whose
loglikelihoods equal the service's own prompt logprobs), guidellm's run (10 requests), and the README's
OpenAI example. Nothing is downloaded: datasets are local files, tokenizers the tiny model's.

A client's failure fails its test with the client and the call named (`calling`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import pathlib
import subprocess
import sys
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from common.client import Client
from tests.support.gateway import running_gateway
from tests.support.procs import REPO

pytestmark = pytest.mark.timeout(300)

API_KEY = "real-clients-key"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}


class Person(BaseModel):
    """A schema that closes quickly: a short name and a bounded integer."""
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


@contextlib.contextmanager
def calling(client: str, call: str):
    """Turns any failure of a third-party client's call into a test failure naming both."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - reported, with the client and the call
        pytest.fail(f"{client}: {call} failed: {type(exc).__name__}: {exc}", pytrace=True)


@pytest.fixture(scope="module")
def base(services, tmp_path_factory):
    log = tmp_path_factory.mktemp("gateway") / "gateway.log"
    with running_gateway(services.scheduler_addr, log, "--api-key", API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def model(services) -> str:
    with Client(services.scheduler_addr) as direct:
        return direct.model_info().model


@pytest.fixture(scope="module")
def direct(services):
    with Client(services.scheduler_addr) as c:
        yield c


@pytest.fixture(scope="module")
def client(base):
    with openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def test_openai_chat_and_completions_with_echo(client, model, direct):
    with calling("openai", "chat.completions.create"):
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length")
    with calling("openai", "completions.create(echo=True, logprobs=1, max_tokens=1)"):
        reply = client.completions.create(model=model, prompt="The sky is blue", echo=True, logprobs=1, max_tokens=1,
                                          temperature=0)
    ids = direct.tokenize("The sky is blue")
    want = direct.generate(ids, max_tokens=1, temperature=0, prompt_logprobs=True, logprobs=True)
    (choice,) = reply.choices
    lp = choice.logprobs
    assert choice.text.startswith("The sky is blue") and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx(want.prompt_logprobs, abs=1e-4)
    assert lp.token_logprobs[-1] == pytest.approx(want.logprobs[0], abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    with calling("openai", "completions.create(echo=True, max_tokens=0)"):
        only = client.completions.create(model=model, prompt="The sky is blue", echo=True, max_tokens=0, logprobs=0)
    assert only.choices[0].text == "The sky is blue" and only.usage.completion_tokens == 0
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want.prompt_logprobs, abs=1e-4)


def test_openai_responses_plain_streamed_and_parsed(client, model, direct):
    with calling("openai", "responses.create"):
        plain = client.responses.create(model=model, input="Hello there", instructions="Be brief.",
                                        max_output_tokens=6, temperature=0)
    want = direct.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                       max_tokens=6, temperature=0, skip_special_tokens=True)
    assert plain.output_text == want.text and plain.usage.output_tokens == want.usage.completion_tokens
    assert plain.status == ("incomplete" if want.finish_reason == "length" else "completed")
    with calling("openai", "responses.create(stream=True)"):
        events = list(client.responses.create(model=model, input="Hello there", instructions="Be brief.",
                                              max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{plain.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}]
    with calling("openai", "responses.create(tools, tool_choice=get_weather)"):
        called = client.responses.create(model=model, input="Weather?", tools=tools, max_output_tokens=200,
                                         tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    history = [{"role": "user", "content": "Weather?"}, *(i.model_dump(exclude_none=True) for i in called.output),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    with calling("openai", "responses.create(input with function_call_output)"):
        answered = client.responses.create(model=model, input=history, tools=tools, max_output_tokens=4,
                                           temperature=0)
    assert answered.status in ("completed", "incomplete") and answered.output
    with calling("openai", "responses.parse(text_format=Person)"):
        parsed = client.responses.parse(model=model, input="A person", text_format=Person, max_output_tokens=200,
                                        temperature=0)
    assert isinstance(parsed.output_parsed, Person)


def test_openai_chat_parse(client, model):
    with calling("openai", "chat.completions.parse(response_format=Person)"):
        parsed = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "A person"}],
                                               response_format=Person, max_tokens=200, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Person)


def test_langchain_openai(base, model):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{base}/v1", api_key=API_KEY, model=model, max_tokens=200, temperature=0,
                     max_retries=0)
    with calling("langchain-openai", "ChatOpenAI.invoke"):
        said = llm.invoke("Hello")
    assert isinstance(said.content, str)
    with calling("langchain-openai", "ChatOpenAI.stream"):
        pieces = [chunk.content for chunk in llm.stream("Hello")]
    assert "".join(pieces) == said.content   # greedy: the same text, streamed
    with calling("langchain-openai", "with_structured_output(Person)"):
        person = llm.with_structured_output(Person, method="json_schema").invoke("A person")
    assert isinstance(person, Person)

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:   # an enum: the constrained call closes quickly
        """The weather in a city."""
        return "sunny"

    with calling("langchain-openai", "bind_tools([get_weather], tool_choice='get_weather').invoke"):
        called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert [c["name"] for c in called.tool_calls] == ["get_weather"]
    assert called.tool_calls[0]["args"]["city"] in ("Paris", "Oslo")


def test_openai_agents_sdk_runs_an_agent_with_a_function_tool(base, model):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0) as client:
            # The tiny model's free text after the call would run to max_tokens, which the SDK takes
            # as a failed turn: the agent answers with the tool's output.
            agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                          model=OpenAIResponsesModel(model=model, openai_client=client),
                          model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0),
                          tool_use_behavior="stop_on_first_tool")
            return await Runner.run(agent, "Weather in Paris?", max_turns=2)

    with calling("openai-agents", "Runner.run(agent with get_weather)"):
        result = asyncio.run(run())
    assert len(calls) == 1 and calls[0] in ("Paris", "Oslo")   # the tool ran with the model's argument
    assert result.final_output == f"sunny in {calls[0]}"


def _lm_eval(base: str, model_dir: pathlib.Path, tasks: list[str]) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OPENAI_API_KEY"] = API_KEY
    args = (f"model=tiny-qwen3,base_url={base}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={model_dir},num_concurrent=1,max_retries=1,tokenized_requests=True")
    # Only these tasks: indexing lm-eval's ~15,000 built-in ones took 20 s of CPU.
    manager = TaskManager(include_path=str(REPO / "tests" / "support" / "lm_eval_tasks"), include_defaults=False)
    return simple_evaluate(model="local-completions", model_args=args, tasks=tasks, task_manager=manager,
                           log_samples=True, limit=None)


def test_lm_eval_loglikelihoods_equal_the_services_prompt_logprobs(base, tiny_model_dir, direct, monkeypatch):
    monkeypatch.chdir(REPO)   # the tasks name their data files relative to the repository
    with calling("lm-eval", "simple_evaluate(local-completions, tiny_choice + tiny_until)"):
        out = _lm_eval(base, tiny_model_dir, ["tiny_choice", "tiny_until"])
    choice_samples = out["samples"]["tiny_choice"]
    assert len(choice_samples) == 3 and "acc,none" in out["results"]["tiny_choice"]
    for sample in choice_samples:
        for (context, continuation), resp in zip((r for r in sample["arguments"]), sample["resps"]):
            loglikelihood = resp[0][0]
            whole = direct.tokenize(context + continuation)
            head = direct.tokenize(context)
            scored = direct.generate(whole, max_tokens=1, temperature=0, prompt_logprobs=True)
            want = sum(scored.prompt_logprobs[len(head) - 1:])   # prompt_logprobs[i] scores token i + 1
            assert loglikelihood == pytest.approx(want, abs=1e-3), (context, continuation)
    for sample in out["samples"]["tiny_until"]:
        context = sample["arguments"][0][0]
        generated = sample["resps"][0][0]
        greedy = direct.generate(direct.tokenize(context), max_tokens=8, temperature=0, stop=["\n"],
                                 skip_special_tokens=True)
        assert generated == greedy.text.split("\n")[0]


def test_guidellm_run_of_10_requests_has_no_errors(base, tiny_model_dir, tmp_path):
    report = tmp_path / "guidellm.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", GUIDELLM__API_KEY=API_KEY)
    command = [sys.executable, "-m", "guidellm", "run", "--backend",
               f"kind=openai_http,target={base},api_key={API_KEY}",
               "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
               "--tokenizer", f"kind=huggingface_auto,model={tiny_model_dir}", "--profile", "kind=synchronous",
               "--constraint", "kind=max_requests,count=10", "--output", f"kind=json,path={report}",
               "--disable-console-interactive"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    if done.returncode != 0 or not report.exists():
        pytest.fail(f"guidellm: `guidellm run` failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    state = json.loads(report.read_text())["benchmarks"][0]["scheduler_state"]
    assert state["errored_requests"] == 0 and state["successful_requests"] > 0, state


def test_the_readme_openai_example_prints_a_tool_call(base, capsys):
    text = (REPO / "README.md").read_text()
    example = text[text.index("from openai import OpenAI"):]
    example = example[:example.index("```")].replace("http://127.0.0.1:8000/v1", f"{base}/v1")
    example = example.replace('api_key="unused-unless---api-key"', f'api_key="{API_KEY}"')
    with calling("openai", "the README's example"):
        exec(compile(example, "README.md", "exec"), {})   # noqa: S102 - the README's own code
    printed = capsys.readouterr().out
    assert "name='get_weather'" in printed and '"city"' in printed, printed


def test_every_number_is_json_even_a_minus_infinity_logprob(client, model):
    """A constrained request asking more top logprobs than the grammar allows tokens: the others'
    logprobs are -inf, sent as -9999.0 (OpenAI's), streamed and not."""
    request = dict(model=model, messages=[{"role": "user", "content": "Pick"}], max_tokens=3, temperature=0,
                   logprobs=True, top_logprobs=20, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    with calling("openai", "chat.completions.create(choice constraint, top_logprobs=20)"):
        whole = client.chat.completions.create(**request)
        streamed = list(client.chat.completions.create(**request, stream=True))
    tops = [t.logprob for e in whole.choices[0].logprobs.content for t in e.top_logprobs]
    tops += [t.logprob for c in streamed for ch in c.choices if ch.logprobs for e in ch.logprobs.content
             for t in e.top_logprobs]
    assert -9999.0 in tops and all(math.isfinite(t) for t in tops)
    jsonschema.validate({"n": tops}, {"type": "object"})
