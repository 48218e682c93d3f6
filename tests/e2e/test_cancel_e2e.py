"""A cancel at any moment frees the request (real processes, two frontend processes): cancelled
before its initial metadata, right after it (while the request is being admitted into the engine
core), or after its first token, no request is left running or paused, every KV block is free
again, and each request id can be used again at once."""
from __future__ import annotations

import time

import grpc
import pytest

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from tests.support.client import generate, model_info

pytestmark = pytest.mark.timeout(300)

ROUNDS = 8


def _long_request(request_id: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        request_id=request_id, token_ids=generation_pb2.TokenIds(ids=[5, 6, 7, 8]),
        sampling=generation_pb2.SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0.0))


def _long_chat(request_id: str) -> generation_pb2.ChatRequest:
    return generation_pb2.ChatRequest(
        request_id=request_id, messages=[generation_pb2.ChatMessage(role="user", content="Tell me a story")],
        sampling=generation_pb2.SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0.0))


def _cancel(call, when: str) -> None:
    if when == "after metadata":
        call.initial_metadata()
    elif when == "after a token":
        next(iter(call))
    call.cancel()


def _wait_idle(channel: grpc.Channel, timeout_s: float = 30.0) -> generation_pb2.WorkerGroupInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        group = model_info(channel).worker_groups[0]
        if (not group.num_running and group.num_free_kv_blocks == group.num_kv_blocks) or time.monotonic() > deadline:
            return group
        time.sleep(0.1)


@pytest.mark.parametrize("frontends", ["2"])
def test_a_cancel_at_any_moment_frees_the_request_and_its_id(launch_services, frontends):
    with launch_services(scheduler_args=("--frontends", frontends)) as svc:
        ids = []
        for when in ("at once", "after metadata", "after a token"):
            for i in range(ROUNDS):
                # Each its own connection, so the calls spread over both frontends.
                with grpc.insecure_channel(svc.scheduler_addr, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                    stub = generation_pb2_grpc.GenerationStub(ch)
                    request_id = f"{when}-{i}"
                    ids.append(request_id)
                    if i % 2:
                        _cancel(stub.Chat(_long_chat(request_id), timeout=60), when)
                    else:
                        _cancel(stub.Generate(_long_request(request_id), timeout=60), when)
        with svc.channel() as ch:
            group = _wait_idle(ch)
            assert group.num_running == 0, "a cancelled request is still running"
            assert group.num_free_kv_blocks == group.num_kv_blocks, "a cancelled request kept its blocks"
            for request_id in ids:      # no id is still taken
                out = generate(ch, request_id=request_id, token_ids=[9, 10], max_tokens=2, temperature=0.0)
                assert len(out.token_ids) == 2
