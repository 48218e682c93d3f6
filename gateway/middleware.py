"""The gateway's plain ASGI middlewares: the API-key check, the request-body bound and the
request-body deadline.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would stand between the routes and
the client's disconnect (the disconnect is what cancels a request's gRPC calls).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.errors import error_body

logger = logging.getLogger(__name__)


class ApiKeyCheck:
    """Refuses a request without `Authorization: Bearer KEY` of a configured key (401, OpenAI's
    body), except on `open_paths`."""

    def __init__(self, app, keys: Sequence[str], open_paths: Sequence[str] = ()) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, key = header.partition(b" ")
            # compare_digest against every key: the time taken says nothing about any of them.
            matches = [hmac.compare_digest(key.strip(), k) for k in self.keys]
            if scheme.lower() != b"bearer" or not any(matches):
                body = error_body(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuses a request body over `max_bytes` with 413: at once by its Content-Length, or while a
    chunked body is read (FastAPI lets an HTTPException raised while reading the body through).
    So too a body of more than `max_values` JSON values, counted as it arrives (at C speed) by its
    commas and colons (one per item and member after the first) and its [ and { (an array or an
    object costs more to make than a number): parsing costs by values, and a few MiB of them
    ([[1], [1], ...]) take seconds of the event loop that writes every stream. A bound of 0 is none."""

    def __init__(self, app, max_bytes: int, max_values: int = 0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_values = max_values

    def _too_large(self, size: str) -> StarletteHTTPException:
        return StarletteHTTPException(413, f"the request body is {size} bytes, more than the gateway's limit of "
                                           f"{self.max_bytes} (--max-request-body-mib)")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if self.max_bytes and length is not None and length.isdigit() and int(length) > self.max_bytes:
            error = self._too_large(length.decode())
            await JSONResponse(error_body(413, error.detail, code="request_too_large"), status_code=413,
                               headers={"connection": "close"})(scope, receive, send)
            return
        received = values = 0

        async def bounded() -> dict:
            nonlocal received, values
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                received += len(body)
                if self.max_bytes and received > self.max_bytes:
                    raise self._too_large(f"more than {received}")
                values += body.count(b",") + body.count(b":") + body.count(b"[") + body.count(b"{")
                if self.max_values and values > self.max_values:
                    raise StarletteHTTPException(413, f"the request body holds more than {self.max_values} JSON "
                                                      "values (counted by its commas, colons, [ and {), the "
                                                      "gateway's limit (--max-request-json-values)")
            return message

        await self.app(scope, bounded, send)


class BodyDeadline:
    """Refuses with 408 a request whose body has not arrived whole within `seconds` of its headers
    (a client that trickles its body would otherwise hold the connection for ever). Once the body
    is in, receive() passes through: waiting for the client's disconnect is not bounded."""

    def __init__(self, app, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        body_done = False

        async def bounded() -> dict:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise StarletteHTTPException(408, f"the request body did not arrive within {self.seconds:g} s "
                                                  "(--body-timeout-s)", headers={"connection": "close"}) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, bounded, send)
