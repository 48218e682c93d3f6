"""The API beyond plain generation, through the real processes: n samples, top and prompt
logprobs against transformers, matched_stop, Tokenize/Detokenize, the Chat RPC with tools, and
priority admission."""
from __future__ import annotations

import json
import random
import threading
import time

import grpc
import jsonschema
import pytest
import torch

from common.pb.llm.v1 import generation_pb2 as pb
from common.pb.llm.v1 import generation_pb2_grpc
from tests.support.client import generate, generate_many
from tests.support.hf_reference import hf_greedy, hf_model

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 16   # the worker's default


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


@torch.inference_mode()
def hf_logprobs(model_dir, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits at every position."""
    return hf_model(model_dir)(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def assert_top(got: list[tuple[list[int], list[float]]], reference: torch.Tensor, k: int) -> None:
    assert len(got) == len(reference)
    values, ids = reference.topk(k, dim=-1)
    for (got_ids, got_values), want_ids, want_values in zip(got, ids.tolist(), values.tolist()):
        assert got_ids == want_ids
        assert got_values == pytest.approx(want_values, abs=1e-4)


def test_n_samples_share_one_prompt_computation_and_are_reproducible(services):
    prompt = random_prompt(1, 40)                        # two full blocks, then 8 tokens
    request = dict(token_ids=prompt, n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    with services.channel() as ch:
        first = generate(ch, **request)
        again = generate(ch, **request)
        single = generate(ch, **dict(request, n=1))
    samples = first.samples
    assert [len(s.token_ids) for s in samples] == [12] * 4
    assert all(s.finish_reason == pb.FINISH_REASON_LENGTH and s.usage.completion_tokens == 12 for s in samples)
    assert [s.token_ids for s in samples] == [s.token_ids for s in again.samples]
    assert len({tuple(s.token_ids) for s in samples}) == 4, "each sample draws with its own seed"
    assert samples[0].token_ids == single.token_ids       # sample 0 draws with the request's seed
    # The prompt is computed once: the other samples find its full blocks in the prefix cache.
    assert [s.usage.cached_prompt_tokens for s in samples] == [0, 32, 32, 32]
    assert all(s.usage.prompt_tokens == 40 for s in samples)


def test_an_aborted_request_ends_every_sample(services):
    with services.channel() as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        stream = stub.Generate(pb.GenerateRequest(request_id="abort-n", token_ids=pb.TokenIds(ids=random_prompt(2, 20)),
                                                  sampling=pb.SamplingParams(n=3, max_tokens=3000, ignore_eos=True)),
                               timeout=60)
        next(stream)
        assert stub.Abort(pb.AbortRequest(request_id="abort-n")).found
        endings = {m.index: m.finish_reason for m in stream if m.finish_reason}
    assert endings == {0: pb.FINISH_REASON_ABORT, 1: pb.FINISH_REASON_ABORT, 2: pb.FINISH_REASON_ABORT}


def test_top_and_prompt_logprobs_equal_transformers_through_chunks_and_a_cached_prefix(services, tiny_model_dir):
    prompt = random_prompt(3, 2100)                      # longer than a step's 2048 tokens: two chunks
    with services.channel() as ch:
        generate(ch, token_ids=prompt, max_tokens=1)     # its blocks are now in the prefix cache
        out = generate(ch, token_ids=prompt, temperature=0.8, seed=5, max_tokens=6, ignore_eos=True,
                       top_logprobs=4, prompt_logprobs=True)
    reference = hf_logprobs(tiny_model_dir, prompt + out.token_ids)
    p = len(prompt)
    assert out.usage.cached_prompt_tokens == 0           # scored prompts are computed in full
    expected = reference[:p - 1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    assert out.prompt_logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    assert_top(out.prompt_top_logprobs, reference[:p - 1], 4)
    assert_top(out.top_logprobs, reference[p - 1:-1], 4)
    sampled = [reference[p - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(sampled, abs=1e-4)   # top_logprobs implies logprobs


def test_logit_bias_equals_transformers_greedy_with_the_bias_added(services, tiny_model_dir):
    """Through the real processes, concurrently with unbiased requests: each greedy output equals
    transformers' greedy loop over logits + bias; banning a request's unbiased greedy tokens
    changes its output, and the unbiased requests in the same batches are unchanged."""
    rng = random.Random(21)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(4, 30))] for _ in range(6)]
    plain = [hf_greedy(tiny_model_dir, p, 10) for p in prompts]
    biases = [{t: -100.0 for t in set(plain[0])}, {plain[1][0]: -100.0, 77: 6.0}, {5: 100.0}, {}, {300: 3.5}, {}]
    requests = [dict(token_ids=p, max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True, logit_bias=b)
                for p, b in zip(prompts, biases)]
    with services.channel() as ch:
        outs = generate_many(ch, requests)
    for prompt, bias, unbiased, out in zip(prompts, biases, plain, outs):
        assert out.token_ids == hf_greedy(tiny_model_dir, prompt, 10, logit_bias=bias)
        if not bias:
            assert out.token_ids == unbiased
    assert not set(outs[0].token_ids) & set(plain[0]) and outs[0].token_ids != plain[0]
    assert outs[2].token_ids == [5] * 10
    # Logprobs stay those of the model's own logits: the forced token is unlikely there.
    assert all(lp < -1.0 for lp in outs[2].logprobs)


def test_matched_stop_names_the_stop_string_or_the_stop_token(services, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with services.channel() as ch:
        free = generate(ch, text="Once upon a time", temperature=0.0, max_tokens=12, ignore_eos=True)
        by_token = generate(ch, text="Once upon a time", temperature=0.0, max_tokens=12, ignore_eos=True,
                            stop_token_ids=[free.token_ids[4]])
        stop = free.text[len(tokenizer.decode(free.token_ids[:6])):][:3]
        by_string = generate(ch, text="Once upon a time", temperature=0.0, max_tokens=12, ignore_eos=True,
                             stop=[stop])
        by_length = generate(ch, text="Once upon a time", temperature=0.0, max_tokens=3, ignore_eos=True)
    stop_at = free.token_ids.index(free.token_ids[4])
    assert by_token.token_ids == free.token_ids[:stop_at + 1]
    assert by_token.matched_stop == tokenizer.decode([free.token_ids[4]])
    assert by_string.matched_stop == stop and stop not in by_string.text
    assert by_length.matched_stop == "" and by_length.finish_reason == pb.FINISH_REASON_LENGTH


def test_tokenize_and_detokenize_use_the_models_tokenizer(services, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Hello world! <|im_start|>user\nnaïve 東京"
    with services.channel() as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        tokens = stub.Tokenize(pb.TokenizeRequest(text=text), timeout=10)
        back = stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens.token_ids), timeout=10)
        skipped = stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens.token_ids, skip_special_tokens=True),
                                  timeout=10)
        each = stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens.token_ids, skip_special_tokens=True,
                                                    each_token=True), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Detokenize(pb.DetokenizeRequest(token_ids=[5, 512]), timeout=10)
        generated = generate(ch, text=text, max_tokens=1)
    assert not back.token_texts   # only when asked
    assert each.text == skipped.text
    assert list(each.token_texts) == [tokenizer.backend_tokenizer.decode([t], skip_special_tokens=True)
                                      for t in tokens.token_ids]
    assert "" in each.token_texts   # <|im_start|>, skipped
    assert list(tokens.token_ids) == tokenizer.encode(text) and tokens.count == len(tokens.token_ids)
    assert tokens.max_model_len == 4096 and generated.usage.prompt_tokens == tokens.count
    assert back.text == text and skipped.text == text.replace("<|im_start|>", "")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[1] = 512" in caught.value.details()


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "when": {"type": "object", "properties": {"day": {"enum": ["today", "tomorrow"]},
                                                  "hours": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                       "maximum": 23}, "maxItems": 3}},
                 "required": ["day", "hours"]},
    },
    "required": ["city", "when"],
}


def chat_request(tool_choice: str, **sampling) -> pb.ChatRequest:
    return pb.ChatRequest(
        messages=[pb.ChatMessage(role="system", content="You help."),
                  pb.ChatMessage(role="user", content="Will it rain in Paris tomorrow?")],
        tools=[pb.Tool(name="get_weather", description="The forecast", parameters_json=json.dumps(WEATHER)),
               pb.Tool(name="get_time", description="The time", parameters_json='{"type": "object"}')],
        tool_choice=tool_choice, sampling=pb.SamplingParams(**sampling))


def run_chat(channel, request: pb.ChatRequest) -> dict[int, list[pb.ChatResponse]]:
    by_index: dict[int, list[pb.ChatResponse]] = {}
    for msg in generation_pb2_grpc.GenerationStub(channel).Chat(request, timeout=240):
        by_index.setdefault(msg.index, []).append(msg)
    return by_index


def test_chat_with_a_required_tool_gives_valid_calls_and_the_templates_prompt(services, tiny_model_dir):
    from transformers import AutoTokenizer

    request = chat_request("required", temperature=1.0, seed=7, max_tokens=400, n=2)
    with services.channel() as ch:
        replies = run_chat(ch, request)
        named = run_chat(ch, chat_request("get_weather", temperature=0.0, max_tokens=400))[0]
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": json.loads(t.parameters_json)}} for t in request.tools]
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    expected_prompt = AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert sorted(replies) == [0, 1]
    for messages_of_sample in [*replies.values(), named]:
        last = messages_of_sample[-1]
        calls = [c for m in messages_of_sample for c in m.tool_calls]
        assert last.finish_reason == pb.FINISH_REASON_TOOL_CALLS and calls
        assert last.usage.prompt_tokens == len(expected_prompt)
        assert last.usage.completion_tokens == sum(len(m.token_ids) for m in messages_of_sample)
        assert "".join(m.text for m in messages_of_sample).strip() == ""   # nothing but the calls
        for call in calls:
            assert call.id.startswith("call_") and call.name in ("get_weather", "get_time")
            if call.name == "get_weather":
                jsonschema.validate(json.loads(call.arguments_json), WEATHER)
    assert [c.name for m in named for c in m.tool_calls] == ["get_weather"]


def test_chat_without_tool_calls_streams_text_and_ends_with_stop_or_length(services):
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hello")], enable_thinking=False,
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=30, json_schema=json.dumps(
                                 {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                                  "required": ["answer"]})))
    with services.channel() as ch:
        (messages,) = run_chat(ch, request).values()
    assert messages[-1].finish_reason == pb.FINISH_REASON_STOP
    assert messages[-1].matched_stop in ("<|im_end|>", "<|endoftext|>")   # the checkpoint's EOS tokens
    assert json.loads("".join(m.text for m in messages)) in ({"answer": "yes"}, {"answer": "no"})


def test_a_high_priority_request_behind_a_full_queue_finishes_before_earlier_low_ones(launch_services):
    # Without aging: the order is the priorities' alone, however the arrivals are spaced.
    with launch_services(scheduler_args=("--max-num-seqs", "1", "--priority-aging", "0")) as svc, \
            svc.channel() as ch:
        finished: list[str] = []

        def run(name: str, **sampling) -> None:
            generate(ch, token_ids=random_prompt(hash(name) % 1000, 8), ignore_eos=True, **sampling)
            finished.append(name)

        threads = [threading.Thread(target=run, args=("running",), kwargs=dict(max_tokens=600))]
        threads += [threading.Thread(target=run, args=(f"low-{i}",), kwargs=dict(max_tokens=10, priority=5))
                    for i in range(3)]
        threads.append(threading.Thread(target=run, args=("high",), kwargs=dict(max_tokens=10, priority=-1)))
        for thread in threads:                   # in order: the queue fills behind the running one
            thread.start()
            time.sleep(0.1)
        for thread in threads:
            thread.join(timeout=120)
    assert finished == ["running", "high", "low-0", "low-1", "low-2"]
