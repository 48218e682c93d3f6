"""The public API's behaviour through real processes: streaming, seeds, stop strings, abort,
cancellation, context limits and bad input."""
from __future__ import annotations

import math
import random
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from tests.support.client import generate, generate_many, model_info

pytestmark = pytest.mark.timeout(300)


def _tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def _wait_all_blocks_free(channel, timeout: float = 10.0) -> generation_pb2.ModelInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = model_info(channel)
        group = info.worker_groups[0]
        if group.num_free_kv_blocks == group.num_kv_blocks and group.num_running == 0:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held: {group}")
        time.sleep(0.05)


def test_model_info_health_and_reflection(services, tiny_model_dir):
    with services.channel() as ch:
        info = model_info(ch)
        assert info.model == tiny_model_dir.name
        assert info.vocab_size == 512 and info.block_size > 0 and info.num_kv_blocks > 0
        assert list(info.eos_token_ids) == [2, 0]
        assert info.worker_groups[0].healthy
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="llm.v1.Generation"))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert {"llm.v1.Generation", "grpc.health.v1.Health"} <= names


def test_streaming_text_matches_token_ids(services, tiny_model_dir):
    tok = _tokenizer(tiny_model_dir)
    stub_req = generation_pb2.GenerateRequest(
        text="Hello world! Once upon a time",
        sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
    with services.channel() as ch:
        arrivals, tokens, text = [], [], ""
        for msg in generation_pb2_grpc.GenerationStub(ch).Generate(stub_req, timeout=60):
            arrivals.append(time.monotonic())
            tokens += msg.token_ids
            text += msg.text
    assert len(tokens) == 48
    assert len(arrivals) >= 40, "tokens must arrive as they are sampled, not in one message"
    assert arrivals[-1] - arrivals[0] > 0
    assert text == tok.decode(tokens)


def test_seeded_sampling_reproducible_across_batches(services):
    rng = random.Random(7)
    target = dict(token_ids=[rng.randrange(3, 512) for _ in range(30)], temperature=0.9, top_p=0.95,
                  top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    others = [dict(token_ids=[rng.randrange(3, 512) for _ in range(rng.randint(5, 60))], temperature=1.0,
                   max_tokens=rng.randint(5, 30), ignore_eos=True) for _ in range(8)]
    with services.channel() as ch:
        alone = generate(ch, **target)
        crowded = generate_many(ch, others[:4] + [target] + others[4:])[4]
        again = generate(ch, **target)
        other_seed = generate(ch, **dict(target, seed=99))
    assert alone.token_ids == crowded.token_ids == again.token_ids
    assert other_seed.token_ids != alone.token_ids


def test_stop_string_ends_text_before_it(services):
    prompt = dict(text="The quick brown fox", temperature=0.0, max_tokens=40, ignore_eos=True)
    with services.channel() as ch:
        full = generate(ch, **prompt)
        stop = full.text[10:14]
        cut = generate(ch, stop=[stop], **prompt)
    assert stop and stop in full.text
    assert cut.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def test_stop_token_and_eos(services):
    with services.channel() as ch:
        full = generate(ch, text="Hello", temperature=0.0, max_tokens=20, ignore_eos=True)
        stop_id = full.token_ids[5]
        cut = generate(ch, text="Hello", temperature=0.0, max_tokens=20, stop_token_ids=[stop_id])
    assert cut.finish_reason == generation_pb2.FINISH_REASON_STOP
    assert cut.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]


def test_logprobs_returned_per_token(services):
    with services.channel() as ch:
        out = generate(ch, text="Hello", temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)
    assert len(out.logprobs) == 8 and all(lp <= 0.0 and math.isfinite(lp) for lp in out.logprobs)


def test_abort_frees_blocks(services):
    with services.channel() as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = generation_pb2.GenerateRequest(
            request_id="to-abort", text="Once upon a time",
            sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True))
        stream = stub.Generate(req, timeout=60)
        first = next(stream)
        assert first.token_ids
        assert stub.Abort(generation_pb2.AbortRequest(request_id="to-abort")).found
        last = list(stream)[-1]
        assert last.finish_reason == generation_pb2.FINISH_REASON_ABORT
        assert last.usage.completion_tokens < 3000
        assert not stub.Abort(generation_pb2.AbortRequest(request_id="to-abort")).found
        _wait_all_blocks_free(ch)


