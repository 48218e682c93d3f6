"""The scheduler service with frontend processes (--frontends 2): they share the public port, and
whichever frontend a client reaches, its greedy tokens equal transformers', its cancel frees the
request's blocks, and its Abort ends a request that another frontend serves."""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from tests.support.client import generate, model_info
from tests.support.hf_reference import hf_greedy

pytestmark = pytest.mark.timeout(300)


def _own_connection(addr: str) -> grpc.Channel:
    """A channel with a connection of its own (channels to one address share one by default)."""
    return grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])


def _served_by(channel: grpc.Channel, **sampling) -> tuple[str, object]:
    """Starts a Generate stream; returns the frontend id from its initial metadata and the call."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    call = stub.Generate(generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
                                                        sampling=generation_pb2.SamplingParams(**sampling)),
                         timeout=120)
    metadata = dict(call.initial_metadata())
    assert "frontend-id" in metadata, f"refused before admission: {call.code()} {call.details()!r}"
    return metadata["frontend-id"], call


def test_two_frontends_share_the_port(tiny_model_dir, launch_services):
    rng = random.Random(11)
    requests = [dict(token_ids=[rng.randrange(3, 512) for _ in range(rng.randint(5, 40))], temperature=0.0,
                     ignore_eos=True, max_tokens=rng.randint(3, 12)) for _ in range(12)]
    with launch_services(scheduler_args=("--frontends", "2")) as svc:
        # The kernel gives each new connection to either frontend once both listen; the service reports
        # ready as soon as one does, so connections are opened (each its own) until each frontend holds
        # half the requests' channels. Requests then alternate between the two frontends.
        by_frontend: dict[str, list[grpc.Channel]] = {"0": [], "1": []}
        half = len(requests) // 2
        for _ in range(400):
            if all(len(chs) >= half for chs in by_frontend.values()):
                break
            ch = _own_connection(svc.scheduler_addr)
            via, _ = _served_by(ch, max_tokens=1)
            if len(by_frontend[via]) < half:
                by_frontend[via].append(ch)
            else:
                ch.close()
        else:
            pytest.fail(f"400 new connections did not reach both frontends: {sorted(by_frontend)}")
        channels = [by_frontend[str(i % 2)][i // 2] for i in range(len(requests))]
        results = [None] * len(requests)

        def run(i: int) -> None:
            results[i] = generate(channels[i], **requests[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Each request ran on the frontend its channel was opened to.
        assert [_served_by(ch, max_tokens=1)[0] for ch in channels] == [str(i % 2) for i in range(len(requests))]
        # Cancel: a long stream dropped by its client ends in the core and frees its blocks.
        with svc.channel() as ch:
            frontend, call = _served_by(ch, max_tokens=4000, ignore_eos=True)
            next(iter(call))
            call.cancel()
            deadline = time.monotonic() + 10
            while model_info(ch).worker_groups[0].num_running and time.monotonic() < deadline:
                time.sleep(0.05)
            info = model_info(ch)
            assert info.worker_groups[0].num_running == 0
            assert info.worker_groups[0].num_free_kv_blocks == info.worker_groups[0].num_kv_blocks
        # Abort by id through a frontend other than the one streaming the request.
        with svc.channel() as streaming:
            owner, call = _served_by(streaming, max_tokens=4000, ignore_eos=True)
            first = next(iter(call))
            for _ in range(200):
                other = _own_connection(svc.scheduler_addr)
                stub = generation_pb2_grpc.GenerationStub(other)
                via, _ = _served_by(other, max_tokens=1)
                if via != owner:
                    assert stub.Abort(generation_pb2.AbortRequest(request_id=first.request_id), timeout=10).found
                    break
                other.close()
            else:
                pytest.fail("every new connection reached the same frontend")
            last = list(call)[-1]
            assert last.finish_reason == generation_pb2.FINISH_REASON_ABORT
        for ch in channels:
            ch.close()
    for req, got in zip(requests, results):
        assert got.token_ids == hf_greedy(tiny_model_dir, req["token_ids"], req["max_tokens"])
        assert got.usage.completion_tokens == req["max_tokens"]
