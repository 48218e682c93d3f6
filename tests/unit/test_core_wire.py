"""The sampling records on the internal wires: every field of the scheduler's SamplingParams but the
frontend's own survives llm.engine.v1, and every field of the worker's SamplingOptions arrives
through llm.worker.v1 unchanged. The values are made from the records' fields, so a new field is
covered without touching this file."""
from __future__ import annotations

import dataclasses
import typing

from common.constraint import Constraint
from common.pb.llm.engine.v1 import engine_pb2
from common.pb.llm.worker.v1 import worker_pb2
from common.record_codec import decode, encode
from common.sampling import SamplingParams
from scheduler_svc.engine.api import CoreRequest
from scheduler_svc.engine.api_wire import add_requests_from_pb, add_requests_to_pb
from worker_svc.layers.sampler import SamplingOptions

# Stop strings, detokenization and the fan-out of samples stay with the frontend.
FRONTEND_ONLY = {"stop", "skip_special_tokens", "n"}


def _other_than(default, hint):
    """A value of the field's type that is not its default (float32-exact for floats)."""
    args = set(typing.get_args(hint))
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 3
    if isinstance(default, float):
        return default + 0.25
    if isinstance(default, frozenset):
        return frozenset({4, 9})
    if Constraint in args:
        return Constraint("regex", "a+")
    if int in args:                               # an optional integer: the seed
        return 2**63 + 5
    if isinstance(default, str):
        return default + "x"
    if args == {Ellipsis, str}:
        return ("x",)
    if args == {Ellipsis, tuple[int, float]}:
        return ((2, -100.0), (11, 0.5))           # (id, value) pairs, ids ascending
    raise TypeError(f"write a test value for fields of type {hint}")


def every_field_set(record_type):
    hints = typing.get_type_hints(record_type)
    return record_type(**{f.name: _other_than(f.default, hints[f.name]) for f in dataclasses.fields(record_type)})


def test_every_scheduler_field_but_the_frontends_own_survives_the_core_wire():
    params = every_field_set(SamplingParams)
    assert all(getattr(params, f.name) != f.default for f in dataclasses.fields(SamplingParams))
    back = decode(encode(params, engine_pb2.SamplingParams()), SamplingParams)
    lost = {f.name for f in dataclasses.fields(SamplingParams) if getattr(back, f.name) != getattr(params, f.name)}
    assert lost == FRONTEND_ONLY
    request = CoreRequest(seq_id=5 << 40 | 1, request_id="r", prompt_token_ids=[1, 2, 3],
                          sampling=dataclasses.replace(params, n=1), sample_index=2)
    (again,) = add_requests_from_pb(add_requests_to_pb([request]))
    assert dataclasses.replace(again, sampling=request.sampling) == request
    assert dataclasses.replace(again.sampling, stop=params.stop, skip_special_tokens=True) == request.sampling


def test_every_worker_field_arrives_from_the_scheduler_record_under_its_own_name():
    params = every_field_set(SamplingParams)
    options = decode(encode(params, worker_pb2.SamplingOptions()), SamplingOptions)
    for f in dataclasses.fields(SamplingOptions):
        assert getattr(options, f.name) == getattr(params, f.name) != f.default, f.name
    on_the_wire = set(worker_pb2.SamplingOptions.DESCRIPTOR.fields_by_name)
    assert on_the_wire == {f.name for f in dataclasses.fields(SamplingOptions)}


def test_unset_fields_on_the_wires_mean_the_records_defaults():
    assert decode(engine_pb2.SamplingParams(), SamplingParams) == SamplingParams()
    assert decode(worker_pb2.SamplingOptions(), SamplingOptions) == SamplingOptions()
    assert decode(encode(SamplingParams(), engine_pb2.SamplingParams()), SamplingParams) == SamplingParams()
