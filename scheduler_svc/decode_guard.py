"""Turns requests that fail to decode into INVALID_ARGUMENT with protobuf's reason.

grpcio answers an undecodable request with a bare INTERNAL error; a client that sent invalid
UTF-8 in a string field, or a corrupt message, deserves to be told so. This interceptor wraps
each method's deserializer so a failure reaches the handler as a value, which then aborts.
"""
from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Undecodable(str(e))
    return deserialize


async def _reject(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        if handler.response_streaming:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    await _reject(request, context)
                async for response in inner(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        inner = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, _Undecodable):
                await _reject(request, context)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer)
