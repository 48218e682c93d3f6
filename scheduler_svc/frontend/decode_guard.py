"""Turns requests that fail to decode into INVALID_ARGUMENT with protobuf's reason, and refuses a
request longer than its method can be within the server's limits before it is decoded.

grpcio answers an undecodable request with a bare INTERNAL error; a client that sent invalid
UTF-8 in a string field, or a corrupt message, deserves to be told so. This interceptor wraps
each unary-request method's deserializer so a failure reaches the handler as a value, which
then aborts. Decoding holds the interpreter lock on the event loop that writes every stream
(200,000 chat messages take ~0.1 s), so a request of more bytes than `max_bytes(method)` is not
decoded at all: INVALID_ARGUMENT names the field that makes it long (read from the wire format's
tags and lengths, a bounded number of them) and says how long the request may be.

grpc.aio runs a handler by its kind: an async generator function's items are sent as the
stream, a coroutine function writes through context.write (the health servicer's Watch does),
and a plain function runs in the server's thread pool. So each wrapper here is of the same kind
as the handler it wraps; one kind wrapped as another fails every call.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable

import grpc
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError, Message

_SCAN_FIELDS = 1024   # fields of a long request read at most to name the longest


class _Undecodable:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def longest_field(data: bytes | memoryview, descriptor: Descriptor) -> str | None:
    """The path of the field that takes the most bytes of a serialized `descriptor` message ("text",
    "messages", or within a singular message field its own longest, "sampling.stop"), from the
    tags and lengths of at most _SCAN_FIELDS fields; None for bytes that are no such message."""
    sizes = _field_sizes(memoryview(data))
    number = max(sizes, key=lambda n: sizes[n][0], default=None)
    field = descriptor.fields_by_number.get(number) if number is not None else None
    if field is None:
        return None
    payload = sizes[number][1]
    if field.message_type is not None and not field.is_repeated and payload is not None:
        inner = longest_field(payload, field.message_type)
        return f"{field.name}.{inner}" if inner else field.name
    return field.name


def _field_sizes(data: memoryview) -> dict[int, tuple[int, memoryview | None]]:
    """Field number -> (its bytes, tags included; its last length-delimited payload)."""
    sizes: dict[int, tuple[int, memoryview | None]] = {}
    pos = 0
    try:
        for _ in range(_SCAN_FIELDS):
            if pos >= len(data):
                break
            start = pos
            tag, pos = _varint(data, pos)
            kind, payload = tag & 7, None
            if kind == 0:
                pos = _varint(data, pos)[1]
            elif kind in (1, 5):
                pos += 8 if kind == 1 else 4
            elif kind == 2:
                length, pos = _varint(data, pos)
                payload, pos = data[pos:pos + length], pos + length
            else:
                return {}   # a group, or not protobuf
            if pos > len(data) or tag >> 3 == 0:
                return {}
            sizes[tag >> 3] = (sizes.get(tag >> 3, (0, None))[0] + pos - start, payload)
    except IndexError:
        return {}
    return sizes


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 70:
        byte = data[pos]
        value, pos, shift = value | (byte & 0x7F) << shift, pos + 1, shift + 7
        if byte < 0x80:
            return value, pos
    raise IndexError("varint too long")


def _lenient(deserializer, method: str, limit: int | None, message: type[Message] | None):
    def deserialize(data: bytes):
        if limit is not None and len(data) > limit:
            field = longest_field(data, message.DESCRIPTOR) if message is not None else None
            return _Undecodable(f"{f'{field}: ' if field else ''}the request is {len(data)} bytes, more than a "
                                f"{method.rsplit('/', 1)[-1]} request within this server's limits can be ({limit} "
                                f"bytes)")
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
                 request_type: Callable[[str], type[Message] | None] = lambda method: None) -> None:
        """`max_bytes(method)`: the longest request of the method (its full name) decoded; None: any.
        `request_type(method)`: its request message, whose longest field a longer one is refused for."""
        self.max_bytes, self.request_type = max_bytes, request_type

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        return make(_guarded(behavior, handler.response_streaming),
                    request_deserializer=_lenient(handler.request_deserializer, method, self.max_bytes(method),
                                                        self.request_type(method)),
                    response_serializer=handler.response_serializer)
