"""How the scheduler reaches its workers: over gRPC (tools/offline.py has an in-process client).

A worker group is one tensor-parallel set of ranks; every step goes to every rank and rank 0's
sampled tokens are the answer (the ranks keep their mirrors in step among themselves).
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Awaitable, Protocol, Sequence

import grpc

from common.constraint import Constraint
from common.pb.llm.worker.v1 import worker_pb2, worker_pb2_grpc

# A NewRequest carries a whole prompt once: leave room for long-context prompts.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class WorkerError(RuntimeError):
    """A worker did not answer a call: down, restarted, timed out or refused it. `code` is the
    gRPC status code name of its answer ("" when the call never reached it); `details` its message."""

    def __init__(self, message: str, code: str = "", details: str = "") -> None:
        super().__init__(message)
        self.code, self.details = code, details


def worker_error(address: str, code: str, details: str) -> WorkerError:
    """The WorkerError of worker `address` answering `code` (a status code's name) with `details`."""
    return WorkerError(f"worker {address}: {code}: {details}", code, details)


class WorkerClient(Protocol):
    address: str

    async def describe(self, timeout: float) -> worker_pb2.WorkerInfo: ...
    def step(self, request: worker_pb2.StepRequest, timeout: float) -> Awaitable[worker_pb2.StepResponse]: ...
    async def reset(self, lease_epoch: int, timeout: float) -> None: ...
    async def claim(self, owner: str, epoch: int, lease_s: float, timeout: float) -> str:
        """Takes or renews the worker's lease (worker_svc/lease.py); returns its instance id."""
    async def prepare_grammar(self, constraint: Constraint, lease_epoch: int, timeout: float) -> None:
        """Has the worker compile a constraint before its request's first step."""
    async def close(self) -> None: ...


class GrpcWorkerClient:
    """One worker rank reached through llm.worker.v1.Worker. Steps go over one Steps stream
    (opened at the first step, again after it breaks), or as Step calls with step_stream=False."""

    def __init__(self, address: str, *, credentials: grpc.ChannelCredentials | None = None,
                 auth_token: str | None = None, step_stream: bool = True) -> None:
        self.address = address
        self.step_stream = step_stream
        self._steps: _StepStream | None = None
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # Notice a dead worker within seconds, even while no step is in flight.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.enable_retries", 0),
        ]
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=options)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def _call(self, method, request, timeout: float):
        return await self._reply(method(request, timeout=timeout, metadata=self._metadata))

    async def describe(self, timeout: float) -> worker_pb2.WorkerInfo:
        return await self._call(self._stub.Describe, worker_pb2.DescribeRequest(), timeout)

    def step(self, request: worker_pb2.StepRequest, timeout: float) -> Awaitable[worker_pb2.StepResponse]:
        """Starts the step now, before the caller next yields to the event loop (a step is on the
        critical path: each task hop before it goes out waits behind the loop's other work)."""
        if not self.step_stream:
            return self._reply(self._stub.Step(request, timeout=timeout, metadata=self._metadata))
        if self._steps is None or self._steps.broken:
            self._steps = _StepStream(self._stub, self._metadata, self.address)
        return self._steps.step(request, timeout)

    async def _reply(self, call: grpc.aio.Call):
        """The answer of a call under way, or a WorkerError."""
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            raise worker_error(self.address, e.code().name, e.details() or "") from e

    async def reset(self, lease_epoch: int, timeout: float) -> None:
        await self._call(self._stub.Reset, worker_pb2.ResetRequest(lease_epoch=lease_epoch), timeout)

    async def claim(self, owner: str, epoch: int, lease_s: float, timeout: float) -> str:
        reply = await self._call(self._stub.Claim, worker_pb2.ClaimRequest(
            owner=owner, epoch=epoch, lease_ms=max(1, round(lease_s * 1000))), timeout)
        return reply.instance_id

    async def prepare_grammar(self, constraint: Constraint, lease_epoch: int, timeout: float) -> None:
        message = worker_pb2.Constraint(kind=constraint.kind, text=constraint.text)
        await self._call(self._stub.PrepareGrammar,
                         worker_pb2.PrepareGrammarRequest(constraint=message, lease_epoch=lease_epoch), timeout)

    async def close(self) -> None:
        if self._steps is not None:
            self._steps.close("the client closed")
        await self._channel.close()


