"""How a frontend reaches the engine core: over llm.engine.v1 (a frontend process), or directly
(a frontend in the core's own process, for the single-process demo and the offline engine).

Adds are coalesced: every add issued in one turn of the event loop travels in one AddRequests
call, so a burst of 256 arriving requests costs the core a few messages, not 256.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Protocol

import grpc

from common.pb.llm.engine.v1 import engine_pb2, engine_pb2_grpc
from scheduler_svc.engine import api_wire as core_wire
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.api import AddCode, AddResult, CoreEvent, CoreInfo, CoreRequest
from scheduler_svc.engine.server import MAX_MESSAGE_BYTES
from scheduler_svc.engine.sequence import FinishReason


class CoreUnreachable(RuntimeError):
    """The engine core did not answer."""


class CoreClient(Protocol):
    frontend_id: int

    def events(self) -> AsyncIterator[CoreEvent]: ...
    async def add(self, request: CoreRequest) -> AddResult: ...
    async def abort(self, seq_ids: list[int], reason: FinishReason, notify: bool) -> None: ...
    async def abort_request_id(self, request_id: str) -> bool: ...
    async def set_paused(self, pause: list[int], resume: list[int]) -> None: ...
    async def info(self) -> CoreInfo: ...
    async def report(self, rejected: dict[str, int]) -> None: ...
    async def close(self) -> None: ...


class LocalCoreClient:
    """A frontend in the core's process: calls go straight to the core."""

    def __init__(self, core: EngineCore, frontend_id: int = 0) -> None:
        self.core = core
        self.frontend_id = frontend_id

    async def events(self) -> AsyncIterator[CoreEvent]:
        queue = self.core.attach(self.frontend_id)
        try:
            while True:
                yield await queue.get()
        finally:
            self.core.detach(self.frontend_id, queue)

    async def add(self, request: CoreRequest) -> AddResult:
        return self.core.add_requests([request])[0]

    async def abort(self, seq_ids: list[int], reason: FinishReason, notify: bool) -> None:
        self.core.abort(seq_ids, reason, notify)

    async def abort_request_id(self, request_id: str) -> bool:
        return self.core.abort_request_id(request_id)

    async def set_paused(self, pause: list[int], resume: list[int]) -> None:
        self.core.set_paused(pause, resume)

    async def info(self) -> CoreInfo:
        return self.core.info()

    async def report(self, rejected: dict[str, int]) -> None:
        for code, count in rejected.items():
            self.core.metrics.observe_rejection(code, count)

    async def close(self) -> None:
        pass


class GrpcCoreClient:
    def __init__(self, address: str, frontend_id: int) -> None:
        self.address = address
        self.frontend_id = frontend_id
        self._channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 0)])
        self._stub = engine_pb2_grpc.EngineCoreStub(self._channel)
        self._pending: list[tuple[CoreRequest, asyncio.Future]] = []

    async def events(self) -> AsyncIterator[CoreEvent]:
        call = self._stub.Attach(engine_pb2.AttachRequest(frontend_id=self.frontend_id))
        try:
            async for msg in call:
                yield core_wire.event_from_pb(msg)
        except grpc.aio.AioRpcError as e:
            raise CoreUnreachable(f"engine core at {self.address}: {e.code().name}: {e.details()}") from e
        finally:
            call.cancel()

    async def add(self, request: CoreRequest) -> AddResult:
        future = asyncio.get_running_loop().create_future()
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush_adds)
        self._pending.append((request, future))
        return await future

    def _flush_adds(self) -> None:
        batch, self._pending = self._pending, []
        asyncio.ensure_future(self._send_adds(batch))

    async def _send_adds(self, batch: list[tuple[CoreRequest, asyncio.Future]]) -> None:
        try:
            reply = await self._stub.AddRequests(core_wire.add_requests_to_pb([r for r, _ in batch]), timeout=30)
            results = core_wire.add_results_from_pb(reply)
        except grpc.aio.AioRpcError as e:
            results = [AddResult(AddCode.UNAVAILABLE, f"the engine core did not answer: {e.code().name}")] * len(batch)
        for (_, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)

    async def abort(self, seq_ids: list[int], reason: FinishReason, notify: bool) -> None:
        await self._call(self._stub.AbortRequests, engine_pb2.AbortRequestsRequest(
            seq_ids=seq_ids, reason=core_wire.reason_to_pb(reason), notify=notify))

    async def abort_request_id(self, request_id: str) -> bool:
        reply = await self._call(self._stub.AbortRequests, engine_pb2.AbortRequestsRequest(request_id=request_id))
        return reply.found

    async def set_paused(self, pause: list[int], resume: list[int]) -> None:
        await self._call(self._stub.PauseRequests,
                         engine_pb2.PauseRequestsRequest(pause_seq_ids=pause, resume_seq_ids=resume))

    async def info(self) -> CoreInfo:
        return core_wire.info_from_pb(await self._call(self._stub.GetInfo, engine_pb2.GetInfoRequest()))

    async def report(self, rejected: dict[str, int]) -> None:
        await self._call(self._stub.Report, engine_pb2.FrontendReport(rejected=rejected))

    async def _call(self, method, request):
        try:
            return await method(request, timeout=30)
        except grpc.aio.AioRpcError as e:
            raise CoreUnreachable(f"engine core at {self.address}: {e.code().name}: {e.details()}") from e

    async def close(self) -> None:
        await self._channel.close()
