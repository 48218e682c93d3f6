"""How an answer reaches the HTTP client: server-sent events, and the cancellation of the gRPC
calls behind a request as soon as its client goes away.

Guarantees:
- a streamed request that the scheduler refuses is refused with its own HTTP status, since the
  stream's headers are only sent once its first item came (`opened`); a failure after that point
  is one `data: {"error": ...}` event, then `data: [DONE]`;
- a client that disconnects mid-stream cancels the stream at once (not at the next write), as does
  one that leaves before the first item (`opened`) or while an unstreamed answer is computed
  (`unless_disconnected`): that aborts the requests on the scheduler and frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from common.client import RequestError
from gateway import outputs
from gateway.errors import ClientGone, GatewayError, error_body, from_request_error
from gateway.protocol import StreamOptions

logger = logging.getLogger(__name__)


class EventStream(StreamingResponse):
    """Server-sent events whose body is cancelled as soon as the client disconnects. Starlette's
    StreamingResponse, under ASGI 2.4 servers (uvicorn), only notices at its next write, which
    for a request waiting in the scheduler's queue may be minutes away."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with contextlib.suppress(OSError):   # the client went away between two writes
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


async def opened(request: Request, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`stream` with its first item already received: a refusal of the request raises here, before
    any response header is sent, so it gets its own HTTP status rather than a 200 stream. A client
    that disconnects while the request waits for its first item (queued) cancels it (ClientGone)."""
    async def first_item() -> Any:
        try:
            return await anext(stream)
        except StopAsyncIteration:
            return None

    try:
        first = await unless_disconnected(request, first_item())
    except BaseException:
        await stream.aclose()
        raise

    async def rest() -> AsyncIterator[Any]:
        try:
            if first is None:
                return
            yield first
            async for item in stream:
                yield item
        finally:
            await stream.aclose()
    return rest()


def stream_failure(exc: Exception) -> dict[str, Any]:
    """The error body of a stream that failed after its headers were sent."""
    if isinstance(exc, GatewayError):
        return exc.body()
    if isinstance(exc, RequestError):
        logger.warning("stream failed: %s", exc)
        return from_request_error(exc).body()
    logger.exception("stream failed")
    return error_body(500, f"internal error: {type(exc).__name__}", code="internal")


async def choice_events(choices: Callable[[outputs.UsageTotal], AsyncIterator[dict[str, Any]]],
                        base: dict[str, Any], stream_options: StreamOptions | None,
                        on_end: Callable[[outputs.UsageTotal], None], known_prompt_tokens: int = 0
                        ) -> AsyncIterator[str]:
    """What every choice stream sends around its choices (`choices(usage)` yields one choice per
    event and adds each finished sample's usage): with stream_options.include_usage, `"usage": null`
    on every chunk and a last chunk of the total; with continuous_usage_stats, the usage so far on
    every chunk instead of null; a failure after the headers as one error event; then [DONE].
    `on_end(usage)` is told what the finished samples used, however the stream ends."""
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = bool(stream_options and stream_options.continuous_usage_stats)
    usage = outputs.UsageTotal(known_prompt_tokens)
    try:
        async for choice in choices(usage):
            extra = {"usage": usage.so_far_json()} if continuous else {"usage": None} if include_usage else {}
            yield outputs.sse({**base, "choices": [choice], **extra})
        if include_usage:
            yield outputs.sse({**base, "choices": [], "usage": usage.to_json()})
    except Exception as exc:  # noqa: BLE001 - the headers are sent: the stream's last event says what failed
        yield outputs.sse(stream_failure(exc))
    finally:
        on_end(usage)
    yield outputs.DONE


async def unless_disconnected(request: Request, call):
    """Awaits `call` (a coroutine) unless the client disconnects first, which cancels it (and so
    its gRPC calls: a client that gave up on a long unstreamed completion frees its KV blocks).
    The body has been read, so the next ASGI message can only be http.disconnect."""
    task = asyncio.ensure_future(call)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        watcher.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def gather(calls: list) -> list:
    """Runs the calls concurrently; the first failure cancels the others (and their gRPC calls)."""
    if len(calls) == 1:
        return [await calls[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in calls]
    except BaseExceptionGroup as grouped:
        raise grouped.exceptions[0] from None
    return [t.result() for t in tasks]
