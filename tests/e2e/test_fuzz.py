"""Malformed and extreme requests get a clear status, and the service keeps serving others."""
from __future__ import annotations

import collections
import math
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from scheduler_svc.frontend.validation import Limits
from tests.support.client import generate, model_info

pytestmark = pytest.mark.timeout(300)

# What a refusal may say: the request is wrong (INVALID_ARGUMENT), too much now (RESOURCE_EXHAUSTED)
# or past a range (OUT_OF_RANGE). UNKNOWN or INTERNAL would mean an unhandled input.
CLEAR_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE}


def _floats(low: float, high: float, valid: bool):
    """In range; or anything a float32 field can carry, and the values just outside the bounds."""
    low, high = np.float32(low), np.float32(high)      # the field's type: 0.01 is 0.0099999998
    in_range = st.floats(float(low), float(high), width=32)
    if valid:
        return in_range
    edges = [low, high, np.nextafter(low, np.float32(-np.inf)), np.nextafter(high, np.float32(np.inf)),
             0.0, -0.0, 1e-45, -1e-45, 1.0000001, -2.0000002, 100.00001, 3.4028235e38, -3.4028235e38]
    return st.one_of(in_range, st.floats(width=32), st.sampled_from([float(e) for e in edges]))


def _lengthy(strategy, limit: int, valid: bool):
    """Short lists; or lists of limit - 1 .. limit + 2 elements too."""
    short = st.lists(strategy, max_size=4)
    if valid:
        return short
    return st.one_of(short, st.integers(limit - 1, limit + 2).flatmap(
        lambda n: st.lists(strategy, min_size=n, max_size=n)))


LIMITS = Limits()
VOCAB_SIZE, MAX_MODEL_LEN = 512, 4096      # the tiny model's; 53235 bytes of text may fit the context


def _sampling(valid: bool):
    """Every field of SamplingParams (unset ones take their defaults): values the service must
    accept, or anything the field's type can carry."""
    token_id = st.integers(0, VOCAB_SIZE - 1) if valid else st.one_of(st.integers(0, 600), st.integers(0, 2**32 - 1))
    count = st.integers(0, 8) if valid else st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1))
    stop = st.text(min_size=1, max_size=8) if valid else st.one_of(
        st.text(max_size=8), st.text(min_size=LIMITS.max_stop_string_len - 1, max_size=LIMITS.max_stop_string_len + 1))
    return st.fixed_dictionaries({}, optional={
        "temperature": _floats(0.0, 100.0, valid), "top_p": _floats(1e-6, 1.0, valid),
        "min_p": _floats(0.0, 1.0, valid), "repetition_penalty": _floats(0.01, 10.0, valid),
        "presence_penalty": _floats(-2.0, 2.0, valid), "frequency_penalty": _floats(-2.0, 2.0, valid),
        "top_k": st.integers(-1, 600) if valid else st.integers(-(2**31), 2**31 - 1),
        "max_tokens": st.integers(8, 8) if valid else count,
        "min_tokens": count,
        "seed": st.integers(0, 2**64 - 1),
        "ignore_eos": st.booleans(),
        "stop": _lengthy(stop, LIMITS.max_stop_strings, valid),
        "stop_token_ids": _lengthy(token_id, LIMITS.max_stop_token_ids, valid),
        "logprobs": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "n": st.integers(0, 3) if valid else st.one_of(st.integers(0, 17), st.integers(0, 2**32 - 1)),
        "top_logprobs": st.integers(0, 20) if valid else st.one_of(st.integers(0, 21), st.integers(0, 2**32 - 1)),
        "prompt_logprobs": st.booleans(),
        "priority": st.integers(-(2**31), 2**31 - 1),
        "logit_bias": _bias(token_id, valid),
    })


def _bias(token_id, valid: bool):
    """logit_bias maps: a few in-range entries; or any ids and float32 values, and sizes around the limit."""
    short = st.dictionaries(token_id, _floats(-100.0, 100.0, valid), max_size=4)
    if valid:
        return short
    return st.one_of(short, st.integers(LIMITS.max_logit_bias - 1, LIMITS.max_logit_bias + 2).map(
        lambda n: {t: 1.0 for t in range(n)}))


