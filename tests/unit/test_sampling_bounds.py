"""The byte bound of sampling options (common/sampling_bounds.py) holds for options at every bound."""
from __future__ import annotations

from common.pb.llm.v1 import generation_pb2 as pb
from common.sampling_bounds import (LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS_ENTRIES, MAX_N, MAX_SAMPLING_BYTES,
                                    MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS,
                                    SEED_LIMIT)

_LARGEST_ID = 2 ** 31 - 1      # a 5-byte varint


def _options_at_every_bound() -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=1.0, top_p=1.0, top_k=_LARGEST_ID, min_p=0.5, seed=SEED_LIMIT - 1, max_tokens=_LARGEST_ID,
        ignore_eos=True, stop=["\U0001F600" * MAX_STOP_STRING_LEN] * MAX_STOP_STRINGS,
        stop_token_ids=[_LARGEST_ID] * MAX_STOP_TOKEN_IDS, repetition_penalty=2.0, presence_penalty=1.0,
        frequency_penalty=1.0, logprobs=True, min_tokens=_LARGEST_ID, skip_special_tokens=True, n=MAX_N,
        top_logprobs=MAX_TOP_LOGPROBS, prompt_logprobs=True, priority=-_LARGEST_ID, speculative=False,
        logit_bias={_LARGEST_ID - i: LOGIT_BIAS_RANGE.low for i in range(MAX_LOGIT_BIAS_ENTRIES)})


def test_options_at_every_bound_encode_in_less_than_half_of_max_sampling_bytes():
    assert _options_at_every_bound().ByteSize() < MAX_SAMPLING_BYTES // 2


def test_the_options_at_every_bound_set_every_field_but_the_constraint():
    given = {f.name for f, _ in _options_at_every_bound().ListFields()}
    fields = {f.name for f in pb.SamplingParams.DESCRIPTOR.fields
              if f.containing_oneof is None or f.containing_oneof.name != "constraint"}
    assert given == fields
