"""The last line at every gRPC edge: an exception that escapes a handler becomes a status that says
what went wrong, never UNKNOWN with a Python exception's text (grpcio's answer).

Handlers refuse what they expect with a status of their own (INVALID_ARGUMENT naming the field,
...); this maps what they did not expect: an error naming a field (InvalidRequest) to
INVALID_ARGUMENT, a RecursionError (input nested too deeply for some parser) to INVALID_ARGUMENT,
a MemoryError to RESOURCE_EXHAUSTED, a missing package to UNIMPLEMENTED naming it, anything else to
INTERNAL (logged with its traceback). The wrappers keep each handler's kind (scheduler_svc/frontend/
decode_guard.py says why that matters).
"""
from __future__ import annotations

import inspect
import logging

import grpc

logger = logging.getLogger(__name__)

# A status message travels in the call's HTTP/2 trailers, which a client takes up to 16 KiB of
# (grpc-core's hard limit: past it the call fails as RESOURCE_EXHAUSTED, "Stream removed"); a
# message quoting a client's long string is cut to this many characters.
MAX_MESSAGE_CHARS = 2048


def bounded_message(message: str) -> str:
    """`message`, cut to MAX_MESSAGE_CHARS (its start names the field)."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[:MAX_MESSAGE_CHARS] + f"... ({len(message) - MAX_MESSAGE_CHARS} more characters cut)"


def status_of(exc: BaseException, method: str = "") -> tuple[grpc.StatusCode, str]:
    """The status an unexpected exception from `method` becomes."""
    if isinstance(exc, ValueError) and isinstance(getattr(exc, "field", None), str):
        return grpc.StatusCode.INVALID_ARGUMENT, bounded_message(str(exc))      # validation's InvalidRequest
    if isinstance(exc, RecursionError):
        return grpc.StatusCode.INVALID_ARGUMENT, "the request is nested too deeply to be read"
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "the request needs more memory than the server can give it"
    if isinstance(exc, ImportError):
        package = getattr(exc, "name", None) or "?"
        return grpc.StatusCode.UNIMPLEMENTED, f"this needs the Python package {package!r}, which the server lacks"
    logger.error("%s failed", method or "a call", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); the server's log has the details"


def _aio_guarded(behavior, method: str):
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            try:
                async for response in behavior(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:   # noqa: BLE001 - the point of this module
                await context.abort(*status_of(exc, method))
        return stream
    if inspect.iscoroutinefunction(behavior):
        async def call(request, context):
            try:
                return await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:   # noqa: BLE001
                await context.abort(*status_of(exc, method))
        return call
    return _sync_guarded(behavior, method)


def _sync_guarded(behavior, method: str):
    def aborted(context) -> bool:
        code = context.code()
        return code is not None and code != grpc.StatusCode.OK

    if inspect.isgeneratorfunction(behavior):
        def sync_stream(request, context):
            try:
                yield from behavior(request, context)
            except Exception as exc:   # noqa: BLE001
                if aborted(context):
                    raise
                context.abort(*status_of(exc, method))
        return sync_stream

    def sync_call(request, context):
        try:
            return behavior(request, context)
        except Exception as exc:   # noqa: BLE001
            if aborted(context):
                raise
            context.abort(*status_of(exc, method))
    return sync_call


def _rewrap(handler: grpc.RpcMethodHandler, wrap):
    """`handler` with its behavior wrapped, for every kind of method."""
    if handler.unary_unary:
        make, behavior = grpc.unary_unary_rpc_method_handler, handler.unary_unary
    elif handler.unary_stream:
        make, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
    elif handler.stream_unary:
        make, behavior = grpc.stream_unary_rpc_method_handler, handler.stream_unary
    else:
        make, behavior = grpc.stream_stream_rpc_method_handler, handler.stream_stream
    return make(wrap(behavior), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class AsyncStatusGuardInterceptor(grpc.aio.ServerInterceptor):
    """For grpc.aio servers; install it last (nearest the handlers)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _rewrap(handler, lambda behavior: _aio_guarded(behavior, handler_call_details.method))


class StatusGuardInterceptor(grpc.ServerInterceptor):
    """For synchronous grpc servers."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _rewrap(handler, lambda behavior: _sync_guarded(behavior, handler_call_details.method))
