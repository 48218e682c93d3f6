"""The worker as a real process on a loopback port, driven through the generated stubs."""
from __future__ import annotations

import signal
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.pb.llm.worker.v1 import worker_pb2 as pb
from common.pb.llm.worker.v1 import worker_pb2_grpc
from tests.support.hf_reference import hf_greedy
from tests.support.procs import worker_proc


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    """One worker for the module. Stopping it is a check too (a second process would cost
    seconds of start-up): SIGTERM must end it gracefully with exit status 0."""
    proc = worker_proc(tiny_model_dir, tmp_path_factory.mktemp("worker-logs"), "--num-kv-blocks", "32").start()
    try:
        proc.wait_serving()
        yield proc
    finally:
        status = proc.stop(signal.SIGTERM, timeout=15)
    assert status == 0, proc.log.read_text()[-2000:]
    assert "shutting down" in proc.log.read_text()


EPOCH = 1     # of the lease these tests hold, as owner "tests"


@pytest.fixture
def stub(worker):
    with grpc.insecure_channel(worker.addr) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        stub.Claim(pb.ClaimRequest(owner="tests", epoch=EPOCH, lease_ms=600_000), timeout=5)
        yield stub



def test_the_start_up_objects_are_frozen_before_it_serves(worker):
    """No full collection walks the model's objects mid-step (common/gc_freeze.py)."""
    log = worker.log.read_text()
    assert "froze" in log and log.index("froze") < log.index("serving llm.worker.v1.Worker")

def test_health_and_reflection(worker):
    with grpc.insecure_channel(worker.addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="llm.worker.v1.Worker"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        [answer] = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in answer.list_services_response.service}
        assert {"llm.worker.v1.Worker", "grpc.health.v1.Health"} <= names


def test_describe_and_greedy_steps(stub, tiny_model_dir):
    info = stub.Describe(pb.DescribeRequest(), timeout=5)
    assert (info.model, info.num_kv_blocks, info.block_size, info.device) == ("tiny-qwen3", 32, 16, "cpu")
    prompt = [5, 17, 33, 2, 99, 140, 7, 8, 250, 31, 12, 44, 61, 3, 9]
    first = stub.Step(pb.StepRequest(lease_epoch=EPOCH, step_id=1, new_requests=[pb.NewRequest(
        seq_id=11, token_ids=prompt, num_prompt_tokens=len(prompt), num_scheduled_tokens=len(prompt),
        block_ids=[4], sampling=pb.SamplingOptions(temperature=0.0))]), timeout=30)
    tokens = list(first.token_ids)
    for step_id in range(2, 6):   # decodes; the 17th token needs a second block
        cached = pb.CachedRequests(seq_ids=[11])
        if len(prompt) + len(tokens) == 17:
            cached.new_block_indices.append(0)
            cached.new_block_counts.append(1)
            cached.new_block_ids.append(9)
        reply = stub.Step(pb.StepRequest(lease_epoch=EPOCH, step_id=step_id, cached=cached), timeout=30)
        assert reply.step_id == step_id and reply.timings.total_ms > 0
        tokens += reply.token_ids
    assert tokens == hf_greedy(tiny_model_dir, prompt, 5)
    stub.Step(pb.StepRequest(lease_epoch=EPOCH, step_id=6, finished_seq_ids=[11]), timeout=5)


def test_bad_steps_map_to_status_codes(stub):
    with pytest.raises(grpc.RpcError) as bad:
        stub.Step(pb.StepRequest(lease_epoch=EPOCH, step_id=7, new_requests=[pb.NewRequest(
            seq_id=12, token_ids=[1, 2], num_prompt_tokens=2, num_scheduled_tokens=2, block_ids=[32])]), timeout=5)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in bad.value.details()
    with pytest.raises(grpc.RpcError) as stale:
        stub.Step(pb.StepRequest(lease_epoch=EPOCH, step_id=8, cached=pb.CachedRequests(seq_ids=[404])), timeout=5)
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stub.Reset(pb.ResetRequest(lease_epoch=EPOCH), timeout=5)


