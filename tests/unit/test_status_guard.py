"""common/status_guard.py on an in-process server: whatever a handler raises (unary or streaming,
async or in the sync worker server) reaches the client as a status naming the problem, never
UNKNOWN; a handler's own abort passes through unchanged."""
from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from common.pb.llm.v1 import generation_pb2 as pb
from common.pb.llm.v1 import generation_pb2_grpc
from common.status_guard import (MAX_MESSAGE_CHARS, AsyncStatusGuardInterceptor, StatusGuardInterceptor,
                                 bounded_message)
from scheduler_svc.frontend.validation import InvalidRequest

RAISED = {
    "field": InvalidRequest("messages[0].content", "messages[0].content is bad"),
    # A message quoting a client's long string: past 16 KiB a client would see RESOURCE_EXHAUSTED.
    "long": InvalidRequest("tool_choice", "tool_choice must be ..., got '" + "x" * 100_000 + "'"),
    "deep": RecursionError("maximum recursion depth exceeded"),
    "memory": MemoryError(),
    "package": ModuleNotFoundError("No module named 'pydantic'", name="pydantic"),
    "bug": KeyError("oops"),
}
EXPECTED = {
    "field": (grpc.StatusCode.INVALID_ARGUMENT, "messages[0].content is bad"),
    "long": (grpc.StatusCode.INVALID_ARGUMENT, "tool_choice must be ..., got 'xxx"),
    "deep": (grpc.StatusCode.INVALID_ARGUMENT, "nested too deeply"),
    "memory": (grpc.StatusCode.RESOURCE_EXHAUSTED, "more memory"),
    "package": (grpc.StatusCode.UNIMPLEMENTED, "'pydantic'"),
    "bug": (grpc.StatusCode.INTERNAL, "internal error (KeyError)"),
    "abort": (grpc.StatusCode.FAILED_PRECONDITION, "my own"),
}


class Raising(generation_pb2_grpc.GenerationServicer):
    async def Tokenize(self, request, context):
        if request.text == "abort":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "my own")
        raise RAISED[request.text]

    async def Generate(self, request, context):
        yield pb.GenerateResponse(text="first")
        if request.text == "abort":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "my own")
        raise RAISED[request.text]


class SyncRaising(generation_pb2_grpc.GenerationServicer):
    def Tokenize(self, request, context):
        if request.text == "abort":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "my own")
        raise RAISED[request.text]


def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


@pytest.mark.parametrize("what", list(EXPECTED))
def test_an_exception_in_an_async_handler_becomes_a_named_status(what):
    async def scenario() -> list[tuple[grpc.StatusCode, str]]:
        server = grpc.aio.server(interceptors=[AsyncStatusGuardInterceptor()])
        generation_pb2_grpc.add_GenerationServicer_to_server(Raising(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                statuses = []
                try:
                    await stub.Tokenize(pb.TokenizeRequest(text=what), timeout=10)
                except grpc.aio.AioRpcError as e:
                    statuses.append((e.code(), e.details()))
                call = stub.Generate(pb.GenerateRequest(text=what), timeout=10)
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as e:
                    statuses.append((e.code(), e.details()))
                return statuses
        finally:
            await server.stop(0)

    code, part = EXPECTED[what]
    statuses = asyncio.run(scenario())
    assert len(statuses) == 2 and all(c == code and part in d for c, d in statuses), statuses


@pytest.mark.parametrize("what", list(EXPECTED))
def test_an_exception_in_a_sync_handler_becomes_a_named_status(what):
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[StatusGuardInterceptor()])
    generation_pb2_grpc.add_GenerationServicer_to_server(SyncRaising(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            code, details = _status(lambda: stub.Tokenize(pb.TokenizeRequest(text=what), timeout=10))
    finally:
        server.stop(0)
    assert code == EXPECTED[what][0] and EXPECTED[what][1] in details


def test_a_long_message_is_cut_after_its_start():
    message = "sampling.json_schema is invalid: " + "y" * 10_000
    cut = bounded_message(message)
    assert cut.startswith(message[:MAX_MESSAGE_CHARS]) and cut.endswith("characters cut)") and len(cut) < 2 * MAX_MESSAGE_CHARS
    assert bounded_message("short") == "short"
