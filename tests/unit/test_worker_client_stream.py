"""The scheduler's side of the Steps stream (scheduler_svc/engine/worker_client.py) against an
in-process gRPC server: replies matched to steps in order, a StepError as that step's
WorkerError with the stream going on, a timeout or the stream's end failing every step waiting
and the next step opening a new stream; and Step calls when the stream is off."""
from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest

from common.pb.llm.worker.v1 import worker_pb2 as pb
from common.pb.llm.worker.v1 import worker_pb2_grpc
from scheduler_svc.engine.worker_client import GrpcWorkerClient, WorkerError

pytestmark = pytest.mark.timeout(60)


class _Worker(worker_pb2_grpc.WorkerServicer):
    """Answers step N with token N; refuses the ids in `refused`; holds those in `held` until `release`."""

    def __init__(self) -> None:
        self.refused: set[int] = set()
        self.held: set[int] = set()
        self.release = threading.Event()
        self.streams = self.calls = 0

    def _answer(self, request):
        if request.step_id in self.held:
            self.release.wait(timeout=30)
        return pb.StepResponse(step_id=request.step_id, token_ids=[request.step_id])

    def Step(self, request, context):
        self.calls += 1
        if request.step_id in self.refused:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {request.step_id} refused")
        return self._answer(request)

    def Steps(self, requests, context):
        self.streams += 1
        for request in requests:
            if request.step_id in self.refused:
                yield pb.StepResult(error=pb.StepError(step_id=request.step_id, code="INVALID_ARGUMENT",
                                                       message=f"step {request.step_id} refused"))
            else:
                yield pb.StepResult(response=self._answer(request))


@pytest.fixture
def worker():
    servicer = _Worker()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}", server
    servicer.release.set()
    server.stop(0)


def _steps(client: GrpcWorkerClient, ids, timeout: float = 10.0):
    return [client.step(pb.StepRequest(step_id=i), timeout) for i in ids]


def _with_client(address: str, body, **options):
    """Runs `body(client)` with a GrpcWorkerClient of the worker at `address`, closed after."""
    async def main():
        client = GrpcWorkerClient(address, **options)
        try:
            return await body(client)
        finally:
            await client.close()
    return asyncio.run(main())


async def _outcomes(awaitables) -> list:
    outcomes = await asyncio.gather(*awaitables, return_exceptions=True)
    return [o.code if isinstance(o, WorkerError) else o.token_ids[0] for o in outcomes]


def test_replies_in_order_and_a_refusal_fails_its_step_alone(worker):
    servicer, address, _ = worker
    servicer.refused = {3}

    async def body(client):
        first = await _outcomes(_steps(client, range(1, 7)))
        second = await _outcomes(_steps(client, [7, 8]))
        refusal = await asyncio.gather(*_steps(client, [3]), return_exceptions=True)
        return first, second, refusal[0]

    first, second, refusal = _with_client(address, body)
    assert first == [1, 2, "INVALID_ARGUMENT", 4, 5, 6] and second == [7, 8]
    assert refusal.details == "step 3 refused" and "INVALID_ARGUMENT" in str(refusal)
    assert (servicer.streams, servicer.calls) == (1, 0)


def test_a_timeout_fails_every_step_waiting_and_the_next_opens_a_new_stream(worker):
    servicer, address, _ = worker
    servicer.held = {2}

    async def body(client):
        first = await _outcomes(_steps(client, [1]))     # answered before the next step's short timeout starts
        stuck = first + await _outcomes([*_steps(client, [2], timeout=0.5), *_steps(client, [3, 4])])
        servicer.release.set()
        return stuck, await _outcomes(_steps(client, [5, 6]))

    stuck, after = _with_client(address, body)
    assert stuck == [1, "DEADLINE_EXCEEDED", "CANCELLED", "CANCELLED"] and after == [5, 6]
    assert servicer.streams == 2


def test_the_worker_going_away_fails_the_steps_waiting_and_a_new_one_is_reached(worker):
    servicer, address, server = worker
    servicer.held = {2}

    async def body(client):
        waiting = _steps(client, [1, 2, 3])
        await asyncio.wait([waiting[0]])      # step 1 answered; step 2 is held
        threading.Thread(target=lambda: server.stop(0)).start()
        gone = await _outcomes(waiting)
        return gone, await _outcomes(_steps(client, [4]))

    gone, after = _with_client(address, body)
    assert gone[0] == 1 and gone[1:] in (["UNAVAILABLE"] * 2, ["CANCELLED"] * 2), gone
    assert after == ["UNAVAILABLE"]     # no worker there any more: the new stream fails too, as a call would


def test_with_the_stream_off_each_step_is_a_call(worker):
    servicer, address, _ = worker
    servicer.refused = {2}

    async def body(client):
        return await _outcomes(_steps(client, [1, 2, 3]))

    assert _with_client(address, body, step_stream=False) == [1, "INVALID_ARGUMENT", 3]
    assert (servicer.streams, servicer.calls) == (0, 3)