def test_client_cancel_frees_blocks(services):
    with services.channel() as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = generation_pb2.GenerateRequest(
            text="Once upon a time", sampling=generation_pb2.SamplingParams(max_tokens=3000, ignore_eos=True))
        stream = stub.Generate(req, timeout=60)
        next(stream)
        assert model_info(ch).worker_groups[0].num_running == 1
        stream.cancel()
        _wait_all_blocks_free(ch)


def test_max_model_len_finishes_with_length(tiny_model_dir, launch_services):
    with launch_services(scheduler_args=("--max-model-len", "64")) as svc, svc.channel() as ch:
        assert model_info(ch).max_model_len == 64
        out = generate(ch, token_ids=list(range(3, 63)), temperature=0.0, ignore_eos=True)
        capped = generate(ch, token_ids=list(range(3, 13)), temperature=0.0, ignore_eos=True, max_tokens=500)
    assert out.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert len(out.token_ids) == 4
    assert capped.finish_reason == generation_pb2.FINISH_REASON_LENGTH and len(capped.token_ids) == 54


@pytest.mark.parametrize("request_kwargs, field", [
    (dict(text=""), "text"),
    (dict(), "prompt"),
    (dict(token_ids=[]), "token_ids"),
    (dict(token_ids=[5, 512]), "token_ids"),
    (dict(token_ids=[1] * 5000), "max_model_len"),
    (dict(text="hi", temperature=-1.0), "temperature"),
    (dict(text="hi", temperature=float("nan")), "temperature"),
    (dict(text="hi", top_p=1.5), "top_p"),
    (dict(text="hi", top_p=float("inf")), "top_p"),
    (dict(text="hi", top_k=-5), "top_k"),
    (dict(text="hi", min_p=2.0), "min_p"),
    (dict(text="hi", max_tokens=0), "max_tokens"),
    (dict(text="hi", repetition_penalty=0.0), "repetition_penalty"),
    (dict(text="hi", presence_penalty=3.0), "presence_penalty"),
    (dict(text="hi", frequency_penalty=-9.0), "frequency_penalty"),
    (dict(text="hi", stop_token_ids=[100000]), "stop_token_ids"),
    (dict(text="hi", stop_token_ids=list(range(257))), "stop_token_ids has 257 ids, more than the limit of 256"),
    (dict(text="hi", repetition_penalty=1e-45), "repetition_penalty must be in [0.01, 10], got 1e-45"),
    # The tiny tokenizer's longest token covers 16 bytes: 4095 tokens hold at most 65520.
    (dict(text="x" * 70_000), "text is 70000 bytes, more than max_model_len 4096 tokens can hold"),
])
def test_bad_input_is_invalid_argument(services, request_kwargs, field):
    with services.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            generate(ch, **request_kwargs)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
        # ... and the service keeps serving everyone else.
        assert generate(ch, text="Hello", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3


@pytest.mark.parametrize("field, value, printed", [
    ("top_p", 1.0000001, "1.0000001"), ("presence_penalty", -2.0000002, "-2.0000002"),
    ("temperature", 100.00001, "100.00001"),
])
def test_a_refused_float_is_printed_as_sent(services, field, value, printed):
    with services.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            generate(ch, text="hi", **{field: value})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().endswith(f"got {printed}")


def test_duplicate_request_id_is_refused(services):
    with services.channel() as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = generation_pb2.GenerateRequest(
            request_id="dup", text="Once", sampling=generation_pb2.SamplingParams(max_tokens=3000, ignore_eos=True))
        stream = stub.Generate(req, timeout=60)
        next(stream)
        with pytest.raises(grpc.RpcError) as err:
            generate(ch, request_id="dup", text="x", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        stream.cancel()
        _wait_all_blocks_free(ch)


def test_scheduler_limits_follow_the_workers(launch_services):
    # The scheduler has no limits of its own: its steps hold what this worker takes, 4 requests and 64 tokens.
    requests = [dict(token_ids=list(range(3 + i, 103 + i)), temperature=0.0, ignore_eos=True, max_tokens=6)
                for i in range(8)]
    with launch_services(worker_args=("--max-num-seqs", "4", "--max-num-batched-tokens", "64")) as svc, \
            svc.channel() as ch:
        outs = generate_many(ch, requests)
        assert model_info(ch).worker_groups[0].healthy
    assert all(o.finish_reason == generation_pb2.FINISH_REASON_LENGTH and len(o.token_ids) == 6 for o in outs)
