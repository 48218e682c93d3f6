"""Turns requests that fail to decode into INVALID_ARGUMENT with protobuf's reason, and refuses a
request longer than its method can be within the server's limits before it is decoded.

grpcio answers an undecodable request with a bare INTERNAL error; a client that sent invalid
UTF-8 in a string field, or a corrupt message, deserves to be told so. This interceptor wraps
each unary-request method's deserializer so a failure reaches the handler as a value, which
then aborts. Decoding holds the interpreter lock on the event loop that writes every stream
(200,000 chat messages take ~0.1 s), so a request of more bytes than `max_bytes(method)` is not
decoded at all: INVALID_ARGUMENT names the field that makes it long and says how long it may be.

grpc.aio runs a handler by its kind: an async generator function's items are sent as the
stream, a coroutine function writes through context.write (the health servicer's Watch does),
and a plain function runs in the server's thread pool. So each wrapper here is of the same kind
as the handler it wraps; one kind wrapped as another fails every call.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(deserializer, method: str, limit: int | None, field: str | None):
    prefix = f"{field}: " if field else ""

    def deserialize(data: bytes):
        if limit is not None and len(data) > limit:
            return _Undecodable(f"{prefix}the request is {len(data)} bytes, more than a {method.rsplit('/', 1)[-1]} "
                                f"request within this server's limits can be ({limit} bytes)")
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Undecodable(str(e))
    return deserialize


def _guarded(behavior, response_streaming: bool):
    """`behavior`, refusing an undecodable request first; of the same kind as `behavior`."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            async for response in behavior(request, context):
                yield response
        return stream
    if inspect.iscoroutinefunction(behavior):
        async def call(request, context):
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            return await behavior(request, context)
        return call

    if response_streaming:
        # In the thread pool, with a synchronous context. A generator even when `behavior` is a
        # plain function returning an iterator: grpc.aio hangs the call when such a function
        # aborts before it returns.
        def sync_stream(request, context):
            if isinstance(request, _Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            yield from behavior(request, context)
        return sync_stream

    def sync_call(request, context):
        if isinstance(request, _Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return behavior(request, context)
    return sync_call


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, max_bytes: Callable[[str], int | None] = lambda method: None,
                 field: Callable[[str], str | None] = lambda method: None) -> None:
        """`max_bytes(method)`: the longest request of the method (its full name) decoded; None: any.
        `field(method)`: the request field a longer one is refused for (what makes it long)."""
        self.max_bytes, self.field = max_bytes, field

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        return make(_guarded(behavior, handler.response_streaming),
                    request_deserializer=_lenient(handler.request_deserializer, method, self.max_bytes(method),
                                                        self.field(method)),
                    response_serializer=handler.response_serializer)