sampling = st.one_of(_sampling(valid=True), _sampling(valid=False))
prompts = st.one_of(
    st.fixed_dictionaries({"text": st.text(min_size=1, max_size=300)}),
    st.fixed_dictionaries({"token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=60)}),
    st.fixed_dictionaries({"text": st.text(max_size=300)}),
    st.fixed_dictionaries({"token_ids": st.lists(st.one_of(st.integers(0, 600), st.integers(0, 2**32 - 1)),
                                                 max_size=60)}),
    # Prompts around and past the context limit, built from a small draw.
    st.integers(MAX_MODEL_LEN - 100, MAX_MODEL_LEN + 100).map(lambda n: {"token_ids": [7] * n}),
    st.tuples(st.characters(exclude_categories=("Cs",)), st.integers(40_000, 70_000)).map(
        lambda c: {"text": c[0] * c[1]}),
    st.just({}),                                                           # no prompt at all
)
request_ids = st.one_of(st.just(""), st.text(max_size=LIMITS.max_request_id_len + 2))


def _ok_or_clear(channel, **kwargs) -> str:
    try:
        out = generate(channel, timeout=60, **kwargs)
    except grpc.RpcError as e:
        assert e.code() in CLEAR_CODES, (e.code(), e.details())
        assert e.details()
        return e.code().name
    assert out.finish_reason in (generation_pb2.FINISH_REASON_STOP, generation_pb2.FINISH_REASON_LENGTH)
    assert len(out.token_ids) <= 8 and (not kwargs.get("logprobs") or len(out.logprobs) == len(out.token_ids))
    assert all(math.isfinite(lp) for lp in out.logprobs)
    return "OK"


def test_random_requests_get_clear_answers(services):
    outcomes: collections.Counter = collections.Counter()

    @settings(max_examples=400, deadline=None, database=None)
    @given(prompt=prompts, params=sampling, request_id=request_ids)
    def one(prompt, params, request_id):
        # Keep accepted requests short (0 stays 0, which must be refused): the fuzz is about what
        # is refused, not about decoding long.
        params["max_tokens"] = min(params.get("max_tokens", 8), 8)
        with services.channel() as ch:
            outcomes[_ok_or_clear(ch, request_id=request_id, **prompt, **params)] += 1

    one()
    print(dict(outcomes))
    assert outcomes["OK"] > 20 and outcomes["INVALID_ARGUMENT"] > 20, outcomes   # both sides were explored
    with services.channel() as ch:
        assert generate(ch, text="still here", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        deadline = time.monotonic() + 10
        while (group := model_info(ch).worker_groups[0]).num_free_kv_blocks != group.num_kv_blocks:
            assert time.monotonic() < deadline, f"blocks still held after the fuzz: {group}"
            time.sleep(0.05)
        assert group.healthy


# Appended to every payload: a message that decodes merges it in, so a request that random bytes
# happen to make valid stays short.
_SHORT = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(max_tokens=4)).SerializeToString()


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=200))
def test_random_bytes_get_clear_answers(services, payload):
    with services.channel() as ch:
        try:
            responses = _raw_generate(ch, payload + _SHORT)
        except grpc.RpcError as e:
            assert e.code() in CLEAR_CODES, (e.code(), e.details())
            return
        assert responses and responses[-1].finish_reason
        for r in responses[:-1]:
            assert not r.finish_reason


def _raw_generate(channel, payload: bytes):
    call = channel.unary_stream("/llm.v1.Generation/Generate",
                                request_serializer=lambda b: b,
                                response_deserializer=generation_pb2.GenerateResponse.FromString)
    return list(call(payload, timeout=30))


@pytest.mark.parametrize("payload, fragment", [
    (b"\x12\x03\xff\xfe\xfd", "UTF-8"),                    # field 2 (text): invalid UTF-8
    (b"\x1a\x05\x0a\x03\xff\xff", "GenerateRequest"),      # truncated varint inside token_ids
    (b"\xff\xff\xff\xff", "GenerateRequest"),              # not protobuf at all
])
def test_undecodable_requests_are_invalid_argument(services, payload, fragment):
    with services.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            _raw_generate(ch, payload)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in err.value.details()
        assert generate(ch, text="still here", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_oversized_message_is_refused(services):
    with services.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            generate(ch, text="x" * (80 * 1024 * 1024), max_tokens=1)
        assert err.value.code() in CLEAR_CODES
        group = model_info(ch).worker_groups[0]
        assert generate(ch, text="fine", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        assert group.healthy


def test_huge_max_tokens_is_accepted_and_capped_by_context(services):
    with services.channel() as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        stream = stub.Generate(generation_pb2.GenerateRequest(
            text="Hello", sampling=generation_pb2.SamplingParams(max_tokens=2**32 - 1, ignore_eos=True)), timeout=60)
        assert next(stream).token_ids
        stream.cancel()
