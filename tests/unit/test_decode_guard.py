"""DecodeGuardInterceptor on an in-process grpc.aio server: every kind of handler grpc.aio runs
(async generator, coroutine writing through context.write, plain function in the thread pool)
still answers as without the guard, and an undecodable request gets INVALID_ARGUMENT."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.pb.llm.v1 import generation_pb2 as pb
from scheduler_svc.frontend.decode_guard import DecodeGuardInterceptor, longest_field

Request, Response = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
SERVING, NOT_SERVING = Response.SERVING, Response.NOT_SERVING
INVALID_UTF8 = b"\x0a\x02\xff\xfe"     # field 1 (service, a string) holding invalid UTF-8


def _echo(request) -> list:
    """Two responses naming the request, so a test sees the request got through decoded."""
    return [Response(status=SERVING if request.service == "up" else NOT_SERVING), Response(status=SERVING)]


async def async_generator_stream(request, context):
    for response in _echo(request):
        yield response


async def coroutine_stream(request, context):
    for response in _echo(request):
        await context.write(response)


def sync_generator_stream(request, context):
    yield from _echo(request)


def sync_function_stream(request, context):   # a plain function returning an iterator
    return iter(_echo(request))


async def coroutine_unary(request, context):
    return _echo(request)[0]


def sync_unary(request, context):
    return _echo(request)[0]


HANDLERS = {
    "AsyncGeneratorStream": grpc.unary_stream_rpc_method_handler(async_generator_stream),
    "CoroutineStream": grpc.unary_stream_rpc_method_handler(coroutine_stream),
    "SyncGeneratorStream": grpc.unary_stream_rpc_method_handler(sync_generator_stream),
    "SyncFunctionStream": grpc.unary_stream_rpc_method_handler(sync_function_stream),
    "CoroutineUnary": grpc.unary_unary_rpc_method_handler(coroutine_unary),
    "SyncUnary": grpc.unary_unary_rpc_method_handler(sync_unary),
}
for _name, _handler in HANDLERS.items():
    HANDLERS[_name] = _handler._replace(request_deserializer=Request.FromString,
                                        response_serializer=Response.SerializeToString)


async def _serve(test, guard: DecodeGuardInterceptor | None = None):
    """Runs `test(channel, health_servicer)` against a guarded server holding HANDLERS and grpc.health.v1."""
    pool = ThreadPoolExecutor(2, thread_name_prefix="guard-test")   # runs the plain functions
    server = grpc.aio.server(interceptors=[guard or DecodeGuardInterceptor()], migration_thread_pool=pool)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Guarded", HANDLERS)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await test(channel, health_servicer)
    finally:
        await server.stop(None)
        # A plain function's thread hands its writes to this loop and waits for them; the pool
        # drains while the loop still runs, else a thread waits forever on a closed loop and
        # the interpreter's exit, which joins it, never ends.
        await asyncio.wait_for(asyncio.to_thread(pool.shutdown, wait=True), timeout=10)


def _call(channel, method: str):
    make = channel.unary_stream if method.endswith("Stream") else channel.unary_unary
    return make(f"/test.Guarded/{method}", request_serializer=lambda b: b, response_deserializer=Response.FromString)


@pytest.mark.parametrize("method", list(HANDLERS))
def test_every_handler_kind_answers_through_the_guard(method):
    async def test(channel, _):
        call = _call(channel, method)(Request(service="up").SerializeToString(), timeout=10)
        if method.endswith("Stream"):
            assert [r.status async for r in call] == [SERVING, SERVING]
        else:
            assert (await call).status == SERVING
    asyncio.run(_serve(test))


async def _refusal(call, method: str):
    """The AioRpcError a call of `method` ends in (a streaming answer read to its end)."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if method.endswith("Stream"):
            [r async for r in call]
        else:
            await call
    return err


@pytest.mark.parametrize("method", list(HANDLERS))
@pytest.mark.parametrize("payload", [INVALID_UTF8, b"\xff\xff\xff\xff"], ids=["invalid-utf8", "not-protobuf"])
def test_every_handler_kind_refuses_an_undecodable_request(method, payload):
    async def test(channel, _):
        err = await _refusal(_call(channel, method)(payload, timeout=10), method)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "HealthCheckRequest" in err.value.details() or "UTF-8" in err.value.details()
    asyncio.run(_serve(test))


@pytest.mark.parametrize("method", list(HANDLERS))
def test_a_request_longer_than_its_method_allows_is_refused_naming_its_field(method):
    guard = DecodeGuardInterceptor(lambda name: 16 if name.startswith("/test.") else None,
                                   lambda name: Request if name.startswith("/test.") else None)

    async def test(channel, _):
        err = await _refusal(_call(channel, method)(Request(service="x" * 32).SerializeToString(), timeout=10), method)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (f"service: the request is 34 bytes, more than a {method} request within "
                                       f"this server's limits can be (16 bytes)")
        assert (await _call(channel, "CoroutineUnary")(Request(service="up").SerializeToString(), timeout=10)
                ).status == SERVING
    asyncio.run(_serve(test, guard))


def test_health_check_and_watch_pass_the_guard():
    async def test(channel, health_servicer):
        await health_servicer.set("svc", SERVING)
        stub = health_pb2_grpc.HealthStub(channel)
        assert (await stub.Check(Request(service="svc"), timeout=10)).status == SERVING
        watch = stub.Watch(Request(service="svc"), timeout=10)
        assert (await watch.read()).status == SERVING
        await health_servicer.set("svc", NOT_SERVING)
        assert (await watch.read()).status == NOT_SERVING
        await health_servicer.enter_graceful_shutdown()
        watch.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _raw_watch(channel, INVALID_UTF8)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    asyncio.run(_serve(test))


async def _raw_watch(channel, payload: bytes):
    call = channel.unary_stream("/grpc.health.v1.Health/Watch", request_serializer=lambda b: b,
                                response_deserializer=Response.FromString)(payload, timeout=10)
    return [r async for r in call]


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(request_id="r" * 5000, text="hi"), "request_id"),
    (pb.GenerateRequest(text="x" * 5000, sampling=pb.SamplingParams(max_tokens=3)), "text"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["s" * 200] * 50)), "sampling.stop"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(logit_bias={i: 1.0 for i in range(3000)})),
     "sampling.logit_bias"),
    (pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="")] * 20_000), "messages"),
    (pb.ChatRequest(messages=[pb.ChatMessage(role="user")], tools=[pb.Tool(name="f", parameters_json="{}" * 5000)]),
     "tools"),
    (pb.DetokenizeRequest(token_ids=[5] * 5000), "token_ids"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_the_longest_field_of_a_request_is_read_from_its_tags_and_lengths(request_, field):
    assert longest_field(request_.SerializeToString(), request_.DESCRIPTOR) == field


@pytest.mark.parametrize("data", [b"", b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x80" * 100, b"\x0b\x0c"])
def test_bytes_that_are_no_such_message_have_no_longest_field(data):
    assert longest_field(data, pb.GenerateRequest.DESCRIPTOR) is None
