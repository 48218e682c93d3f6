"""Malformed and extreme requests get a clear status, and the service keeps serving others."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from tests.client import generate, model_info

pytestmark = pytest.mark.timeout(300)

CLEAR_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0, -1.0, 1e30]))
sampling = st.fixed_dictionaries({}, optional={
    "temperature": floats, "top_p": floats, "min_p": floats,
    "repetition_penalty": floats, "presence_penalty": floats, "frequency_penalty": floats,
    "top_k": st.integers(-(2**31), 2**31 - 1),
    "max_tokens": st.integers(0, 2**32 - 1),
    "min_tokens": st.integers(0, 2**32 - 1),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(st.text(max_size=40), max_size=20),
    "stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=5),
})
prompts = st.one_of(
    st.fixed_dictionaries({"text": st.text(max_size=300)}),
    st.fixed_dictionaries({"token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=60)}),
    # Prompts around and past the context limit (4096), built from a small draw.
    st.integers(3000, 6000).map(lambda n: {"token_ids": [7] * n}),
)


def _ok_or_clear(channel, **kwargs) -> None:
    try:
        out = generate(channel, timeout=60, **kwargs)
    except grpc.RpcError as e:
        assert e.code() in CLEAR_CODES, (e.code(), e.details())
        assert e.details()
        return
    assert out.finish_reason in (generation_pb2.FINISH_REASON_STOP, generation_pb2.FINISH_REASON_LENGTH)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, params=sampling)
def test_random_requests_get_clear_answers(services, prompt, params):
    # Keep accepted requests short (0 stays 0, which must be refused): the fuzz is about what
    # is refused, not about decoding long.
    params["max_tokens"] = min(params.get("max_tokens", 8), 8)
    with services.channel() as ch:
        _ok_or_clear(ch, **prompt, **params)


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