def test_large_new_request_fits_in_one_message(stub):
    """A 100k-token NewRequest is well past gRPC's 4 MiB default; it must arrive (and be refused
    for its length here, not for its size)."""
    with pytest.raises(grpc.RpcError) as error:
        stub.Step(pb.StepRequest(lease_epoch=EPOCH, step_id=9, new_requests=[pb.NewRequest(
            seq_id=13, token_ids=[100_000] * 1_000_000, num_prompt_tokens=1_000_000, num_scheduled_tokens=1,
            block_ids=[0])]), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in error.value.details()


def test_the_lease_refuses_another_scheduler_and_steps_of_another_epoch(stub, worker):
    """The worker is leased to "tests": another owner's claim and a step or reset of another
    epoch are refused (naming the owner) without disturbing the order of the owner's steps."""
    with pytest.raises(grpc.RpcError) as taken:
        stub.Claim(pb.ClaimRequest(owner="intruder", epoch=99, lease_ms=1000), timeout=5)
    assert taken.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "leased to scheduler 'tests'" in taken.value.details()
    for call, request in ((stub.Step, pb.StepRequest(step_id=1, lease_epoch=99)),
                          (stub.Reset, pb.ResetRequest(lease_epoch=99)),
                          (stub.Step, pb.StepRequest(step_id=1))):
        with pytest.raises(grpc.RpcError) as stale:
            call(request, timeout=5)
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "lease held by scheduler 'tests'" in stale.value.details()
        assert f"epoch {EPOCH}" not in stale.value.details(), "a refusal told the held epoch"
    with pytest.raises(grpc.RpcError) as malformed:
        stub.Claim(pb.ClaimRequest(owner="tests", epoch=0, lease_ms=1000), timeout=5)
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.Reset(pb.ResetRequest(lease_epoch=EPOCH), timeout=5)
    prompt = [5, 17, 33]
    reply = stub.Step(pb.StepRequest(lease_epoch=EPOCH, step_id=1, new_requests=[pb.NewRequest(
        seq_id=21, token_ids=prompt, num_prompt_tokens=3, num_scheduled_tokens=3, block_ids=[1],
        sampling=pb.SamplingOptions(temperature=0.0))]), timeout=30)
    assert len(reply.token_ids) == 1
    stub.Reset(pb.ResetRequest(lease_epoch=EPOCH), timeout=5)


def test_the_steps_stream_answers_each_step_in_order_and_refusals_in_band(stub, tiny_model_dir):
    """Steps over one stream, all sent before the first answer (as a pipelining scheduler does):
    greedy tokens equal transformers'; a bad step and a stale lease's step get a StepError with
    the status Step would end with, and the stream goes on."""
    stub.Reset(pb.ResetRequest(lease_epoch=EPOCH), timeout=5)
    prompt = [5, 17, 33, 2, 99, 140, 7, 8, 250, 31, 12, 44, 61, 3, 9]
    requests = [pb.StepRequest(lease_epoch=EPOCH, step_id=1, new_requests=[pb.NewRequest(
        seq_id=31, token_ids=prompt, num_prompt_tokens=len(prompt), num_scheduled_tokens=len(prompt),
        block_ids=[4], sampling=pb.SamplingOptions(temperature=0.0))])]
    for step_id in range(2, 6):   # decodes of the token before, on the worker's device; the 17th needs a block
        cached = pb.CachedRequests(seq_ids=[31])
        if len(prompt) + step_id - 1 == 17:
            cached.new_block_indices.append(0)
            cached.new_block_counts.append(1)
            cached.new_block_ids.append(9)
        requests.append(pb.StepRequest(lease_epoch=EPOCH, step_id=step_id, cached=cached))
    requests += [
        pb.StepRequest(lease_epoch=EPOCH, step_id=6, new_requests=[pb.NewRequest(
            seq_id=32, token_ids=[1, 2], num_prompt_tokens=2, num_scheduled_tokens=2, block_ids=[32])]),
        pb.StepRequest(lease_epoch=EPOCH + 5, step_id=7, cached=pb.CachedRequests(seq_ids=[31])),
        pb.StepRequest(lease_epoch=EPOCH, step_id=7, cached=pb.CachedRequests(seq_ids=[31])),
        pb.StepRequest(lease_epoch=EPOCH, step_id=8, finished_seq_ids=[31]),
    ]
    results = list(stub.Steps(iter(requests), timeout=60))
    assert len(results) == len(requests)
    answered = [r.response for r in results[:5]]
    assert [r.step_id for r in answered] == [1, 2, 3, 4, 5] and all(r.HasField("response") for r in results[:5])
    assert [t for r in answered for t in r.token_ids] == hf_greedy(tiny_model_dir, prompt, 5)
    bad, stale = results[5].error, results[6].error
    assert (bad.step_id, bad.code) == (6, "INVALID_ARGUMENT") and "out of range" in bad.message
    assert (stale.step_id, stale.code) == (7, "FAILED_PRECONDITION") and "lease held by scheduler 'tests'" in stale.message
    assert results[7].response.step_id == 7 and len(results[7].response.token_ids) == 1
    assert results[8].response.step_id == 8
    stub.Reset(pb.ResetRequest(lease_epoch=EPOCH), timeout=5)


def test_a_stream_cancelled_with_steps_in_flight_leaves_the_worker_serving(stub):
    """The client goes away with steps launched and unanswered: each still releases its output slot
    (five of them), so the steps of a new stream after a Reset are answered."""
    stub.Reset(pb.ResetRequest(lease_epoch=EPOCH), timeout=5)

    def steps(first_id: int, count: int):
        yield pb.StepRequest(lease_epoch=EPOCH, step_id=first_id, new_requests=[pb.NewRequest(
            seq_id=41, token_ids=[5, 17, 33], num_prompt_tokens=3, num_scheduled_tokens=3, block_ids=[1],
            sampling=pb.SamplingOptions(temperature=0.0))])
        for step_id in range(first_id + 1, first_id + count):
            yield pb.StepRequest(lease_epoch=EPOCH, step_id=step_id, cached=pb.CachedRequests(seq_ids=[41]))

    for _ in range(3):      # each cancelled stream holds up to all five slots
        call = stub.Steps(steps(1, 8), timeout=60)
        next(call)
        call.cancel()
        stub.Reset(pb.ResetRequest(lease_epoch=EPOCH), timeout=30)
    results = list(stub.Steps(steps(1, 8), timeout=60))
    assert [r.response.step_id for r in results] == list(range(1, 9))
    assert all(len(r.response.token_ids) == 1 for r in results)
    stub.Reset(pb.ResetRequest(lease_epoch=EPOCH), timeout=5)


def test_sigterm_ends_an_open_step_stream_cleanly(tiny_model_dir, tmp_path):
    """A worker stopped while a scheduler's stream is open answers the steps launched and ends the
    stream with OK (the scheduler hears "the worker ended the step stream"), instead of keeping it
    open until the server's grace runs out and cancelling it."""
    proc = worker_proc(tiny_model_dir, tmp_path, "--num-kv-blocks", "8").start()
    try:
        proc.wait_serving()
        with grpc.insecure_channel(proc.addr) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            stub.Claim(pb.ClaimRequest(owner="tests", epoch=EPOCH, lease_ms=600_000), timeout=5)
            done = threading.Event()

            def requests():
                yield pb.StepRequest(lease_epoch=EPOCH, step_id=1, new_requests=[pb.NewRequest(
                    seq_id=1, token_ids=[5, 17, 33], num_prompt_tokens=3, num_scheduled_tokens=3, block_ids=[1],
                    sampling=pb.SamplingOptions(temperature=0.0))])
                done.wait(timeout=120)      # the stream stays open: a scheduler between steps

            call = stub.Steps(requests(), timeout=120)
            assert next(call).response.step_id == 1
            proc.popen.send_signal(signal.SIGTERM)
            assert list(call) == []
            assert call.code() == grpc.StatusCode.OK
            done.set()
    finally:
        status = proc.stop(signal.SIGTERM, timeout=15)
    assert status == 0, proc.log.read_text()[-2000:]