class _StepStream:
    """One Steps stream: requests written in the order sent, each reply matched to the oldest
    step waiting. A step's StepError raises its WorkerError and the stream goes on; a step past its
    timeout, or the stream ending, breaks it: every step waiting fails (the next step opens a new
    stream), as the calls of a worker that stopped answering would."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, metadata, address: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._address = address
        self._outgoing: asyncio.Queue = asyncio.Queue()
        self._waiting: deque[tuple[asyncio.Future, asyncio.TimerHandle]] = deque()
        self.broken = False
        self._call = stub.Steps(self._requests(), metadata=metadata)
        self._reader = self._loop.create_task(self._read())

    def step(self, request: worker_pb2.StepRequest, timeout: float) -> Awaitable[worker_pb2.StepResponse]:
        future = self._loop.create_future()
        timer = self._loop.call_later(timeout, self._timed_out, future, request.step_id, timeout)
        self._waiting.append((future, timer))
        self._outgoing.put_nowait(request)
        return future

    async def _requests(self):
        while (request := await self._outgoing.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for result in self._call:
                if not self._waiting:
                    raise worker_error(self._address, "INTERNAL", "a step result nobody waits for")
                future, timer = self._waiting.popleft()
                timer.cancel()
                if future.done():
                    continue
                if result.HasField("error"):
                    future.set_exception(worker_error(self._address, result.error.code, result.error.message))
                else:
                    future.set_result(result.response)
            self._break(worker_error(self._address, "UNAVAILABLE", "the worker ended the step stream"))
        except grpc.aio.AioRpcError as e:
            self._break(worker_error(self._address, e.code().name, e.details() or ""))
        except asyncio.CancelledError:
            self.close("the step stream was closed")
            raise
        except WorkerError as e:
            self._break(e)

    def _timed_out(self, future: asyncio.Future, step_id: int, timeout: float) -> None:
        details = f"step {step_id} got no answer within {timeout:g} s"
        if not future.done():
            future.set_exception(worker_error(self._address, "DEADLINE_EXCEEDED", details))
        self.close(details)

    def _break(self, error: WorkerError) -> None:
        """Fails every step waiting with `error` and ends the stream (once)."""
        if self.broken:
            return
        self.broken = True
        self._outgoing.put_nowait(None)
        while self._waiting:
            future, timer = self._waiting.popleft()
            timer.cancel()
            if not future.done():
                future.set_exception(error)
        self._call.cancel()

    def close(self, why: str) -> None:
        """Ends the stream; the steps waiting fail (CANCELLED)."""
        self._break(worker_error(self._address, "CANCELLED", why))


class WorkerGroupClient:
    """The ranks of one tensor-parallel group, driven as one."""

    def __init__(self, ranks: Sequence[WorkerClient]) -> None:
        if not ranks:
            raise ValueError("a worker group needs at least one rank")
        self.ranks = list(ranks)

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.ranks]

    async def describe(self, timeout: float) -> list[worker_pb2.WorkerInfo]:
        return list(await asyncio.gather(*(r.describe(timeout) for r in self.ranks)))

    def step(self, request: worker_pb2.StepRequest, timeout: float) -> Awaitable[worker_pb2.StepResponse]:
        """Rank 0's reply, once every rank answered; each rank's call starts now (see GrpcWorkerClient.step)."""
        replies = [r.step(request, timeout) for r in self.ranks]
        if len(replies) == 1:
            return replies[0]
        return self._first_of(replies)

    @staticmethod
    async def _first_of(replies) -> worker_pb2.StepResponse:
        return (await asyncio.gather(*replies))[0]

    async def reset(self, lease_epoch: int, timeout: float) -> None:
        await asyncio.gather(*(r.reset(lease_epoch, timeout) for r in self.ranks))

    async def claim(self, owner: str, epoch: int, lease_s: float, timeout: float) -> list[str]:
        """Claims (or renews) every rank under one epoch; returns their instance ids."""
        return list(await asyncio.gather(*(r.claim(owner, epoch, lease_s, timeout) for r in self.ranks)))

    async def prepare_grammar(self, constraint: Constraint, lease_epoch: int, timeout: float) -> None:
        """Rank 0 samples, so it alone holds grammars."""
        await self.ranks[0].prepare_grammar(constraint, lease_epoch, timeout)

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.ranks), return_exceptions=True)
