"""The core/frontend wire (scheduler_svc/engine/api_wire.py): a request's sampling parameters survive the
trip through llm.engine.v1 unchanged, every field of them."""
from __future__ import annotations

import dataclasses

from common.constraint import Constraint
from scheduler_svc.engine.api import CoreRequest
from scheduler_svc.engine.api_wire import add_requests_from_pb, add_requests_to_pb, sampling_from_pb, sampling_to_pb
from common.sampling import SamplingParams

EVERY_FIELD = SamplingParams(
    temperature=0.5, top_p=0.75, top_k=7, min_p=0.25, seed=2**63 + 5, max_tokens=99, min_tokens=3, ignore_eos=True,
    stop=("x",), stop_token_ids=frozenset({4, 9}), repetition_penalty=1.5, presence_penalty=-0.5,
    frequency_penalty=0.25, logprobs=True, skip_special_tokens=True, n=1, top_logprobs=4, prompt_logprobs=True,
    constraint=Constraint("regex", "a+"), priority=-3, logit_bias=((2, -100.0), (11, 0.5)))


def test_every_sampling_field_but_the_frontends_own_survives_the_wire():
    # stop strings and skip_special_tokens stay with the frontend (it matches and detokenizes).
    frontend_only = {"stop", "skip_special_tokens"}
    unset = {f.name for f in dataclasses.fields(SamplingParams)} - frontend_only
    assert all(getattr(EVERY_FIELD, name) != getattr(SamplingParams(), name) for name in unset - {"n"})
    back = sampling_from_pb(sampling_to_pb(EVERY_FIELD))
    assert dataclasses.replace(back, stop=EVERY_FIELD.stop, skip_special_tokens=True) == EVERY_FIELD
    request = CoreRequest(seq_id=5 << 40 | 1, request_id="r", prompt_token_ids=[1, 2, 3], sampling=EVERY_FIELD,
                          sample_index=2)
    (again,) = add_requests_from_pb(add_requests_to_pb([request]))
    assert again.sampling.logit_bias == EVERY_FIELD.logit_bias and again.sample_index == 2
