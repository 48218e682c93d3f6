"""Request bodies read as JSON and nothing else (common/strict_json.py): NaN, Infinity, -Infinity
and 1e999, which Python's parser takes and no reply can carry back (a Responses reply echoes the
request's tools), are refused. The routes of the endpoints that take a body read it with
StrictJSONRoute; such a number is an unreadable body (400 invalid_json naming it and where it sits,
gateway/errors.py), and any other problem is the parser's own error, which FastAPI and
gateway/errors.py word. A body over PARSE_APART_BYTES is parsed on a worker thread: the event loop
that parses it also writes every other client's stream, and CPython lets it run again every switch
interval (5 ms) while a thread parses, where an inline parse of a large body holds it throughout."""
from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import anyio.to_thread
from fastapi import Request, Response
from fastapi.routing import APIRoute

from common import strict_json

PARSE_APART_BYTES = 64 << 10    # ~0.3 ms of parsing; a thread's hand-off costs ~0.05 ms


def loads(body: bytes | str) -> Any:
    """The body's JSON; JsonProblem (with its number and path) for a number JSON does not have."""
    try:
        return strict_json.loads(body)
    except strict_json.JsonProblem as exc:
        if exc.number is None and exc.__cause__ is not None:
            raise exc.__cause__ from None    # FastAPI tells a JSONDecodeError from the rest by its type
        raise


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await anyio.to_thread.run_sync(loads, body) if len(body) > PARSE_APART_BYTES else loads(body)
        return self._json


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict
