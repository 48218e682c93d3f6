"""The client's SamplingParams is llm.v1's SamplingParams by name: every field of one is a field of
the other, its keyword form lists the same names, and the command line has a flag for each."""
from __future__ import annotations

import dataclasses
import typing

import pytest

from common.cli import ArgumentParser
from common.client import SamplingOptions, SamplingParams
from common.pb.llm.v1 import generation_pb2 as pb
from tools.sampling_flags import add_sampling_flags, sampling_options

NAMES = [f.name for f in dataclasses.fields(SamplingParams)]


def test_the_client_record_and_llm_v1_name_the_same_fields():
    assert set(NAMES) == set(pb.SamplingParams.DESCRIPTOR.fields_by_name)
    assert set(NAMES) == set(typing.get_type_hints(SamplingOptions))
    assert all(f.metadata.get("help") for f in dataclasses.fields(SamplingParams))


def test_every_option_reaches_the_proto_under_its_name():
    given = SamplingParams(max_tokens=5, temperature=0.5, top_p=0.75, top_k=3, min_p=0.25, seed=7, min_tokens=1,
                           ignore_eos=True, stop=("x",), stop_token_ids=(4,), repetition_penalty=1.5,
                           presence_penalty=0.5, frequency_penalty=-0.5, logprobs=True, skip_special_tokens=True,
                           n=2, top_logprobs=3, prompt_logprobs=True, regex="a+", priority=-1, logit_bias={5: -1.0})
    sent = {fd.name for fd, _ in given.to_proto().ListFields()}
    assert sent == {name for name in NAMES if getattr(given, name) not in (None, False)}
    assert given.to_proto().logit_bias == {5: -1.0} and given.to_proto().regex == "a+"
    with pytest.raises(ValueError, match="give one constraint"):
        SamplingParams(regex="a", json_object=True).to_proto()


def test_the_command_line_has_a_flag_for_every_option():
    parser = ArgumentParser(env_prefix="TEST_SAMPLING_")
    add_sampling_flags(parser, {"temperature": 0.0})
    args = parser.parse_args(["--top-p", "0.5", "--stop", "a", "b", "--stop-token-ids", "3", "4", "--json-object",
                              "--logit-bias", "5=100", "9=-100"])
    options = sampling_options(args)
    assert set(options) == set(NAMES)
    assert (options["top_p"], options["stop"], options["stop_token_ids"], options["json_object"]) == \
        (0.5, ["a", "b"], [3, 4], True)
    assert options["logit_bias"] == {5: 100.0, 9: -100.0} and options["temperature"] == 0.0
    unset = sampling_options(parser.parse_args([]))
    assert SamplingParams(**unset).to_proto() == pb.SamplingParams(temperature=0.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--logit-bias", "5:100"])
