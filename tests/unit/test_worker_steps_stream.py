"""The worker's Steps stream (worker_svc/server.py) with a stand-in runner: every step launched is
answered or, when the stream closes early, still settled (its output slot released); refusals
answer in band, in order."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.pb.llm.worker.v1 import worker_pb2 as pb
from worker_svc.server import WorkerServicer

EPOCH = 3


class _Pending:
    def __init__(self, runner, step_id: int) -> None:
        self.runner, self.step_id = runner, step_id

    def result(self):
        from worker_svc.runner_io import StepOutput
        self.runner.settled.append(self.step_id)
        return StepOutput(self.step_id, [self.step_id], None, 0.1, 0.1, 0.2)


class _Runner:
    def __init__(self) -> None:
        self.launched: list[int] = []
        self.settled: list[int] = []

    def launch(self, step):
        self.launched.append(step.step_id)
        return _Pending(self, step.step_id)


class _Context:
    def abort(self, code, message):
        raise AssertionError(f"the stream aborted: {code} {message}")


def _until(done, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the stream's threads did not get there"
        time.sleep(0.01)


def _servicer() -> tuple[WorkerServicer, _Runner]:
    servicer, runner = WorkerServicer(), _Runner()
    servicer.attach(runner)
    servicer.lease.claim("tests", EPOCH, 60.0)
    return servicer, runner


def test_each_step_is_answered_in_order_and_a_refusal_in_band():
    servicer, runner = _servicer()
    requests = [pb.StepRequest(lease_epoch=EPOCH, step_id=1), pb.StepRequest(lease_epoch=EPOCH + 1, step_id=2),
                pb.StepRequest(lease_epoch=EPOCH, step_id=2), pb.StepRequest(lease_epoch=EPOCH, step_id=3)]
    results = list(servicer.Steps(iter(requests), _Context()))
    assert [r.WhichOneof("result") for r in results] == ["response", "error", "response", "response"]
    assert [r.response.step_id for r in results if r.HasField("response")] == [1, 2, 3]
    assert [list(r.response.token_ids) for r in results if r.HasField("response")] == [[1], [2], [3]]
    error = results[1].error
    assert (error.step_id, error.code) == (2, "FAILED_PRECONDITION") and "lease" in error.message
    assert runner.launched == runner.settled == [1, 2, 3]


def test_a_stream_closed_early_still_settles_every_step_it_launched():
    servicer, runner = _servicer()
    cancelled = threading.Event()

    def requests():
        for step_id in (1, 2, 3):
            yield pb.StepRequest(lease_epoch=EPOCH, step_id=step_id)
        cancelled.wait(timeout=30)
        raise grpc.RpcError()     # what grpcio's request iterator raises once the client cancels

    stream = servicer.Steps(requests(), _Context())
    assert next(stream).response.step_id == 1
    _until(lambda: len(runner.launched) == 3)
    cancelled.set()
    stream.close()               # grpcio closes the response generator of a cancelled call
    assert runner.settled == [1, 2, 3]


@pytest.mark.parametrize("bad", ["parse", "launch"])
def test_a_bad_step_answers_invalid_argument_and_the_next_goes_on(bad):
    from worker_svc.runner_io import InvalidStepError
    servicer, runner = _servicer()
    launch = runner.launch

    def refusing(step):
        if step.step_id == 1:
            raise InvalidStepError("step 1 is no good")
        return launch(step)
    if bad == "launch":
        runner.launch = refusing
    first = (pb.StepRequest(lease_epoch=EPOCH, step_id=1, cached=pb.CachedRequests(
                 seq_ids=[1], multi_token_indices=[0, 1], multi_token_counts=[2]))
             if bad == "parse" else pb.StepRequest(lease_epoch=EPOCH, step_id=1))
    results = list(servicer.Steps(iter([first, pb.StepRequest(lease_epoch=EPOCH, step_id=2)]), _Context()))
    assert results[0].error.code == "INVALID_ARGUMENT" and results[0].error.step_id == 1
    assert results[1].response.step_id == 2 and runner.launched == [2]


def test_stopping_ends_a_stream_once_its_launched_steps_are_answered():
    """end_streams (the worker's SIGTERM): the steps launched are answered, then the stream ends
    (rather than waiting for the server's grace to cancel it); a step the reader launches after
    that is settled where it is."""
    servicer, runner = _servicer()
    more = threading.Event()

    def requests():
        yield pb.StepRequest(lease_epoch=EPOCH, step_id=1)
        yield pb.StepRequest(lease_epoch=EPOCH, step_id=2)
        more.wait(timeout=30)
        yield pb.StepRequest(lease_epoch=EPOCH, step_id=3)
        raise grpc.RpcError()    # the call is over

    stream = servicer.Steps(requests(), _Context())
    assert next(stream).response.step_id == 1
    _until(lambda: len(runner.launched) == 2)
    servicer.end_streams()
    assert [r.response.step_id for r in stream] == [2]
    more.set()
    _until(lambda: len(runner.settled) == 3)    # the reader settles step 3 itself
    assert runner.launched == runner.settled == [1, 2, 3]
