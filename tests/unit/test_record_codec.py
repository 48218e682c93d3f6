"""common/record_codec.py: records travel field by field by name, and a record whose default would
need a `value or default` on the reading side cannot be coded at all."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.constraint import Constraint
from common.pb.llm.engine.v1 import engine_pb2
from common.pb.llm.worker.v1 import worker_pb2
from common.record_codec import decode, encode


@dataclass(frozen=True)
class Subset:
    top_p: float = 1.0                      # optional on the wire
    min_p: float = 0.0                      # plain: its zero is the default
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None
    not_on_the_wire: str = "kept"


@dataclass(frozen=True)
class OffIsNotZero:
    min_p: float = 0.5


@dataclass(frozen=True)
class StopIds:
    stop_token_ids: frozenset[int] = frozenset()


def test_only_the_fields_both_sides_have_travel_and_unset_decodes_as_the_default():
    msg = encode(Subset(top_p=0.5, seed=7, not_on_the_wire="local"), worker_pb2.SamplingOptions())
    assert msg.HasField("top_p") and msg.HasField("seed") and not msg.HasField("constraint")
    assert decode(msg, Subset) == Subset(top_p=0.5, seed=7)
    assert decode(worker_pb2.SamplingOptions(), Subset) == Subset()


def test_maps_decode_sorted_and_nested_records_travel_whole():
    record = Subset(logit_bias=((9, -1.0), (2, 0.5)), constraint=Constraint("json_object"))
    msg = encode(record, worker_pb2.SamplingOptions())
    assert dict(msg.logit_bias) == {9: -1.0, 2: 0.5} and msg.HasField("constraint")
    back = decode(msg, Subset)
    assert back.logit_bias == ((2, 0.5), (9, -1.0)) and back.constraint == Constraint("json_object")


def test_a_default_that_is_not_the_wires_zero_is_refused_when_coding_starts():
    with pytest.raises(TypeError, match=r"OffIsNotZero.min_p .* make the field optional"):
        encode(OffIsNotZero(), worker_pb2.SamplingOptions())
    with pytest.raises(TypeError, match=r"OffIsNotZero.min_p"):
        decode(worker_pb2.SamplingOptions(), OffIsNotZero)


def test_a_set_is_sent_sorted_and_decoded_as_a_set():
    msg = encode(StopIds(frozenset({9, 2, 5})), engine_pb2.SamplingParams())
    assert list(msg.stop_token_ids) == [2, 5, 9]
    assert decode(msg, StopIds) == StopIds(frozenset({2, 5, 9}))
